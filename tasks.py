"""Tasks and the tiny local models: everything rc_train.py learns on, behind one small interface.

    task = tasks.make_task(name, mini, dataset=...)  # a name of tasks.TASKS: 'minigsm' (default), 'gsm8k', 'add'
    rows, n_skipped = task.problems("train")          # [row, ...]: dicts with whatever prompt and score need
    text = task.prompt(row)                           # the prompt text (before any chat template)
    scores = task.score(response, row)                # {key: 0/1 for key in task.score_keys (and task.format_key)}

The trainer has no per-task branch: it asks the task for problems, prompts and scores (reward and logged accuracies
by the keys the task declares), and asks `base_model_path` for the model behind `--model tiny`. A new task is a
factory in TASKS (README "Fork it").

* minigsm: a miniature GSM8K generated here from a seed. Short word problems of 1..max_steps add/subtract
  steps ("Tom has 27 pens. Tom buys 18 more. Tom gives away 17. How many pens does Tom have now?"), reference
  solutions in GSM8K's own shape (one worked line per step, then `#### N`), prompts built by
  `gsm8k.format_prompt` and scored by `gsm8k.score_response`, exactly as the real GSM8K job. Its base model is a
  1M-parameter Qwen2 warm-started by supervised fine-tuning on the train split (see MiniGSMArgs).
* gsm8k: the real data set (local JSONL/parquet or a Hugging Face id); the tiny model is a random smoke-test net.
* add: 'a+b=' -> one digit, the one-token fixture the fast tests learn in seconds.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import math
import os
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass
from typing import Callable
from unicodedata import normalize

import torch
from tqdm import tqdm

import gsm8k

TINY_MODEL = "tiny"  # the --model value of the tiny models built here (base_model_path), never downloaded
TINY_MOE_MODEL = "tiny-moe"  # the same, a Qwen3-MoE (make_qwen3_moe; its router scale in the cache key)
# Bumped whenever the generator, tokenizer or warm start changes what a cached warm-started base holds.
BUILDER_VERSION = 1
# The random tiny net's own version (its cache name does not hash BUILDER_VERSION): bumped when its build changes.
TINY_BUILDER_VERSION = 2
# The tiny MoE's own version (hashed into both of its cache names): bumped when its architecture or build changes.
MOE_BUILDER_VERSION = 1


@dataclass
class MiniGSMArgs:
    """The miniature GSM8K: problem generator and the warm start of its base model (the sft_* fields and model_seed
    also drive the warm start of any other task that has one, tasks.build_warm_base)."""

    max_steps: int = 3
    """arithmetic steps per problem: each problem has 1..max_steps add/subtract steps (longer answers)"""
    operand_max: int = 20
    """operands are drawn from 1..operand_max (the starting amount from 2..operand_max): carries make it harder"""
    train_size: int = 5000
    """number of training problems"""
    test_size: int = 200
    """number of test problems (disjoint from training: the split is a hash of the question text)"""
    data_seed: int = 0
    """seed of the problem generator (the same seed always gives the same problems)"""
    format_share: float = 0.3
    """share of warm-start solutions ending in the strict '#### N' line; the rest end 'The answer is N.' (strict
    scoring rejects them, flexible accepts them): the base follows the answer format only sometimes, like a
    pretrained model on GSM8K, and the strict reward has to teach it (1.0 = always the strict format)"""
    sft_steps: int = 900
    """warm-start budget: AdamW steps of supervised fine-tuning on the train split (fixed, not timed)"""
    sft_batch_size: int = 64
    """warm-start batch size (sequences)"""
    sft_learning_rate: float = 2e-3
    """warm-start peak learning rate, reached by a linear warm-up over 100 steps"""
    sft_schedule: str = "constant"
    """after the warm-up: 'constant' keeps the rate; 'cosine' decays it to 10 % of its peak at the last step (600
    steps then reach the same SFT loss, but GRPO from that base learns far slower: docs/running.md)"""
    model_seed: int = 0
    """seed of the base model's random initialisation and of the warm start's data order"""


# ---------------------------------------------------------------------------------------------
# The interface
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Task:
    name: str
    """the --task name (run folder names, cached model names)"""
    problems: Callable[..., tuple[list[dict], int]]
    """(split, limit=None) -> (rows, number of rows skipped as malformed). A row is a dict with whatever prompt and
    score need (a question, a gold answer, numbers and a target); its 'question' and 'gold', when it has them, are
    copied to eval_samples.jsonl"""
    prompt: Callable[[dict], str]
    """row -> prompt text (the user message when the tokenizer has a chat template)"""
    score: Callable[[str, dict], dict]
    """(response, row) -> {key: float}, every key of score_keys (and format_key), each 0.0 or 1.0 as a rule"""
    score_keys: tuple[str, ...] = ("correct",)
    """the keys the scorer returns: each may be the --reward-mode and is logged as eval/accuracy_<key>"""
    reward_key: str = "correct"
    """the score key that is the reward unless --reward-mode names another"""
    accuracy_key: str = "correct"
    """the score key shown as the accuracy on the progress bar and in the closing summary"""
    format_key: str | None = None
    """a score key (in score_keys or not) that flags a well-formed answer, right or wrong: --format-bonus rewards it
    (None: the task has none, and --format-bonus is refused)"""
    system_prompt: str | None = None
    """sent as a system message under a chat template; without one, written before the prompt text (prompt_text)"""
    prefill: str = ""
    """the text every response starts with: appended after the generation prompt, so the model continues it"""
    warm_start: Callable[[dict, random.Random], str] | None = None
    """(row, rng) -> a solution (the response after the prefill): with it, `--model tiny` is a base warm-started on
    the train split (build_warm_base); without, a random net (build_random_tiny)"""

    def __post_init__(self):
        for what, key in (("reward_key", self.reward_key), ("accuracy_key", self.accuracy_key)):
            if key not in self.score_keys:
                raise ValueError(f"task {self.name!r}: {what} {key!r} is not one of its score_keys {self.score_keys}")
        taken = set(self.score_keys) & set(SAMPLE_FIELDS)
        if taken:
            raise ValueError(f"task {self.name!r}: score keys {sorted(taken)} clash with the eval sample's own fields")


SAMPLE_FIELDS = ("step", "index", "question", "gold", "response", "tokens")  # eval_samples.jsonl's other fields


GSM8K_KEYS = dict(
    score_keys=("strict", "flexible"), reward_key="strict", accuracy_key="strict", format_key="well_formed"
)


def score_gsm8k_style(response: str, row: dict) -> dict:
    """GSM8K's scorer both ways: strict reads the last '#### N' line, flexible the last number."""
    strict = gsm8k.score_response(response, row["gold"], mode="strict")
    return {
        "strict": strict,
        "flexible": gsm8k.score_response(response, row["gold"], mode="flexible"),
        "well_formed": float(gsm8k.extract_answer(response, "strict") is not None),
    }


