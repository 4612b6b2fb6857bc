"""Tests of tasks.py: the miniature GSM8K generator, the task interface and the model cache (no engine)."""

import dataclasses
import json
import os

import pytest

import gsm8k
import tasks

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
        assert tasks.score_gsm8k_style(p["answer"], p["gold"]) == {"strict": 1.0, "flexible": 1.0, "well_formed": 1.0}


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
    assert tasks.score_gsm8k_style(loose, p["gold"]) == {"strict": 0.0, "flexible": 1.0, "well_formed": 0.0}
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
        assert (
            task.score(rows[0]["gold"] if name == "add" else f"#### {rows[0]['gold']}", rows[0]["gold"])["strict"] == 1
        )
    assert tasks.make_task("minigsm", MINI).prompt("Q?") == gsm8k.format_prompt("Q?")  # the GSM8K code path
    with pytest.raises(ValueError, match="'nope'.*minigsm, gsm8k, add"):
        tasks.make_task("nope")


def test_score_addition_reads_first_ascii_integer():
    assert tasks.score_addition("7", "7")["strict"] == 1.0 and tasks.score_addition(" 7 and 3", "7")["strict"] == 1.0
    assert tasks.score_addition("17", "7")["strict"] == 0.0 and tasks.score_addition("x", "7")["strict"] == 0.0
    assert tasks.score_addition("³7", "7")["strict"] == 1.0 and tasks.score_addition("³", "3")["strict"] == 0.0
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
    # A half-written build (a crash before the rename) is never picked up: only the complete folder is.
    (tmp_path / "m2.tmp999").mkdir()
    assert tasks.cached_build("m2", build, logs.append) == str(tmp_path / "m2") and len(calls) == 2
    # A corrupt file (or a folder without its build stamp) fails the checksum: moved aside and rebuilt.
    with open(os.path.join(path, "model.safetensors"), "r+b") as f:
        f.write(b"\0\0\0\0")
    assert tasks.cached_build("m", build, logs.append) == path and len(calls) == 3
    assert any("failed its checksum" in m and path in m for m in logs)
    assert json.load(open(os.path.join(path, "config.json")))["n"] == 3
    os.remove(os.path.join(path, "build.json"))
    tasks.cached_build("m", build, logs.append)
    assert len(calls) == 4


def test_settings_hash_covers_every_setting():
    base = tasks.settings_hash(MINI)
    for f in dataclasses.fields(MINI):
        value = getattr(MINI, f.name)
        changed = dataclasses.replace(MINI, **{f.name: value + 1 if not isinstance(value, float) else value / 2})
        assert tasks.settings_hash(changed) != base, f.name


def test_tiny_warm_start_builds_a_loadable_model(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("RC_CACHE_DIR", str(tmp_path))
    mini = dataclasses.replace(MINI, train_size=200, test_size=20, sft_steps=3, sft_batch_size=4)
    path = tasks.base_model_path("minigsm", mini, seed=1, log=lambda _: None)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.head_dim == 64 and model.config.num_hidden_layers == 4
    ids = tok("27+18=45 #### 45")["input_ids"]
    assert tok.decode(ids) == "27+18=45 #### 45"
    assert [tok.decode([i]) for i in tok("27")["input_ids"]] == ["2", "7"]  # digits one per token
    assert json.load(open(os.path.join(path, "build.json")))["settings"]["sft_steps"] == 3
