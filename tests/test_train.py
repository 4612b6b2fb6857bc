"""End-to-end tests of rc_train.py: the real script, real vLLM (CPU build), tiny budgets (CleanRL habit).

Each test starts `python rc_train.py ...` in a subprocess and reads the run's metrics.jsonl; the presets beyond one
per code path run the script's own step in this process on batches its engine samples (section 5).
Engine start-up (~15 s) dominates; steps take well under a second with the tiny local model.
"""

import copy
import dataclasses
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

import rc_core
import rc_plot
import tasks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
ENGINE_STARTED = "Initializing a V1 LLM engine"
# The one-token fixture (configs/cpu_add.yaml), small and fast; tests add what they need.
ADD = ["--config", os.path.join(ROOT, "configs", "cpu_add.yaml")]
# The shortened default run of test_default_run_learns_multi_token_answers, and the rise it must show (set from
# measured runs: see the test).
SHORT_STEPS = 20
SHORT_MARGIN = 0.3
QUICK = [*ADD, "--num-prompts-per-step", "8", "--num-samples-per-prompt", "8", "--eval-limit", "10", "--no-save-final"]
# the real GSM8K files: ./data/gsm8k or ../shared/data/gsm8k (a clone alone may have no hub to fall back on)
needs_local_gsm8k = pytest.mark.skipif(tasks.local_gsm8k_dir() is None, reason="no local GSM8K copy")


def session_cache(basetemp):
    """The tiny models' cache, one per test session (`basetemp`: pytest's, or a test's tmp_path.parent). The suite's
    workers (pytest-xdist, pyproject.toml) each have a basetemp inside the session's: they share the cache there, and
    tasks.cached_build's lock builds each model once."""
    return (basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp) / "rc_cache"


def train_env(tmp_path):
    """One thread per process (vLLM and torch share the cores); the tiny models cached once per test session."""
    return dict(os.environ, OMP_NUM_THREADS="1", RC_CACHE_DIR=str(session_cache(tmp_path.parent)))


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def engine_started(run_dir):
    """The engine writes its log lines to engine.log in the run folder (none on the console)."""
    log = run_dir / "engine.log"
    return log.exists() and ENGINE_STARTED in log.read_text()