def gsm8k_prompt(row: dict) -> str:
    return gsm8k.format_prompt(row["question"])


def minigsm_task(mini: MiniGSMArgs, **_) -> Task:
    check_mini_args(mini)
    return Task(
        "minigsm",
        lambda split, limit=None: (_limit(minigsm_problems(mini, split), limit), 0),
        gsm8k_prompt,
        score_gsm8k_style,
        **GSM8K_KEYS,
        warm_start=lambda row, rng: warm_start_solution(row, rng, mini.format_share),
    )


def gsm8k_task(dataset: str, dataset_config: str, **_) -> Task:
    source = (local_gsm8k_dir() or "openai/gsm8k") if dataset == "auto" else dataset
    return Task(
        "gsm8k",
        lambda split, limit=None: gsm8k.load_gsm8k(source, split, limit=limit, config=dataset_config),
        gsm8k_prompt,
        score_gsm8k_style,
        **GSM8K_KEYS,
    )


def add_task(**_) -> Task:
    return Task(
        "add",
        lambda split, limit=None: (_limit(addition_problems(), limit), 0),
        lambda row: row["question"],
        score_addition,
        **GSM8K_KEYS,
    )


TASKS: dict[str, Callable[..., Task]] = {"minigsm": minigsm_task, "gsm8k": gsm8k_task, "add": add_task}
"""The --task names and their factories. make_task calls a factory with the keywords mini (MiniGSMArgs), dataset
and dataset_config; it takes those it needs and ignores the rest (**_). A fork adds an entry (README "Fork it")."""
TASK_NAMES = TASKS.keys()  # a live view: a task registered later (a fork's, at the end of this file) is in it


def make_task(name: str, mini: MiniGSMArgs | None = None, dataset: str = "auto", dataset_config: str = "main") -> Task:
    """The task called `name`; raises ValueError naming a bad name or setting (before any engine starts)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    return TASKS[name](mini=mini or MiniGSMArgs(), dataset=dataset, dataset_config=dataset_config)


def prompt_text(task: Task, row: dict) -> str:
    """The prompt as the model reads it without a chat template: system prompt and a blank line, prompt, prefill."""
    system = f"{task.system_prompt}\n\n" if task.system_prompt else ""
    return system + task.prompt(row) + task.prefill


def encode_prompts(args, task: Task, tokenizer, rows) -> list[list[int]]:
    """Prompt token ids, through the chat template when there is one."""
    use_template = args.use_chat_template and getattr(tokenizer, "chat_template", None)
    system = [{"role": "system", "content": task.system_prompt}] if task.system_prompt else []
    prefill = tokenizer(task.prefill, add_special_tokens=False)["input_ids"] if task.prefill else []
    out = []
    for i, row in enumerate(rows):
        if use_template:
            messages = [*system, {"role": "user", "content": task.prompt(row)}]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids) + prefill
        else:
            ids = tokenizer(prompt_text(task, row), add_special_tokens=False)["input_ids"]
        if len(ids) + args.max_response_length > args.max_model_len:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens; with --max-response-length "
                f"{args.max_response_length} it exceeds --max-model-len {args.max_model_len}"
            )
        out.append(ids)
    return out


def check_reward_settings(task: Task, reward_mode: str | None, format_bonus: float) -> None:
    """--reward-mode names a score key of the task; --format-bonus > 0 needs the task's format key."""
    if reward_mode is not None and reward_mode not in task.score_keys:
        raise ValueError(
            f"--reward-mode must be a score key of task {task.name!r} ({', '.join(task.score_keys)}), "
            f"got {reward_mode!r}"
        )
    if format_bonus > 0 and task.format_key is None:
        raise ValueError(
            f"--format-bonus {format_bonus} needs a format key, and task {task.name!r} has none (Task.format_key)"
        )


def check_scorer(task: Task, rows: list[dict]) -> None:
    """The scorer returns every declared key (an empty response scored against each of `rows`: a missing key fails
    here, not after the engine has started)."""
    for row in rows:
        scores = task.score("", row)
        missing = [k for k in (*task.score_keys, task.format_key) if k is not None and k not in scores]
        if missing:
            raise ValueError(f"task {task.name!r}: its scorer returned the keys {sorted(scores)}, without {missing}")


