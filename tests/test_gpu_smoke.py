"""benchmarks/gpu_smoke.sh and its table (benchmarks/gpu_smoke.py), on CPU.

The table is checked on a run folder written here (a GPU run's keys, numbers chosen by hand: milliseconds), then the
script runs end to end with --tiny (the tiny local model on `add`, 2 steps: one engine start, ~30 s) and its printed
table is read back. The trainer's MFU inputs (perf/mfu_*) are counted by hand on a batch of two groups.
"""

import json
import os
import re
import statistics
import subprocess
import sys

import pytest
import torch
import yaml

import rc_forward
import rc_run
from benchmarks import bench_gpu_step as bench
from benchmarks import gpu_smoke
from tests.test_train import ROOT, read_jsonl, train_env

PHASES = ["rollout", "rollout wait", "engine idle", "reward", "pi_old", "reference", "update", "sync", "eval", "step"]


def test_flop_inputs_are_the_benchmarks_counts_by_hand():
    # two groups: prompts of 3 and 2 tokens; responses of 2 and 1 tokens (group 0), 4 tokens (group 1)
    batch = rc_forward.make_batch(
        [[1, 2, 3], [1, 2, 3], [4, 5]], [([6, 7], [0.0, 0.0]), ([6], [0.0]), ([7, 8, 9, 6], [0.0] * 4)], 0, [0, 0, 1]
    )
    assert bench.conventional_counts is rc_run.conventional_counts  # one count, the trainer's
    assert rc_run.flop_inputs(batch) == {
        "perf/mfu_tokens": 3 + 2 + 2 + 1 + 4,  # each group's prompt once, every response token
        "perf/mfu_logit_positions": 2 + 1 + 4,
        # prompts 3*4/2 + 2*3/2 once per group; a response token j attends p + j + 1 keys
        "perf/mfu_attention_pairs": 6 + 3 + (3 + 1 + 3 + 2) + (3 + 1) + (2 + 1 + 2 + 2 + 2 + 3 + 2 + 4),
    }
    assert rc_run.memory_metrics() == {} and not torch.cuda.is_available()  # CUDA only


def write_run(path, rows, model="Qwen/Qwen2.5-0.5B-Instruct", task="gsm8k"):
    """A run folder as rc_train.py writes it: config.yaml (the keys the table reads) and metrics.jsonl; the model's
    config.json (Qwen2.5-0.5B's shape) in a folder of its own, named by config.yaml's model_path."""
    model_dir = path / "model"
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text(json.dumps({"model_type": "qwen2", **bench.MODEL_SHAPES["0.5b"]}))
    args = dict(model=model, task=task, num_prompts_per_step=64, num_samples_per_prompt=8, ppo_epochs=1)
    args.update(eval_limit=None, reward_mode="strict", rc={"preset": "bypass_ppo_clip"})
    config = dict(args=args, world_size=1, model_path=str(model_dir))
    run = path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def gpu_rows():
    """Step -1's evaluation, then 4 steps of a GPU run: step 0 slow (compilation), an evaluation at the last."""
    rows = [{"step": -1, "eval/accuracy_strict": 0.364, "eval/accuracy_flexible": 0.5, "timing/eval_s": 30.0}]
    for step in range(4):
        rows.append(
            {
                "step": step,
                "timing/rollout_s": [40.0, 6.0, 5.0, 7.5][step],
                "timing/rollout_wait_s": [40.0, 6.0, 5.0, 7.5][step],
                "timing/engine_idle_s": [0.0, 3.0, 3.5, 2.0][step],
                "timing/reward_s": [0.2, 0.1, 0.3, 0.2][step],
                "timing/old_log_prob_s": 0.0,
                "timing/ref_log_prob_s": [0.001, 0.002, 0.001, 0.003][step],
                "timing/update_s": [30.0, 3.0, 3.5, 3.25][step],
                "timing/sync_s": [1.0, 0.25, 0.5, 0.75][step],
                "timing/step_s": [72.0, 10.0, 9.5, 45.0][step],
                "perf/mfu_tokens": [150000.0, 160000.0, 155000.0, 170000.0][step],
                "perf/mfu_logit_positions": [140000.0, 150000.0, 145000.0, 160000.0][step],
                "perf/mfu_attention_pairs": [4.0e7, 4.5e7, 4.2e7, 5.0e7][step],
                "perf/max_memory_allocated_gib": [60.0, 50.5, 51.0, 52.0][step],
                "perf/max_memory_reserved_gib": [70.0, 66.0, 66.5, 67.0][step],
                "perf/engine_memory_gib": 8.25,
                "perf/engine_budget_gib": 16.75,
            }
        )
    rows[-1].update({"eval/accuracy_strict": 0.4, "eval/accuracy_flexible": 0.55, "timing/eval_s": 28.0})
    return rows


def row(table: str, name: str) -> str:
    """The value of the table's row `name` (the text after the name column)."""
    found = [line for line in table.splitlines() if re.match(rf"\s+{re.escape(name)}\s{{2,}}", line)]
    assert len(found) == 1, (name, table)
    return found[0].strip()[len(name) :].strip()


