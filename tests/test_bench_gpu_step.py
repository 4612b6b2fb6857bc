"""Tests of benchmarks/bench_gpu_step.py: the --tiny run reports sane figures (one process, and two under torchrun
with DDP and FSDP2), bad flags fail before any model is built, and the benchmarked update really trains (the weights
move). The benchmark does not import rc_train.py: its update, composed from rc_core, rc_forward and rc_run, is proven
equal to rc_train.update_policy (and rc_train.decoupled_correction) here, its settings are rc_train.Args' own fields
with their defaults, read from the configs as rc_train reads them, and its synthetic batch is rc_forward.make_batch's.
--breakdown: its phases partition the pass, its op and host-sync counts are there and positive, its micro-batches are
the update's own, and its sync counter counts what a GPU would synchronise on (no timing is asserted). MFU: the
field's FLOP count equals a hand count, and benchmarks/mfu_table.py recomputes the committed GPU records as
docs/gpus.md and the README quote them."""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import shlex
import subprocess
import sys
from collections import Counter

import pytest
import torch

import rc_config
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
    # the field's accounting: counted on the batch (the tokens the algorithm needs), with no card peak on a CPU
    assert result["mfu_conventional"] is None and result["card"] is None and result["mfu_of_measured_peak"] is None
    plan = bench.make_plan(bench.build_parser().parse_args(["--tiny"]))
    counts = bench.conventional_counts(bench.make_rollout(plan))
    assert {k: result["conventional"][k] for k in bench.COUNTS} == counts
    flops = bench.conventional_flops(bench.MODEL_SHAPES["tiny"], counts)["total"]
    assert result["flops_per_update_conventional"] == flops
    assert counts["tokens"] < result["update_tokens"]  # the shared-prompt pass forwards a prompt once per micro-batch


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
        (["--tiny", "--card-peak-tflops", "nan"], "--card-peak-tflops"),
        (["--tiny", "--micro-batch-size", "0"], "--micro-batch-size"),  # the trainer's check, as validate_args words it
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
    argv = ["--tiny", "--repeats", "2", "--breakdown", "--profile", str(tmp_path), "--peak-tflops", "1"]
    assert bench.main(argv + ["--card-peak-tflops", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert kernels() == originals  # the phase hooks are undone
    assert result["mfu"] > 0 and result["peak_tflops"] == 1
    # the field's MFU against --card-peak-tflops, the same FLOPs against the matmul peak, the old one beside them
    flops, seconds = result["flops_per_update_conventional"], result["seconds_per_update"]
    assert result["peak_tflops_card"] == 2 and result["peak_tflops_card_source"] == "--card-peak-tflops"
    assert result["mfu_conventional"] == pytest.approx(flops / seconds / 2e12)
    assert result["mfu_of_measured_peak"] == pytest.approx(flops / seconds / 1e12)
    assert result["mfu"] == pytest.approx(6 * result["params"] * result["update_tokens"] / seconds / 1e12)
    low, high = result["mfu_conventional_range"]
    assert low <= result["mfu_conventional"] <= high and result["repeats"] == 2
    assert any(line.strip().startswith("of measured matmul peak") for line in out)
    # benchmarks/mfu_table.py reads a new record's own counts: the same three figures
    from benchmarks import mfu_table

    table = mfu_table.figures(result)
    assert table["conventional"] == pytest.approx(result["mfu_conventional"])
    assert table["of_measured"] == pytest.approx(result["mfu_of_measured_peak"])
    assert table["old"] == table["old_recomputed"] == pytest.approx(result["mfu"])
    assert len(mfu_table.tables([("tiny", result)])) == 3  # header, separator, the row
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
    # op and sync counts: the pass by phase, and the (unmarked) update itself
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
    assert any(s["site"].startswith("benchmarks/bench_gpu_step.py:") for s in sites)  # the update's loop
    assert any("rc_core.py:" in s["site"] for s in sites) and any("rc_forward.py:" in s["site"] for s in sites)
    assert b["cuda_sync_warnings_per_micro_batch"] is None  # CUDA's own count: a GPU only
    profile = result["profile"]
    assert "error" not in profile, profile
    assert os.path.isfile(profile["file"]) and "top 40 by" in open(profile["file"]).read()
    assert os.path.isfile(profile["trace"])
    table = bench.summary_table([dict(result, check="tiny_check")]).splitlines()  # benchmarks/gpu_check.sh's table
    assert "tiny_check" in table[0] and any(line.startswith("  forward ms") for line in table)


def gpu_check_runs() -> list[tuple[str, list[str]]]:
    """benchmarks/gpu_check.sh's calls of its run(): (NAME, FLAGS), BREAKDOWN's flags first (as run() passes them)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "benchmarks", "gpu_check.sh")) as f:
        text = f.read().replace("\\\n", " ")  # continued lines joined
    runs = []
    for line in text.splitlines():
        words, extra = shlex.split(line, comments=True), []
        while words and "=" in words[0] and not words[0].startswith("-"):
            name, value = words.pop(0).split("=", 1)
            extra += value.split() if name == "BREAKDOWN" else []
        if words[:1] == ["run"]:
            runs.append((words[1], extra + words[3:]))  # run NAME SECONDS FLAGS...
    return runs


def test_gpu_check_script_runs_valid_flags():
    # benchmarks/gpu_check.sh runs where nothing can be fixed in between: its runs' flags pass the benchmark's checks;
    # eager and compiled runs at the 0.5B mean shape and the 1.5B worst case, all with the shared-prompt pass (the
    # configs'), the compiled 0.5B run with --breakdown: its micro-batches without the shared prompt beside them
    runs = gpu_check_runs()
    assert len(runs) == 4 and len({name for name, _ in runs}) == 4
    plans = {name: bench.make_plan(bench.build_parser().parse_args(["--breakdown", *flags])) for name, flags in runs}
    assert {p.model_size for p in plans.values()} == {"0.5b", "1.5b"}
    assert sorted(str(p.compile) for p in plans.values()) == ["None", "None", "layers", "layers"]
    for plan in plans.values():
        assert plan.train.compile == (plan.compile == "layers") and rc_forward.shares_prefix(plan.train)
    assert "--breakdown" in dict(runs)["0.5b_mean_compiled"]


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
    assert result["compile"] == "layers (aot_eager)" and result["shared_prompt_pass"]
    assert result["compiled_graphs"]["unique_graphs"] >= 1 and result["compiled_graphs"]["graph_breaks"] == 0
    assert result["warmup_seconds"] > 0 and math.isfinite(result["seconds_per_update"])


def test_breakdown_cuts_the_updates_own_micro_batches(monkeypatch):
    plan = bench.parse_plan(["--tiny"])
    b = bench.setup(plan)
    seen, forward = [], rc_forward.sequence_log_probs

    def record(net, batch, rows, *args, **kwargs):
        seen.append(rows.tolist())
        return forward(net, batch, rows, *args, **kwargs)

    monkeypatch.setattr(rc_forward, "sequence_log_probs", record)  # the update's forward (bypass: no pi_old pass)
    b.update()
    assert seen == [rows.tolist() for _, micro in bench.update_schedule(b) for rows in micro]


def test_marked_breakdown_step_trains_as_the_unmarked_update():
    """--breakdown times run_step, the update's own optimizer step, with marks between its calls and rc_forward's
    kernels wrapped (phase_hooks): with one epoch and one minibatch, one marked step over the update's micro-batches
    leaves the very weights the unmarked update leaves."""
    plan = bench.parse_plan(["--tiny", "--config", "configs/gsm8k_qwen0.5b_token_tis.yaml"])
    plan = dataclasses.replace(plan, train=dataclasses.replace(plan.train, ppo_epochs=1, num_minibatches=1))
    a, b = bench.setup(plan), bench.setup(plan)
    a.update()
    tensors, batch_correction, _ = b.prepare()
    ((rows, micro),) = bench.update_schedule(b)
    marks = bench.Marks(torch.device("cpu"))
    with bench.phase_hooks(marks):
        bench.run_step(b, tensors, batch_correction, rows, micro, marks, b.share_prefix)
    assert marks.calls["log_prob"] == len(micro)  # the hooks were on
    for (name, p), q in zip(a.learner.model.named_parameters(), b.learner.model.parameters()):
        assert torch.equal(p, q), name


def _trainer_args(plan):
    """rc_train.Args as rc_train.py reads the plan's config, with --tiny's and the plan's own changes."""
    args = rc_train.load_yaml_defaults(plan.config_path)
    changed = {**bench.TINY_ARGS, "ppo_epochs": plan.train.ppo_epochs, "train_dtype": plan.train.train_dtype}
    return dataclasses.replace(args, **changed)


@pytest.mark.parametrize(
    "config",
    [
        "configs/gsm8k_qwen0.5b_bypass.yaml",  # bypass PPO-clip: the correction inside the loss
        "configs/gsm8k_qwen0.5b_token_tis.yaml",  # decoupled, token IS weights
        "configs/gsm8k_qwen0.5b_seq_mis.yaml",  # decoupled, sequence IS and rejection: the keep mask rejects rows
    ],
)
def test_the_update_equals_rc_train_update_policy(config):
    """The benchmark's update (Bench.prepare, then Bench.policy_update) against rc_train.decoupled_correction and
    rc_train.update_policy, each on its own copy of the same model, optimizer and batch, with the generator seeded
    alike: bypass and decoupled presets, two epochs of two minibatches of micro-batches, float32 (the master weights'
    dtype). torch.equal and ==, not a tolerance: both run the same torch ops in the same order on the same inputs on
    one CPU, which is bitwise reproducible, so any difference at all would mean the benchmark computes something else
    (a tolerance would let a changed denominator or a dropped term of order 1e-7 through)."""
    plan = bench.parse_plan(["--tiny", "--config", config])
    plan = dataclasses.replace(plan, train=dataclasses.replace(plan.train, ppo_epochs=2, train_dtype="float32"))
    args = _trainer_args(plan)
    assert {f.name: getattr(args, f.name) for f in dataclasses.fields(plan.train)} == vars(plan.train)
    ours, theirs = bench.setup(plan), bench.setup(plan)
    for p, q in zip(ours.learner.model.parameters(), theirs.learner.model.parameters()):
        assert torch.equal(p, q)
    assert torch.equal(ours.batch["input_ids"], theirs.batch["input_ids"])

    tensors, batch_correction, size = ours.prepare()
    metrics, actor, update_size = ours.policy_update(tensors, batch_correction)

    their_tensors = {k: theirs.batch[k] for k in ("response_mask", "advantages", "rollout_log_prob")}
    their_correction, their_size = {}, Counter()
    if not plan.correction.bypass_mode:
        unwrapped = theirs.learner.accelerator.unwrap_model(theirs.learner.model)
        their_correction, their_size = rc_train.decoupled_correction(
            args, plan.correction, unwrapped, theirs.batch, their_tensors
        )
    learner = rc_train.Learner(**vars(theirs.learner))
    generator = torch.Generator().manual_seed(plan.seed)
    their_metrics, their_actor, their_update_size = rc_train.update_policy(
        args,
        plan.correction,
        learner,
        theirs.batch,
        their_tensors,
        generator=generator,
        batch_correction=their_correction,
    )

    assert set(tensors) == set(their_tensors) and ("keep_mask" in tensors) != plan.correction.bypass_mode
    for key in tensors:
        assert torch.equal(tensors[key], their_tensors[key]), key
    assert batch_correction == their_correction and size == their_size
    assert actor == their_actor and actor["actor/grad_norm"] > 0
    assert metrics.sums == their_metrics.sums and update_size == their_update_size
    for (name, p), q in zip(ours.learner.model.named_parameters(), theirs.learner.model.parameters()):
        assert torch.equal(p, q), name


def test_settings_are_rc_train_args_fields_read_as_rc_train_reads_them():
    """Every field of bench.UpdateSettings is a field of rc_train.Args with the same default (and its rc, of
    rc_config.CorrectionArgs); every config in configs/ gives them the values rc_train.load_yaml_defaults gives."""
    trainer, ours = rc_train.Args(), bench.UpdateSettings()
    names = [f.name for f in dataclasses.fields(bench.UpdateSettings)]
    assert set(names) <= {f.name for f in dataclasses.fields(rc_train.Args)}
    for name in names:
        assert getattr(ours, name) == getattr(trainer, name), name
    assert ours.rc == rc_config.CorrectionArgs() == trainer.rc
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    configs = sorted(glob.glob(os.path.join(root, "configs", "*.yaml")))
    assert len(configs) >= 5
    for path in configs:
        args, settings = rc_train.load_yaml_defaults(path), bench.load_settings(path)
        assert {name: getattr(args, name) for name in names} == vars(settings), path


def test_settings_ignore_the_keys_the_update_does_not_read_and_refuse_unknown_rc_keys(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(
        "num_steps: 3\nvllm_gpu_memory_utilization: 0.2\nlearning_rate: 1e-5\nrc:\n  preset: bypass_ppo_clip\n"
    )
    settings = bench.load_settings(str(config))
    assert settings.learning_rate == 1e-5 and settings.rc.preset == "bypass_ppo_clip"  # 1e-5 a number, as rc_config
    config.write_text("rc:\n  preset: bypass_ppo_clip\n  rollout_iss: token\n")
    with pytest.raises(ValueError, match="rc.rollout_iss"):
        bench.load_settings(str(config))


def test_rollout_batch_is_rc_train_make_batch():
    """The synthetic batch, built in the benchmark, is the batch rc_forward.make_batch makes of its rows."""
    batch = bench.make_rollout(bench.parse_plan(["--tiny"]))
    T = batch["response_mask"].shape[1]
    P = batch["input_ids"].shape[1] - T
    prompts, responses = [], []
    for i in range(len(batch["group"])):
        p, t = int(batch["prompt_len"][i]), int(batch["response_len"][i])
        prompts.append(batch["input_ids"][i, P - p : P].tolist())
        responses.append((batch["input_ids"][i, P : P + t].tolist(), batch["rollout_log_prob"][i, :t].tolist(), ""))
    made = rc_forward.make_batch(
        prompts, responses, bench.MODEL_SHAPES["tiny"]["pad_token_id"], batch["group"].tolist()
    )
    assert set(made) == set(batch) - {"advantages"}
    for key, value in made.items():
        assert value.dtype == batch[key].dtype and torch.equal(value, batch[key]), key


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
    plan = bench.make_plan(bench.build_parser().parse_args(["--tiny", *flags]), world=2)
    counts = [bench.conventional_counts(bench.make_rollout(plan, rank)) for rank in range(2)]
    assert {k: result["conventional"][k] for k in bench.COUNTS} == {k: sum(c[k] for c in counts) for k in bench.COUNTS}


def test_conventional_flops_equal_a_hand_count_for_a_tiny_shape():
    """Two groups: a 3-token prompt with responses of 2 and 4 tokens, a 5-token prompt with a 1-token response."""
    lengths = {"prompt_len": [3, 3, 5], "response_len": [2, 4, 1], "group": [0, 0, 1]}
    batch = {k: torch.tensor(v) for k, v in lengths.items()}
    counts = bench.conventional_counts(batch)
    # tokens: each prompt once (3 + 5) and every response (2 + 4 + 1); one logit position per response token.
    # causal pairs: a prompt's p(p+1)/2 once (6, 15); response token j after a p-token prompt attends p + j + 1 keys:
    # (4 + 5), (4 + 5 + 6 + 7), (6)
    assert counts == {"tokens": 15, "logit_positions": 7, "attention_pairs": 6 + 15 + 9 + 22 + 6}
    # the tiny shape: d 64, 2 layers, 2 heads x 32, 1 KV head x 32, MLP 128, vocabulary 1024. Per layer: q 64 x 64 + 64,
    # k and v 64 x 32 + 32 each, o 64 x 64, MLP 3 x 64 x 128, two norms 2 x 64; then the final norm
    layer = (64 * 64 + 64) + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64
    shape = bench.MODEL_SHAPES["tiny"]
    assert bench.non_embedding_params(shape) == 2 * layer + 64 == 74304
    # forward + backward: 6 x N per token, 6 x d x V per logit position, 12 x L x (heads x head_dim) per pair
    dense, lm_head, attention = 6 * 74304 * 15, 6 * 64 * 1024 * 7, 12 * 2 * 64 * 58
    flops = bench.conventional_flops(shape, counts)
    assert flops == {"dense": dense, "lm_head": lm_head, "attention": attention, "total": dense + lm_head + attention}
    # two epochs and a pi_old pass (forward only: a third of a forward + backward)
    assert bench.conventional_flops(shape, counts, 2, 1)["total"] == (dense + lm_head + attention) * 7 // 3


def test_non_embedding_params_are_the_models_own():
    from transformers import Qwen2ForCausalLM

    for size, shape in bench.MODEL_SHAPES.items():
        with torch.device("meta"):
            model = Qwen2ForCausalLM(bench.model_config(size))
        embeddings = {id(model.model.embed_tokens.weight), id(model.lm_head.weight)}
        rest = sum(p.numel() for p in model.parameters() if id(p) not in embeddings)
        assert bench.non_embedding_params(shape) == rest, size


def test_card_peaks_come_from_the_device_name():
    assert bench.card_peak("NVIDIA H200") == ("H200 SXM", 989.0)
    assert bench.card_peak("NVIDIA H100 80GB HBM3") == ("H100 SXM", 989.0)
    assert bench.card_peak("NVIDIA A100-SXM4-80GB") == ("A100", 312.0)
    for other in ("NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA L40S", "cpu (8 threads)"):
        assert bench.card_peak(other) == (None, None), other


def test_mfu_table_recomputes_the_committed_records_as_docs_gpus_md_shows_them():
    """The old accounting comes out as recorded, the issue's four numbers come out, and docs/gpus.md holds the tables
    the script prints (so the page cannot drift from the records)."""
    from benchmarks import mfu_table

    files = sorted(glob.glob(os.path.join(mfu_table.RUNS, "*.jsonl")))
    rows = mfu_table.load(files)
    assert rows
    figures = {r["check"]: mfu_table.figures(r) for _, r in rows}
    for _, r in rows:
        assert figures[r["check"]]["old_recomputed"] == pytest.approx(r["mfu"], rel=1e-9), r["check"]
    # issue 51: non-embedding 6N + the lm_head on the tokens the compiled runs computed, against 989 TFLOP/s ...
    assert round(100 * figures["0.5b_mean_compiled"]["intermediate"], 1) == 19.9
    assert round(100 * figures["1.5b_worst_compiled"]["intermediate"], 1) == 37.1
    # ... and the old accounting (6 x all parameters, measured matmul) on the eager twin's tokens
    for compiled, expected in (("0.5b_mean_compiled", 20.3), ("1.5b_worst_compiled", 34.3)):
        f, eager = figures[compiled], figures[compiled.removesuffix("_compiled")]
        assert round(100 * f["old"] * eager["update_tokens"] / f["update_tokens"], 1) == expected
    # the compiled runs computed every sample's prompt: about 30 % of their tokens at the mean shape are copies
    f = figures["0.5b_mean_compiled"]
    assert 1 - f["tokens_needed"] / f["update_tokens"] == pytest.approx(0.30, abs=0.005)
    with open(os.path.join(bench.ROOT, "docs", "gpus.md"), encoding="utf-8") as page:
        text = page.read()
    assert "\n".join(mfu_table.tables(rows)) in text
    # the compiled-layers table quotes each run as "conventional (old)", the README the compiled runs' conventional
    for name, f in figures.items():
        quoted = f"{mfu_table.pct(f['conventional'])}{'**' if 'compiled' in name else ''} ({mfu_table.pct(f['old'])})"
        assert quoted in text, name
    pct = {name: mfu_table.pct(f["conventional"]) for name, f in figures.items()}
    with open(os.path.join(bench.ROOT, "README.md"), encoding="utf-8") as readme:
        assert f"{pct['0.5b_mean_compiled']} MFU at 0.5B and {pct['1.5b_worst_compiled']} at 1.5B" in readme.read()


def test_mfu_table_refuses_a_record_its_rebuilt_batch_does_not_match():
    from benchmarks import mfu_table

    _, record = mfu_table.load(sorted(glob.glob(os.path.join(mfu_table.RUNS, "*.jsonl"))))[0]
    with pytest.raises(ValueError, match="tokens computed"):
        mfu_table.figures({**record, "tokens_per_second": record["tokens_per_second"] * 1.01})