def check_coverage(tokenizer, texts, what: str = "prompt") -> None:
    """Raise ValueError naming the first text (by index) holding a character the tokenizer cannot encode: its
    encode -> decode round trip (between two letters, as in running text) loses it, or it becomes the unknown token.
    A byte-level BPE drops a byte outside its alphabet without a word. A Unicode normalisation (Qwen2's tokenizer
    applies NFC) is not a loss."""
    first = {}
    for i, text in enumerate(texts):
        for ch in set(text) - first.keys():
            first[ch] = i
    unk = getattr(tokenizer, "unk_token_id", None)
    bad = []
    for ch, i in first.items():
        probe = f"a{ch}a"
        ids = tokenizer(probe, add_special_tokens=False)["input_ids"]
        decoded = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
        if (unk is not None and unk in ids) or decoded not in {probe, *(normalize(f, probe) for f in ("NFC", "NFKC"))}:
            bad.append((i, ch))
    if bad:
        i, ch = min(bad)
        raise ValueError(
            f"{what} {i} holds the character {ch!r} (U+{ord(ch):04X}), which the tokenizer cannot encode "
            f"(it is lost or becomes the unknown token): use a model whose tokenizer covers it, or change the task"
        )


def _limit(rows, limit):
    return rows[:limit] if limit else rows


def local_gsm8k_dir() -> str | None:
    """A local GSM8K copy: ./data/gsm8k, or ../shared/data/gsm8k next to this repository."""
    here = os.path.dirname(os.path.abspath(__file__))
    for path in (os.path.join(here, "data", "gsm8k"), os.path.join(here, "..", "shared", "data", "gsm8k")):
        if os.path.isfile(os.path.join(path, "train.jsonl")):
            return os.path.normpath(path)
    return None


# ---------------------------------------------------------------------------------------------
# The miniature GSM8K
# ---------------------------------------------------------------------------------------------
NAMES = ("Tom", "Ann", "Ben", "Mia", "Sam", "Lily", "Jack", "Emma", "Noah", "Zoe", "Leo", "Ava")
ITEMS = ("apples", "pens", "books", "coins", "stickers", "marbles", "cards", "shells", "eggs", "stamps")
MORE = ("{n} buys {x} more.", "{n} finds {x} more.", "{n} gets {x} more from a friend.")
LESS = ("{n} gives away {x}.", "{n} loses {x}.", "{n} sells {x}.")


def check_mini_args(mini: MiniGSMArgs) -> None:
    def need(cond, msg):
        if not cond:
            raise ValueError(msg)

    need(1 <= mini.max_steps <= 8, f"--mini.max-steps must be in 1..8, got {mini.max_steps}")
    need(
        mini.operand_max >= 2,
        f"--mini.operand-max must be >= 2 (the starting amount is drawn from 2..operand_max), got {mini.operand_max}",
    )
    need(
        mini.train_size >= 1 and mini.test_size >= 1,
        f"--mini.train-size and --mini.test-size must be >= 1, got {mini.train_size} and {mini.test_size}",
    )
    need(0.0 <= mini.format_share <= 1.0, f"--mini.format-share must be in [0, 1], got {mini.format_share}")
    need(mini.sft_steps >= 0, f"--mini.sft-steps must be >= 0, got {mini.sft_steps}")
    need(mini.sft_batch_size >= 1, f"--mini.sft-batch-size must be >= 1, got {mini.sft_batch_size}")
    need(
        mini.sft_schedule in SFT_SCHEDULES,
        f"--mini.sft-schedule must be one of {', '.join(SFT_SCHEDULES)}, got {mini.sft_schedule!r}",
    )
    need(
        mini.sft_learning_rate > 0 and math.isfinite(mini.sft_learning_rate),
        f"--mini.sft-learning-rate must be a finite number > 0, got {mini.sft_learning_rate}",
    )
    need(
        -(2**63) <= mini.model_seed < 2**64,
        f"--mini.model-seed must be in [-2**63, 2**64) (a torch seed), got {mini.model_seed}",
    )
    # Distinct problems the generator can write: names x items x (start amounts) x (step choices)^steps.
    starts, per_step = mini.operand_max - 1, 2 * len(MORE) * mini.operand_max
    capacity = len(NAMES) * len(ITEMS) * starts * sum(per_step**k for k in range(1, mini.max_steps + 1))
    need(
        capacity >= 4 * (mini.train_size + mini.test_size),
        f"--mini.operand-max {mini.operand_max} with --mini.max-steps {mini.max_steps} cannot produce "
        f"{mini.train_size} + {mini.test_size} distinct problems (at most ~{capacity}); raise them or lower the sizes",
    )


