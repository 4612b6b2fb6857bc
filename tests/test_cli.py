"""Every flag and YAML key of rc_train.py refuses a value that cannot work, with one line naming the flag and the
value, before the engine starts (rc_config.validate_args; the task settings in tasks.check_mini_args).

Unit tests call validate_args on an Args with one bad value (milliseconds each); one subprocess test checks that
the real script stops before its engine and writes nothing.
"""

import dataclasses
import glob
import os
import subprocess
import sys

import pytest

import rc_config
import rc_train
import tasks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
INF, NAN = float("inf"), float("nan")


def refused(args: rc_train.Args, world_size: int = 1) -> str:
    with pytest.raises(ValueError) as info:
        rc_config.validate_args(args, world_size=world_size)
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def with_(**changes) -> rc_train.Args:
    return dataclasses.replace(rc_train.Args(), **changes)


# ---- one bad value each: the message names the flag and the value -------------------------------------------
BAD = [
    # (changes, flag, value as it appears in the message)
    (dict(num_samples_per_prompt=1), "--num-samples-per-prompt", "got 1"),
    (dict(num_samples_per_prompt=0), "--num-samples-per-prompt", "got 0"),
    (dict(model="/path/that/does/not/exist"), "--model", "/path/that/does/not/exist"),
    (dict(model="./no_such_model"), "--model", "./no_such_model"),
    (dict(model="~/no_such_model_here"), "--model", "~/no_such_model_here"),
    (dict(model="org/name/extra"), "--model", "org/name/extra"),
    (dict(model=""), "--model", "''"),
    (dict(train_dtype="float16"), "--train-dtype", "float16"),
    (dict(eval_every=-1), "--eval-every", "got -1"),
    (dict(checkpoint_every=-5), "--checkpoint-every", "got -5"),
    (dict(keep_checkpoints=0), "--keep-checkpoints", "got 0"),
    (dict(warmup_steps=-1), "--warmup-steps", "got -1"),
    (dict(weight_decay=-0.1), "--weight-decay", "got -0.1"),
    (dict(weight_decay=NAN), "--weight-decay", "got nan"),
    (dict(weight_decay=INF), "--weight-decay", "got inf"),
    (dict(learning_rate=INF), "--learning-rate", "got inf"),
    (dict(learning_rate=NAN), "--learning-rate", "got nan"),
    (dict(kl_coef=INF), "--kl-coef", "got inf"),
    (dict(format_bonus=INF), "--format-bonus", "got inf"),
    (dict(vllm_gpu_memory_utilization=0.0), "--vllm-gpu-memory-utilization", "got 0.0"),
    (dict(vllm_gpu_memory_utilization=1.5), "--vllm-gpu-memory-utilization", "got 1.5"),
    (dict(vllm_gpu_memory_utilization=NAN), "--vllm-gpu-memory-utilization", "got nan"),
    (dict(vllm_kv_cache_gb=0.0), "--vllm-kv-cache-gb", "got 0.0"),
    (dict(vllm_kv_cache_gb=-1.0), "--vllm-kv-cache-gb", "got -1.0"),
    (dict(vllm_kv_cache_gb=INF), "--vllm-kv-cache-gb", "got inf"),
    (dict(vllm_max_num_batched_tokens=0), "--vllm-max-num-batched-tokens", "got 0"),
    (dict(train_limit=0), "--train-limit", "got 0"),
    (dict(train_limit=-3), "--train-limit", "got -3"),
    (dict(eval_limit=0), "--eval-limit", "got 0"),
    (dict(max_model_len=0), "--max-model-len", "got 0"),
    (dict(max_model_len=64, max_response_length=64), "--max-model-len", "got 64"),
    (dict(max_staleness=-1), "--max-staleness", "got -1"),
    (dict(max_staleness=1, sync_every=2), "--max-staleness 1", "--sync-every 2"),
    (dict(max_staleness=2, sync_every=0), "--max-staleness 2", "--sync-every 0"),
    (dict(rollout_worker=True, sync_every=3, max_staleness=0), "--max-staleness 0", "--sync-every 3"),
    (dict(seed=-1), "--seed", "got -1"),
    (dict(seed=2**32), "--seed", f"got {2**32}"),
    (dict(exp_name=""), "--exp-name", "''"),
    (dict(exp_name="a/b"), "--exp-name", "'a/b'"),
    (dict(run_name=""), "--run-name", "''"),
    (dict(run_name="sweep/seed1"), "--run-name", "'sweep/seed1'"),
    (dict(run_name=".."), "--run-name", "'..'"),
    (dict(resume=True), "--resume", "--run-name"),
    (dict(log_with=["wandbb"]), "--log-with", "'wandbb'"),
    (dict(clip_ratio=1.5), "--clip-ratio", "1.5"),  # rc_core's check; the message says where the value came from
    # an unknown name is no README "Fork it" recipe's (rloo, countdown, ...): a fork that applies them stays green
    (dict(adv_estimator="no-such-estimator"), "--adv-estimator", "'no-such-estimator'"),
    # YAML values reach the fields untyped: the type is checked too
    (dict(num_steps="ten"), "--num-steps", "'ten'"),
    (dict(learning_rate="1e-4x"), "--learning-rate", "'1e-4x'"),
    (dict(learning_rate=True), "--learning-rate", "True"),
    (dict(reward_mode="strik"), "--reward-mode", "'strik'"),
    (dict(task="add", reward_mode="correct"), "--reward-mode", "'correct'"),  # a score key of another task
    (dict(task="no-such-task"), "--task", "'no-such-task'"),  # not registered in tasks.TASKS
    (dict(rollout_dtype="float8"), "--rollout-dtype", "'float8'"),
    (dict(rollout_weight_quant="int2"), "--rollout-weight-quant", "'int2'"),
    (dict(overwrite="yes"), "--overwrite", "'yes'"),
    (dict(eval_limit="all"), "--eval-limit", "'all'"),
    (dict(model=5), "--model", "got 5"),
    (dict(log_with="wandb"), "--log-with", "'wandb'"),
    (dict(mini=tasks.MiniGSMArgs(max_steps="3")), "--mini.max-steps", "'3'"),
    (dict(mini=tasks.MiniGSMArgs(sft_learning_rate="fast")), "--mini.sft-learning-rate", "'fast'"),
    (dict(compile=True, fsdp=True), "--compile", "--fsdp"),  # FSDP2's hooks inside compiled layers: not verified
    (dict(compile=True, routing_metrics=True), "--compile", "--routing-metrics"),  # the router hooks
    (dict(compile="yes"), "--compile", "'yes'"),
]


