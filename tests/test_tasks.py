"""Tests of tasks.py: the miniature GSM8K generator, the task interface, the tiny models and their cache (no engine,
but for the README's task recipe, trained for two steps by the real script)."""

import dataclasses
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time

import pytest
import yaml

import gsm8k
import rc_rollout
import rc_run
import rc_train
import tasks
from tests.test_recipes import append_to, copy_repo, imported_from, readme_block, without_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
MINI = tasks.MiniGSMArgs()


# ---- The miniature GSM8K -----------------------------------------------------------------------------------
def test_problems_are_deterministic_disjoint_and_sized():
    train, test = tasks.minigsm_problems(MINI, "train"), tasks.minigsm_problems(MINI, "test")
    assert len(train) == MINI.train_size and len(test) == MINI.test_size
    assert not {p["question"] for p in train} & {p["question"] for p in test}
    assert len({p["question"] for p in train}) == len(train)  # no duplicates either
    tasks._PROBLEM_CACHE.clear()
    assert tasks.minigsm_problems(MINI, "test") == test  # regenerated from the seed alone
    other = tasks.minigsm_problems(dataclasses.replace(MINI, data_seed=1), "test")
    assert [p["question"] for p in other] != [p["question"] for p in test]


def test_reference_solutions_have_gsm8k_shape_and_correct_arithmetic():
    for p in tasks.minigsm_problems(MINI, "train")[:500]:
        *lines, last = p["answer"].split("\n")
        assert last == f"#### {p['gold']}" and gsm8k.parse_gold_answer(p["answer"]) == p["gold"]
        assert 1 <= len(lines) <= MINI.max_steps
        for line in lines:  # 'a+b=c' or 'a-b=c', each one true, chained
            lhs, rhs = line.split("=")
            assert eval(lhs) == int(rhs) >= 0  # noqa: S307 - digits and one operator, written by the generator
        assert int(lines[-1].split("=")[1]) == int(p["gold"])
        assert tasks.score_gsm8k_style(p["answer"], p) == {"strict": 1.0, "flexible": 1.0, "well_formed": 1.0}


def test_difficulty_knobs_change_length_and_range():
    def mean_lines(mini):
        rows = tasks.minigsm_problems(mini, "train")
        return sum(p["answer"].count("\n") for p in rows) / len(rows)

    short = dataclasses.replace(MINI, max_steps=1, train_size=400)
    long = dataclasses.replace(MINI, max_steps=5, train_size=400)
    assert mean_lines(short) == 1.0 and mean_lines(long) > 2.5
    small = tasks.minigsm_problems(dataclasses.replace(MINI, operand_max=5, train_size=300), "train")
    assert max(int(n) for p in small for n in p["question"].replace(".", " ").split() if n.isdigit()) <= 5


def test_warm_start_format_share():
    import random

    p = tasks.minigsm_problems(MINI, "train")[0]
    rng = random.Random(0)
    texts = [tasks.warm_start_solution(p, rng, 0.3) for _ in range(2000)]
    strict = sum(t == p["answer"] for t in texts) / len(texts)
    assert 0.26 < strict < 0.34
    loose = next(t for t in texts if t != p["answer"])
    assert tasks.score_gsm8k_style(loose, p) == {"strict": 0.0, "flexible": 1.0, "well_formed": 0.0}
    assert all(tasks.warm_start_solution(p, rng, 1.0) == p["answer"] for _ in range(50))


@pytest.mark.parametrize(
    "change, needle",
    [
        (dict(max_steps=0), "--mini.max-steps"),
        (dict(operand_max=1), "--mini.operand-max must be >= 2"),
        (dict(train_size=0), "--mini.train-size"),
        (dict(format_share=1.5), "1.5"),
        (dict(operand_max=2, max_steps=1, train_size=5000), "cannot produce"),
        (dict(sft_learning_rate=0.0), "--mini.sft-learning-rate"),
        (dict(sft_schedule="linear"), "--mini.sft-schedule must be one of cosine, constant, got 'linear'"),
    ],
)
def test_impossible_settings_are_refused(change, needle):
    with pytest.raises(ValueError) as e:
        tasks.make_task("minigsm", dataclasses.replace(MINI, **change))
    assert needle in str(e.value)