def run_train(tmp_path, *flags, name="run", check=True, timeout=600):
    """Run rc_train.py; return (metrics rows of the training steps, completed process). The evaluation before
    training (step -1) is left out of the rows; read metrics.jsonl for it."""
    env = train_env(tmp_path)
    cmd = [sys.executable, os.path.join(ROOT, "rc_train.py"), "--output-dir", str(tmp_path), "--run-name", name, *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"rc_train.py failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    path = tmp_path / name / "metrics.jsonl"
    rows = [r for r in read_jsonl(path) if r["step"] >= 0] if path.exists() else []
    return rows, proc


# The tests that need the minigsm base run first, one after the other on one worker (tests/conftest.py).
needs_minigsm_base = pytest.mark.minigsm_base


# ---- 0. The default job: the miniature GSM8K learns (builds the cached base model on first use) ----------
@needs_minigsm_base
def test_default_run_learns_multi_token_answers(tmp_path):
    # The default job (configs/cpu_demo.yaml), shortened: SHORT_STEPS steps, eval on 100 test problems, from the base
    # the repository ships (models/; tests/test_tasks.py checks it is the default's and loaded without a build).
    rows, proc = run_train(
        tmp_path, "--num-steps", str(SHORT_STEPS), "--eval-limit", "100", "--no-save-final", timeout=3600
    )
    everything = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    evals = [r for r in everything if "eval/accuracy_strict" in r]
    assert evals[0]["step"] == -1 and everything[0] is evals[0]  # the evaluation before any update comes first
    assert evals[-1]["step"] == SHORT_STEPS - 1  # and the last one follows the last update
    before, after = evals[0]["eval/accuracy_strict"], evals[-1]["eval/accuracy_strict"]
    assert after >= before + SHORT_MARGIN, (before, after)
    assert all(r["response_length/mean"] >= 12 for r in rows)  # worked solutions, many tokens each
    samples = read_jsonl(tmp_path / "run" / "eval_samples.jsonl")
    steps = [s["step"] for s in samples]  # every problem at every evaluation: before, every 10 steps, at the end
    assert steps == [e["step"] for e in evals for _ in range(100)] and steps[0] == -1 and steps[-1] == SHORT_STEPS - 1
    assert {"question", "gold", "response", "strict", "flexible"} <= set(samples[0])
    trained = [s for s in samples if s["step"] >= 0]
    # Greedy responses stop at EOS (not at the length cap), and the strict ones end with the '#### N' line.
    assert sum(s["tokens"] < 64 for s in trained) >= 95
    assert all(s["response"].rstrip().rsplit("\n", 1)[-1].startswith("####") for s in trained if s["strict"])
    # A quiet console: the progress bar and the summary, no engine lines.
    assert "before ->" in proc.stdout and "dashboard: python rc_train.py plot" in proc.stdout
    console = proc.stdout + proc.stderr
    assert " INFO " not in console and "WARNING" not in console, console[-3000:]
    assert "Failed to load weights" not in (tmp_path / "run" / "engine.log").read_text()
    # The first run shows the subject: asynchronous by one version (a CPU's default), so every dashboard panel has
    # data and the mismatch is real, well above fp32 rounding (k3 ~1e-13 when the engine holds the trainer's weights).
    assert [r["rollout/staleness_max"] for r in rows] == [0] + [1] * (SHORT_STEPS - 1)
    for panel in rc_plot.PANELS:
        assert panel.needs or any(s.key in r for s in panel.series for r in everything), panel.title
    assert min(r["rollout_corr/k3_kl"] for r in rows[1:]) > 1e-6
    assert max(r["rollout_corr/rollout_rs_masked_fraction"] for r in rows) > 0  # the k3 gate acts
    assert all(r["actor/tv_update"] > 0 for r in rows)


# ---- 1. Mismatch is ~0 when nothing differs (fp32/fp32, sync every step); bf16 rollout shows it ----------
@pytest.mark.parametrize("preset", ["bypass_ppo_clip", "decoupled_token_is"])
def test_fp32_mismatch_is_near_zero_and_old_log_prob_passes(tmp_path, preset):
    rows, _ = run_train(tmp_path, *QUICK, "--num-steps", "4", "--max-response-length", "4", "--rc.preset", preset)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert abs(r["rollout_corr/kl"]) < 1e-4 and abs(r["rollout_corr/k3_kl"]) < 1e-4, r
        assert r["actor/sync_count"] == r["step"] + 1
        parts = ("rollout_wait_s", "reward_s", "old_log_prob_s", "ref_log_prob_s", "update_s", "sync_s")
        assert r["timing/step_s"] >= sum(r[f"timing/{p}"] for p in parts), r  # the whole step, the wait included
    if preset.startswith("bypass"):  # no old-log-prob forward pass at all
        assert all(r["actor/old_log_prob_passes"] == 0 and r["timing/old_log_prob_s"] == 0 for r in rows)
    else:  # exactly one per rollout batch
        assert [r["actor/old_log_prob_passes"] for r in rows] == [1, 2, 3, 4]
        assert all(r["timing/old_log_prob_s"] > 0 for r in rows)
        assert "rollout_corr/rollout_is_mean" in rows[0]


def test_bf16_rollout_shows_mismatch(tmp_path):
    rows, _ = run_train(
        tmp_path, *QUICK, "--num-steps", "2", "--max-response-length", "4", "--rollout-dtype", "bfloat16"
    )
    ref, _ = run_train(tmp_path, *QUICK, "--num-steps", "2", "--max-response-length", "4", name="fp32")
    bf16_diff = max(r["rollout_corr/rollout_probs_diff_max"] for r in rows)
    fp32_diff = max(r["rollout_corr/rollout_probs_diff_max"] for r in ref)
    # measured: bf16 max |p_train - p_rollout| ~3e-5..8e-5 vs ~1e-8 in fp32 (tiny model, probabilities ~1/160)
    assert bf16_diff > 100 * fp32_diff, (bf16_diff, fp32_diff)
    bf16_k3 = max(r["rollout_corr/k3_kl"] for r in rows)
    assert bf16_k3 > 1e-7 and bf16_k3 > 100 * max(r["rollout_corr/k3_kl"] for r in ref), bf16_k3


# ---- 2. A stale engine: mismatch grows until the next sync, then returns to ~0 ---------------------------
def test_stale_engine_mismatch_grows_then_resets(tmp_path):
    rows, _ = run_train(
        tmp_path,
        *QUICK,
        "--num-steps",
        "6",
        "--max-response-length",
        "4",
        "--sync-every",
        "4",
        "--learning-rate",
        "5e-3",
    )
    k3 = [r["rollout_corr/k3_kl"] for r in rows]
    assert k3[0] < 1e-6 and k3[4] < 1e-6, k3  # fresh engine at steps 0 and 4 (synced after step 3)
    # measured (seeded, deterministic on CPU): 0, 0.207, 0.401, 0.338, 0, 0.355: three stale steps > one
    assert k3[1] > 1e-4 and k3[3] > k3[1] and k3[5] > 1e-4, k3
    # one sync, after step 3; the final step's evaluation then pushes the trainer's weights once more
    assert rows[3]["actor/sync_count"] == 1 and rows[4]["actor/sync_count"] == 1 and rows[5]["actor/sync_count"] == 2


# ---- 2b. Mismatch dials (the lab): each dial's mismatch grows with its level; level 0 is exact -----------
DIAL_RUN = [*QUICK, "--num-steps", "2", "--max-response-length", "4", "--rc.preset", "decoupled_token_is"]


def mean_mismatch(rows):
    """(k3, total variation) between engine and trainer, averaged over the run's steps."""
    return tuple(sum(r[f"rollout_corr/{k}"] for r in rows) / len(rows) for k in ("k3_kl", "tv_mismatch"))


@pytest.fixture(scope="module")
def dials_at_zero(tmp_path_factory):
    """Level 0 of every dial at once, each set explicitly (the defaults): one run shared by the dials' tests."""
    zero = ["--rollout-weight-noise", "0", "--rollout-weight-quant", "none", "--rollout-temperature", "1.0"]
    rows, _ = run_train(tmp_path_factory.mktemp("dials"), *DIAL_RUN, *zero, "--top-p", "1.0", name="level0")
    return mean_mismatch(rows)


@pytest.mark.parametrize(
    "dial, levels",
    [
        ("--rollout-weight-noise", ["0.3", "1.0"]),
        ("--rollout-weight-quant", ["int8", "int4"]),
        ("--rollout-temperature", ["1.3", "2.0"]),
        ("--top-p", ["0.9", "0.5"]),
    ],
)
def test_mismatch_dials_are_monotone(tmp_path, dials_at_zero, dial, levels):
    measured = [dials_at_zero]
    for i, level in enumerate(levels, start=1):
        rows, _ = run_train(tmp_path, *DIAL_RUN, dial, level, name=f"level{i}")
        measured.append(mean_mismatch(rows))
    k3, tv = zip(*measured)
    assert k3[0] < 1e-6 and 1e-6 < k3[1] < k3[2], (dial, k3)  # measured int8: 4.8e-6, int4: 1.2e-3
    assert tv[0] < 1e-3 and tv[0] < tv[1] < tv[2], (dial, tv)


def test_planted_tokens_are_caught_by_the_veto(tmp_path):
    # --rollout-corrupt-prob p: each sampled token is, with chance p, a uniformly random token reported with mu = 1.
    # The untrained tiny model gives any token pi ~ 1/160, so a veto threshold of 0.05 flags exactly the planted
    # ones (an honest token has rho ~ 1): the catastrophic-token fraction estimates p, and a response is vetoed
    # iff it holds one. Greedy evaluation is never corrupted.
    p = 0.25
    rows, _ = run_train(
        tmp_path,
        *QUICK,
        "--num-steps",
        "3",
        "--eval-every",
        "1",
        "--eval-limit",
        "55",
        "--rollout-corrupt-prob",
        str(p),
        "--rc.preset",
        "decoupled_token_is",
        "--rc.rollout-token-veto-threshold",
        "0.05",
    )
    catastrophic = sum(r["rollout_corr/rollout_is_catastrophic_token_fraction"] for r in rows) / len(rows)
    vetoed = sum(r["rollout_corr/rollout_is_veto_fraction"] for r in rows) / len(rows)
    # 3 steps x 64 responses x 1 token: p +- 4 standard errors (0.031)
    assert abs(catastrophic - p) < 0.13, catastrophic
    assert abs(vetoed - catastrophic) < 1e-6, (vetoed, catastrophic)  # one-token answers: a response is its token
    ref, _ = run_train(
        tmp_path,
        *QUICK,
        "--num-steps",
        "3",
        "--eval-every",
        "1",
        "--eval-limit",
        "55",
        "--rc.preset",
        "decoupled_token_is",
        "--rc.rollout-token-veto-threshold",
        "0.05",
        name="clean",
    )
    assert all(r["rollout_corr/rollout_is_veto_fraction"] == 0 for r in ref)
    # the planted token's rho is tiny, so the token-level mismatch metrics jump; evaluation is greedy and uncorrupted
    assert min(r["rollout_corr/k3_kl"] for r in rows) > 100 * max(r["rollout_corr/k3_kl"] for r in ref)
    evals = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    clean = [json.loads(x) for x in (tmp_path / "clean" / "metrics.jsonl").read_text().splitlines()]
    assert evals[0]["eval/accuracy_strict"] == clean[0]["eval/accuracy_strict"]  # same weights, no planting


def test_raw_engine_log_probs_show_the_temperature_pitfall(tmp_path):
    # T = 0.7: processed log-probs are those of the sampling distribution (ratio ~1); raw ones are the
    # untempered model's, so the "mismatch" is the trl#4159 bug the raw mode reproduces.
    k3 = {}
    for mode in ("processed", "raw"):
        rows, _ = run_train(
            tmp_path,
            *QUICK,
            "--num-steps",
            "1",
            "--max-response-length",
            "4",
            "--temperature",
            "0.7",
            "--rollout-logprobs",
            mode,
            "--rc.preset",
            "decoupled_token_is",
            name=mode,
        )
        k3[mode] = rows[0]["rollout_corr/k3_kl"]
    assert k3["processed"] < 1e-6 and k3["raw"] > 1e-4, k3


# ---- 3. Learning: reward rises in both modes (a sign error in the loss fails this) -----------------------
@pytest.mark.parametrize("preset", ["bypass_ppo_clip", "decoupled_token_is"])
def test_reward_rises(tmp_path, preset):
    # Measured (seed 1, both modes): reward 0.016 over steps 0-4, 0.74 at step 20, ~0.8 over steps
    # 150-199. A sign error in the loss drives the reward to 0 instead; a broken sampler or sync stalls it.
    rows, _ = run_train(
        tmp_path, *ADD, "--num-steps", "30", "--eval-limit", "10", "--no-save-final", "--rc.preset", preset
    )
    first = sum(r["reward/mean"] for r in rows[:5]) / 5
    last = sum(r["reward/mean"] for r in rows[-10:]) / 10
    assert first < 0.1 and last > 0.5 and last > first + 0.4, (first, last)


# ---- 5. Every preset trains on the miniature GSM8K (multi-token responses) --------------------------------
# Legacy aliases that build exactly another preset's config: a run of one is a run of the other (checked below).
PRESET_TWINS = {"naive": "disabled", "pg_is": "bypass_pg_is", "bypass_pg_rs": "bypass_pg_geo_rs"}
DISTINCT_PRESETS = [p for p in rc_core.PRESET_NAMES if p not in PRESET_TWINS]
# End-to-end runs of the script, one per code path of the trainer: decoupled token IS, decoupled sequence IS with
# rejection, geometric rejection, bypass PPO-clip, bypass REINFORCE with sequence IS, the newer masks (OPSM, outlier).
# Every distinct preset runs the trainer's own step on a real batch in test_every_preset_trains_on_a_real_batch.
PRESET_RUNS = [
    "decoupled_token_is",
    "decoupled_seq_is_rs",
    "decoupled_geo_rs",
    "bypass_ppo_clip",
    "bypass_pg_is",
    "decoupled_opsm",
    "decoupled_outlier_rs",
]
# bf16 rollout against the fp32 trainer: a real mismatch, so sequence- and token-level statistics differ.
PRESET_FLAGS = [
    "--num-prompts-per-step",
    "4",
    "--num-samples-per-prompt",
    "4",
    "--num-steps",
    "2",
    "--eval-limit",
    "4",
    "--no-eval-before",
    "--no-save-final",
    "--rollout-dtype",
    "bfloat16",
]


def check_preset_metrics(preset, rows):
    """What every training step of `preset` must log: finite metrics, the rejection and IS metrics iff the preset
    has them, multi-token responses whose sequence statistics are not the token ones."""
    assert len(rows) == 2
    config = rc_core.RolloutCorrectionConfig.from_name(preset)
    for r in rows:
        # Pearson correlation is NaN by definition when a series has zero variance (docs/metrics.md)
        assert all(math.isfinite(v) for k, v in r.items() if not k.endswith("pearson_corr")), r
        assert ("rollout_corr/rollout_rs_masked_fraction" in r) == (config.rollout_rs is not None)
        assert ("rollout_corr/rollout_is_mean" in r) == (config.rollout_is is not None)
        assert r["response_length/mean"] > 10  # worked solutions, not one token
        if "rollout_corr/chi2_seq" in r:  # a sequence is many tokens: its chi2 is not the token one
            assert r["rollout_corr/chi2_seq"] != pytest.approx(r["rollout_corr/chi2_token"], rel=1e-3), r
        if config.rollout_is is not None:
            assert r["rollout_corr/rollout_is_seq_max"] >= r["rollout_corr/rollout_is_seq_min"]


@pytest.fixture(scope="module")
def preset_batches(tmp_path_factory):
    """The two training steps' inputs of a run with PRESET_FLAGS, made by the trainer's own functions as its main loop
    makes them: the tiny base in fp32 (the trainer's model, and its Args), and the rollout batches of steps 0 and 1,
    both sampled by version 0 (k = 1, a CPU's default) by the bf16 engine in a rollout worker process, scored, with
    their GRPO advantages and rollout metrics."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import rc_config
    import rc_rollout
    import rc_train

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RC_CACHE_DIR", str(session_cache(tmp_path_factory.getbasetemp())))  # run_train's
        patch.setattr(sys, "argv", ["rc_train.py", *PRESET_FLAGS])
        args = rc_config.parse_cli(rc_train.Args, rc_train.load_yaml_defaults)
        args.max_staleness = rc_config.resolve_max_staleness(args, False, "")
        task = rc_config.validate_args(args, 1)
        args.reward_mode = args.reward_mode or task.reward_key
        model_path = tasks.base_model_path(task, args.mini, args.seed, None)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train_rows, _ = task.problems("train", args.train_limit)
    prompts = tasks.encode_prompts(args, task, tokenizer, train_rows)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype="auto").float()
    accelerator = Accelerator(cpu=True)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    data = rc_train.TrainData(task, train_rows, prompts, pad_id)

    def indices(step):
        return rc_train.prompt_indices(
            len(prompts), args.seed, step * args.num_prompts_per_step, args.num_prompts_per_step
        )

    engine = rc_rollout.make_engine(args, model_path, str(tmp_path_factory.mktemp("engine")), prompts, accelerator)
    rollouts = rc_rollout.Rollouts(args, engine, model, lambda step: ([prompts[i] for i in indices(step)], 0))
    steps, bound = [], rc_rollout.staleness_bound(args)
    try:
        rollouts.begin(0)
        for step in range(args.num_steps):
            groups, version, *_ = rollouts.take(step)
            pairs = enumerate(zip(indices(step), groups))
            samples = [rc_train.Sample(i, g, version, r) for g, (i, group) in pairs for r in group]
            batch, tensors, logged = rc_train.scored_batch(args, data, samples, step, bound, len(samples))
            steps.append((batch, tensors, logged))
    finally:
        rollouts.close()
    return args, accelerator, model, steps


def train_preset(preset_batches, preset):
    """The metrics rows of the two steps of a run of `preset` on preset_batches: rc_train.py's step after the rollout,
    call for call (the decoupled correction, update_policy, the metrics reduced and health-checked as logged)."""
    import rc_config
    import rc_run
    import rc_train

    args, accelerator, model, steps = preset_batches
    args = dataclasses.replace(args, rc=dataclasses.replace(args.rc, preset=preset))
    correction = rc_config.build_correction_config(args.rc)
    model = copy.deepcopy(model)  # every preset starts from the base
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (args.warmup_steps + 1)))
    model, optimizer = accelerator.prepare(model, optimizer)
    learner = rc_train.Learner(accelerator, rc_run.HostGroup(1), model, optimizer, scheduler)
    health, rows = rc_run.HealthWatch(), []
    for step, (batch, tensors, logged) in enumerate(steps):
        batch, tensors = dict(batch), dict(tensors)  # the correction adds its own tensors
        batch_correction = {}
        if not correction.bypass_mode:
            unwrapped = accelerator.unwrap_model(model)
            batch_correction, _ = rc_train.decoupled_correction(args, correction, unwrapped, batch, tensors)
        step_metrics, actor, _ = rc_train.update_policy(
            args=args,
            correction=correction,
            learner=learner,
            batch=batch,
            tensors=tensors,
            generator=torch.Generator().manual_seed(args.seed * 7919 + step * 31),  # the trainer's minibatch order
            batch_correction=batch_correction,
        )
        mask = tensors["response_mask"]
        step_metrics.add(batch_correction, weight=float(mask.sum()))
        step_metrics.add({**logged, **actor}, weight=float(len(mask)))
        metrics = rc_run.reduce_metrics(step_metrics, learner.host)
        rows.append({**metrics, **health.check(step, metrics)})
    return rows


def test_preset_twins_build_the_same_config_and_the_rest_differ():
    import rc_config

    def built(preset):  # as rc_train.py builds --rc.preset PRESET
        return rc_config.build_correction_config(rc_config.CorrectionArgs(preset=preset))

    assert all(built(alias) == built(target) for alias, target in PRESET_TWINS.items())
    same = [(a, b) for i, a in enumerate(DISTINCT_PRESETS) for b in DISTINCT_PRESETS[:i] if built(a) == built(b)]
    assert same == []  # a new twin belongs in PRESET_TWINS
    assert set(PRESET_RUNS) <= set(DISTINCT_PRESETS)


@needs_minigsm_base
@pytest.mark.parametrize("preset", PRESET_RUNS)
def test_preset_runs_end_to_end(tmp_path, preset_batches, preset):
    rows, _ = run_train(tmp_path, *PRESET_FLAGS, "--rc.preset", preset)
    check_preset_metrics(preset, rows)
    # The in-process steps of test_every_preset_trains_on_a_real_batch are the script's: same batches, same metrics
    # (measured bit for bit on one thread; the tolerance allows another thread count's rounding)
    for logged, replayed in zip(rows, train_preset(preset_batches, preset), strict=True):
        assert replayed == pytest.approx({k: logged.get(k) for k in replayed}, rel=1e-3, abs=1e-6, nan_ok=True)


@needs_minigsm_base
@pytest.mark.parametrize("preset", DISTINCT_PRESETS)
def test_every_preset_trains_on_a_real_batch(preset_batches, preset):
    check_preset_metrics(preset, train_preset(preset_batches, preset))


# ---- 6. Bad configuration: a clear message, before any engine starts, nothing written --------------------
@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--rc.preset", "no_such_preset"], "no_such_preset"),
        (["--rc.preset", "decoupled_token_is", "--rc.rollout-is-threshold", "-1"], "-1"),
        (["--rc.preset", "decoupled_geo_rs", "--rc.rollout-rs", "seq_max_k1"], "seq_max_k1"),
        (["--task", "gsm8k", "--dataset", "/nonexistent/gsm8k.jsonl"], "/nonexistent/gsm8k.jsonl"),
        (["--max-model-len", "4"], "--max-model-len 4"),
        (["--max-model-len", "512", "--vllm-max-num-batched-tokens", "256"], "--vllm-max-num-batched-tokens 256"),
        (["--vllm-max-num-seqs", "0"], "--vllm-max-num-seqs"),
        (["--num-prompts-per-step", "0"], "--num-prompts-per-step"),
        (["--loss-agg-mode", "seq-mean"], "seq-mean"),
        (["--rollout-weight-noise", "-0.5"], "-0.5"),
        (["--rollout-temperature", "0"], "--rollout-temperature"),
        (["--rollout-corrupt-prob", "1.5"], "--rollout-corrupt-prob must be in [0, 1), got 1.5"),
        (["--max-tokens-per-micro-batch", "3"], "--max-tokens-per-micro-batch 3 is below the longest sequence"),
    ],
)
def test_bad_config_fails_before_engine(tmp_path, flags, needle):
    _, proc = run_train(tmp_path, *ADD, *flags, check=False, timeout=180)
    assert proc.returncode != 0
    assert "error" in proc.stderr and needle in proc.stderr, proc.stderr[-2000:]
    assert ENGINE_STARTED not in proc.stdout + proc.stderr and not engine_started(tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_bad_yaml_key_and_existing_run_are_refused(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_stepz: 3\n")
    _, proc = run_train(tmp_path, "--config", str(bad), check=False, timeout=180)
    assert proc.returncode != 0 and "num_stepz" in proc.stderr
    existing = tmp_path / "run"
    existing.mkdir()
    (existing / "metrics.jsonl").write_text('{"step": 0}\n')
    _, proc = run_train(tmp_path, *ADD, check=False, timeout=180)
    assert proc.returncode != 0 and "--overwrite" in proc.stderr
    assert (existing / "metrics.jsonl").read_text() == '{"step": 0}\n'


# ---- Issue 4: several processes, kill and resume, the GSM8K smoke run, malformed data ---------------------
LAUNCHERS = {  # two processes on this CPU machine; rc_train.py finds no GPU and runs them on gloo
    "torchrun": ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"],
    # the shipped Accelerate configs must start 2 processes here, like torchrun
    "accelerate": [
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        os.path.join(ROOT, "configs", "accelerate", "multi_cpu.yaml"),
    ],
    "accelerate-fsdp2": [
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        os.path.join(ROOT, "configs", "accelerate", "fsdp2.yaml"),
        "--num_processes",
        "2",
    ],
}


def launch(tmp_path, launcher, name, *flags, env=None, check=True):
    """rc_train.py in two processes; returns (metrics rows of the training steps, completed process)."""
    cmd = [
        sys.executable,
        *LAUNCHERS[launcher],
        os.path.join(ROOT, "rc_train.py"),
        "--output-dir",
        str(tmp_path),
        "--run-name",
        name,
        *flags,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env or train_env(tmp_path), timeout=600, cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"{launcher} rc_train.py failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    path = tmp_path / name / "metrics.jsonl"
    return ([r for r in read_jsonl(path) if r["step"] >= 0] if path.exists() else []), proc


# One uninterrupted two-process run per sharding, read by the replica check and by the kill-and-resume test as its
# reference. Responses of up to 3 tokens: shared prompts then take both passes, the prompt's through the inner module.
TWO_PROCESS_RUN = [
    *QUICK,
    "--num-steps",
    "4",
    "--checkpoint-every",
    "2",
    "--rc.preset",
    "decoupled_token_is",
    "--max-response-length",
    "3",
    "--log-rank-checksums",
]


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def two_process_run(request, tmp_path_factory):
    """TWO_PROCESS_RUN under torchrun, DDP or FSDP2, left alone: (its flags, its run folder, its metrics rows)."""
    flags = [*TWO_PROCESS_RUN, *(["--fsdp"] if request.param == "fsdp" else [])]
    tmp = tmp_path_factory.mktemp(f"two_{request.param}")
    rows, _ = launch(tmp, "torchrun", "reference", *flags)
    return flags, tmp / "reference", rows


def check_two_replicas(run_dir, steps: int, fsdp: bool) -> list[dict]:
    """Two ranks, every step: the same weights (replicas, or gathered shards), each its own samples, weights that
    change every step, the config of a 2-process gloo run. Returns the metrics rows."""
    ranks = [read_jsonl(run_dir / "ranks" / f"rank{r}.jsonl") for r in (0, 1)]
    assert [len(r) for r in ranks] == [steps, steps]
    for a, b in zip(*ranks):
        assert a["world_size"] == b["world_size"] == 2 and a["step"] == b["step"]
        assert a["weights_sha256"] == b["weights_sha256"], a["step"]  # the replicas (or gathered shards) agree
        assert a["rollout_sha256"] != b["rollout_sha256"], a["step"]  # each rank sampled its own shard
    assert len({r["weights_sha256"] for r in ranks[0]}) == steps  # and the weights did change every step
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(-1, steps))
    import yaml

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["world_size"] == 2 and config["distributed_type"] == "DistributedType.MULTI_CPU"
    assert config["args"]["fsdp"] == fsdp
    return rows


def test_two_processes_same_weights_different_samples(two_process_run):
    flags, run_dir, _ = two_process_run
    check_two_replicas(run_dir, 4, fsdp="--fsdp" in flags)


@pytest.mark.parametrize(
    "launcher, flags",
    [
        ("accelerate", ["--log-with", "tensorboard"]),
        ("accelerate-fsdp2", []),
        ("torchrun", ["--max-staleness", "1"]),
    ],
)
def test_two_processes_by_each_launcher(tmp_path, launcher, flags):
    """The shipped Accelerate configs and the asynchronous loop start two replicas like torchrun's DDP and FSDP2."""
    launch(
        tmp_path,
        launcher,
        "ddp",
        *QUICK,
        "--num-steps",
        "3",
        "--log-rank-checksums",
        "--rc.preset",
        "decoupled_token_is",
        "--max-response-length",
        "3",
        *flags,
    )
    rows = check_two_replicas(tmp_path / "ddp", 3, fsdp=launcher == "accelerate-fsdp2")
    if "--max-staleness" in flags:  # each rank's rollout worker follows the schedule
        assert [r["rollout/policy_version"] for r in rows[1:]] == [0, 0, 1]
    if "tensorboard" in flags:  # Accelerate's tracker: one event file, the main process's, with every step
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = list((tmp_path / "ddp").rglob("events.out.tfevents.*"))  # the scalars, and the config's hparams
        assert len({e.name.split(".")[-2] for e in events}) == 1, events  # all written by one process (its pid)
        scalars = [e for e in events if e.parent.name == "rollout-correction"]
        assert len(scalars) == 1, events
        acc = EventAccumulator(str(scalars[0]))
        acc.Reload()
        assert [e.step for e in acc.Scalars("reward/mean")] == [0, 1, 2]
        assert [e.value for e in acc.Scalars("reward/mean")] == pytest.approx([r["reward/mean"] for r in rows[1:]])


def test_fsdp2_matches_one_process(tmp_path):
    """Two FSDP2 processes and one unsharded process on the same batch: the same samples (rollout seeds follow the
    prompt, not the rank), so the same loss and gradient norm to float32 rounding, and the same weights after the
    optimizer step. One minibatch, so both split the batch into the same optimizer steps."""
    flags = [
        *ADD,
        "--num-prompts-per-step",
        "8",
        "--num-samples-per-prompt",
        "8",
        "--eval-limit",
        "10",
        "--num-steps",
        "1",
        "--num-minibatches",
        "1",
        "--ppo-epochs",
        "1",
        "--max-response-length",
        "3",
        "--rc.preset",
        "decoupled_token_is",
        "--kl-coef",
        "0.01",
    ]  # the pi_old pass and the reference model
    one, _ = run_train(tmp_path, *flags, name="one")
    two, _ = launch(tmp_path, "torchrun", "two", *flags, "--fsdp")
    a, b = one[0], two[0]
    for k in ("reward/mean", "response_length/mean", "rollout_corr/rollout_is_mean"):
        assert a[k] == pytest.approx(b[k], rel=1e-6), k  # the same responses and engine log-probs
    # pg_loss is ~0 at the first step (ratio 1, group-centred advantages) and k3_kl ~1e-14: their rounding is absolute
    for k, tol in (
        ("actor/grad_norm", 0),
        ("actor/entropy", 0),
        ("actor/pg_loss", 1e-7),
        ("rollout_corr/k3_kl", 1e-10),
        ("actor/kl_loss", 1e-10),
    ):  # KL to the reference model: 0 before the first step
        assert a[k] == pytest.approx(b[k], rel=1e-5, abs=tol), k
    from safetensors.torch import load_file

    w1, w2 = (load_file(tmp_path / n / "final" / "model.safetensors") for n in ("one", "two"))
    assert w1.keys() == w2.keys()
    diff = torch.cat([(w1[k] - w2[k]).abs().flatten() for k in w1])
    # AdamW's first step is lr * g / (|g| + eps): where |g| is near eps (1e-8), a float32 rounding of g moves that
    # weight by up to lr * dg / eps (measured: 2.2e-6 at most, 0.02 % of weights beyond 1e-7, at lr 5e-4). Every
    # other weight takes the same step: the agreement is 1 % of one step, and exact almost everywhere.
    assert diff.max() < 0.01 * 5e-4 and (diff > 1e-7).float().mean() < 0.005, (diff.max(), (diff > 1e-7).float().mean())


def test_two_processes_sigkill_during_checkpoint_then_resume(tmp_path, two_process_run):
    """Rank 0 is killed inside the step-3 checkpoint (after the model and optimizer shards, before trainer_state.json):
    --resume loads step 1 and reproduces the uninterrupted run exactly, every rank's RNG and shard included."""
    flags, _, reference = two_process_run
    _, killed = launch(
        tmp_path,
        "torchrun",
        "killed",
        *flags,
        check=False,
        env={**train_env(tmp_path), "RC_TRAIN_KILL_IN_CHECKPOINT": "3"},
    )
    assert killed.returncode != 0
    assert sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir()) == ["step_000001", "step_000003.tmp"]
    rows, out = launch(tmp_path, "torchrun", "killed", *flags, "--resume")
    assert "resumed from" in out.stdout + out.stderr and "step_000001" in out.stdout + out.stderr
    assert [r["step"] for r in rows] == list(range(4))
    for a, b in zip(rows, reference):
        assert _same_metrics(a, b), (a["step"], {k: (a[k], b[k]) for k in a if k in b and a[k] != b[k]})