@pytest.mark.parametrize("changes, flag, value", BAD, ids=[f"{flag} {value}" for _, flag, value in BAD])
def test_bad_value_is_refused_naming_flag_and_value(changes, flag, value):
    message = refused(with_(**changes))
    assert flag in message and value in message, message


def test_group_of_one_says_why():
    message = refused(with_(num_samples_per_prompt=1))
    assert "GRPO group" in message and "baseline" in message


def test_train_float16_suggests_bfloat16_or_float32():
    message = refused(with_(train_dtype="float16"))
    assert "use bfloat16 (no scaler needed) or float32" in message and "scaler" in message


def test_paths_that_exist_but_cannot_work(tmp_path):
    a_file = tmp_path / "weights.bin"
    a_file.write_text("x")
    assert "a file, not a folder" in refused(with_(model=str(a_file)))
    assert "--output-dir" in refused(with_(output_dir=str(a_file)))
    message = refused(with_(output_dir=str(a_file / "sub")))  # cannot be created under a file
    assert "--output-dir" in message and str(a_file / "sub") in message
    (tmp_path / "run").write_text("x")
    message = refused(with_(output_dir=str(tmp_path), run_name="run"))
    assert "--run-name" in message and "'run'" in message


def test_seed_range_depends_on_world_size():
    rc_config.validate_args(with_(seed=2**32 - 2, num_prompts_per_step=32), world_size=2)
    assert "--seed" in refused(with_(seed=2**32 - 1, num_prompts_per_step=32), world_size=2)