def test_task_interface_and_unknown_name():
    for name in ("minigsm", "add"):
        task = tasks.make_task(name, MINI)
        rows, skipped = task.problems("test", 5)
        assert len(rows) == 5 and skipped == 0 and set(rows[0]) >= {"question", "gold"}
        assert task.score(rows[0]["gold"] if name == "add" else f"#### {rows[0]['gold']}", rows[0])["strict"] == 1
        assert (task.score_keys, task.reward_key, task.accuracy_key, task.format_key) == (
            ("strict", "flexible"),
            "strict",
            "strict",
            "well_formed",
        )
        tasks.check_scorer(task, rows)
    assert tasks.make_task("minigsm", MINI).prompt({"question": "Q?"}) == gsm8k.format_prompt("Q?")  # GSM8K's code
    with pytest.raises(ValueError, match="'nope'.*minigsm, gsm8k, add"):
        tasks.make_task("nope")


def test_score_addition_reads_first_ascii_integer():
    def score(response, gold):
        return tasks.score_addition(response, {"question": "3+4=", "gold": gold})["strict"]

    assert score("7", "7") == 1.0 and score(" 7 and 3", "7") == 1.0
    assert score("17", "7") == 0.0 and score("x", "7") == 0.0
    assert score("³7", "7") == 1.0 and score("³", "3") == 0.0
    problems = tasks.addition_problems()
    assert len(problems) == 55 and all(int(p["gold"]) <= 9 for p in problems)


# ---- The model cache ---------------------------------------------------------------------------------------
def _counting_build(calls):
    def build(path):
        calls.append(path)
        with open(os.path.join(path, "model.safetensors"), "wb") as f:
            f.write(os.urandom(64))
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({"n": len(calls)}, f)
        return {"kind": "test"}

    return build


def test_cache_is_reused_and_never_loads_half_written_or_corrupt(tmp_path, monkeypatch):
    monkeypatch.setenv("RC_CACHE_DIR", str(tmp_path))
    calls, logs = [], []
    build = _counting_build(calls)
    path = tasks.cached_build("m", build, logs.append)
    assert tasks.cached_build("m", build, logs.append) == path and len(calls) == 1  # reused
    assert calls[0] != path and ".tmp" in calls[0]  # built aside, then renamed into place
    # A half-written build (a crash before the rename) is never picked up: only the complete folder is (and the
    # half-written one is removed: tasks.remove_stale_builds).
    (tmp_path / "m2.tmp999").mkdir()
    assert tasks.cached_build("m2", build, logs.append) == str(tmp_path / "m2") and len(calls) == 2
    assert not (tmp_path / "m2.tmp999").exists()
    # A corrupt file (or a folder without its build stamp) fails the checksum: moved aside and rebuilt.
    with open(os.path.join(path, "model.safetensors"), "r+b") as f:
        f.write(b"\0\0\0\0")
    assert tasks.cached_build("m", build, logs.append) == path and len(calls) == 3
    assert any("failed its checksum" in m and path in m for m in logs)
    assert json.load(open(os.path.join(path, "config.json")))["n"] == 3
    os.remove(os.path.join(path, "build.json"))
    tasks.cached_build("m", build, logs.append)
    assert len(calls) == 4


DEAD_PID = 1 << 22  # above the kernel's largest pid (pid_max <= 2**22): no process ever has it


def test_a_killed_build_s_folder_is_removed_by_the_next_build_never_a_live_one(tmp_path, monkeypatch):
    """A SIGKILLed build leaves cache/name.tmpPID: the next build removes it, of its own name or any other whose lock
    is free (the lock decides, not the PID, which can be reused). A folder whose lock a live build holds stays; so
    does one without a lock file whose process is alive. A build that fails or is interrupted removes its own."""
    import fcntl

    monkeypatch.setenv("RC_CACHE_DIR", str(tmp_path))
    for name in ("m", "other", "busy"):
        (tmp_path / f"{name}.lock").touch()
    (tmp_path / f"m.tmp{DEAD_PID}").mkdir()  # killed builds
    (tmp_path / f"other.tmp{os.getpid()}").mkdir()  # a live PID (reused, say), but its lock is free: stale
    (tmp_path / f"busy.tmp{DEAD_PID}" / "sub").mkdir(parents=True)  # its lock is held: being built now
    (tmp_path / f"nolock.tmp{DEAD_PID}").mkdir()  # no lock file: its PID decides (gone)
    (tmp_path / f"alive.tmp{os.getppid()}").mkdir()  # no lock file, its process alive
    (tmp_path / "not-a-build.tmpfile").mkdir()
    logs, calls = [], []
    with open(tmp_path / "busy.lock") as holder:  # another open file: flock refuses this process too
        fcntl.flock(holder, fcntl.LOCK_EX)
        assert tasks.cached_build("m", _counting_build(calls), logs.append) == str(tmp_path / "m")
    left = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock"))
    assert left == [f"alive.tmp{os.getppid()}", f"busy.tmp{DEAD_PID}", "m", "not-a-build.tmpfile"]
    said = [m for m in logs if m.startswith("model cache: removed")]
    assert len(said) == 3 and any(f"m.tmp{DEAD_PID}" in m and f"pid {DEAD_PID}" in m for m in said)

    def interrupted(path):
        (tmp_path / "seen").write_text(path)
        raise KeyboardInterrupt

    for fault in (interrupted, lambda path: 1 / 0):
        with pytest.raises((KeyboardInterrupt, ZeroDivisionError)):
            tasks.cached_build("n", fault, logs.append)
        assert not any(p.name.startswith("n.tmp") for p in tmp_path.iterdir())  # nothing half-built stays
    assert ".tmp" in (tmp_path / "seen").read_text()


