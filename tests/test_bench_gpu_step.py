"""Tests of benchmarks/bench_gpu_step.py: the --tiny run reports sane figures (one process, and two under torchrun
with DDP and FSDP2), bad flags fail before any model is built, and the benchmarked update (rc_train.update_policy
itself) really trains (the weights move). --breakdown: its phases partition the pass, its op and host-sync counts
are there and positive, its micro-batches are the update's own, and its sync counter counts what a GPU would
synchronise on (no timing is asserted)."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys

import pytest
import torch

import rc_forward
import rc_train
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
    assert 0 <= result["update_padding_fraction"] < 1 and 0 <= result["batch_padding_fraction"] < 1
    assert result["mfu"] is None and result["peak_reserved_gib"] is None  # a CPU: no peak given, no CUDA allocator
    assert "breakdown" not in result  # only with --breakdown


def _no_model(*_args, **_kwargs):
    raise AssertionError("a model was built before the flags were checked")


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--response-len", "600"], "600"),  # full size: max_response_length is 512 in the default config
        (["--tiny", "--response-len", "17"], "17"),  # --tiny: max_response_length 16
        (["--config", "configs/does_not_exist.yaml"], "does_not_exist.yaml"),
        (["--repeats", "0"], "--repeats"),
        (["--tiny", "--breakdown-micro-batches", "0"], "--breakdown-micro-batches"),
        (["--tiny", "--peak-tflops", "0"], "--peak-tflops"),
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


def test_breakdown_is_refused_under_several_processes():
    ns = bench.build_parser().parse_args(["--tiny", "--profile", "somewhere"])
    with pytest.raises(ValueError, match="--breakdown"):
        bench.make_plan(ns, world=2)
    assert bench.make_plan(ns, world=1).breakdown  # --profile implies --breakdown


def kernels() -> tuple:
    """What bench.phase_hooks wraps for the time of a pass: rc_forward's log-prob, entropy and log-prob backward."""
    return rc_forward.log_probs_from_logits, rc_forward.entropy_from_logits, rc_forward._ChunkedTokenLogProb.backward