def test_tracker_whose_package_is_missing_is_refused():
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers

    installed = {str(getattr(t, "value", t)) for t in get_available_trackers()}
    missing = sorted(set(LOGGER_TYPE_TO_CLASS) - installed)
    if not missing:
        pytest.skip("every Accelerate tracker is installed here")
    message = refused(with_(log_with=[missing[0]]))
    assert f"--log-with {missing[0]}" in message and "not installed" in message


def test_bad_yaml_values_name_the_key(tmp_path):
    for text, flag, value in [
        ("num_steps: ten\n", "--num-steps", "'ten'"),
        ("reward_mode: strik\n", "--reward-mode", "'strik'"),
        ("learning_rate: .inf\n", "--learning-rate", "inf"),
        ("eval_every: -1\n", "--eval-every", "-1"),
        ("num_samples_per_prompt: 1\n", "--num-samples-per-prompt", "1"),
        ("vllm_sleep_level: 1.0\n", "--vllm-sleep-level", "1.0"),
        ("adv_estimator: ppo\n", "--adv-estimator", "'ppo'"),
        ("mini:\n  max_steps: '3'\n", "--mini.max-steps", "'3'"),
    ]:
        path = tmp_path / "bad.yaml"
        path.write_text(text)
        message = refused(rc_train.load_yaml_defaults(str(path)))
        assert flag in message and value in message, (text, message)


def cli_refusal(monkeypatch, capsys, *argv) -> str:
    """rc_train.py's command line parsed (rc_config.parse_cli) and refused: the one line it exits with."""
    monkeypatch.setattr(sys, "argv", ["rc_train.py", *argv])
    with pytest.raises(SystemExit) as info:
        rc_config.parse_cli(rc_train.Args, rc_train.load_yaml_defaults)
    message = str(info.value.code)
    assert message.startswith("rc_train.py: error: ") and "\n" not in message, message
    assert capsys.readouterr().err == ""  # nothing of tyro's
    return message


@pytest.mark.parametrize(
    "text, flags, needle",
    [
        ("eval_before: maybe\n", ["--no-eval-before"], "eval_before must be true or false, got 'maybe'"),
        ("num_steps: ten\n", ["--num-steps", "3"], "num_steps must be an integer, got 'ten'"),
        ("rc:\n  bypass_mode: maybe\n", ["--rc.bypass-mode", "True"], "rc.bypass_mode must be true or false"),
        ("mini:\n  max_steps: '3'\n", [], "mini.max_steps must be an integer, got '3'"),
    ],
    ids=["bool-over-flag", "int-over-flag", "nested", "mini"],
)
def test_bad_yaml_value_is_refused_even_under_a_flag(tmp_path, monkeypatch, capsys, text, flags, needle):
    """A YAML value of the wrong type is one line naming the file, the key and the value, before tyro, even where a
    flag overrides it (today: `eval_before: maybe` with --no-eval-before got tyro's box 'Unrecognized options:
    --no-eval-before', and `num_steps: ten` with --num-steps 3 ran, after a tyro warning)."""
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    message = cli_refusal(monkeypatch, capsys, "--config", str(path), *flags)
    assert f"config {str(path)!r}: {needle}" in message, message