def _slow_build_in_a_process(cache, together, out):
    """Child of test_two_processes_wanting_one_model_build_it_once: a 1 s build of model 'm' that counts itself,
    started at the same moment as its twin's (the barrier)."""
    os.environ["RC_CACHE_DIR"] = cache
    logs = []

    def build(path):
        with open(os.path.join(cache, "builds"), "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(1.0)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({"by": os.getpid()}, f)
        return {"kind": "test"}

    together.wait()
    out.put((tasks.cached_build("m", build, logs.append), logs))


def test_two_processes_wanting_one_model_build_it_once(tmp_path):
    """Two runs (or two test workers) start at once on a fresh cache: one builds, the other waits on its lock and
    loads the result instead of building it a second time."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    together, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_slow_build_in_a_process, args=(str(tmp_path), together, out)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
    assert (tmp_path / "builds").read_text().count("\n") == 1  # one build
    assert [path for path, _ in results] == [str(tmp_path / "m")] * 2
    assert any("waiting for it" in line for _, logs in results for line in logs)
    assert any("(cached)" in line for _, logs in results for line in logs)


def test_settings_hash_covers_every_setting():
    base = tasks.settings_hash(MINI)
    for f in dataclasses.fields(MINI):
        value = getattr(MINI, f.name)
        if isinstance(value, str):
            other = "constant" if value != "constant" else "cosine"
        else:
            other = value / 2 if isinstance(value, float) else value + 1
        assert tasks.settings_hash(dataclasses.replace(MINI, **{f.name: other})) != base, f.name


def test_tiny_warm_start_builds_a_loadable_model(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("RC_CACHE_DIR", str(tmp_path))
    mini = dataclasses.replace(MINI, train_size=200, test_size=20, sft_steps=3, sft_batch_size=4)
    path = tasks.base_model_path(tasks.make_task("minigsm", mini), mini, seed=1, log=lambda _: None)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.head_dim == 64 and model.config.num_hidden_layers == 4
    ids = tok("27+18=45 #### 45")["input_ids"]
    assert tok.decode(ids) == "27+18=45 #### 45"
    assert [tok.decode([i]) for i in tok("27")["input_ids"]] == ["2", "7"]  # digits one per token
    assert json.load(open(os.path.join(path, "build.json")))["settings"]["sft_steps"] == 3


def test_minigsm_base_keeps_its_cache_name_and_corpus():
    """The default job's base is cached as minigsm-base-1fa400aac5e0bdb3 (its name before sft_schedule existed: the
    constant schedule is not hashed); a cosine schedule gets its own name. The generic warm start must rebuild exactly
    it: same name, same prompts and solutions as the minigsm-only builder wrote (re-implemented here)."""
    task = tasks.make_task("minigsm", MINI)
    prompts, solutions = tasks.warm_start_corpus(task, MINI)
    assert tasks.warm_base_name(task, MINI, prompts, solutions) == "minigsm-base-1fa400aac5e0bdb3"
    cosine = dataclasses.replace(MINI, sft_schedule="cosine")
    assert tasks.warm_base_name(task, cosine, prompts, solutions) != "minigsm-base-1fa400aac5e0bdb3"
    train = tasks.minigsm_problems(MINI, "train")
    rng = random.Random(f"warm-start/{MINI.model_seed}")
    assert solutions == [tasks.warm_start_solution(p, rng, MINI.format_share) for p in train]
    assert prompts == [gsm8k.format_prompt(p["question"]) for p in train]


# ---- The interface: registry, declared score keys, reward, evaluation, prompts -----------------------------
def toy_task(**changes) -> tasks.Task:
    """A task of the tests' own: each row carries a word, and the scorer reads it from the row."""
    rows = [{"word": w} for w in ("cat", "dog", "sun")]
    fields = dict(
        name="rev",
        problems=lambda split, limit=None: (rows[:limit] if limit else rows, 0),
        prompt=lambda row: f"Reverse {row['word']}:",
        score=lambda response, row: {
            "correct": float(response.strip() == row["word"][::-1]),
            "well_formed": float(len(response.strip()) == 3),
        },
        score_keys=("correct", "well_formed"),
    )
    return tasks.Task(**{**fields, **changes})