def minigsm_problem(rng: random.Random, mini: MiniGSMArgs) -> dict:
    """One problem: question, reference solution (worked lines, '#### N') and gold answer."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    total = rng.randint(2, mini.operand_max)
    sentences, lines = [f"{name} has {total} {item}."], []
    for _ in range(rng.randint(1, mini.max_steps)):
        x = rng.randint(1, mini.operand_max)
        if x <= total and rng.random() < 0.5:  # never below zero
            sentences.append(rng.choice(LESS).format(n=name, x=x))
            lines.append(f"{total}-{x}={total - x}")
            total -= x
        else:
            sentences.append(rng.choice(MORE).format(n=name, x=x))
            lines.append(f"{total}+{x}={total + x}")
            total += x
    sentences.append(f"How many {item} does {name} have now?")
    return {"question": " ".join(sentences), "answer": "\n".join(lines + [f"#### {total}"]), "gold": str(total)}


def minigsm_split(question: str) -> str:
    """'test' for about one problem in ten, decided by the question text alone: the splits are disjoint."""
    return "test" if hashlib.blake2b(question.encode(), digest_size=8).digest()[0] % 10 == 0 else "train"


_PROBLEM_CACHE: dict = {}


def minigsm_problems(mini: MiniGSMArgs, split: str) -> list[dict]:
    """The split's problems, generated deterministically from mini.data_seed (rows: question, answer, gold)."""
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r}; minigsm has 'train' and 'test'")
    key = (mini.max_steps, mini.operand_max, mini.train_size, mini.test_size, mini.data_seed)
    if key not in _PROBLEM_CACHE:
        rng = random.Random(f"minigsm/{mini.data_seed}")
        want = {"train": mini.train_size, "test": mini.test_size}
        out, seen = {"train": [], "test": []}, set()
        for _ in range(50 * (mini.train_size + mini.test_size)):
            p = minigsm_problem(rng, mini)
            s = minigsm_split(p["question"])
            if p["question"] not in seen and len(out[s]) < want[s]:
                seen.add(p["question"])
                out[s].append(p)
            if all(len(out[k]) == want[k] for k in want):
                break
        else:
            raise ValueError(
                f"--mini.operand-max {mini.operand_max} with --mini.max-steps {mini.max_steps} produced "
                f"only {len(out['train'])} train / {len(out['test'])} test distinct problems"
            )
        _PROBLEM_CACHE[key] = out
    return _PROBLEM_CACHE[key][split]


def warm_start_solution(problem: dict, rng: random.Random, format_share: float) -> str:
    """The reference solution, its last line in the strict format with probability format_share."""
    if rng.random() < format_share:
        return problem["answer"]
    return problem["answer"].rsplit("\n", 1)[0] + f"\nThe answer is {problem['gold']}."


# ---------------------------------------------------------------------------------------------
# The one-token addition fixture
# ---------------------------------------------------------------------------------------------
def addition_problems() -> list[dict]:
    """'a+b=' for the 55 digit pairs whose sum is one digit; train and eval use all of them.

    A one-token answer out of a 160-token vocabulary: a random policy is right ~1 time in 160, so the
    reward climbs from ~0.01 within a few dozen steps (the fast tests' learning fixture)."""
    return [{"question": f"{a}+{b}=", "gold": str(a + b)} for a in range(10) for b in range(10) if a + b <= 9]


def score_addition(response: str, row: dict) -> dict:
    """1.0 if the first run of ASCII digits in the response equals the row's gold number, else 0.0 (all three keys).

    ASCII only: str.isdigit() also accepts '³' or '٣', which int() then rejects (a sampled byte-level
    token can decode to them)."""
    match = re.search(r"[0-9]+", response)
    ok = float(match is not None and int(match.group()) == int(row["gold"]))
    return {"strict": ok, "flexible": ok, "well_formed": float(match is not None)}