@pytest.mark.parametrize(
    "text, needle",
    [
        ("num_steps: 10\nseed: 1\nnum_steps: 20\n", "num_steps is given twice: 10 (line 1) and 20 (line 3)"),
        (
            "rc:\n  preset: bypass_ppo_clip\n  preset: disabled\n",
            "rc.preset is given twice: bypass_ppo_clip (line 2) and disabled (line 3)",
        ),
        ("rc:\n  preset: disabled\nseed: 1\nrc:\n  bypass_mode: true\n", "rc is given twice: a mapping (line 2) and"),
    ],
    ids=["top", "nested", "section"],
)
def test_duplicated_yaml_key_is_refused(tmp_path, monkeypatch, capsys, text, needle):
    """A key given twice in a YAML config: one line naming the key, both values and their lines (today: accepted,
    the last value winning)."""
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    message = cli_refusal(monkeypatch, capsys, "--config", str(path))
    assert f"config {str(path)!r}: {needle}" in message, message
    anchors = "base: &b {num_steps: 5}\n<<: *b\nnum_steps: 7\n"  # a merge key's values are overridden, not repeated
    assert rc_config.yaml.load(anchors, Loader=rc_config._YamlLoader)["num_steps"] == 7


@pytest.mark.parametrize(
    "changes, flag",
    [
        (dict(sft_learning_rate=INF), "--mini.sft-learning-rate"),
        (dict(sft_learning_rate=NAN), "--mini.sft-learning-rate"),
        (dict(model_seed=2**64), "--mini.model-seed"),
        (dict(model_seed=-(2**63) - 1), "--mini.model-seed"),
    ],
)
def test_bad_task_setting_is_refused(changes, flag):
    mini = tasks.MiniGSMArgs(**changes)
    with pytest.raises(ValueError) as info:
        tasks.check_mini_args(mini)
    value = str(next(iter(changes.values())))
    assert flag in str(info.value) and value in str(info.value)


# ---- values that work are accepted --------------------------------------------------------------------------
GOOD = [
    dict(),
    dict(model="Qwen/Qwen2.5-0.5B-Instruct"),  # a Hugging Face id, not a local path
    dict(model="gpt2"),
    dict(rollout_dtype="float16"),
    dict(train_dtype="bfloat16", rollout_dtype="bfloat16"),
    dict(num_samples_per_prompt=2, num_minibatches=4),
    dict(seed=0),
    dict(seed=2**32 - 1),
    dict(train_limit=1, eval_limit=None),
    dict(eval_every=0, checkpoint_every=0, warmup_steps=0, weight_decay=0.0, kl_coef=0.0),
    dict(max_grad_norm=INF),  # no clipping
    dict(vllm_gpu_memory_utilization=1.0, vllm_kv_cache_gb=0.5),
    dict(learning_rate=1),  # a YAML integer for a float field
    dict(run_name="my_run.v2", resume=False, exp_name="exp.1"),
    dict(log_with=[]),
    dict(log_with=["all"]),
    dict(mini=tasks.MiniGSMArgs(model_seed=-1)),
    dict(task="add", reward_mode="flexible", format_bonus=0.1),
    dict(task="gsm8k", reward_mode=None),  # None: the task's reward key
    dict(adv_estimator="grpo", norm_adv_by_std=False),
]


@pytest.mark.parametrize("changes", GOOD)
def test_good_values_pass(changes):
    rc_config.validate_args(with_(**changes), world_size=1)


def test_local_model_folder_passes(tmp_path):
    rc_config.validate_args(with_(model=str(tmp_path)), world_size=1)


def test_tiny_is_never_read_as_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").write_text("not a model")  # a file called 'tiny' here does not shadow the built-in model
    rc_config.validate_args(with_(model="tiny", output_dir=str(tmp_path / "runs")), world_size=1)


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))), ids=os.path.basename)
def test_shipped_configs_pass(path):
    args = rc_train.load_yaml_defaults(path)
    rc_config.validate_args(args, world_size=1)
    tasks.check_mini_args(args.mini)