def test_registry_takes_a_new_task_without_editing_make_task(monkeypatch):
    monkeypatch.setitem(tasks.TASKS, "rev", lambda **_: toy_task())
    assert "rev" in tasks.TASK_NAMES and tasks.make_task("rev").name == "rev"
    with pytest.raises(ValueError, match="'nope'") as info:
        tasks.make_task("nope")
    # the built-ins first and the new one last; a fork's own tasks (README "Fork it": countdown) may stand between
    assert re.search(r"choose one of minigsm, gsm8k, add(, [\w-]+)*, rev$", str(info.value)), info.value


def test_declared_score_keys_are_checked():
    with pytest.raises(ValueError, match="reward_key 'strict' is not one of its score_keys"):
        toy_task(reward_key="strict")
    with pytest.raises(ValueError, match="accuracy_key 'exact'"):
        toy_task(accuracy_key="exact")
    with pytest.raises(ValueError, match="clash"):
        toy_task(score_keys=("correct", "tokens"))
    with pytest.raises(ValueError, match=r"without \['exact'\]"):
        tasks.check_scorer(toy_task(score_keys=("correct", "exact")), [{"word": "cat"}])
    tasks.check_reward_settings(toy_task(), "well_formed", 0.0)
    with pytest.raises(ValueError, match="--reward-mode .*'rev' \\(correct, well_formed\\), got 'strict'"):
        tasks.check_reward_settings(toy_task(), "strict", 0.0)
    with pytest.raises(ValueError, match="--format-bonus 0.5 .*'rev' has none"):
        tasks.check_reward_settings(toy_task(), None, 0.5)
    tasks.check_reward_settings(toy_task(format_key="well_formed"), None, 0.5)


def test_reward_reads_the_reward_mode_and_the_tasks_format_key():
    scores = {"correct": 0.0, "well_formed": 1.0}
    args = dataclasses.replace(rc_train.Args(), reward_mode="correct", format_bonus=0.25)
    assert rc_train.reward(args, toy_task(format_key="well_formed"), scores) == 0.25
    assert rc_train.reward(dataclasses.replace(args, format_bonus=0.0), toy_task(), scores) == 0.0
    args = dataclasses.replace(rc_train.Args(), reward_mode="flexible", format_bonus=0.5)
    assert rc_train.reward(args, tasks.make_task("add"), {"strict": 0.0, "flexible": 1.0, "well_formed": 1.0}) == 1.5


class FakeRollouts:
    """rc_rollout.Rollouts.evaluate for rc_run.evaluate: prompt [i] gets responses[i], 3 tokens long."""

    def __init__(self, responses):
        self.responses = responses

    def evaluate(self, prompts, version, restore):
        return [[rc_rollout.Response([0, 0, 0], [], self.responses[p[0]])] for p in prompts]


class OneRank:
    def gather(self, x):
        return [x]


def test_evaluate_logs_one_accuracy_per_score_key():
    minigsm = tasks.make_task("minigsm", MINI)
    rows, _ = minigsm.problems("test", 2)
    rollouts = FakeRollouts([f"#### {rows[0]['gold']}", f"The answer is {rows[1]['gold']}."])
    metrics, samples = rc_run.evaluate(minigsm, rollouts, [[0], [1]], rows, 0, 1, OneRank(), 1)
    # The names and samples of the GSM8K-style tasks, exactly as before the keys were the task's.
    assert metrics == {"eval/accuracy_strict": 0.5, "eval/accuracy_flexible": 1.0, "eval/response_length": 3.0}
    assert list(samples[0]) == ["index", "question", "gold", "response", "strict", "flexible", "tokens"]
    toy = toy_task()
    rows, _ = toy.problems("test", 2)
    metrics, samples = rc_run.evaluate(toy, FakeRollouts(["tac", "dgo"]), [[0], [1]], rows, 0, 1, OneRank(), 1)
    assert metrics == {"eval/accuracy_correct": 0.5, "eval/accuracy_well_formed": 1.0, "eval/response_length": 3.0}
    assert samples[1] == {"index": 1, "response": "dgo", "correct": 0.0, "well_formed": 1.0, "tokens": 3}


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_tokenizer(chat_template=None):
    """A small byte-level BPE (every byte encodable), with or without a chat template."""
    tokenizer = tasks.make_tokenizer([p["question"] for p in tasks.minigsm_problems(MINI, "test")], 300)
    tokenizer.chat_template = chat_template
    return tokenizer


