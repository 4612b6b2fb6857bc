"""Tasks and the tiny local models: everything rc_train.py learns on, behind one small interface.

    task = tasks.make_task(name, mini, dataset=...)  # 'minigsm' (default), 'gsm8k' or 'add'
    rows, n_skipped = task.problems("train")          # [{'question': str, 'gold': str}, ...]
    text = task.prompt(row["question"])               # the prompt text (before any chat template)
    scores = task.score(response, row["gold"])        # {'strict': 0/1, 'flexible': 0/1, 'well_formed': 0/1}

The trainer has no per-task branch: it asks the task for problems, prompts and scores, and asks
`base_model_path` for the model behind `--model tiny`.

* minigsm: a miniature GSM8K generated here from a seed. Short word problems of 1..max_steps add/subtract
  steps ("Tom has 27 pens. Tom buys 18 more. Tom gives away 17. How many pens does Tom have now?"), reference
  solutions in GSM8K's own shape (one worked line per step, then `#### N`), prompts built by
  `gsm8k.format_prompt` and scored by `gsm8k.score_response`, exactly as the real GSM8K job. Its base model is a
  1M-parameter Qwen2 warm-started by supervised fine-tuning on the train split (see MiniGSMArgs).
* gsm8k: the real data set (local JSONL/parquet or a Hugging Face id); the tiny model is a random smoke-test net.
* add: 'a+b=' -> one digit, the one-token fixture the fast tests learn in seconds.
"""

from __future__ import annotations

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

import torch

import gsm8k

TASK_NAMES = ("minigsm", "gsm8k", "add")
# Bumped whenever the generator, tokenizer or warm start changes what a cached base model holds.
BUILDER_VERSION = 1


@dataclass
class MiniGSMArgs:
    """The miniature GSM8K: problem generator and the warm start of its base model."""

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
    """warm-start learning rate (linear warm-up over 100 steps, then constant)"""
    model_seed: int = 0
    """seed of the base model's random initialisation and of the warm start's data order"""


# ---------------------------------------------------------------------------------------------
# The interface
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Task:
    name: str
    problems: Callable[..., tuple[list[dict], int]]
    """(split, limit=None) -> (rows {'question', 'gold'}, number of rows skipped as malformed)"""
    prompt: Callable[[str], str]
    """question -> prompt text"""
    score: Callable[[str, str], dict]
    """(response, gold) -> {'strict', 'flexible', 'well_formed'}, each 0.0 or 1.0"""


def score_gsm8k_style(response: str, gold: str) -> dict:
    """GSM8K's scorer both ways: strict reads the last '#### N' line, flexible the last number."""
    strict = gsm8k.score_response(response, gold, mode="strict")
    return {
        "strict": strict,
        "flexible": gsm8k.score_response(response, gold, mode="flexible"),
        "well_formed": float(gsm8k.extract_answer(response, "strict") is not None),
    }


def make_task(name: str, mini: MiniGSMArgs | None = None, dataset: str = "auto", dataset_config: str = "main") -> Task:
    """The task called `name`; raises ValueError naming a bad name or setting (before any engine starts)."""
    if name == "minigsm":
        mini = mini or MiniGSMArgs()
        check_mini_args(mini)
        return Task(
            "minigsm",
            lambda split, limit=None: (_limit(minigsm_problems(mini, split), limit), 0),
            gsm8k.format_prompt,
            score_gsm8k_style,
        )
    if name == "gsm8k":
        source = (local_gsm8k_dir() or "openai/gsm8k") if dataset == "auto" else dataset
        return Task(
            "gsm8k",
            lambda split, limit=None: gsm8k.load_gsm8k(source, split, limit=limit, config=dataset_config),
            gsm8k.format_prompt,
            score_gsm8k_style,
        )
    if name == "add":
        return Task(
            "add", lambda split, limit=None: (_limit(addition_problems(), limit), 0), lambda q: q, score_addition
        )
    raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASK_NAMES)}")


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


def score_addition(response: str, gold: str) -> dict:
    """1.0 if the first run of ASCII digits in the response equals the gold number, else 0.0 (all three keys).

    ASCII only: str.isdigit() also accepts '³' or '٣', which int() then rejects (a sampled byte-level
    token can decode to them)."""
    match = re.search(r"[0-9]+", response)
    ok = float(match is not None and int(match.group()) == int(gold))
    return {"strict": ok, "flexible": ok, "well_formed": float(match is not None)}