def test_tiny_breakdown_reports_phases_ops_and_syncs(capsys, tmp_path):
    originals = kernels()
    argv = ["--tiny", "--repeats", "1", "--breakdown", "--profile", str(tmp_path), "--peak-tflops", "1"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert kernels() == originals  # the phase hooks are undone
    assert result["mfu"] > 0 and result["peak_tflops"] == 1
    b = result["breakdown"]
    # --tiny: 8 sequences, 2 minibatches of 4 rows, micro-batch 2
    assert b["micro_batches_per_update"] == 4 and b["optimizer_steps_per_update"] == 2
    assert b["micro_batches_timed"] == 2 and b["clock"] == "perf_counter"
    phases = b["phase_ms"]
    assert set(phases) == set(bench.PHASES) and all(v >= 0 for v in phases.values())
    for phase in ("forward", "log_prob", "entropy", "loss", "backward", "log_prob_backward", "metrics", "optimizer"):
        assert phases[phase] > 0, phase
    # the phases partition the pass: they add up to its sum; the gap is what the timed update adds
    assert b["sum_ms"] == pytest.approx(sum(phases.values()))
    assert b["gap_ms"] == pytest.approx(b["update_ms"] - b["sum_ms"])
    assert b["unshared_sum_ms"] > 0 and b["no_grad_forward_ms"] > 0  # the default config shares prompts
    assert b["log_prob_backward_calls"] == b["micro_batches_timed"]  # one chunked log-prob backward per micro-batch
    # op and sync counts: the pass by phase, and rc_train.update_policy itself
    for phase in ("forward", "loss", "backward", "optimizer"):
        assert b["phase_aten_ops"][phase] > 0, phase
    assert b["phase_host_syncs"]["loss"] > 0 and b["phase_host_syncs"]["optimizer"] > 0  # float(loss), float(norm)
    assert b["aten_ops_per_micro_batch"] > b["aten_compute_ops_per_micro_batch"] > 0
    assert b["host_syncs_per_micro_batch"] * b["micro_batches_per_update"] == pytest.approx(b["host_syncs_per_update"])
    kinds = b["sync_kinds_per_update"]
    assert set(kinds) == set(bench.SYNC_KINDS) and sum(kinds.values()) == b["host_syncs_per_update"]
    assert kinds["read"] > 0 and kinds["to_device"] > 0 and kinds["data_dependent"] > 0
    sites = b["sync_sites_per_update"]
    assert sum(s["count"] for s in sites) <= b["host_syncs_per_update"]
    assert any(s["site"].startswith("rc_train.py:") for s in sites) and any("rc_core.py:" in s["site"] for s in sites)
    assert b["cuda_sync_warnings_per_micro_batch"] is None  # CUDA's own count: a GPU only
    profile = result["profile"]
    assert "error" not in profile, profile
    assert os.path.isfile(profile["file"]) and "top 40 by" in open(profile["file"]).read()
    assert os.path.isfile(profile["trace"])
    table = bench.summary_table([dict(result, check="tiny_check")]).splitlines()  # benchmarks/gpu_check.sh's table
    assert "tiny_check" in table[0] and any(line.startswith("  forward ms") for line in table)


def gpu_check_runs() -> list[tuple[str, list[str]]]:
    """benchmarks/gpu_check.sh's calls of its run(): (NAME, FLAGS), after any VAR=value assignments."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "benchmarks", "gpu_check.sh")) as f:
        text = f.read().replace("\\\n", " ")  # continued lines joined
    runs = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        while words and "=" in words[0] and not words[0].startswith("-"):
            words.pop(0)
        if words[:1] == ["run"]:
            runs.append((words[1], words[3:]))  # run NAME SECONDS FLAGS...
    return runs


def test_gpu_check_script_runs_valid_flags():
    # benchmarks/gpu_check.sh runs where nothing can be fixed in between: its runs' flags pass the benchmark's checks;
    # eager and compiled runs at the 0.5B mean shape and the 1.5B worst case
    runs = gpu_check_runs()
    assert len(runs) == 4 and len({name for name, _ in runs}) == 4
    plans = {name: bench.make_plan(bench.build_parser().parse_args(["--breakdown", *flags])) for name, flags in runs}
    assert {p.model_size for p in plans.values()} == {"0.5b", "1.5b"}
    assert sorted(str(p.compile) for p in plans.values()) == ["None", "None", "layers", "layers"]
    for plan in plans.values():  # the trainer's --compile turns the shared-prompt pass off
        assert plan.train.compile == (plan.compile == "layers")
        assert rc_forward.shares_prefix(plan.train) == (plan.compile is None)


def test_compile_follows_the_config_unless_a_flag_says_otherwise():
    # the GPU configs say compile: true, so the benchmark compiles the layers as the trainer would; --compile off
    # measures eager; --tiny stays eager (a CPU's compilation takes minutes) unless --compile is given
    config = ["--config", "configs/gsm8k_qwen0.5b_bypass.yaml"]
    assert bench.parse_plan(config).compile == "layers"
    eager = bench.parse_plan([*config, "--compile", "off"])
    assert eager.compile is None and not eager.train.compile and rc_forward.shares_prefix(eager.train)
    assert bench.parse_plan(["--tiny", *config]).compile is None
    assert bench.parse_plan(["--tiny", *config, "--compile", "layers"]).train.compile
    whole = bench.parse_plan([*config, "--compile"])  # the whole model: an experiment, not the trainer's --compile
    assert whole.compile == "model" and not whole.train.compile


def test_tiny_run_with_compiled_layers_reports_the_compilation(capsys):
    # aot_eager: the capture without generating code (seconds); the update and its figures as the trainer's --compile
    from torch._dynamo.utils import counters

    counters.clear()  # Dynamo's counters are the process's: another test's graphs are not this run's
    argv = ["--tiny", "--repeats", "1", "--compile", "layers", "--compile-backend", "aot_eager"]
    assert bench.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["compile"] == "layers (aot_eager)" and not result["shared_prompt_pass"]
    assert result["compiled_graphs"]["unique_graphs"] >= 1 and result["compiled_graphs"]["graph_breaks"] == 0
    assert result["warmup_seconds"] > 0 and math.isfinite(result["seconds_per_update"])


def test_breakdown_cuts_the_updates_own_micro_batches(monkeypatch):
    plan = bench.parse_plan(["--tiny"])
    b = bench.setup(plan)
    seen, forward = [], rc_train.sequence_log_probs

    def record(net, batch, rows, *args, **kwargs):
        seen.append(rows.tolist())
        return forward(net, batch, rows, *args, **kwargs)

    monkeypatch.setattr(rc_train, "sequence_log_probs", record)
    b.update()
    assert seen == [rows.tolist() for _, micro in bench.update_schedule(b) for rows in micro]


def test_breakdown_step_trains_as_update_policy_does():
    """run_step mirrors update_policy's micro-batch loop with marks between the calls: with one epoch and one
    minibatch, one run_step over the update's own micro-batches leaves the same weights as the update itself."""
    import dataclasses

    plan = bench.parse_plan(["--tiny", "--config", "configs/gsm8k_qwen0.5b_token_tis.yaml"])
    plan = dataclasses.replace(plan, train=dataclasses.replace(plan.train, ppo_epochs=1, num_minibatches=1))
    torch.manual_seed(0)
    a = bench.setup(plan)
    torch.manual_seed(0)
    b = bench.setup(plan)
    a.update()
    tensors, batch_correction, _ = b.prepare()
    ((rows, micro),) = bench.update_schedule(b)
    bench.run_step(b, tensors, batch_correction, rows, micro, bench.Marks(torch.device("cpu")), b.share_prefix)
    for (name, p), q in zip(a.learner.model.named_parameters(), b.learner.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)


def test_op_counter_counts_what_a_gpu_would_synchronise_on():
    weight = torch.randn(3, requires_grad=True)  # a parameter: on the device
    counter = bench.OpCounter(torch.device("cpu"), resident=[weight])
    with counter:
        y = weight * 2  # made from a device tensor: on the device
        float(y.detach().sum())  # read
        if y.sum() > 0:  # read (bool)
            pass
        host = torch.ones(3)
        int(host.sum())  # a host tensor: no sync
        host.tolist()  # no sync
        moved = host.to(weight.device)  # to_device
        moved[moved > 0]  # data_dependent (boolean mask)
        torch.tensor(1.0, device=weight.device)  # to_device
        torch.tensor([], device=weight.device)  # empty: nothing is copied
        torch.zeros(3, device=weight.device).sum().item()  # a device factory, then a read
        torch.unique(moved)  # data_dependent
        back = y.detach().cpu()  # to_host
        float(back.sum())  # a host tensor again: no sync
        moved.to(weight.device, non_blocking=True)  # already on the device: nothing
        host.to(weight.device, non_blocking=True)  # not a sync: counted apart
        (y * y).sum().backward()
    assert counter.kinds == {"read": 3, "to_device": 2, "data_dependent": 2, "to_host": 1}
    assert counter.async_copies == 1
    assert sum(counter.syncs.values()) == 8 and sum(counter.ops.values()) > 8
    sites = [site for (_, site), _ in counter.sites.items()]
    assert all(site.startswith("tests/test_bench_gpu_step.py:") for site in sites), sites


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