def old_encode(name: str, tokenizer, rows) -> list[list[int]]:
    """tasks.encode_prompts before tasks had system prompts and prefills: task.prompt(question), as the user
    message of the chat template when the tokenizer has one."""
    out = []
    for row in rows:
        text = row["question"] if name == "add" else gsm8k.format_prompt(row["question"])
        if tokenizer.chat_template:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        else:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out.append(ids)
    return out


@pytest.mark.parametrize("chat_template", [None, CHAT_TEMPLATE], ids=["plain", "chat"])
def test_prompt_ids_of_the_shipped_tasks_are_unchanged(chat_template):
    tokenizer = byte_tokenizer(chat_template)
    args = rc_train.Args(max_model_len=4096)
    gsm8k_rows = [{"question": "Ann’s lunch costs 5 €. She buys 2.\nHow much?", "gold": "10"}]
    for name, rows in [
        ("minigsm", tasks.minigsm_problems(MINI, "test")[:20]),
        ("add", tasks.addition_problems()),
        ("gsm8k", gsm8k_rows),
    ]:
        task = tasks.make_task(name, MINI)
        assert tasks.encode_prompts(args, task, tokenizer, rows) == old_encode(name, tokenizer, rows), name


def test_system_prompt_and_prefill():
    task = dataclasses.replace(tasks.make_task("add"), system_prompt="One digit.", prefill="=> ")
    row = {"question": "3+4=", "gold": "7"}
    assert tasks.prompt_text(task, row) == "One digit.\n\n3+4==> "
    args = rc_train.Args()
    plain = byte_tokenizer()
    assert tasks.encode_prompts(args, task, plain, [row]) == [plain("One digit.\n\n3+4==> ")["input_ids"]]
    chat = byte_tokenizer(CHAT_TEMPLATE)
    [ids] = tasks.encode_prompts(args, task, chat, [row])
    assert chat.decode(ids) == "<|system|>One digit.\n<|user|>3+4=\n<|assistant|>=> "  # the response continues it
    assert ids[-len(chat("=> ")["input_ids"]) :] == chat("=> ")["input_ids"]


# ---- Coverage: every prompt character encodes, checked before the engine starts -----------------------------
def test_coverage_check_names_the_prompt_and_the_character():
    ascii_only = tasks.make_tokenizer(["What is 3 plus 4? 3+4=7"], 120, tasks.tiny_alphabet([]))
    texts = ["3+4=", "It costs 5 €.", "Ann’s"]
    with pytest.raises(ValueError, match=r"^prompt 1 holds the character '€' \(U\+20AC\)"):
        tasks.check_coverage(ascii_only, texts)
    with pytest.raises(ValueError, match="eval prompt 0 .*'’'"):
        tasks.check_coverage(ascii_only, texts[2:], "eval prompt")
    tasks.check_coverage(ascii_only, texts[:1] + ["".join(tasks.PRINTABLE)])
    # A Unicode normalisation is not a loss: Qwen2's tokenizer composes 'e' + U+0301 into 'é' (NFC)
    from tokenizers import normalizers

    nfc = byte_tokenizer()
    nfc.backend_tokenizer.normalizer = normalizers.NFC()
    tasks.check_coverage(nfc, ["Cafe\u0301 ’ €"])
    # A tokenizer with an unknown token: the character becomes [UNK]
    from tokenizers import Tokenizer, decoders, models, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="[UNK]"))
    raw.decoder = decoders.Fuse()
    raw.train_from_iterator(["abc cab ba"], trainers.BpeTrainer(special_tokens=["[UNK]"], show_progress=False))
    with_unk = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")
    tasks.check_coverage(with_unk, ["abc", "b a"])
    with pytest.raises(ValueError, match="prompt 1 .*'€'"):
        tasks.check_coverage(with_unk, ["abc", "a€b"])