# ---------------------------------------------------------------------------------------------
# Tiny local models: built here, cached on disk, no download
# ---------------------------------------------------------------------------------------------
def cache_root() -> str:
    return os.environ.get("RC_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "rc_train"))


def base_model_path(task: str, mini: MiniGSMArgs, seed: int, log: Callable[[str], None] = print) -> str:
    """The model behind `--model tiny`: the warm-started base for minigsm (one per setting of MiniGSMArgs, shared
    by every run seed), a random net initialised from the run seed for add/gsm8k."""
    if task == "minigsm":
        return cached_build(
            f"minigsm-base-{settings_hash(mini)}", lambda path: build_minigsm_base(mini, path, log), log
        )
    return cached_build(f"tiny-qwen2-v160-s{seed}", lambda path: build_random_tiny(path, seed), log)


def settings_hash(mini: MiniGSMArgs) -> str:
    """Every setting that shapes the base model, hashed: a changed setting never reuses a stale model."""
    text = json.dumps({"version": BUILDER_VERSION, **asdict(mini)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _weights_digest(path: str) -> str:
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        if name.endswith((".safetensors", ".json")) and name != "build.json":
            with open(os.path.join(path, name), "rb") as f:
                h.update(name.encode() + f.read())
    return h.hexdigest()


def cached_build(name: str, build: Callable[[str], dict], log: Callable[[str], None]) -> str:
    """cache/name, built once by build(tmp_dir) and renamed into place (atomic: a half-built model is never
    picked up). A complete build holds build.json with the SHA-256 of its files; a folder whose files no longer
    match it (corrupt, truncated, edited) is moved aside and rebuilt, never loaded."""
    path = os.path.join(cache_root(), name)
    stamp = os.path.join(path, "build.json")
    if os.path.isdir(path):
        try:
            with open(stamp) as f:
                if json.load(f)["sha256"] == _weights_digest(path):
                    return path
        except (OSError, ValueError, KeyError):
            pass
        broken = f"{path}.corrupt{time.time_ns()}"
        os.rename(path, broken)
        log(f"cached model {path} failed its checksum: moved to {broken}, rebuilding")
    tmp = f"{path}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    info = build(tmp)
    with open(os.path.join(tmp, "build.json"), "w") as f:
        json.dump({**info, "sha256": _weights_digest(tmp)}, f, indent=1)
    try:
        os.rename(tmp, path)
    except OSError:  # another process finished the same build first
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def make_tokenizer(texts, vocab_size: int, full_byte_alphabet: bool):
    """Byte-level BPE with digits split one per token (as Qwen2's tokenizer does). transformers and vLLM load it
    as a Qwen2 tokenizer. full_byte_alphabet: every byte encodable (any text round-trips), else only the corpus's
    bytes (a smaller vocabulary: a random policy hits a given digit with chance ~1/150 rather than ~1/300)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet() if full_byte_alphabet else []
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def make_qwen2(vocab_size: int, eos: int, hidden: int, layers: int, intermediate: int, seed: int):
    """A Qwen2-architecture causal LM with head_dim 64 (vLLM's CPU attention rejects head_dim 16)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
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
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def build_random_tiny(path: str, seed: int) -> dict:
    """A random 0.3M-parameter Qwen2 (2 layers, hidden 128) and a 160-token BPE: the add/gsm8k smoke model."""
    folder = local_gsm8k_dir()
    if folder:
        rows, _ = gsm8k.load_gsm8k(folder, "train")
        texts = [t for r in rows for t in (r["question"], r["answer"])]
    else:
        rng = random.Random(0)
        texts = []
        for _ in range(20000):
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            texts.append(f"What is {a} plus {b}? {a}+{b}={a + b}. #### {a + b}")
    tokenizer = make_tokenizer(texts, 160, full_byte_alphabet=False)
    model = make_qwen2(len(tokenizer), tokenizer.eos_token_id, hidden=128, layers=2, intermediate=256, seed=seed)
    tokenizer.save_pretrained(path)
    model.save_pretrained(path)
    return {"kind": "random tiny"}


def build_minigsm_base(mini: MiniGSMArgs, path: str, log: Callable[[str], None]) -> dict:
    """Tokenizer (trained on the task's prompts and solutions) + a 1M-parameter Qwen2 (4 layers, hidden 128),
    warm-started by supervised fine-tuning on the train split: loss on the solution tokens and EOS only, the
    prompt built exactly as rc_train.py builds it. Sizing and measurements: docs/running.md "The miniature GSM8K"."""
    t0 = time.time()
    train = minigsm_problems(mini, "train")
    rng = random.Random(f"warm-start/{mini.model_seed}")
    solutions = [warm_start_solution(p, rng, mini.format_share) for p in train]
    prompts = [gsm8k.format_prompt(p["question"]) for p in train]
    tokenizer = make_tokenizer(prompts + solutions, 512, full_byte_alphabet=True)
    eos = tokenizer.eos_token_id
    model = make_qwen2(len(tokenizer), eos, hidden=128, layers=4, intermediate=512, seed=mini.model_seed)
    examples = [
        (
            tokenizer(p, add_special_tokens=False)["input_ids"],
            tokenizer(s, add_special_tokens=False)["input_ids"] + [eos],
        )
        for p, s in zip(prompts, solutions)
    ]
    optimizer = torch.optim.AdamW(model.parameters(), lr=mini.sft_learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 100))
    order = torch.Generator().manual_seed(mini.model_seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)  # the build has the machine to itself
    model.train()
    loss = float("nan")
    try:
        for step in range(mini.sft_steps):
            idx = torch.randint(len(examples), (mini.sft_batch_size,), generator=order).tolist()
            input_ids, labels = sft_batch([examples[i] for i in idx], eos)
            out = model(input_ids=input_ids, labels=labels)  # right padding: causal attention never sees it
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            loss = out.loss.item()
            if step % 100 == 0 or step == mini.sft_steps - 1:
                log(f"warm start: step {step + 1}/{mini.sft_steps}, loss {loss:.3f}, {time.time() - t0:.0f} s")
    finally:
        torch.set_num_threads(threads)
    if not math.isfinite(loss) and mini.sft_steps:
        raise RuntimeError(f"warm start diverged (loss {loss})")
    tokenizer.save_pretrained(path)
    model.save_pretrained(path)
    return {
        "kind": "minigsm base",
        "settings": asdict(mini),
        "sft_final_loss": loss,
        "build_seconds": round(time.time() - t0, 1),
    }


def sft_batch(examples, pad: int):
    """Right-padded (prompt + solution) ids and labels that are -100 except on the solution tokens."""
    width = max(len(p) + len(s) for p, s in examples)
    input_ids = torch.full((len(examples), width), pad, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for i, (p, s) in enumerate(examples):
        input_ids[i, : len(p) + len(s)] = torch.tensor(p + s)
        labels[i, len(p) : len(p) + len(s)] = torch.tensor(s)
    return input_ids, labels