def _same_metrics(a, b):
    def timed(k):  # wall-clock figures: timing/* and rates such as perf/train_tokens_per_s
        return k.startswith("timing/") or k.endswith("_per_s")

    keys = {k for k in a if not timed(k)}
    assert keys == {k for k in b if not timed(k)}
    return all(a[k] == b[k] or (a[k] != a[k] and b[k] != b[k]) for k in keys)  # NaN == NaN here


KILLED_RUN = [*QUICK, "--num-steps", "6", "--checkpoint-every", "2", "--rc.preset", "decoupled_token_is"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The metrics rows of KILLED_RUN left alone: the reference of both kills."""
    rows, _ = run_train(tmp_path_factory.mktemp("uninterrupted"), *KILLED_RUN, name="reference")
    return rows


@pytest.mark.parametrize("kill", ["between_checkpoints", "during_checkpoint"])
def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path, uninterrupted, kill):
    import signal
    import time

    flags, reference = KILLED_RUN, uninterrupted
    env = train_env(tmp_path)
    if kill == "during_checkpoint":
        env["RC_TRAIN_KILL_IN_CHECKPOINT"] = "3"  # the process SIGKILLs itself inside the step-3 checkpoint
    cmd = [
        sys.executable,
        os.path.join(ROOT, "rc_train.py"),
        "--output-dir",
        str(tmp_path),
        "--run-name",
        "killed",
        *flags,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=ROOT)
    metrics = tmp_path / "killed" / "metrics.jsonl"
    if kill == "between_checkpoints":  # after step 2 is logged: step_000001 is complete, step_000003 not begun
        deadline = time.time() + 300  # 4 lines: the evaluation before training (step -1), then steps 0, 1, 2
        while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 4):
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=300)
    assert proc.returncode == -signal.SIGKILL
    ckpts = sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir())
    if kill == "during_checkpoint":
        assert ckpts == ["step_000001", "step_000003.tmp"]  # the half-written one is left as .tmp
    rows, out = run_train(tmp_path, *flags, "--resume", name="killed")
    assert "resumed from" in out.stdout + out.stderr and "step_000001" in out.stdout + out.stderr
    assert [r["step"] for r in rows] == list(range(6))
    for a, b in zip(rows, reference):
        assert _same_metrics(a, b), (a["step"], {k: (a[k], b[k]) for k in a if k in b and a[k] != b[k]})


# ---- Asynchronous rollout (--max-staleness k): a rollout worker process, every batch tagged by its version ----
def test_bound_zero_in_the_rollout_worker_is_the_synchronous_loop(tmp_path):
    """k = 0 through the worker process (queues, weights in shared memory, an engine of its own) gives the in-process
    loop's samples, metrics, evaluations and final weights bit for bit. A weight dial and three evaluations exercise
    every kind of load: perturbed weights, the unperturbed ones for evaluation, the perturbed ones back."""
    flags = [f for f in QUICK if f != "--no-save-final"] + [
        "--num-steps",
        "4",
        "--max-response-length",
        "3",
        "--eval-every",
        "2",
        "--rollout-weight-noise",
        "0.3",
        "--rc.preset",
        "decoupled_token_is",
    ]
    run_train(tmp_path, *flags, name="local")
    run_train(tmp_path, *flags, "--rollout-worker", name="worker")
    local, worker = (read_jsonl(tmp_path / n / "metrics.jsonl") for n in ("local", "worker"))
    assert [r["step"] for r in worker] == [-1, 0, 1, 2, 3] and "eval/accuracy_strict" in worker[2]
    for a, b in zip(local, worker):
        assert _same_metrics(a, b), (a["step"], {k: (a[k], b[k]) for k in a if k in b and a[k] != b[k]})
    assert [r["rollout/policy_version"] for r in worker[1:]] == [0, 1, 2, 3]  # every batch from the current version
    assert all(r["rollout/staleness_max"] == 0 and r["rollout/dropped_samples"] == 0 for r in worker[1:])
    assert (tmp_path / "local" / "eval_samples.jsonl").read_text() == (
        tmp_path / "worker" / "eval_samples.jsonl"
    ).read_text()
    final = [(tmp_path / n / "final" / "model.safetensors").read_bytes() for n in ("local", "worker")]
    assert final[0] == final[1]


# k = 2 with a checkpoint every 2 steps, read by the schedule test and by the kill-and-resume test as its reference;
# --mismatch-split (diagnostic only) puts the weights kept by version into the checkpoints the resume reads.
STALE_RUN = [
    *QUICK,
    "--num-steps",
    "6",
    "--checkpoint-every",
    "2",
    "--max-staleness",
    "2",
    "--max-response-length",
    "3",
    "--learning-rate",
    "5e-3",
    "--rc.preset",
    "decoupled_token_is",
    "--mismatch-split",
]


@pytest.fixture(scope="module")
def stale_run(tmp_path_factory):
    """The metrics rows of STALE_RUN left alone."""
    rows, _ = run_train(tmp_path_factory.mktemp("stale"), *STALE_RUN, name="reference")
    return rows


def test_staleness_follows_the_schedule_and_is_deterministic(tmp_path, stale_run):
    """k = 2: the batch of step t comes from version max(0, t - 2), whatever the timing (two runs agree exactly), no
    sample is beyond the bound, and the decoupled correction sees the lag: alpha_1 (pi_old recomputed vs mu) is
    rounding noise while the engine holds the trainer's weights (step 0) and clearly not afterwards."""
    rows = stale_run
    again, _ = run_train(tmp_path, *STALE_RUN, name="again")
    assert [r["rollout/policy_version"] for r in rows] == [0, 0, 0, 1, 2, 3]
    assert (
        [r["rollout/staleness_max"] for r in rows] == [r["rollout/staleness_mean"] for r in rows] == [0, 1, 2, 2, 2, 2]
    )
    assert all(r["rollout/dropped_samples"] == 0 for r in rows)
    assert [r["actor/sync_count"] for r in rows] == [1, 2, 3, 4, 5, 6]  # one load per update
    k3 = [r["rollout_corr/k3_kl"] for r in rows]
    assert k3[0] < 1e-6 and min(k3[1:]) > 1e-4, k3
    # the split (corrections §6.9): the fp32 engine holds the trainer's weights, so all of it is staleness, and the
    # two parts' log-ratios add up to today's total, -rollout_corr/kl = <log pi_old - log mu>
    for r in rows:
        assert abs(r["rollout_corr/numerics_log_ratio"]) < 1e-6 and r["rollout_corr/numerics_tv"] < 1e-4, r["step"]
        total = r["rollout_corr/numerics_log_ratio"] + r["rollout_corr/staleness_log_ratio"]
        assert total == pytest.approx(-r["rollout_corr/kl"], rel=1e-6, abs=1e-7), r["step"]  # float32 sums
        assert r["rollout_corr/tv_mismatch"] <= r["rollout_corr/numerics_tv"] + r["rollout_corr/staleness_tv"] + 1e-9
    assert [r["perf/kept_versions"] for r in rows] == [1, 2, 3, 3, 3, 3]  # versions t - 2 .. t
    assert all(r["timing/rollout_wait_s"] >= 0 and r["timing/engine_idle_s"] >= 0 for r in rows)
    for a, b in zip(rows, again):
        assert _same_metrics(a, b), (a["step"], {k: (a[k], b[k]) for k in a if k in b and a[k] != b[k]})


def test_resume_with_staleness_continues_exactly(tmp_path, stale_run):
    """k = 2, killed inside the step-3 checkpoint: the rollout worker exits by itself, the step-1 checkpoint holds the
    batches of steps 2 and 3, already sampled by versions 0 and 1; --resume trains on them and reproduces the
    uninterrupted run exactly. Resuming with another bound is refused before the engine starts."""
    import time

    flags, reference = STALE_RUN, stale_run
    env = {**train_env(tmp_path), "RC_TRAIN_KILL_IN_CHECKPOINT": "3"}
    proc = subprocess.Popen(
        [
            sys.executable,
            os.path.join(ROOT, "rc_train.py"),
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "killed",
            *flags,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        cwd=ROOT,
    )
    children = set()  # the rollout worker: a child of the trainer (Linux lists children under /proc)
    while proc.poll() is None:
        for task in (f"/proc/{proc.pid}/task/{t}/children" for t in os.listdir(f"/proc/{proc.pid}/task")):
            try:
                children.update(int(c) for c in open(task).read().split())
            except (FileNotFoundError, ProcessLookupError):
                pass
        time.sleep(0.05)
    assert proc.returncode != 0 and children

    def alive(pid):  # an exited child that nobody reaped yet is a zombie ('Z'): gone
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.time() + 10  # the worker notices that its trainer died (SIGKILL: no word) and exits
    while time.time() < deadline and any(map(alive, children)):
        time.sleep(0.1)
    assert not [c for c in children if alive(c)]
    ckpt = tmp_path / "killed" / "checkpoints" / "step_000001"
    in_flight = torch.load(ckpt / "in_flight_rank0.pt", weights_only=False)
    assert sorted(in_flight) == [2, 3] and [in_flight[t][0] for t in (2, 3)] == [0, 1]  # (version, groups, ...)
    _, refused = run_train(
        tmp_path, *[f if f != "2" else "1" for f in flags], "--resume", name="killed", check=False, timeout=120
    )
    assert refused.returncode != 0 and "--max-staleness 2, this run has --max-staleness 1" in refused.stderr
    rows, out = run_train(tmp_path, *flags, "--resume", name="killed")
    assert "step_000001" in out.stdout + out.stderr
    assert [r["step"] for r in rows] == list(range(6))
    for a, b in zip(rows, reference):
        assert _same_metrics(a, b), (a["step"], {k: (a[k], b[k]) for k in a if k in b and a[k] != b[k]})


# --partial-rollout (docs/async.md §9): 16-token answers of the untrained tiny model, 3 tokens a round, so most
# responses span two versions; a checkpoint every 2 steps.
PARTIAL_RUN = [*QUICK, "--num-steps", "5", "--checkpoint-every", "2", "--max-response-length", "16"]
PARTIAL_RUN += ["--partial-rollout", "--partial-rollout-tokens", "3", "--rc.preset", "decoupled_token_is"]


@pytest.mark.parametrize("k", [0, 1])
def test_partial_rollouts_span_versions_and_resume_exactly(tmp_path, k):
    """k = 0 (the engine in this process) and k = 1 (the rollout worker): responses carry tokens of two versions, each
    with its own log mu, and a run killed inside the step-3 checkpoint resumes from step 1, with the unfinished
    responses of that checkpoint in flight, and reproduces the uninterrupted run exactly."""
    flags = [*PARTIAL_RUN, "--max-staleness", str(k)]
    reference, _ = run_train(tmp_path, *flags, name="reference")
    assert max(r["rollout/spanning_responses"] for r in reference) > 0.5
    assert max(r["rollout/versions_per_response"] for r in reference) > 1.5
    assert max(r["rollout/token_staleness_max"] for r in reference) == k + 1  # the bound's default: k + 1
    assert all(r["rollout/masked_stale_tokens"] == r["rollout/dropped_samples"] == 0 for r in reference)
    env = {**train_env(tmp_path), "RC_TRAIN_KILL_IN_CHECKPOINT": "3"}
    cmd = [sys.executable, os.path.join(ROOT, "rc_train.py"), "--output-dir", str(tmp_path), "--run-name", "killed"]
    killed = subprocess.run([*cmd, *flags], capture_output=True, env=env, cwd=ROOT, timeout=600)
    assert killed.returncode != 0
    carried_file = tmp_path / "killed" / "checkpoints" / "step_000001" / "partial_rank0.pt"
    carried = torch.load(carried_file, weights_only=False)
    assert any(0 < len(r[0]) for g in carried for r in g[3] if not r[3])  # prefixes in flight
    in_flight = torch.load(carried_file.parent / "in_flight_rank0.pt", weights_only=False)
    assert len(in_flight) == k and all(r.carried is None for r in in_flight.values())  # saved once: partial_rank0.pt
    rows, out = run_train(tmp_path, *flags, "--resume", name="killed")
    assert "step_000001" in out.stdout + out.stderr and [r["step"] for r in rows] == list(range(5))
    for a, b in zip(rows, reference):
        assert _same_metrics(a, b), (a["step"], {k: (a[k], b[k]) for k in a if k in b and a[k] != b[k]})
    _, refused = run_train(tmp_path, *flags, "--partial-rollout-tokens", "4", "--resume", name="killed", check=False)
    assert refused.returncode != 0 and "--partial-rollout-tokens is 3 in the checkpoint, 4 now" in refused.stderr


@needs_local_gsm8k
def test_gsm8k_smoke_config_on_the_real_files(tmp_path):
    rows, _ = run_train(tmp_path, "--config", os.path.join(ROOT, "configs", "cpu_gsm8k_smoke.yaml"), "--no-save-final")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert {"eval/accuracy_strict", "eval/accuracy_flexible"} <= set(rows[1]) and "eval/accuracy_strict" in rows[2]
    samples = read_jsonl(tmp_path / "run" / "eval_samples.jsonl")
    assert samples and {"question", "gold", "response"} <= set(samples[0])
    import yaml

    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert config["train_rows"] == 7473 and config["train_rows_skipped"] == 0


def test_malformed_gsm8k_rows_are_counted_and_an_all_bad_file_fails(tmp_path):
    data = tmp_path / "bad.jsonl"
    good = [{"question": f"What is {i} plus 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(6)]
    bad = [{"question": "no answer field"}, {"question": "q", "answer": "#### seven"}, {"answer": "#### 3"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in good + bad))
    flags = [
        "--task",
        "gsm8k",
        "--dataset",
        str(data),
        "--num-steps",
        "1",
        "--num-prompts-per-step",
        "2",
        "--num-samples-per-prompt",
        "2",
        "--max-response-length",
        "8",
        "--eval-limit",
        "2",
        "--no-save-final",
    ]
    rows, proc = run_train(tmp_path, *flags)
    import yaml

    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert config["train_rows"] == 6 and config["train_rows_skipped"] == 3 and len(rows) == 1
    assert "skipped 3" in proc.stderr.lower() or "3 of 9" in proc.stderr, proc.stderr[-2000:]
    data.write_text("".join(json.dumps(r) + "\n" for r in bad))
    _, proc = run_train(tmp_path, *flags, name="all_bad", check=False, timeout=180)
    assert proc.returncode != 0 and "error" in proc.stderr and str(data) in proc.stderr, proc.stderr[-2000:]
    assert ENGINE_STARTED not in proc.stdout + proc.stderr and not engine_started(tmp_path / "all_bad")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    _, proc = run_train(
        tmp_path, *[f if f != str(data) else str(empty) for f in flags], name="empty", check=False, timeout=180
    )
    assert proc.returncode != 0 and "empty" in proc.stderr and not engine_started(tmp_path / "empty")


def test_final_weights_load_in_transformers_and_vllm(tmp_path):
    flags = [f for f in QUICK if f != "--no-save-final"]
    run_train(tmp_path, *flags, "--num-steps", "3", "--log-rank-checksums", "--learning-rate", "5e-3")
    final = tmp_path / "run" / "final"
    trained_sha = read_jsonl(tmp_path / "run" / "ranks" / "rank0.jsonl")[-1]["weights_sha256"]
    samples = [s for s in read_jsonl(tmp_path / "run" / "eval_samples.jsonl") if s["step"] == 2]
    assert len(samples) == 10  # every evaluated problem
    script = f"""
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"; os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
sys.path.insert(0, {ROOT!r})
import rc_config
import rc_rollout
import rc_run
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(final)!r})
sha = rc_run.weights_sha256(model.state_dict().items())  # the fingerprint --log-rank-checksums writes
from vllm import LLM, SamplingParams
llm = LLM(model={str(final)!r}, dtype="float32", enforce_eager=True, max_model_len=64)
outs = llm.generate({[s["question"] for s in samples]!r}, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
print("RESULT", json.dumps({{"sha": sha, "responses": [o.outputs[0].text for o in outs]}}))
"""
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert result["sha"] == trained_sha  # transformers loads exactly the trainer's last weights
    assert result["responses"] == [s["response"] for s in samples]  # vLLM loads them too: same greedy answers


def test_the_engines_process_group_is_torn_down_at_world_1(tmp_path):
    """At world 1 vLLM's CPU build creates torch.distributed's default group itself (measured: gloo, world 1, its
    store a file in the temp folder). Closing the engine tears it down, with vLLM's own shutdown
    (rc_rollout.shutdown_engine); the process then exits with nothing left: no traceback from vLLM's exit
    finalizer, the store's file removed."""
    script = f"""
import os, sys, types
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"; os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
sys.path.insert(0, {ROOT!r})
import torch.distributed as dist
import rc_rollout, rc_run, rc_train, tasks
args = rc_train.load_yaml_defaults({os.path.join(ROOT, "configs", "cpu_add.yaml")!r})
path = tasks.base_model_path(tasks.make_task(args.task), args.mini, args.seed, None)
accelerator = types.SimpleNamespace(process_index=0, num_processes=1, local_process_index=0)
engine = rc_rollout.make_engine(args, path, {str(tmp_path)!r}, [[1] * 8], accelerator)
print("STARTED", dist.is_initialized() and (dist.get_world_size(), dist.get_backend()), flush=True)
engine.close()
print("CLOSED", dist.is_initialized(), flush=True)
rc_run.exit_cleanly(1)
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=train_env(tmp_path), cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "STARTED (1, 'gloo')" in proc.stdout and "CLOSED False" in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    store = re.search(r"distributed_init_method=file://(\S+)", (tmp_path / "engine.log").read_text()).group(1)
    assert not os.path.exists(store)


# ---- GSM8K-length prompts at a realistic batch: no split prefill, reproducible samples ----------------------
@needs_local_gsm8k
def test_gsm8k_length_prompts_at_32x8_are_reproducible(tmp_path):
    flags = [
        "--config",
        os.path.join(ROOT, "configs", "cpu_gsm8k_smoke.yaml"),
        "--num-prompts-per-step",
        "32",
        "--num-samples-per-prompt",
        "8",
        "--num-steps",
        "1",
        "--no-eval-before",
        "--eval-limit",
        "4",
        "--ppo-epochs",
        "1",
        "--num-minibatches",
        "1",
        "--log-rank-checksums",
        "--no-save-final",
    ]
    first, _ = run_train(tmp_path, *flags, name="a")
    second, _ = run_train(tmp_path, *flags, name="b")
    assert first[0]["timing/rollout_s"] < 60, first[0]["timing/rollout_s"]  # measured: ~2.4 s for 256 responses
    assert first[0]["response_length/mean"] > 8
    sha = [read_jsonl(tmp_path / n / "ranks" / "rank0.jsonl")[0]["rollout_sha256"] for n in ("a", "b")]
    assert sha[0] == sha[1]  # same seed, same samples
    assert first[0]["reward/mean"] == second[0]["reward/mean"]
    config = (tmp_path / "a" / "engine.log").read_text()
    assert "CPU Generator does not use offset" not in config


def test_engine_limits_never_split_a_prefill_on_cpu():
    import rc_rollout
    import rc_train

    args = rc_train.Args(num_prompts_per_step=32, num_samples_per_prompt=8, max_model_len=1024)
    cpu = rc_rollout.engine_limits(args, world=1, longest_prompt=140, on_gpu=False)
    assert cpu["enable_chunked_prefill"] is False and cpu["max_num_seqs"] == 256
    assert cpu["max_num_batched_tokens"] == 32 * 8 * 140  # the whole batch's prefill in one engine step
    assert rc_rollout.engine_limits(args, world=2, longest_prompt=140, on_gpu=False)["max_num_seqs"] == 128
    small = rc_rollout.engine_limits(
        rc_train.Args(num_prompts_per_step=1, num_samples_per_prompt=1, max_model_len=512),
        world=1,
        longest_prompt=10,
        on_gpu=False,
    )
    assert small["max_num_batched_tokens"] == 512  # never below the longest sequence
    huge = rc_rollout.engine_limits(rc_train.Args(num_prompts_per_step=512, num_samples_per_prompt=64), 1, 500, False)
    assert huge["max_num_batched_tokens"] == 65536
    gpu = rc_rollout.engine_limits(args, world=1, longest_prompt=140, on_gpu=True)
    assert gpu == {"max_num_seqs": 256}  # GPU: vLLM's own token budget and chunked prefill
    custom = rc_train.Args(vllm_max_num_seqs=64, vllm_max_num_batched_tokens=4096)
    assert rc_rollout.engine_limits(custom, 1, 140, False) == {
        "max_num_seqs": 64,
        "max_num_batched_tokens": 4096,
        "enable_chunked_prefill": False,
    }


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--task", "nope"], "'nope'"),
        (["--task", "minigsm", "--mini.max-steps", "0"], "--mini.max-steps must be in 1..8, got 0"),
        (["--task", "minigsm", "--mini.operand-max", "1"], "--mini.operand-max must be >= 2"),
        (["--task", "minigsm", "--mini.operand-max", "2", "--mini.max-steps", "1"], "cannot produce"),
        (["--task", "minigsm", "--max-model-len", "96", "--max-response-length", "64"], "--max-model-len 96"),
    ],
)
def test_bad_task_settings_fail_before_engine(tmp_path, flags, needle):
    existing = tmp_path / "run"
    existing.mkdir()
    (existing / "metrics.jsonl").write_text('{"step": 0}\n')
    _, proc = run_train(tmp_path, *flags, "--overwrite", check=False, timeout=900)
    assert proc.returncode != 0 and "error" in proc.stderr and needle in proc.stderr, proc.stderr[-2000:]
    assert not engine_started(existing)
    assert (existing / "metrics.jsonl").read_text() == '{"step": 0}\n'  # nothing in the run folder is lost


def test_cpu_demo_config_spells_out_the_defaults():
    import dataclasses

    import rc_train

    spelled = rc_train.load_yaml_defaults(os.path.join(ROOT, "configs", "cpu_demo.yaml"))
    assert dataclasses.replace(spelled, config=None) == rc_train.Args()


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--rc.preset", "decoupled_token_is", "--rc.rollout-is-threshold", "3"], {"rollout_is_threshold": 3.0}),
        (
            ["--rc.preset", "decoupled_token_is", "--rc.rollout-is-threshold", "0.5_5"],
            {"rollout_is_threshold": "0.5_5"},
        ),
        (
            ["--rc.preset", "decoupled_geo_rs", "--rc.rollout-rs-threshold", "0.999_1.001"],
            {"rollout_rs_threshold": "0.999_1.001"},
        ),
        (["--rc.preset", "decoupled_token_is", "--rc.rollout-is", "none"], {"rollout_is": None}),
        (["--rc.preset", "decoupled_seq_is_rs", "--rc.rollout-rs", "none"], {"rollout_rs": None}),
        (
            ["--config", os.path.join(ROOT, "configs", "gsm8k_qwen0.5b_geo_rs.yaml")],
            {"rollout_token_veto_threshold": 1e-4},
        ),
        (
            [
                "--config",
                os.path.join(ROOT, "configs", "gsm8k_qwen0.5b_geo_rs.yaml"),
                "--rc.rollout-token-veto-threshold",
                "none",
            ],
            {"rollout_token_veto_threshold": None},
        ),
    ],
)
def test_correction_flags_reach_the_config_with_their_types(monkeypatch, flags, expected):
    import rc_config
    import rc_train

    monkeypatch.setattr(sys, "argv", ["rc_train.py", *flags])
    config = rc_config.build_correction_config(rc_config.parse_cli(rc_train.Args, rc_train.load_yaml_defaults).rc)
    for name, value in expected.items():
        assert getattr(config, name) == value and type(getattr(config, name)) is type(value), (name, config)
    if flags[-1] == "0.5_5":
        assert (config.is_spec.mode, config.is_spec.lower, config.is_spec.upper) == ("icepop", 0.5, 5.0)