def test_tiny_tokenizer_covers_the_tasks_characters(tmp_path, monkeypatch):
    """--model tiny without a warm start: a tokenizer from text generated here, its alphabet printable ASCII, newline
    and every character of the task's prompts (one more token per extra byte); the alphabet is in the cache name."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("RC_CACHE_DIR", str(tmp_path))
    add = tasks.make_task("add")
    path = tasks.base_model_path(add, MINI, seed=1, log=lambda _: None)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == 160 and os.path.basename(path).startswith("tiny-qwen2-v160-")
    tasks.check_coverage(tokenizer, [tasks.prompt_text(add, r) for r in add.problems("test")[0]])
    tasks.check_coverage(tokenizer, ["".join(tasks.PRINTABLE)])
    assert [tokenizer.decode([i]) for i in tokenizer("27")["input_ids"]] == ["2", "7"]  # digits one per token
    assert tasks.base_model_path(add, MINI, seed=1, log=lambda _: None) == path  # reused
    rows = [{"question": "Ann’s lunch costs 5 €.", "gold": "5"}]
    gsm8k_like = tasks.Task(
        "gsm8k-like",
        lambda split, limit=None: (rows, 0),
        tasks.gsm8k_prompt,
        tasks.score_gsm8k_style,
        **tasks.GSM8K_KEYS,
    )
    with pytest.raises(ValueError, match="'’'"):
        tasks.check_coverage(tokenizer, [rows[0]["question"]])
    wide_path = tasks.base_model_path(gsm8k_like, MINI, seed=1, log=lambda _: None)
    wide = AutoTokenizer.from_pretrained(wide_path)
    assert len(wide) == 165  # five more bytes: E2 80 99 (’) and 82 AC (€)
    assert os.path.basename(wide_path).startswith("tiny-qwen2-v165-")
    tasks.check_coverage(wide, [tasks.prompt_text(gsm8k_like, r) for r in rows])


def test_any_task_with_a_warm_start_gets_a_warm_base(tmp_path, monkeypatch):
    monkeypatch.setenv("RC_CACHE_DIR", str(tmp_path))
    task = toy_task(warm_start=lambda row, rng: row["word"][::-1])
    mini = dataclasses.replace(MINI, sft_steps=2, sft_batch_size=2)
    path = tasks.base_model_path(task, mini, seed=1, log=lambda _: None)
    assert os.path.basename(path).startswith("rev-base-")
    assert json.load(open(os.path.join(path, "build.json")))["kind"] == "rev base"
    # Another corpus (other solutions) or other SFT settings never reuse it
    other = dataclasses.replace(task, warm_start=lambda row, rng: row["word"])
    assert tasks.base_model_path(other, mini, seed=1, log=lambda _: None) != path
    longer = dataclasses.replace(mini, sft_steps=3)
    assert tasks.base_model_path(task, longer, seed=1, log=lambda _: None) != path


# ---- The README's task recipe, run as it stands ----------------------------------------------------------------
def readme_task_recipe() -> str:
    """The code block after README.md's "**A new task.**" paragraph."""
    return readme_block("A new task.")


def recipe_task() -> tasks.Task:
    """The recipe's task, its code run as if appended to tasks.py (against an empty registry, so that the one task it
    registers is found also in a fork that has added it to tasks.py already)."""
    namespace = {**vars(tasks), "TASKS": {}}
    exec(readme_task_recipe(), namespace)  # noqa: S102 - the README's own code block
    [factory] = namespace["TASKS"].values()
    return factory()


def test_readme_task_recipe_scores_the_row():
    task = recipe_task()
    rows, skipped = task.problems("train")
    a, b = rows[0]["numbers"]
    assert skipped == 0 and task.score(f"{a}*{b}", rows[0]) == {"correct": 1.0, "well_formed": 1.0}
    assert task.score(f"{a}+{b}", rows[0]) == {"correct": float(a + b == a * b), "well_formed": 1.0}
    other = next(r for r in rows if sorted(r["numbers"]) != sorted([a, b]))
    assert task.score(f"{a}*{b}", other) == {"correct": 0.0, "well_formed": 0.0}  # same response, another row
    assert task.score("no idea", rows[0]) == {"correct": 0.0, "well_formed": 0.0}
    tasks.check_scorer(task, rows)