# ---------------------------------------------------------------------------------------------
# Tiny local models: built here, cached on disk, no download
# ---------------------------------------------------------------------------------------------
def cache_root() -> str:
    return os.environ.get("RC_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "rc_train"))


# Built models the repository ships, by cache name (models/NAME: the files and build.json with their SHA-256): the
# default job's base, so a first run starts training at once, and every machine trains from the same weights (a build
# here depends on the thread count, which follows the machine's load: docs/running.md "The miniature GSM8K").
SHIPPED_MODELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models")


def resolve_model(args, task: Task, main: bool) -> str:
    """The path of --model: a tiny model built here and cached (base_model_path; the MoE with its router scale; the
    main process says where it is), else the local path or Hugging Face id as given."""
    if args.model not in (TINY_MODEL, TINY_MOE_MODEL):
        return args.model
    say = (lambda m: print(m, flush=True)) if main else None  # None: quiet
    moe = args.moe_router_scale if args.model == TINY_MOE_MODEL else None
    return base_model_path(task, args.mini, args.seed, say, router_scale=moe)


def base_model_path(
    task: Task,
    mini: MiniGSMArgs,
    seed: int,
    log: Callable[[str], None] | None = print,
    router_scale: float | None = None,
) -> str:
    """The model behind `--model tiny`: for a task with a warm start, its warm-started base (one per setting, shared by
    every run seed; mini's sft_* fields and model_seed); for any other task, a random net initialised from the run
    seed, whose tokenizer encodes every character of the task's prompts. With `router_scale` (`--model tiny-moe`) the
    same, built as the tiny Qwen3-MoE (make_qwen3_moe) whose router weights start with that standard deviation; its
    cache names hash it. `log` (None: quiet, no progress bar) gets a line saying where the model is cached."""
    show_progress, log = log is not None, log or (lambda _: None)
    if task.warm_start is not None:
        prompts, solutions = warm_start_corpus(task, mini)
        name = warm_base_name(task, mini, prompts, solutions)
        if router_scale is not None:
            sft = {k: v for k, v in hashed_settings(mini).items() if k.startswith("sft_") or k == "model_seed"}
            moe = {"version": MOE_BUILDER_VERSION, "router_scale": router_scale, **sft, "corpus": [prompts, solutions]}
            name = f"{task.name}-moe-base-{_digest(moe)[:16]}"
        return cached_build(
            name,
            lambda path: build_warm_base(task, mini, prompts, solutions, path, log, show_progress, router_scale),
            log,
        )
    prompts = [prompt_text(task, row) for split in ("train", "test") for row in task.problems(split)[0]]
    corpus, alphabet = tiny_corpus(), tiny_alphabet(prompts)
    vocab_size = TINY_VOCAB + len(alphabet) - len(tiny_alphabet([]))  # one more token per extra alphabet symbol
    digest = _digest({"version": TINY_BUILDER_VERSION, "corpus": corpus, "alphabet": alphabet, "vocab": vocab_size})
    name = f"tiny-qwen2-v{vocab_size}-{digest[:12]}-s{seed}"
    if router_scale is not None:
        moe = {"version": MOE_BUILDER_VERSION, "router_scale": router_scale, "tokenizer": digest}
        name = f"tiny-qwen3moe-v{vocab_size}-{_digest(moe)[:12]}-s{seed}"
    return cached_build(
        name,
        lambda path: build_random_tiny(path, seed, corpus, alphabet, vocab_size, router_scale),
        log,
    )


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def warm_base_name(task: Task, mini: MiniGSMArgs, prompts: list[str], solutions: list[str]) -> str:
    """The cache name of a warm-started base: the SFT settings and the corpus, hashed (a changed setting or problem
    never reuses a stale model). minigsm keeps the name its base has always had, settings_hash(mini): every
    MiniGSMArgs field, the generator's included, so the cached default base stays valid."""
    if task.name == "minigsm":
        return f"minigsm-base-{settings_hash(mini)}"
    sft = {k: v for k, v in hashed_settings(mini).items() if k.startswith("sft_") or k == "model_seed"}
    return f"{task.name}-base-{_digest({'version': BUILDER_VERSION, **sft, 'corpus': [prompts, solutions]})[:16]}"


def hashed_settings(mini: MiniGSMArgs) -> dict:
    """The settings a base's cache name hashes: every field, except sft_schedule when it is 'constant' (the only
    schedule before the field existed), so every base built before keeps its name and its cached copy."""
    return {k: v for k, v in asdict(mini).items() if not (k == "sft_schedule" and v == "constant")}


def settings_hash(mini: MiniGSMArgs) -> str:
    """Every setting that shapes the base model, hashed: a changed setting never reuses a stale model."""
    text = json.dumps({"version": BUILDER_VERSION, **hashed_settings(mini)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _weights_digest(path: str) -> str:
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        if name.endswith((".safetensors", ".json")) and name != "build.json":
            with open(os.path.join(path, name), "rb") as f:
                h.update(name.encode() + f.read())
    return h.hexdigest()


def _cached(path: str) -> bool:
    """A complete build: its folder holds build.json, and the stamp there matches its files."""
    try:
        with open(os.path.join(path, "build.json")) as f:
            return json.load(f)["sha256"] == _weights_digest(path)
    except (OSError, ValueError, KeyError):
        return False


STALE_BUILD = re.compile(r"(?P<name>.+)\.tmp(?P<pid>\d+)")  # cache/name.tmpPID: a build under way, or a killed one's


def _gone(pid: int) -> bool:
    """No process has this id (on this machine)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # PermissionError: someone else's process
        return False
    return False


def remove_stale_builds(held: str, log: Callable[[str], None]) -> list[str]:
    """Remove the folders that killed builds left in the cache (cache/name.tmpPID: a SIGKILL, a power cut; a build
    that fails or is interrupted removes its own) and return them. A build holds cache/name.lock for as long as its
    folder is unfinished, so a name.tmpPID is stale when that lock is free: `held`, the name whose lock the caller
    holds, or any other whose lock this process can take for a moment. The lock, not the PID, decides: a PID can be
    reused by an unrelated process, or belong to another machine sharing the cache. Without a lock file (never made by
    cached_build) the PID decides: gone, the folder goes."""
    root, removed = cache_root(), []
    for entry in sorted(os.listdir(root)):
        match, folder = STALE_BUILD.fullmatch(entry), os.path.join(root, entry)
        if match is None or not os.path.isdir(folder) or os.path.islink(folder):
            continue
        name, pid = match["name"], int(match["pid"])
        lock_path = os.path.join(root, f"{name}.lock")
        with contextlib.ExitStack() as held_lock:
            if name != held and os.path.exists(lock_path):
                try:
                    lock = held_lock.enter_context(open(lock_path, "a"))  # closing it releases the lock
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:  # BlockingIOError: being built now; or not ours to open
                    continue
            elif name != held and not _gone(pid):
                continue
            if not os.path.isdir(folder):  # finished or removed meanwhile
                continue
            shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
        log(f"model cache: removed {folder}, left by a build that was stopped (pid {pid})")
    return removed


def cached_build(name: str, build: Callable[[str], dict], log: Callable[[str], None]) -> str:
    """models/name when the repository ships it and its files match its stamp (SHIPPED_MODELS); else cache/name,
    built once by build(tmp_dir) and renamed into place (atomic: a half-built model is never
    picked up). A complete build holds build.json with the SHA-256 of its files; a folder whose files no longer
    match it (corrupt, truncated, edited) is moved aside and rebuilt, never loaded. Two processes that want the same
    model at once (two runs, or the test suite's workers, on a fresh machine) build it once: the second waits on the
    first's lock (cache/name.lock, an empty file that stays; flock, so the kernel releases it if its holder dies)
    and then finds the model cached. A build that fails or is interrupted removes its folder; one that was killed
    leaves it, and the next build removes it (remove_stale_builds)."""
    shipped = os.path.join(SHIPPED_MODELS, name)
    if _cached(shipped):
        log(f"model: {shipped} (shipped with the repository, checksum verified)")
        return shipped
    if os.path.isdir(shipped):
        log(f"model: {shipped} fails its checksum (edited or damaged), not loaded; using the cache")
    path = os.path.join(cache_root(), name)
    if _cached(path):
        log(f"model: {path} (cached)")
        return path
    tmp = f"{path}.tmp{os.getpid()}"
    lock = None
    try:  # a cache that cannot be written (read-only, full, a file in the way): one line, before the engine starts
        os.makedirs(cache_root(), exist_ok=True)
        lock = open(f"{path}.lock", "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"model: another process is building {path}; waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if _cached(path):  # built by the process we waited for
            log(f"model: {path} (cached)")
            return path
        if os.path.isdir(path):
            broken = f"{path}.corrupt{time.time_ns()}"
            os.rename(path, broken)
            log(f"cached model {path} failed its checksum: moved to {broken}, rebuilding")
        remove_stale_builds(name, log)
        os.makedirs(tmp)
        info = build(tmp)
        with open(os.path.join(tmp, "build.json"), "w") as f:
            json.dump({**info, "sha256": _weights_digest(tmp)}, f, indent=1)
        os.rename(tmp, path)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(
            f"the model cache {cache_root()!r} (RC_CACHE_DIR) cannot be written: {e.strerror} "
            f"({e.filename or tmp}); set RC_CACHE_DIR to a writable folder"
        ) from None
    except BaseException:  # a failed build, Ctrl-C: nothing half-built stays (a SIGKILL's: remove_stale_builds)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            lock.close()  # releases the flock
    log(f"model: built once and cached in {path}; later runs reuse it")
    return path


def make_tokenizer(texts, vocab_size: int, alphabet: list[str] | None = None):
    """Byte-level BPE with digits split one per token (as Qwen2's tokenizer does). transformers and vLLM load it
    as a Qwen2 tokenizer. alphabet: the byte-level symbols it starts from (tiny_alphabet), beside those of `texts`;
    None = all 256 (any text round-trips). A byte outside the alphabet is dropped silently when encoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if alphabet is None else alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def _tiny_shape(eos: int, hidden: int, layers: int) -> dict:
    """The config fields both tiny models share: head_dim 64 (vLLM's CPU attention rejects head_dim 16), one KV head,
    tied embeddings, the tokenizer's end token as bos, eos and pad."""
    return dict(
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )


def make_qwen2(vocab_size: int, eos: int, hidden: int, layers: int, intermediate: int, seed: int):
    """A Qwen2-architecture causal LM with head_dim 64 (vLLM's CPU attention rejects head_dim 16)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        **_tiny_shape(eos, hidden, layers),
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def make_qwen3_moe(vocab_size: int, eos: int, hidden: int, layers: int, seed: int, router_scale: float):
    """The tiny Mixture-of-Experts (`--model tiny-moe`, docs/moe.md): a Qwen3-MoE whose every layer is sparse, 8 experts
    of intermediate size 128 (a multiple of 32, as vLLM's CPU grouped GEMM wants), top-2 renormalised
    (norm_topk_prob), head_dim 64 and tied embeddings like make_qwen2. The router weights start with standard
    deviation `router_scale` (the rest with transformers' 0.02): the router's sharpness, the dial of how often a
    bf16 engine routes a token elsewhere (docs/moe.md; measured here at 0.02 against 0.3)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=4 * hidden,  # unused: every layer is sparse (decoder_sparse_step 1, no mlp_only_layers)
        moe_intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        **_tiny_shape(eos, hidden, layers),
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, router_scale)
    return model


TINY_VOCAB = 160  # the random tiny net's vocabulary on printable ASCII: a random policy hits a digit ~1 time in 160
PRINTABLE = [chr(c) for c in range(32, 127)] + ["\n"]


def tiny_corpus() -> list[str]:
    """The text the random tiny net's tokenizer learns its merges from, all generated here (never a file outside the
    repository, so the tokenizer is the same on every machine): the default miniature GSM8K's questions and solutions
    and the addition prompts."""
    rows = minigsm_problems(MiniGSMArgs(), "train")
    return [t for r in rows for t in (r["question"], r["answer"])] + [p["question"] for p in addition_problems()]


def tiny_alphabet(prompts: list[str]) -> list[str]:
    """The byte-level symbols of printable ASCII, newline and every character of `prompts` (the UTF-8 bytes of each
    character, mapped as GPT-2's byte-level BPE maps bytes), sorted: each of those characters encodes."""
    from tokenizers import pre_tokenizers

    chars = "".join(sorted(set(PRINTABLE).union(*prompts)))
    mapped = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(chars)
    return sorted(set("".join(piece for piece, _ in mapped)))


def build_random_tiny(
    path: str, seed: int, corpus: list[str], alphabet: list[str], vocab_size: int, router_scale: float | None = None
) -> dict:
    """A random 0.3M-parameter Qwen2 (2 layers, hidden 128) and a ~160-token BPE: the smoke model of every task
    without a warm start. With `router_scale`: the tiny Qwen3-MoE instead (make_qwen3_moe, 2 layers)."""
    tokenizer = make_tokenizer(corpus, vocab_size, alphabet)
    eos = tokenizer.eos_token_id
    if router_scale is None:
        model = make_qwen2(len(tokenizer), eos, hidden=128, layers=2, intermediate=256, seed=seed)
        info = {"kind": "random tiny"}
    else:
        model = make_qwen3_moe(len(tokenizer), eos, 128, layers=2, seed=seed, router_scale=router_scale)
        info = {"kind": "random tiny MoE", "router_scale": router_scale}
    tokenizer.save_pretrained(path)
    model.save_pretrained(path)
    return {**info, "alphabet": "".join(alphabet)}


def warm_start_corpus(task: Task, mini: MiniGSMArgs) -> tuple[list[str], list[str]]:
    """(prompts, solutions) of the train split: the prompt as rc_train.py writes it without a chat template, and one
    warm-start solution per row (drawn in row order from a generator seeded by mini.model_seed)."""
    train, _ = task.problems("train")
    rng = random.Random(f"warm-start/{mini.model_seed}")
    solutions = [task.warm_start(row, rng) for row in train]
    return [prompt_text(task, row) for row in train], solutions


def _cpu_ticks() -> tuple[int, int, int] | None:
    """(all, idle + iowait, cores) CPU ticks since boot of the cores this process may run on (its affinity: in a
    container pinned to some cores of a bigger machine, those), from /proc/stat; None where there is none (macOS)."""
    mine = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    total = idle = cores = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if not name.startswith("cpu") or name == "cpu" or (mine is not None and int(name[3:]) not in mine):
                    continue
                ticks = [int(x) for x in fields]
                total, idle, cores = total + sum(ticks), idle + ticks[3] + ticks[4], cores + 1
    except (OSError, ValueError, IndexError):
        return None
    return (total, idle, cores) if cores else None


def _busy(before: tuple[int, int, int], after: tuple[int, int, int]) -> float:
    """Cores kept busy on average between two _cpu_ticks samples."""
    total, idle = after[0] - before[0], after[1] - before[1]
    return (1.0 - idle / max(1, total)) * after[2]


def busy_cores(seconds: float = 0.3) -> float | None:
    """Cores the machine's other processes keep busy, sampled from /proc/stat over `seconds` while this process waits
    (None where there is no /proc/stat, e.g. macOS)."""
    before = _cpu_ticks()
    time.sleep(seconds)
    after = _cpu_ticks()
    return None if before is None or after is None else _busy(before, after)


class OtherLoad:
    """Cores the machine's other processes kept busy since the last call (or since it was made), without waiting: the
    machine's busy time (/proc/stat) less this process's own CPU time, all its threads, spinning ones included. A
    loop that works between calls samples the others' load as it goes. None where there is no /proc/stat."""

    def __init__(self, ticks=_cpu_ticks, cpu_time=time.process_time, clock=time.monotonic):
        self.ticks, self.cpu_time, self.clock = ticks, cpu_time, clock
        self.last = self._sample()

    def _sample(self):
        return self.ticks(), self.cpu_time(), self.clock()

    def __call__(self) -> float | None:
        (t0, cpu0, wall0), now = self.last, self._sample()
        (t1, cpu1, wall1), self.last = now, now
        if t0 is None or t1 is None or t1[0] <= t0[0] or t1[2] != t0[2]:
            return None
        return max(0.0, _busy(t0, t1) - (cpu1 - cpu0) / max(1e-6, wall1 - wall0))


def usable_cores() -> int:
    """The cores this process may run on (its affinity), else the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def build_threads(environ=os.environ, busy=busy_cores, cores: int | None = None) -> int:
    """Threads of a base-model build: every core while the other processes leave them idle (under half a core busy);
    beside busy ones, the cores they leave free (at least one; at most OMP_NUM_THREADS when it is set, rc_config.
    check_environment checked it); without /proc/stat, OMP_NUM_THREADS or every core. Measured on the 2-core machine
    (docs/running.md "The miniature GSM8K"): with spinning OpenMP threads (libgomp's default) a step went from
    0.45 s alone to 4-7 s beside busy processes at 2 threads, 1.0-1.2 s at one; re-deciding every few seconds
    (BuildThreads) follows the others as they start and stop, and one thread leaves them their share."""
    cores = cores or usable_cores()
    value = environ.get("OMP_NUM_THREADS", "").strip()
    cap = int(value) if value.isdigit() and int(value) > 0 else cores
    others = busy()
    if others is None:
        return min(cap, cores)
    if others < 0.5:
        return cores
    return max(1, min(cap, cores, round(cores - others)))


class BuildThreads:
    """torch's threads for a long build loop on a machine others share, re-decided as they start and stop: set from
    build_threads at the start (a short sample of the load, busy_cores), then every `every` seconds (at the next call
    of `recheck`, between steps) from what the others kept busy since the last decision (OtherLoad). `restore` puts
    the caller's thread count back."""

    def __init__(self, every=5.0, environ=os.environ, set_threads=None, clock=time.monotonic, first=None, load=None):
        self.every, self.environ, self.clock = every, environ, clock
        self.set_threads = set_threads or torch.set_num_threads
        self.before = torch.get_num_threads()
        self.threads = build_threads(environ, busy=first or busy_cores)
        self.used = {self.threads}
        self.set_threads(self.threads)
        self.load = load or OtherLoad(clock=clock)
        self.due = clock() + every

    def recheck(self) -> int:
        """The threads now: unchanged until `every` seconds have passed since the last decision."""
        if self.clock() >= self.due:
            self.due = self.clock() + self.every
            threads = build_threads(self.environ, busy=self.load)
            if threads != self.threads:
                self.threads = threads
                self.used.add(threads)
                self.set_threads(threads)
        return self.threads

    def restore(self) -> None:
        self.set_threads(self.before)


ESTIMATE_AFTER = 5  # the build's step after which it says how long it will take (step 0 warms up, not counted)


def build_estimate(name: str, steps: int, seconds: list[float], threads: int) -> str:
    """The one line that says how long a build of `steps` steps will take, from the seconds of its first steps."""
    per = sum(seconds) / max(1, len(seconds))
    total = per * steps
    about = f"{total:.0f} s" if total < 90 else f"{total / 60:.0f} min"
    return f"building the {name} base model (once): ~{about} ({steps} steps, {per:.2f} s each on {threads} thread(s))"


def build_warm_base(
    task: Task,
    mini: MiniGSMArgs,
    prompts: list[str],
    solutions: list[str],
    path: str,
    log: Callable[[str], None],
    show_progress: bool = False,
    router_scale: float | None = None,
    step_times: list[float] | None = None,
) -> dict:
    """Tokenizer (trained on the task's prompts and solutions, warm_start_corpus) + a 1M-parameter Qwen2 (4 layers,
    hidden 128), warm-started by supervised fine-tuning on the train split: loss on the solution tokens and EOS only,
    the prompt built exactly as rc_train.py builds it. Sizing and measurements of the minigsm base: docs/running.md
    "The miniature GSM8K". With `router_scale`: the tiny Qwen3-MoE (make_qwen3_moe, 4 layers) by the same loop, plus
    Qwen3-MoE's own load-balancing loss (router_aux_loss_coef) so that the experts share the tokens (docs/moe.md).
    Threads: BuildThreads. After the first steps `log` gets one line saying how long it will take (build_estimate).
    `step_times` (a list) receives each step's seconds (benchmarks/bench_build.py)."""
    t0 = time.time()
    tokenizer = make_tokenizer(prompts + solutions, 512)
    eos = tokenizer.eos_token_id
    if router_scale is None:
        model = make_qwen2(len(tokenizer), eos, hidden=128, layers=4, intermediate=512, seed=mini.model_seed)
    else:
        model = make_qwen3_moe(len(tokenizer), eos, 128, layers=4, seed=mini.model_seed, router_scale=router_scale)
    moe = {} if router_scale is None else {"output_router_logits": True}  # the aux loss joins out.loss
    examples = [
        (
            tokenizer(p, add_special_tokens=False)["input_ids"],
            tokenizer(s, add_special_tokens=False)["input_ids"] + [eos],
        )
        for p, s in zip(prompts, solutions)
    ]
    optimizer = torch.optim.AdamW(model.parameters(), lr=mini.sft_learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(sft_rate, mini))
    order = torch.Generator().manual_seed(mini.model_seed)
    threads = BuildThreads()  # every idle core, re-decided as other processes start and stop
    model.train()
    loss, times = float("nan"), [] if step_times is None else step_times
    first = len(times)
    desc = f"building the {task.name} base model (once)"
    bar = tqdm(range(mini.sft_steps), desc=desc, disable=not show_progress, leave=False, dynamic_ncols=True)
    try:
        for step in bar:
            t_step = time.perf_counter()
            idx = torch.randint(len(examples), (mini.sft_batch_size,), generator=order).tolist()
            input_ids, labels = sft_batch([examples[i] for i in idx], eos)
            out = model(input_ids=input_ids, labels=labels, **moe)  # right padding: causal attention never sees it
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            loss = out.loss.item()
            times.append(time.perf_counter() - t_step)
            if step % 10 == 0:
                bar.set_postfix(loss=f"{loss:.3f}")
            if step == ESTIMATE_AFTER and mini.sft_steps > 2 * ESTIMATE_AFTER:
                with tqdm.external_write_mode():  # one line above the bar
                    log(build_estimate(task.name, mini.sft_steps, times[first + 1 :], threads.threads))
            threads.recheck()
    finally:
        bar.close()
        threads.restore()
    log(f"warm start: {mini.sft_steps} steps, final loss {loss:.3f}, {time.time() - t0:.0f} s")
    if not math.isfinite(loss) and mini.sft_steps:
        raise RuntimeError(f"warm start diverged (loss {loss})")
    tokenizer.save_pretrained(path)
    model.save_pretrained(path)
    return {
        "kind": f"{task.name} base" if router_scale is None else f"{task.name} MoE base",
        "settings": asdict(mini) if router_scale is None else {**asdict(mini), "router_scale": router_scale},
        "sft_final_loss": loss,
        "build_seconds": round(time.time() - t0, 1),
        "threads": sorted(threads.used),
    }


SFT_SCHEDULES = ("cosine", "constant")
SFT_WARMUP = 100  # steps of linear learning-rate warm-up


def sft_rate(mini: MiniGSMArgs, step: int) -> float:
    """The warm start's learning rate at `step` as a factor of its peak: a linear warm-up over SFT_WARMUP steps, then
    constant or a cosine decay to 10 % at the last step (Loshchilov & Hutter 2017, SGDR, eq. 5: one cycle, a floor).
    Measured on the minigsm base (docs/running.md "The miniature GSM8K"): with the decay, 600 steps reach the SFT loss
    and greedy accuracy of 900 constant ones, but GRPO from that base learns far slower; so the default is constant."""
    if step < SFT_WARMUP or mini.sft_schedule == "constant":
        return min(1.0, (step + 1) / SFT_WARMUP)
    done = (step - SFT_WARMUP) / max(1, mini.sft_steps - 1 - SFT_WARMUP)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, done)))


def sft_batch(examples, pad: int):
    """Right-padded (prompt + solution) ids and labels that are -100 except on the solution tokens."""
    width = max(len(p) + len(s) for p, s in examples)
    input_ids = torch.full((len(examples), width), pad, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for i, (p, s) in enumerate(examples):
        input_ids[i, : len(p) + len(s)] = torch.tensor(p + s)
        labels[i, len(p) : len(p) + len(s)] = torch.tensor(s)
    return input_ids, labels