def test_legacy_use_policy_gradient_reaches_the_correction_config(monkeypatch):
    """--rc.use-policy-gradient (docs/corrections.md §9.1) sets loss_type where neither the preset nor --rc.loss-type
    did, and is refused where they set another one."""

    def config(*flags):
        monkeypatch.setattr(sys, "argv", ["rc_train.py", *flags])
        return rc_config.build_correction_config(rc_config.parse_cli(rc_train.Args, rc_train.load_yaml_defaults).rc)

    bypass = ["--rc.preset", "disabled", "--rc.bypass-mode", "True"]
    assert config(*bypass).loss_type == "ppo_clip"
    assert config(*bypass, "--rc.use-policy-gradient", "True").loss_type == "reinforce"
    on_bypass_preset = ["--rc.preset", "bypass_ppo_clip", "--rc.loss-type", "none", "--rc.use-policy-gradient", "True"]
    assert config(*on_bypass_preset).loss_type == "reinforce"
    with pytest.raises(ValueError, match="conflicts with loss_type='ppo_clip'"):
        config("--rc.preset", "bypass_ppo_clip", "--rc.use-policy-gradient", "True")


def test_format_bonus_needs_the_tasks_format_key(monkeypatch):
    plain = tasks.Task("plain", lambda split, limit=None: ([{"q": "1"}], 0), lambda row: row["q"], lambda r, row: {})
    monkeypatch.setitem(tasks.TASKS, "plain", lambda **_: plain)
    rc_config.validate_args(with_(task="plain"), world_size=1)
    message = refused(with_(task="plain", format_bonus=0.5))
    assert "--format-bonus 0.5" in message and "'plain'" in message and "format key" in message


# ---- the real script: refused before the engine, nothing written ---------------------------------------------
@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--num-samples-per-prompt", "1"], "--num-samples-per-prompt"),
        (["--model", "/path/that/does/not/exist"], "/path/that/does/not/exist"),
        (["--reward-mode", "correct"], "'correct'"),
    ],
)
def test_refused_before_engine_and_run_folder(tmp_path, flags, needle):
    env = dict(os.environ, OMP_NUM_THREADS="1", RC_CACHE_DIR=str(tmp_path / "cache"))
    cmd = [
        sys.executable,
        os.path.join(ROOT, "rc_train.py"),
        "--config",
        os.path.join(ROOT, "configs", "cpu_add.yaml"),
        "--output-dir",
        str(tmp_path),
        "--run-name",
        "run",
        *flags,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert proc.returncode != 0
    assert "error" in proc.stderr and needle in proc.stderr and flags[0] in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "Initializing a V1 LLM engine" not in proc.stdout + proc.stderr
    assert not (tmp_path / "run").exists()  # no run folder, so no engine.log and no metrics.jsonl
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_asynchronous_rollout_is_refused_on_a_gpu(monkeypatch):
    """The rollout worker is CPU-only: on a GPU, k >= 1 (or --rollout-worker) stops at start with the reason."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    message = refused(with_(max_staleness=1))
    assert "--max-staleness 1" in message and "CPU only" in message and "--max-staleness 0" in message
    assert "--rollout-worker" in refused(with_(rollout_worker=True))
    rc_config.validate_args(with_(max_staleness=0), world_size=1)  # the synchronous loop is fine there


def test_compile_on_a_gpu_without_expandable_segments_is_warned():
    # --compile's varying shapes leave the caching allocator holding twice the memory in use unless its expandable
    # segments are on (docs/gpus.md, "Compiled layers"): a warning at start names the variable, nothing is refused
    on = with_(compile=True)
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in rc_config.allocator_advice(on, True, {})
    assert rc_config.allocator_advice(on, True, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) is None
    assert (
        rc_config.allocator_advice(on, True, {"PYTORCH_ALLOC_CONF": "max_split_size_mb:512,expandable_segments:True"})
        is None
    )
    assert rc_config.allocator_advice(on, True, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}) is not None
    assert rc_config.allocator_advice(on, False, {}) is None  # a CPU: no CUDA allocator
    assert rc_config.allocator_advice(with_(compile=False), True, {}) is None