def test_readme_task_recipe_trains(tmp_path):
    """The recipe appended to a copy of tasks.py; the copied rc_train.py trains it for two steps with --model tiny."""
    repo, code, task = copy_repo(tmp_path), readme_task_recipe(), recipe_task()
    without_recipe(repo, "tasks.py", code)  # where a fork has added it in place already
    with imported_from(repo, "tasks") as (bare,):
        assert task.name not in bare.TASKS  # the recipe adds a task the repository lacks
    append_to(repo, "tasks.py", code)
    short = ["--num-steps", "2", "--num-prompts-per-step", "4", "--num-samples-per-prompt", "4"]
    flags = [*short, "--max-response-length", "4", "--eval-limit", "8", "--no-save-final"]
    cmd = [sys.executable, "rc_train.py", "--config", "configs/cpu_add.yaml", "--task", task.name, "--model", "tiny"]
    cmd += [*flags, "--output-dir", str(tmp_path / "runs"), "--run-name", "run"]
    env = dict(os.environ, OMP_NUM_THREADS="1", RC_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=repo)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = tmp_path / "runs" / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/accuracy_correct" in r]
    assert [r["step"] for r in evals] == [-1, 1] and all("eval/accuracy_well_formed" in r for r in evals)
    assert not any("eval/accuracy_strict" in r for r in records)
    assert f"eval accuracy (correct, greedy, 8 problems): {evals[0]['eval/accuracy_correct']:.3f}" in proc.stdout
    sample = json.loads((run / "eval_samples.jsonl").read_text().splitlines()[0])
    assert {"question", "response", "correct", "well_formed"} <= set(sample)
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["args"]["reward_mode"] == "correct"  # the task's reward key
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config["model_path"])
    texts = [tasks.prompt_text(task, r) for split in ("train", "test") for r in task.problems(split)[0]]
    tasks.check_coverage(tokenizer, texts)


def test_a_base_build_takes_every_idle_core_and_the_free_ones_beside_others():
    """Every core while the others leave them idle (under half a core busy); beside busy processes the cores they
    leave free, at least one and at most OMP_NUM_THREADS; without /proc/stat, OMP_NUM_THREADS or every core (two
    spinning OpenMP threads beside a busy process made a build step 10x slower, tasks.build_threads)."""
    threads = tasks.build_threads
    assert threads({}, busy=lambda: 0.4, cores=2) == threads({"OMP_NUM_THREADS": "1"}, busy=lambda: 0.1, cores=2) == 2
    assert threads({}, busy=lambda: 0.6, cores=2) == threads({}, busy=lambda: 1.4, cores=2) == 1
    assert threads({}, busy=lambda: 2.0, cores=2) == threads({}, busy=lambda: 7.0, cores=2) == 1  # never none
    assert threads({}, busy=lambda: 3.0, cores=16) == 13
    assert threads({"OMP_NUM_THREADS": " 3 "}, busy=lambda: 3.0, cores=16) == 3  # the setting caps a busy machine
    assert threads({"OMP_NUM_THREADS": "1"}, busy=lambda: None, cores=4) == 1  # no /proc/stat: the setting
    assert threads({}, busy=lambda: None, cores=4) == threads({"OMP_NUM_THREADS": "0"}, busy=lambda: None, cores=4) == 4
    cores = os.cpu_count() or 1
    assert 0.0 <= tasks.busy_cores(0.05) <= cores + 0.01


def test_the_load_of_the_other_processes_is_the_machine_s_less_this_one_s():
    """OtherLoad, sampled between steps without waiting: the machine's busy cores (/proc/stat) less this process's
    CPU time over the same wall time; None without /proc/stat."""
    ticks, cpu, wall = iter([(0, 0, 2), (400, 100, 2), (800, 400, 2)]), iter([0.0, 3.0, 3.0]), iter([0.0, 2.0, 4.0])
    load = tasks.OtherLoad(ticks=lambda: next(ticks), cpu_time=lambda: next(cpu), clock=lambda: next(wall))
    assert load() == pytest.approx(0.0)  # 1.5 cores busy, all of them this process's (3 s of CPU in 2 s)
    assert load() == pytest.approx(0.5)  # 0.5 busy, none of it ours: another process
    assert tasks.OtherLoad(ticks=lambda: None)() is None
    total, idle, cores = tasks._cpu_ticks()  # this process's cores only
    assert cores == tasks.usable_cores() and 0 <= idle <= total


def test_a_build_re_decides_its_threads_as_others_start_and_stop():
    """BuildThreads: every core on an idle machine; within `every` seconds of a process starting beside it, the cores
    left free; all of them again once it stops; the caller's thread count back at the end."""
    now, loads, set_to = [0.0], iter([1.2, 1.1, 0.2]), []
    threads = tasks.BuildThreads(
        every=5.0,
        environ={},
        set_threads=set_to.append,
        clock=lambda: now[0],
        first=lambda: 0.0,
        load=lambda: next(loads),
    )
    full = tasks.usable_cores()
    assert threads.threads == full and set_to == [full]
    now[0] = 4.9
    assert threads.recheck() == full  # not due yet: no sample taken
    now[0] = 5.0
    assert threads.recheck() == max(1, round(full - 1.2))  # a process started beside the build
    now[0] = 10.0
    threads.recheck()
    now[0] = 15.0
    assert threads.recheck() == full  # it stopped
    assert threads.used == {full, max(1, round(full - 1.2))}
    threads.restore()
    assert set_to[-1] == threads.before


