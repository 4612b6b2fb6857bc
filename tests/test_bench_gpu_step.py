"""Tests of benchmarks/bench_gpu_step.py: the --tiny run reports sane figures (one process, and two under torchrun
with DDP and FSDP2), bad flags fail before any model is built, and the benchmarked update (rc_train.update_policy
itself) really trains (the weights move)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import bench_gpu_step as bench


def test_tiny_run_prints_a_json_line_with_positive_figures(capsys):
    assert bench.main(["--tiny", "--repeats", "1"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    for key in (
        "device",
        "params",
        "sequences",
        "micro_batch_size",
        "dtype",
        "peak_memory_gib",
        "seconds_per_optimizer_step",
        "seconds_per_update",
        "tokens_per_second",
    ):
        assert key in result, key
    assert result["params"] > 0
    for key in ("seconds_per_optimizer_step", "seconds_per_update", "tokens_per_second"):
        assert math.isfinite(result[key]) and result[key] > 0, (key, result[key])
    # the default config: 2 minibatches x 1 epoch per update; --tiny: 2 prompts x 4 samples, micro-batch 2
    assert result["seconds_per_update"] == pytest.approx(2 * result["seconds_per_optimizer_step"])
    assert result["sequences"] == 8 and result["micro_batch_size"] == 2
    assert result["dtype"] == "bfloat16"  # read from configs/gsm8k_qwen0.5b_bypass.yaml, not shrunk
    assert math.isfinite(result["peak_memory_gib"]) and result["peak_memory_gib"] >= 0


def _no_model(*_args, **_kwargs):
    raise AssertionError("a model was built before the flags were checked")


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--response-len", "600"], "600"),  # full size: max_response_length is 512 in the default config
        (["--tiny", "--response-len", "17"], "17"),  # --tiny: max_response_length 16
        (["--config", "configs/does_not_exist.yaml"], "does_not_exist.yaml"),
        (["--repeats", "0"], "--repeats"),
    ],
)
def test_bad_values_exit_nonzero_naming_them_before_any_model(monkeypatch, capsys, argv, named):
    monkeypatch.setattr(bench, "build_model", _no_model)
    monkeypatch.setattr(bench, "setup", _no_model)
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code not in (0, None)
    err = capsys.readouterr().err
    assert named in err, err


def test_rollout_batch_has_the_trainer_layout():
    plan = bench.parse_plan(["--tiny"])
    batch = bench.make_rollout(plan)
    (p_lo, p_hi), (r_lo, r_hi) = plan.length_ranges()
    mask, attention = batch["response_mask"], batch["attention_mask"]
    T = mask.shape[1]
    lengths, prompt_lengths = mask.sum(-1), attention[:, :-T].sum(-1)
    assert bool(((lengths >= r_lo) & (lengths <= r_hi)).all())
    assert bool(((prompt_lengths >= p_lo) & (prompt_lengths <= p_hi)).all())
    assert batch["input_ids"].shape == (8, int(prompt_lengths.max()) + T) and T == int(lengths.max())
    assert bool((attention[:, :-T].flip(-1).cumprod(-1).sum(-1) == prompt_lengths).all())  # prompts left-padded
    assert torch.equal(attention[:, -T:].float(), mask)  # responses right-padded after a common column
    assert bool((batch["rollout_log_prob"][mask > 0] < 0).all())
    assert bool((batch["advantages"] != 0).any(-1).all())  # every group has mixed rewards
    assert torch.equal(batch["advantages"], bench.make_rollout(plan)["advantages"])  # seeded


@pytest.mark.parametrize("config", ["configs/gsm8k_qwen0.5b_bypass.yaml", "configs/gsm8k_qwen0.5b_token_tis.yaml"])
def test_one_update_moves_every_weight(config):
    plan = bench.parse_plan(["--tiny", "--config", config])
    b = bench.setup(plan)
    before = {name: p.detach().clone() for name, p in b.learner.model.named_parameters()}
    stats = b.update()  # bypass: the update alone; decoupled (token_tis): the pi_old pass and correction first
    assert math.isfinite(stats["loss"]) and stats["grad_norm"] > 0
    passes = plan.train.ppo_epochs + (0 if plan.correction.bypass_mode else 1)  # the update's, and pi_old's
    assert 0 < stats["tokens"] <= passes * int(b.batch["attention_mask"].sum())  # a shared prompt counts once
    unchanged = [name for name, p in b.learner.model.named_parameters() if torch.equal(p.detach(), before[name])]
    assert not unchanged, f"parameters the step did not update: {unchanged}"
    assert all(p.grad is None for p in b.learner.model.parameters())  # zero_grad(set_to_none=True), as the trainer


@pytest.mark.parametrize("flags", [[], ["--fsdp"]])
def test_two_processes_run_the_update_with_ddp_and_fsdp2(flags):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "benchmarks.bench_gpu_step",
        "--tiny",
        "--repeats",
        "1",
        *flags,
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, cwd=root, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])  # printed once, by the main process
    assert result["processes"] == 2 and result["fsdp"] == bool(flags) and result["sequences"] == 8
    assert result["params"] == 139840  # FSDP2: the shards add up to the whole model
    assert result["shared_prompt_pass"] != bool(flags)  # off under FSDP2, as in rc_train.py
    assert math.isfinite(result["seconds_per_update"]) and result["tokens_per_second"] > 0