def test_the_table_shows_each_phase_median_memory_mfu_and_accuracy(tmp_path):
    rows = gpu_rows()
    run = write_run(tmp_path, rows)
    table = gpu_smoke.summarise(str(run), device="NVIDIA H200")
    print(table)
    steps = rows[2:]  # steps 1-3: step 0 left out
    assert "median of steps 1-3 (step 0 left out" in row(table, "seconds / step")
    for name, key in zip(PHASES, [k for k, _ in gpu_smoke.PHASES if k != "timing/routing_s"]):
        values = [r[key] for r in (rows if key == "timing/eval_s" else steps) if key in r]
        assert row(table, name).split()[0] == f"{statistics.median(values):.3f}", name
    assert row(table, "update").split()[0] == "3.250" and row(table, "eval").split()[0] == "29.000"
    assert "2 evaluation(s): before, step 3" in row(table, "eval")
    assert "routing" not in table  # a key the run did not log has no row
    # memory: the largest step's (step 0's compilation included), the engine's share and budget
    assert row(table, "allocated").startswith("60.00  GiB") and "largest at step 0" in row(table, "allocated")
    assert row(table, "reserved").startswith("70.00  GiB")
    assert row(table, "engine").startswith("8.25  GiB") and "budget 16.75 GiB" in row(table, "engine")
    # MFU: bench_gpu_step's FLOPs of each step over its update seconds, against the H200's 989 TFLOP/s; the median
    shape = {"model_type": "qwen2", **bench.MODEL_SHAPES["0.5b"]}
    counts = [{k: r[key] for k, key in gpu_smoke.COUNT_KEYS.items()} for r in steps]
    mfu = [bench.conventional_flops(shape, c)["total"] / r["timing/update_s"] / 989e12 for c, r in zip(counts, steps)]
    text = row(table, "MFU of the update")
    assert text.startswith(f"{statistics.median(mfu):.1%} (steps' range {min(mfu):.1%}-{max(mfu):.1%}) of H200 SXM")
    assert 0.05 < statistics.median(mfu) < 0.5  # a 0.5B update's plausible range
    # accuracy: the reward's key first, before -> after; verl's documented figures beside this model and task
    lines = table.splitlines()
    strict = next(i for i, line in enumerate(lines) if "accuracy_strict" in line)
    assert strict < next(i for i, line in enumerate(lines) if "accuracy_flexible" in line)
    assert row(table, "accuracy_strict").startswith("0.364 (before) -> 0.400 (step 3), greedy, the whole test split")
    assert "36.4 released, 56.7 after PPO" in row(table, "verl's figures")


def test_a_cpu_run_says_na_for_memory_and_mfu(tmp_path):
    rows = [{k: v for k, v in r.items() if "memory" not in k and "engine_budget" not in k} for r in gpu_rows()]
    run = write_run(tmp_path, rows, model="tiny", task="add")
    table = gpu_smoke.summarise(str(run))
    assert row(table, "memory").startswith("n/a on CPU")
    assert row(table, "MFU of the update").startswith("n/a on CPU")
    assert "TFLOP/s, median of 3 step(s)" in row(table, "FLOPs")
    assert "verl" not in table and ", cpu" in row(table, "run")
    # a GPU the benchmark does not know: n/a, unless its peak is given
    gpu = write_run(tmp_path / "gpu", gpu_rows())
    assert "no dense bf16 peak known for NVIDIA L4" in gpu_smoke.summarise(str(gpu), device="NVIDIA L4")
    assert "of NVIDIA L4's 121 TFLOP/s" in gpu_smoke.summarise(str(gpu), device="NVIDIA L4", card_peak_tflops=121)


def test_gpu_smoke_tiny_runs_the_trainer_and_prints_the_table(tmp_path):
    env = dict(train_env(tmp_path), OUT=str(tmp_path / "out"), PYTHON=sys.executable)
    cmd = ["bash", os.path.join(ROOT, "benchmarks", "gpu_smoke.sh"), "--tiny", "--eval-limit", "5"]  # a flag passes
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    table = "\n".join(lines[next(i for i, line in enumerate(lines) if line.startswith("gpu_smoke: ")) :])
    print(table)
    assert (tmp_path / "out" / "summary.txt").read_text().strip() == table.strip()
    everything = read_jsonl(tmp_path / "out" / "smoke" / "metrics.jsonl")
    rows = [r for r in everything if r["step"] >= 0]
    assert [r["step"] for r in rows] == [0, 1]
    assert {"perf/mfu_tokens", "perf/mfu_logit_positions", "perf/mfu_attention_pairs"} <= set(rows[1])
    assert not any("memory" in k for r in rows for k in r)  # CUDA only
    assert "tiny on add" in row(table, "run") and "2 step(s) of 8 prompts x 8 samples" in row(table, "run")
    assert row(table, "seconds / step").startswith("step 1 (step 0 left out")
    for key, name in gpu_smoke.PHASES:
        if key == "timing/eval_s":  # the evaluation before training and the one after step 1
            assert row(table, name).split()[0] == f"{statistics.median(r[key] for r in everything if key in r):.3f}"
        elif key in rows[1]:
            assert row(table, name).split()[0] == f"{rows[1][key]:.3f}", name
    assert row(table, "memory").startswith("n/a on CPU") and row(table, "MFU of the update").startswith("n/a on CPU")
    accuracy = row(table, "accuracy_strict")
    assert re.fullmatch(r"\d\.\d{3} \(before\) -> \d\.\d{3} \(step 1\), greedy, 5 test problems", accuracy)


@pytest.mark.parametrize("flag", ["--run-name", "--output-dir=x"])
def test_gpu_smoke_refuses_to_move_its_run(tmp_path, flag):
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "benchmarks", "gpu_smoke.sh"), flag, "y"],
        capture_output=True,
        text=True,
        env=dict(os.environ, OUT=str(tmp_path)),
    )
    assert proc.returncode == 2 and "OUT=DIR" in proc.stderr and not os.listdir(tmp_path)