def test_a_build_says_how_long_it_will_take_after_its_first_steps(tmp_path):
    """One line after the first steps (step 0 warms up, not counted): the estimate, the steps, the time of one; every
    step's seconds go to `step_times`; the threads used are in build.json's info."""
    mini = dataclasses.replace(MINI, train_size=200, test_size=20, sft_steps=11, sft_batch_size=4)
    task = tasks.make_task("minigsm", mini)
    prompts, solutions = tasks.warm_start_corpus(task, mini)
    logs, times = [], []
    info = tasks.build_warm_base(task, mini, prompts, solutions, str(tmp_path), logs.append, step_times=times)
    assert len(times) == 11 and all(t > 0 for t in times)
    [line] = [m for m in logs if m.startswith("building")]
    assert re.fullmatch(
        r"building the minigsm base model \(once\): ~\d+ s \(11 steps, [\d.]+ s each on \d+ thread\(s\)\)", line
    )
    assert info["threads"] and all(1 <= n <= tasks.usable_cores() for n in info["threads"])
    assert tasks.build_estimate("minigsm", 900, [0.45, 0.45], 2) == (
        "building the minigsm base model (once): ~7 min (900 steps, 0.45 s each on 2 thread(s))"
    )
    assert "~45 s" in tasks.build_estimate("x", 100, [0.45], 1)


def test_the_warm_starts_learning_rate():
    """A linear warm-up over 100 steps, then constant (the base before 2026-11-29) or a cosine down to 10 % at the
    last step, falling all the way."""
    const = dataclasses.replace(MINI, sft_steps=600, sft_schedule="constant")
    cos = dataclasses.replace(const, sft_schedule="cosine")
    assert [tasks.sft_rate(const, s) for s in (0, 49, 99, 100, 599)] == [0.01, 0.5, 1.0, 1.0, 1.0]
    assert [tasks.sft_rate(cos, s) for s in (0, 49, 99, 100)] == [0.01, 0.5, 1.0, 1.0]
    assert tasks.sft_rate(cos, 599) == pytest.approx(0.1) and tasks.sft_rate(cos, 350) == pytest.approx(0.55, abs=0.01)
    rates = [tasks.sft_rate(cos, s) for s in range(100, 600)]
    assert all(a > b for a, b in zip(rates, rates[1:]))


def test_the_repository_ships_the_default_base_and_a_first_run_loads_it(tmp_path, monkeypatch):
    """models/ holds the default job's base under its cache name, its stamp matching its files and its build.json
    naming the default settings; base_model_path returns it without building or touching the cache. A shipped copy
    that fails its stamp is never loaded: the cache's copy (here a fake build) is used instead, and the line says so."""
    task, mini = tasks.make_task("minigsm", MINI), tasks.MiniGSMArgs()
    name = tasks.warm_base_name(task, mini, *tasks.warm_start_corpus(task, mini))
    shipped = os.path.join(tasks.SHIPPED_MODELS, name)
    assert os.listdir(tasks.SHIPPED_MODELS) == [name] and tasks._cached(shipped)
    info = json.load(open(os.path.join(shipped, "build.json")))
    assert info["settings"] == tasks.hashed_settings(mini) and info["kind"] == "minigsm base"
    monkeypatch.setenv("RC_CACHE_DIR", str(tmp_path / "cache"))

    def no_build(*_, **__):
        raise AssertionError("built")

    monkeypatch.setattr(tasks, "build_warm_base", no_build)
    logs = []
    assert tasks.base_model_path(task, mini, seed=1, log=logs.append) == shipped
    assert "shipped with the repository" in logs[0] and not (tmp_path / "cache").exists()
    damaged = tmp_path / "models" / name
    shutil.copytree(shipped, damaged)
    (damaged / "config.json").write_text((damaged / "config.json").read_text().replace("128", "129", 1))
    monkeypatch.setattr(tasks, "SHIPPED_MODELS", str(tmp_path / "models"))
    logs.clear()

    def fake(path):
        open(os.path.join(path, "config.json"), "w").write("{}")
        return {}

    path = tasks.cached_build(name, fake, logs.append)
    assert path == str(tmp_path / "cache" / name) and "fails its checksum" in logs[0]
