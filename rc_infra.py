"""Infrastructure of rc_train.py, kept out of its reading path: configuration (YAML defaults, the CLI, checks, the
correction config), the engine's scheduler limits, log files and memory on GPU, the micro-batches of the trainer's
forward passes, metric reduction across ranks, gradient norms, the step's metrics and progress bar, the prompt order
and evaluation, the run folder and its logs, checkpoints and resume, data-parallel checksums.

Nothing here changes the algorithm; every piece is unit-tested on CPU (tests/test_infra.py) or end to end
(tests/test_train.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import sys
import time
import warnings
from collections import Counter
from typing import Annotated

import numpy as np
import torch
import tyro
import yaml

import rc_core
import tasks


def _number_or_text(text: str) -> float | str:
    """'3' -> 3.0, '1e-4' -> 0.0001; 'L_U' bounds and option lists stay text ('0.5_5' is not the number 0.55)."""
    try:
        return text if "_" in text else float(text)
    except ValueError:
        return text


# A threshold: a number, or the text forms rc_core parses ('L_U', one entry per RS option, 'none').
Threshold = Annotated[
    float | str | None,
    tyro.constructors.PrimitiveConstructorSpec(
        nargs=1,
        metavar="{FLOAT,L_U,...,none}",
        instance_from_str=lambda a: _number_or_text(a[0]),
        is_instance=lambda x: x is None or isinstance(x, (int, float, str)),
        str_from_instance=lambda x: [str(x)],
    ),
]


# ---------------------------------------------------------------------------------------------
# Configuration: YAML defaults, the command line, checks (all before any engine starts)
# ---------------------------------------------------------------------------------------------
class _YamlLoader(yaml.SafeLoader):
    """yaml.safe_load, with YAML 1.2 floats: '1e-4' is a number (YAML 1.1 reads it as a string) and '0.5_5' stays
    the string it is meant to be (YAML 1.1 drops the underscore and reads 0.55), so an IcePop bound 'L_U' or a
    multi-option RS threshold may be written unquoted, and every number reaches its field as a number."""


_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:float"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^[-+]?(?:[0-9]+\.[0-9]*(?:[eE][-+]?[0-9]+)?|\.[0-9]+(?:[eE][-+]?[0-9]+)?|[0-9]+[eE][-+]?[0-9]+)$"
        r"|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"
    ),
    list("-+0123456789."),
)


def load_yaml_defaults(cls, path: str, **extra):
    """An instance of the dataclass `cls` whose values come from a YAML file: flat keys, plus one mapping per nested
    dataclass field (e.g. `rc:`). Values are handed over as YAML typed them (numbers as numbers); unknown keys fail."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file not found: {path!r}")
    with open(path) as f:
        raw = yaml.load(f, Loader=_YamlLoader) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"config {path!r} must hold a mapping, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    nested = {k: f.default_factory for k, f in fields.items() if dataclasses.is_dataclass(f.default_factory)}
    bad = sorted(set(raw) - set(fields))
    for key, sub in nested.items():
        if not isinstance(raw.get(key) or {}, dict):
            raise ValueError(f"config {path!r}: {key!r} must be a mapping")
        bad += [f"{key}.{k}" for k in sorted(set(raw.get(key) or {}) - {f.name for f in dataclasses.fields(sub)})]
    if bad:
        raise ValueError(f"config {path!r}: unknown keys {bad}")
    values = {k: nested[k](**(v or {})) if k in nested else v for k, v in raw.items()}
    return cls(**{**values, **extra})


def parse_cli(cls, load_defaults, gpu_config: str | None = None):
    """tyro over the dataclass `cls`; --config FILE (or, with a GPU and neither --config nor --model, `gpu_config`)
    gives the defaults through load_defaults(path), and flags on the command line still win."""
    argv = sys.argv[1:]
    config = None
    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv):
            config = argv[i + 1]
        elif a.startswith("--config="):
            config = a.split("=", 1)[1]
    if config is None and gpu_config and torch.cuda.is_available() and "--model" not in argv:
        config = gpu_config
    try:
        default = load_defaults(config) if config else cls()
    except (ValueError, TypeError, FileNotFoundError) as e:
        sys.exit(f"rc_train.py: error: {e}")
    return tyro.cli(cls, default=default, args=argv)


def _check_field_types(obj, prefix: str = "") -> None:
    """Raise ValueError naming the first field of the dataclass `obj` whose value does not have its annotated type
    (int, float, bool, str, None, Literal choices, a nested dataclass). tyro checks the command line, but YAML
    values reach the fields as YAML typed them ('ten' steps, reward_mode 'strik'), so they are checked here."""
    import types
    import typing

    def fits(value, hint) -> bool:
        origin, parts = typing.get_origin(hint), typing.get_args(hint)
        if origin in (typing.Union, types.UnionType):
            return any(fits(value, p) for p in parts)
        if origin is typing.Literal:
            return any(value == p and type(value) is type(p) for p in parts)
        if hint is type(None):
            return value is None
        if hint is bool:
            return isinstance(value, bool)
        if hint is int:
            return isinstance(value, int) and not isinstance(value, bool)
        if hint is float:  # an int is a number too; one too large for a float is not
            return (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and not (isinstance(value, int) and abs(value) > sys.float_info.max)
            )
        if hint is str:
            return isinstance(value, str)
        if origin is list:
            return isinstance(value, list) and all(fits(v, parts[0]) for v in value)
        if dataclasses.is_dataclass(hint):
            return isinstance(value, hint)
        return True  # any other annotation is checked where it is used

    def describe(hint) -> str:
        origin, parts = typing.get_origin(hint), typing.get_args(hint)
        if origin in (typing.Union, types.UnionType):
            return " or ".join(describe(p) for p in parts)
        if origin is typing.Literal:
            return "one of " + ", ".join(map(repr, parts))
        if origin is list:
            return f"a list, each item {describe(parts[0])}"
        return {type(None): "null", bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
            hint, "a mapping"
        )

    for name, hint in typing.get_type_hints(type(obj)).items():
        value = getattr(obj, name)
        if not fits(value, hint):
            raise ValueError(f"--{prefix}{name.replace('_', '-')} must be {describe(hint)}, got {value!r}")


def _local_path(model: str) -> bool:
    """--model names a local folder (not a Hugging Face id such as Qwen/Qwen2.5-0.5B-Instruct): it starts with '/',
    '.' or '~', has more than one '/', or exists."""
    return model.startswith(("/", ".", "~")) or model.count("/") > 1 or os.path.exists(model)


def validate_args(args, world_size: int) -> None:
    """Fail fast with a message naming the bad value (before tokenizer, data or engine, and before anything is
    written to the run folder). The correction settings (--rc.*) are checked by rc_core when the config is built,
    the task and its settings (--task, --mini.*, --reward-mode, --format-bonus) by tasks.make_task and
    tasks.check_reward_settings, the loss settings by rc_core.check_loss_settings below."""

    def need(cond, msg):
        if not cond:
            raise ValueError(msg)

    # Types first (YAML values arrive unchecked), so every comparison below compares numbers.
    _check_field_types(args)
    _check_field_types(args.mini, prefix="mini.")

    # Names, paths, trackers
    need(
        args.exp_name.strip() != "" and not any(s in args.exp_name for s in ("/", os.sep, os.altsep) if s),
        f"--exp-name must be a non-empty name without a path separator (it is part of the run folder's name), "
        f"got {args.exp_name!r}",
    )
    if args.run_name is not None:
        need(
            args.run_name.strip() not in ("", ".", "..")
            and not any(s in args.run_name for s in ("/", os.sep, os.altsep) if s),
            f"--run-name must be a folder name without a path separator (not '', '.' or '..'; the parent folder is "
            f"--output-dir), got {args.run_name!r}",
        )
    need(
        not args.resume or args.run_name is not None,
        "--resume needs --run-name (the run to continue; the default name holds the start time, so it is always new)",
    )
    need(
        not os.path.exists(args.output_dir) or os.path.isdir(args.output_dir),
        f"--output-dir must be a folder, got {args.output_dir!r} (a file)",
    )
    if args.run_name is not None:
        run_dir = os.path.join(args.output_dir, args.run_name)
        need(
            not os.path.exists(run_dir) or os.path.isdir(run_dir),
            f"--run-name {args.run_name!r}: {run_dir!r} exists and is not a folder",
        )
    existing = os.path.abspath(args.output_dir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    need(
        os.path.isdir(existing) and os.access(existing, os.W_OK | os.X_OK),
        f"--output-dir {args.output_dir!r} cannot be created or written: {existing!r} is not a writable folder",
    )
    model = args.model
    need(model.strip() != "", f"--model must be 'tiny', a local model folder or a Hugging Face model id, got {model!r}")
    if model != "tiny" and _local_path(model) and not os.path.isdir(model):  # 'tiny': rc_train.TINY_MODEL, built here
        home = model.startswith("~") and os.path.isdir(os.path.expanduser(model))
        need(
            False,
            f"--model must be an existing local model folder or a Hugging Face model id, got {model!r} "
            + (
                "('~' is not expanded here: write the full path)"
                if home
                else "(a file, not a folder)"
                if os.path.exists(model)
                else "(no such folder)"
            ),
        )
    trackers = getattr(args, "log_with", None) or []
    if trackers:
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers

        installed = {str(getattr(t, "value", t)) for t in get_available_trackers()}
        for name in trackers:
            need(
                name == "all" or name in LOGGER_TYPE_TO_CLASS,
                f"--log-with must name Accelerate trackers ({', '.join(LOGGER_TYPE_TO_CLASS)}) or all, got {name!r}",
            )
            need(
                name == "all" or name in installed,
                f"--log-with {name}: the {name} package is not installed (Accelerate would skip it silently): "
                f"pip install {name}, or drop it",
            )
        if "wandb" in trackers:
            project = args.wandb_project_name
            need(
                0 < len(project) <= 128 and not any(c in project for c in "/\\#?%:"),
                f"--wandb-project-name must be 1..128 characters, none of / \\ # ? % :, got {project!r}",
            )
    need(
        0 <= args.seed <= 2**32 - world_size,
        f"--seed must be in [0, {2**32 - world_size}] (numpy and vLLM take 32-bit seeds; rank r's engine uses "
        f"seed + r), got {args.seed}",
    )

    # Data and task
    need(
        args.train_limit is None or args.train_limit >= 1,
        f"--train-limit must be >= 1 (or None: every problem), got {args.train_limit}",
    )
    need(
        args.eval_limit is None or args.eval_limit >= 1,
        f"--eval-limit must be >= 1 (or None: the whole split), got {args.eval_limit}",
    )
    need(
        args.format_bonus >= 0 and math.isfinite(args.format_bonus),
        f"--format-bonus must be a finite number >= 0, got {args.format_bonus}",
    )
    need(
        args.task in tasks.TASKS,
        f"--task must be one of {', '.join(tasks.TASKS)} (tasks.TASKS), got {args.task!r}",
    )
    task = tasks.make_task(args.task, args.mini, args.dataset, args.dataset_config)  # checks --mini.* too
    tasks.check_reward_settings(task, args.reward_mode, args.format_bonus)

    # Rollout
    need(args.num_steps >= 1, f"--num-steps must be >= 1, got {args.num_steps}")
    need(
        args.num_samples_per_prompt >= 2,
        f"--num-samples-per-prompt must be >= 2 (the GRPO group size: a group of one response has no group mean "
        f"to compare with, so the advantage falls back to the raw reward, REINFORCE without a baseline), "
        f"got {args.num_samples_per_prompt}",
    )
    need(
        args.num_prompts_per_step >= 1 and args.num_prompts_per_step % world_size == 0,
        f"--num-prompts-per-step ({args.num_prompts_per_step}) must be a positive multiple of the world size "
        f"({world_size})",
    )
    batch = args.num_prompts_per_step // world_size * args.num_samples_per_prompt
    need(
        args.num_minibatches >= 1 and batch % args.num_minibatches == 0,
        f"--num-minibatches ({args.num_minibatches}) must divide the per-rank rollout batch ({batch})",
    )
    need(args.micro_batch_size >= 1, f"--micro-batch-size must be >= 1, got {args.micro_batch_size}")
    need(
        args.max_tokens_per_micro_batch is None or args.max_tokens_per_micro_batch >= 1,
        f"--max-tokens-per-micro-batch must be >= 1, got {args.max_tokens_per_micro_batch}",
    )
    need(args.max_response_length >= 1, f"--max-response-length must be >= 1, got {args.max_response_length}")
    need(
        args.max_model_len > args.max_response_length,
        f"--max-model-len must be > --max-response-length ({args.max_response_length}): a prompt and its response "
        f"must fit in the context, got {args.max_model_len}",
    )
    need(
        args.temperature > 0 and math.isfinite(args.temperature),
        f"--temperature must be > 0 (greedy rollouts have no log-probs to correct), got {args.temperature}",
    )
    need(0 < args.top_p <= 1, f"--top-p must be in (0, 1], got {args.top_p}")
    need(
        args.train_dtype != "float16",
        f"--train-dtype must be float32 or bfloat16, got {args.train_dtype}: the trainer has no gradient scaler, "
        f"so float16 gradients underflow; use bfloat16 (no scaler needed) or float32",
    )
    need(args.sync_every >= 0, f"--sync-every must be >= 0, got {args.sync_every}")
    k = args.max_staleness
    need(k is None or k >= 0, f"--max-staleness must be >= 0 (0 = the synchronous loop), got {k}")
    if k or args.rollout_worker:
        need(
            args.sync_every == 1,
            f"--max-staleness {k} loads every new version into the rollout worker: it needs --sync-every 1 (the "
            f"synchronous loop's own lag dial), got --sync-every {args.sync_every}",
        )
        need(
            not torch.cuda.is_available(),
            f"--max-staleness {k} (a rollout worker process) runs on CPU only: on a GPU the worker's engine would "
            f"share the device with the trainer while it generates (no sleep mode then) and the weights would need "
            f"CUDA IPC; neither is built or verified here. Use --max-staleness 0 on GPUs"
            if k
            else "--rollout-worker runs on CPU only (no GPU weight hand-over is built): drop it on GPUs",
        )
    need(
        0 < args.vllm_gpu_memory_utilization <= 1,
        f"--vllm-gpu-memory-utilization must be in (0, 1] (a share of the GPU's memory), "
        f"got {args.vllm_gpu_memory_utilization}",
    )
    need(
        args.vllm_kv_cache_gb > 0 and math.isfinite(args.vllm_kv_cache_gb),
        f"--vllm-kv-cache-gb must be a finite number > 0, got {args.vllm_kv_cache_gb}",
    )
    need(
        0.0 <= args.rollout_corrupt_prob < 1.0,
        f"--rollout-corrupt-prob must be in [0, 1), got {args.rollout_corrupt_prob}",
    )
    need(
        args.rollout_weight_noise >= 0 and math.isfinite(args.rollout_weight_noise),
        f"--rollout-weight-noise must be a finite number >= 0, got {args.rollout_weight_noise}",
    )
    need(
        args.rollout_temperature is None or (args.rollout_temperature > 0 and math.isfinite(args.rollout_temperature)),
        f"--rollout-temperature must be > 0, got {args.rollout_temperature}",
    )
    need(args.dump_log_ratio_every >= 0, f"--dump-log-ratio-every must be >= 0, got {args.dump_log_ratio_every}")

    # Optimisation
    need(
        args.learning_rate > 0 and math.isfinite(args.learning_rate),
        f"--learning-rate must be a finite number > 0, got {args.learning_rate}",
    )
    need(
        args.weight_decay >= 0 and math.isfinite(args.weight_decay),
        f"--weight-decay must be a finite number >= 0, got {args.weight_decay}",
    )
    need(args.warmup_steps >= 0, f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    need(args.ppo_epochs >= 1, f"--ppo-epochs must be >= 1, got {args.ppo_epochs}")
    need(
        args.kl_coef >= 0 and math.isfinite(args.kl_coef), f"--kl-coef must be a finite number >= 0, got {args.kl_coef}"
    )
    need(args.max_grad_norm > 0, f"--max-grad-norm must be > 0 (inf: no clipping), got {args.max_grad_norm}")

    # Evaluation, checkpoints
    need(args.eval_every >= 0, f"--eval-every must be >= 0 (0 = only at the end), got {args.eval_every}")
    need(args.checkpoint_every >= 0, f"--checkpoint-every must be >= 0 (0 = never), got {args.checkpoint_every}")

    # Engine
    need(args.vllm_sleep_level in (1, 2), f"--vllm-sleep-level must be 1 or 2, got {args.vllm_sleep_level}")
    need(
        args.vllm_sleep_level == 1 or args.sync_every == 1,
        f"--vllm-sleep-level 2 discards the engine's weights while it sleeps, so every rollout needs fresh ones: "
        f"it needs --sync-every 1, got --sync-every {args.sync_every}",
    )
    need(
        args.vllm_max_num_seqs is None or args.vllm_max_num_seqs >= 1,
        f"--vllm-max-num-seqs must be >= 1, got {args.vllm_max_num_seqs}",
    )
    tokens = args.vllm_max_num_batched_tokens
    need(tokens is None or tokens >= 1, f"--vllm-max-num-batched-tokens must be >= 1, got {tokens}")
    if tokens is not None and not torch.cuda.is_available():
        # CPU: prefills are never split (see engine_limits), so one step must hold the longest sequence.
        need(
            tokens >= args.max_model_len,
            f"--vllm-max-num-batched-tokens {tokens} is below --max-model-len {args.max_model_len}: the CPU engine "
            f"never splits a prefill, so raise --vllm-max-num-batched-tokens or lower --max-model-len",
        )
    need(
        tokens is None or args.vllm_max_num_seqs is None or tokens >= args.vllm_max_num_seqs,
        f"--vllm-max-num-batched-tokens {tokens} must be >= --vllm-max-num-seqs {args.vllm_max_num_seqs}",
    )

    # Advantage and loss (rc_core's own checks; the message says which flag gave a clip value that was not set itself)
    need(
        args.adv_estimator in rc_core.ADVANTAGE_ESTIMATORS,
        f"--adv-estimator must be one of {', '.join(rc_core.ADVANTAGE_ESTIMATORS)} (rc_core.ADVANTAGE_ESTIMATORS), "
        f"got {args.adv_estimator!r}",
    )
    if args.kl_coef > 0:
        rc_core.kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), args.kl_estimator)  # raises on unknown names
    low = args.clip_ratio if args.clip_ratio_low is None else args.clip_ratio_low
    high = args.clip_ratio if args.clip_ratio_high is None else args.clip_ratio_high
    try:
        rc_core.check_loss_settings(low, high, args.clip_ratio_c, args.loss_agg_mode, args.loss_scale_factor)
    except ValueError as e:
        side = next(
            (
                s
                for s in ("low", "high")
                if str(e).startswith(f"clip_ratio_{s}") and getattr(args, f"clip_ratio_{s}") is None
            ),
            None,
        )
        if side is None:
            raise
        raise ValueError(f"{e} (--clip-ratio-{side} is unset: it takes --clip-ratio {args.clip_ratio})") from None


SWITCH_OFF = "none"  # the value that switches a correction option off from the CLI or YAML (build_correction_config)


def build_correction_config(rc) -> rc_core.RolloutCorrectionConfig:
    """The preset, with every field the user set replaced; SWITCH_OFF ('none') becomes None. rc_core validates."""
    set_fields = {
        k: None if isinstance(v, str) and v.strip().lower() == SWITCH_OFF else v
        for k, v in dataclasses.asdict(rc).items()
        if k != "preset" and v is not None
    }
    return dataclasses.replace(rc_core.RolloutCorrectionConfig.from_name(rc.preset), **set_fields)


# ---------------------------------------------------------------------------------------------
# Processes and devices
# ---------------------------------------------------------------------------------------------
def launcher_settings(args, environ=os.environ) -> None:
    """Read what `accelerate launch` asked for, before the Accelerator is built; refuse what cannot work.

    DeepSpeed is refused: through Accelerate >= 1.8 it steps its optimizer after every micro-batch unless the loop runs
    inside accelerator.accumulate(), it divides the loss by its accumulation steps on top of the trainer's global
    denominators, and its ZeRO partitions do not round-trip through a module checkpoint (docs/gpus.md). FSDP2 shards
    the same state and is what this trainer supports. An Accelerate FSDP config (FSDP_VERSION 2) switches on --fsdp:
    the trainer shards with torch's fully_shard itself, on every device, because Accelerate builds its FSDP2 plugin
    only for GPU distributed types (on CPU it silently drops it and trains DDP). The variable is removed so that
    Accelerate sets up plain data parallelism under the trainer's own sharding."""

    def on(name):
        return environ.get(name, "false").lower() in ("1", "true", "yes")

    if on("ACCELERATE_USE_DEEPSPEED"):
        raise ValueError(
            "DeepSpeed is not supported (under Accelerate it steps the optimizer per micro-batch and "
            "scales the loss by 1/gradient_accumulation_steps); shard with FSDP2 instead: --fsdp, or "
            "accelerate launch --config_file configs/accelerate/fsdp2.yaml"
        )
    if on("ACCELERATE_USE_FSDP"):
        version = environ.get("FSDP_VERSION", "1")
        if version != "2":
            raise ValueError(
                f"FSDP version {version} (FSDP1) is not supported: set fsdp_version: 2 in the Accelerate "
                f"config (configs/accelerate/fsdp2.yaml)"
            )
        if on("FSDP_OFFLOAD_PARAMS"):
            raise ValueError(
                "fsdp_offload_params: true is not supported: every weight sync streams the full "
                "parameters from the device into the colocated engine"
            )
        args.fsdp = True
        environ.pop("ACCELERATE_USE_FSDP")


def check_distributed(accelerator, args) -> None:
    """Refuse what the processes Accelerate started cannot run, before anything is built.

    --fsdp needs several processes; every FSDP2 forward is a collective, so every rank must run the same number of
    forwards: micro-batches by count only (a token budget gives each rank its own count). Accelerate's own sharded
    backends (its FSDP plugin, DeepSpeed), when they arrive other than through the launcher, are refused as in
    launcher_settings. On GPUs each rank's engine needs a GPU of its own."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        raise ValueError("DeepSpeed is not supported; shard with FSDP2 instead (--fsdp, configs/accelerate/fsdp2.yaml)")
    if kind == DistributedType.FSDP:
        raise ValueError(
            "Accelerate's FSDP plugin is not used: shard with --fsdp (torch's fully_shard), or launch "
            "with configs/accelerate/fsdp2.yaml"
        )
    if args.fsdp and accelerator.num_processes < 2:
        raise ValueError(
            "--fsdp shards over several processes, but this run has 1: launch it with torchrun "
            "--nproc_per_node N or accelerate launch --config_file configs/accelerate/fsdp2.yaml"
        )
    if args.fsdp and args.max_tokens_per_micro_batch:
        raise ValueError(
            f"--fsdp needs the same number of micro-batches on every rank: drop "
            f"--max-tokens-per-micro-batch {args.max_tokens_per_micro_batch}"
        )
    if torch.cuda.is_available():
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if local_world > torch.cuda.device_count():
            raise ValueError(
                f"{local_world} processes on this node but {torch.cuda.device_count()} GPUs: each rank's "
                f"engine needs a GPU of its own (num_processes of the Accelerate config, or torchrun "
                f"--nproc_per_node)"
            )


class HostGroup:
    """The trainer's own collectives (loss denominators, metric sums, evaluation samples): small host-side values, on
    a gloo group of all ranks created at start. Accelerate and torchrun give GPU jobs an NCCL default group, which
    serves only CUDA tensors ("No backend type associated with device type cpu" for a CPU tensor); a gloo side group
    serves the CPU on every machine and spares a device round trip for a few floats. The model's own collectives
    (DDP, FSDP2) stay on the default group. tests/test_infra.py runs these under an NCCL-like group (gloo serving
    cuda only)."""

    def __init__(self, world: int):
        import torch.distributed as dist

        self.world = world
        self.group = dist.new_group(backend="gloo") if world > 1 else None

    def sum(self, values: list[float]) -> list[float]:
        """Elementwise sum over the ranks."""
        if self.world == 1:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self.group)
        return t.tolist()

    def extreme(self, values: list[float], op: str) -> list[float]:
        """Elementwise max or min over the ranks."""
        if self.world == 1:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN, group=self.group)
        return t.tolist()

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out


def resolve_max_staleness(args, on_gpu: bool, run_dir: str) -> int:
    """--max-staleness as given, or its default (None): on --resume the bound the checkpoint was written with (its
    batches in flight belong to that schedule); else 0 on GPUs (the rollout worker is CPU-only) or with --sync-every
    other than 1 (the synchronous loop's own lag dial), and 1 on a CPU."""
    if args.max_staleness is not None:
        return args.max_staleness
    state = newest_checkpoint_state(run_dir) if args.resume else None
    if state is not None:
        return state.get("max_staleness", 0)
    return 0 if on_gpu or args.sync_every != 1 else 1


def torch_threads(max_staleness: int, environ=os.environ) -> int:
    """Threads of torch (and of a CPU engine's kernels) in each process: OMP_NUM_THREADS when it is set; otherwise
    the setting measured best on the 2-core machines (docs/async.md §7). At --max-staleness 0 rollout and update take
    turns, so each takes every core of this process (the default job ran in 0.73x the time of one thread, same
    accuracy); at k >= 1 the trainer and the rollout worker run side by side, so each takes half."""
    if environ.get("OMP_NUM_THREADS", "").strip():
        return max(1, int(environ["OMP_NUM_THREADS"]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores if max_staleness == 0 else max(1, cores // 2)


def engine_placement(on_gpu: bool, rank: int, local_rank: int, world: int) -> tuple[dict, dict]:
    """(vLLM keyword arguments, environment variables) that give each rank's engine its own device.

    GPU, several processes: vLLM's default in-process executor takes its device from a plain 'cuda' and makes GPU 0
    current on every rank, so every rank's engine would land on GPU 0. The 'external_launcher' executor (the way
    TRL's colocate mode starts vLLM) instead joins the launcher's processes: each engine runs on the rank's local
    GPU (tensor-parallel size 1: one engine per GPU, each sampling its own shard of the prompts). It reads the
    launcher's RANK / LOCAL_RANK / WORLD_SIZE. CPU, or one GPU: the default executor is right."""
    if not on_gpu or world == 1:
        return {}, {}
    env = {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world)}
    return {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": 1}, env


class EngineMemory:
    """Which parts of a sleeping-capable GPU engine are awake, and the order that keeps memory free for training.

    A weight sync wakes the weights only; a generation also wakes the KV cache; sleep() before the update puts
    everything back to sleep (level 1: weights offloaded to CPU RAM, KV cache freed; level 2: both freed, so the
    next weight sync must rewrite every weight). torch.cuda.empty_cache() runs before every wake-up: the trainer's
    cached blocks are returned to the device first, so the engine's memory is really there. On CPU (or with
    --no-vllm-sleep) every call is a no-op: the engine never sleeps."""

    TAGS = ("weights", "kv_cache")

    def __init__(self, llm, enabled: bool, level: int = 1):
        self.llm, self.enabled, self.level = llm, enabled, level
        self.awake = set(self.TAGS)  # a new engine starts awake

    def wake(self, *tags: str) -> None:
        missing = [t for t in self.TAGS if t in tags and t not in self.awake]
        if self.enabled and missing:
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=missing)
        self.awake.update(missing)

    def sleep(self) -> None:
        if self.enabled and self.awake:
            self.llm.sleep(level=self.level)
            self.awake.clear()


@contextlib.contextmanager
def engine_awake(engine: EngineMemory, *tags: str, sleep_after: bool = False):
    """Wake `tags` of the engine for the block; with sleep_after, put it all back to sleep at the end (only after a
    rollout: the update comes next and gets the memory). A weight sync wakes the weights alone and leaves them
    awake: the KV cache sleeps on until the next generation, and a level-2 sleep would discard the new weights."""
    engine.wake(*tags)
    yield
    if sleep_after:
        engine.sleep()


def start_engine(args, model_path: str, seed: int, limits: dict, log_path: str, placement: dict):
    """vLLM in this process; its log lines and start-up output go to log_path (the run's engine.log).
    limits: engine_limits; placement: engine_placement (each rank's engine on its own GPU)."""
    kwargs = dict(
        model=model_path,
        dtype=args.rollout_dtype,
        seed=seed,
        max_model_len=args.max_model_len,
        # processed: temperature/top-p applied, i.e. the distribution that sampled ('raw' is a lab dial)
        logprobs_mode=f"{args.rollout_logprobs}_logprobs",
        enable_prefix_caching=True,
        **limits,
        **placement,
    )
    if args.rollout_corrupt_prob > 0:  # the veto lab's sampler dial (planted_tokens_processor)
        kwargs["logits_processors"] = [planted_tokens_processor()]
    if torch.cuda.is_available():
        kwargs.update(gpu_memory_utilization=args.vllm_gpu_memory_utilization, enable_sleep_mode=args.vllm_sleep)
        if args.rollout_corrupt_prob > 0:
            # On CUDA, vLLM 0.32 defaults to its V2 model runner, whose logits-processor loader refuses V1
            # LogitsProcessor subclasses (PlantedTokens is one): keep the V1 runner (vllm/envs.py,
            # VllmConfig.use_v2_model_runner in vllm/config/vllm.py). Read at engine start, so set before LLM().
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    else:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(args.vllm_kv_cache_gb)))
        kwargs.update(enforce_eager=True)
    with engine_output_to(log_path):
        from vllm import LLM

        return LLM(**kwargs)


def engine_limits(args, world: int, longest_prompt: int, on_gpu: bool) -> dict:
    """Scheduler settings of the engine: one wave holds this rank's whole rollout batch.

    CPU: chunked prefill is off, so no prefill is ever split across engine steps. vLLM rewinds the random
    generator of a seeded request whose prompt was only partly prefilled (its sampled token is discarded),
    and CPU generators cannot rewind: a split prefill crashed the first rollout ("CPU Generator does not use
    offset") with GSM8K-length prompts. Without chunking, a prompt waits for the next step instead, which only
    needs a step budget >= --max-model-len (checked in validate_args). GPU generators rewind fine: chunked
    prefill stays on there and the budget is passed only when set."""
    batch = args.num_prompts_per_step // world * args.num_samples_per_prompt
    max_num_seqs = args.vllm_max_num_seqs or batch
    tokens = args.vllm_max_num_batched_tokens
    if tokens is None and not on_gpu:
        tokens = min(max(batch * longest_prompt, args.max_model_len), max(65536, args.max_model_len))
    limits = dict(max_num_seqs=max_num_seqs)
    if tokens is not None:
        limits["max_num_batched_tokens"] = max(tokens, max_num_seqs)
    if not on_gpu:
        limits["enable_chunked_prefill"] = False
    return limits


@contextlib.contextmanager
def output_to(path: str):
    """Send this process's stdout and stderr (file descriptors 1 and 2: C++ warnings and progress bars
    included) to a file for the duration; exceptions still reach the console once restored."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "a") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


class _BenignReloadWarning(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights" after each weight sync. Benign: vLLM's
    layer-wise reload counts the rotary cos/sin cache as a loadable tensor, no checkpoint holds it (it is
    computed from the config, not learnt), and the reload puts the existing cache back. The fp32 tests
    check that the engine's log-probs still match the trainer's to ~1e-8 after every sync."""

    def filter(self, record):
        return not (
            record.getMessage().startswith("RotaryEmbedding") and "Failed to load weights" in record.getMessage()
        )


@contextlib.contextmanager
def engine_output_to(log_path: str):
    """Start the engine inside this block: vLLM's log lines go to log_path (the run's engine.log) from now on, and
    so does everything its start-up prints, C++ warnings and progress bars included (the console stays quiet)."""
    engine_log = logging.getLogger("vllm")
    engine_log.setLevel(logging.INFO)
    engine_log.propagate = False
    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_BenignReloadWarning())
    engine_log.addHandler(handler)
    with output_to(log_path), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


def sampling_seed(*keys: int) -> int:
    """A 62-bit seed hashed from (run seed, step, 0, the prompt's place in the step). vLLM seeds the k-th of the n
    samples of a request with `seed + k`, so consecutive per-prompt seeds would make prompt i+1 replay prompt i's
    random stream shifted by one sample: every prompt then explores the same few tokens (measured: the CPU demo
    collapsed onto one answer). Hashed seeds keep the streams apart and the run reproducible."""
    digest = hashlib.blake2b("/".join(map(str, keys)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


# ---------------------------------------------------------------------------------------------
# Mismatch dials of the lab (lab/README.md): the weights the engine receives
# ---------------------------------------------------------------------------------------------
def fake_quantise(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """Symmetric per-output-channel round-to-nearest: W_q = s * clamp(round(W / s), -q, q), s = max|W_row| / q,
    q = 2^(bits-1) - 1. The weight-only INT8/INT4 scheme whose rollout mismatch FlashRL (Yao et al. 2025)
    measures; quantisation happens once per sync, like a calibration-free quantised engine."""
    q = 2 ** (bits - 1) - 1
    scale = weight.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / q
    return (weight / scale).round().clamp(-q, q) * scale


def has_weight_dial(args) -> bool:
    """True when the engine is sent perturbed weights (--rollout-weight-quant or --rollout-weight-noise)."""
    return args.rollout_weight_quant != "none" or args.rollout_weight_noise > 0


def rollout_weights(weights, args):
    """The (name, tensor) pairs the engine receives: the trainer's, or perturbed copies when a weight dial is on.

    Only matrices (dim >= 2: projections, embedding/lm_head) are perturbed; norms and biases are kept, as weight-only
    quantisers do. The noise eps is drawn on the tensor's device from a generator seeded by (--seed, tensor index),
    so every sync sends the same perturbation pattern (a persistent error, like a quantiser's, not fresh noise) and a
    GPU draws it on the GPU. One tensor at a time: the pairs stream through (no second copy of the model)."""
    if not has_weight_dial(args):
        yield from weights
        return
    for i, (name, w) in enumerate(weights):
        if w.dim() >= 2 and w.is_floating_point():
            w = w.detach().float()
            if args.rollout_weight_noise:
                gen = torch.Generator(device=w.device).manual_seed(args.seed * 100_003 + i)
                eps = torch.randn(w.shape, generator=gen, device=w.device)
                w = w + args.rollout_weight_noise * w.pow(2).mean().sqrt() * eps
            if args.rollout_weight_quant != "none":
                w = fake_quantise(w, int(args.rollout_weight_quant[3:]))
        yield name, w


# ---------------------------------------------------------------------------------------------
# FSDP2: sharding, full weights one tensor at a time
# ---------------------------------------------------------------------------------------------
def shard_model(model, device_type: str):
    """torch's FSDP2 on a Hugging Face model: fully_shard on every transformer block (the classes the model names in
    _no_split_modules), then on the root (embeddings, final norm, lm_head; tied weights stay tied). Parameters stay
    fp32 and sharded dim 0 over all ranks; the trainer's autocast computes in --train-dtype as without sharding.
    Every FSDP2 forward is a collective, so all ranks must run the same forwards: rc_train.py turns the shared-prompt
    pass off (it runs one or two forwards depending on the lengths) and check_distributed refuses a token budget."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"--fsdp: {type(model).__name__} names no transformer block class (_no_split_modules)")
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_weights(model):
    """(name, full tensor) for every entry of the model's state dict (a tied lm_head too: vLLM's CPU build keeps its
    own copy), one at a time. Under FSDP2 each is gathered from the shards when it is reached, a collective that
    every rank runs in the same order, so no rank ever holds a full state dict; otherwise they are the live
    parameters (no copy)."""
    from torch.distributed.tensor import DTensor

    for name, t in model.state_dict().items():
        yield name, (t.full_tensor() if isinstance(t, DTensor) else t).detach()


CORRUPT_KEY = "rc_corrupt_prob"  # SamplingParams.extra_args key that switches PlantedTokens on for a request


def planted_tokens_processor():
    """The vLLM logits processor behind --rollout-corrupt-prob (imported lazily: vLLM is heavy).

    At each decoding step of a request that carries extra_args[CORRUPT_KEY] = p, with probability p the row's
    distribution is replaced by a point mass on a token drawn uniformly from the vocabulary. The engine then
    samples that token and, with processed log-probs, reports mu = 1 for it, while the trainer's pi gives it
    roughly 1/vocab or far less: a planted catastrophic token, the failure the worst-token veto is built to catch
    (docs/corrections.md §4.5). Requests without the key (greedy evaluation) are left alone."""
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates

    class PlantedTokens(LogitsProcessor):
        def __init__(self, vllm_config, device, is_pin_memory):
            self.prob: dict[int, float] = {}  # persistent-batch row -> corruption probability
            self.gen = torch.Generator(device="cpu").manual_seed(vllm_config.model_config.seed or 0)

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            def prob(params, _prompt, _output):
                p = (params.extra_args or {}).get(CORRUPT_KEY, 0.0)
                return float(p) if p else None

            process_dict_updates(self.prob, batch_update, prob)

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            if not self.prob:
                return logits
            rows = torch.tensor(sorted(self.prob), dtype=torch.long)
            chance = torch.tensor([self.prob[r] for r in rows.tolist()])
            draw = torch.rand(len(rows), generator=self.gen)
            token = torch.randint(logits.shape[-1], (len(rows),), generator=self.gen)
            hit = draw < chance
            if hit.any():
                rows, token = rows[hit].to(logits.device), token[hit].to(logits.device)
                logits[rows] = float("-inf")
                logits[rows, token] = 0.0
            return logits

    return PlantedTokens


# ---------------------------------------------------------------------------------------------
# The trainer's forward passes: micro-batches sorted by length, trimmed inputs, one forward per shared prompt
# ---------------------------------------------------------------------------------------------
def micro_batches(
    rows: torch.Tensor, batch: dict, size: int, max_tokens: int | None, by_group: bool = False
) -> list[torch.Tensor]:
    """One minibatch's rows, sorted by length and cut into micro-batches of at most `size` sequences and, with a
    token budget, at most `max_tokens` padded tokens (a sequence longer than the budget goes alone). Each
    micro-batch is then trimmed to its own longest prompt and response (trimmed_inputs), so sorting keeps the
    padding small, like verl's dynamic batch size. The loss has global denominators, so the grouping does not
    change it (tests/test_train.py::test_length_batching_gives_the_same_loss_and_gradients)."""
    p, t = batch["prompt_len"][rows], batch["response_len"][rows]
    # by_group (--share-prompt-prefix): a group's rows side by side, so a micro-batch holds few distinct prompts
    key = batch["group"][rows] * (int(t.max()) + 1) + t if by_group else p + t
    order = torch.argsort(key, stable=True)
    rows, p, t = rows[order], p[order], t[order]
    groups, start = [], 0
    while start < len(rows):
        end = min(start + size, len(rows))
        if max_tokens:  # the longest run whose padded size, n x (longest prompt + longest response), fits
            n = torch.arange(1, end - start + 1)
            padded = n * (torch.cummax(p[start:end], 0).values + torch.cummax(t[start:end], 0).values)
            end = start + max(1, int((padded <= max_tokens).sum()))
        groups.append(rows[start:end])
        start = end
    return groups


def trimmed_inputs(batch: dict, rows: torch.Tensor):
    """input_ids and attention_mask of `rows`, cut to their own longest prompt and response; and that response width."""
    P = batch["input_ids"].shape[1] - batch["response_mask"].shape[1]
    p, t = int(batch["prompt_len"][rows].max()), max(1, int(batch["response_len"][rows].max()))
    cols = slice(P - p, P + t)
    return batch["input_ids"][rows][:, cols], batch["attention_mask"][rows][:, cols], t


def shared_prefix_logits(model, input_ids, attention_mask, T: int, group: torch.Tensor) -> torch.Tensor:
    """The logits that predict the last T tokens, each distinct prompt forwarded once: pass 1 runs the distinct
    prompts and keeps their KV cache, each row indexes its prompt's (so its gradients add up there), pass 2 runs the
    responses on it. Same positions and masks as one pass over [prompt | response] (tests/test_train.py). DDP must see
    one forward per backward: pass 1 calls the inner module when pass 2 follows."""
    P = input_ids.shape[1] - T
    distinct, row_prompt = torch.unique(group, return_inverse=True)
    first = torch.empty(len(distinct), dtype=torch.long, device=group.device)
    first[row_prompt] = torch.arange(len(group), device=group.device)  # any row of each prompt: they are identical
    prompt_mask = attention_mask[first, :P]
    out = (getattr(model, "module", model) if T > 1 else model)(
        input_ids=input_ids[first, :P],
        attention_mask=prompt_mask,
        logits_to_keep=1,
        use_cache=True,
        position_ids=(prompt_mask.cumsum(-1) - 1).clamp(min=0),
    )
    cache = out.past_key_values
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[row_prompt], layer.values[row_prompt]
    if T == 1:
        return out.logits[row_prompt]
    position_ids = prompt_mask.sum(-1)[row_prompt, None] + torch.arange(T - 1, device=input_ids.device)
    logits = model(
        input_ids=input_ids[:, P:-1],
        attention_mask=attention_mask[:, :-1],
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=True,
    ).logits
    return torch.cat([out.logits[row_prompt], logits], 1)


# ---------------------------------------------------------------------------------------------
# Metrics across micro-batches and ranks
# ---------------------------------------------------------------------------------------------
# An RS option's own name (seq_max_k2) is not a reduction word: rollout_rs_seq_max_k2_mean is a mean.
_RS_OPTION_IN_NAME = re.compile("rollout_rs_(?:" + "|".join(map(re.escape, rc_core.RS_OPTIONS)) + ")_")


def metric_kind(name: str) -> str:
    """'max' / 'min' for names whose last part has a max/min word (rollout_is_max, log_ppl_diff_min,
    rollout_is_seq_max_deviation, rollout_rs_seq_max_k2_max), else 'mean'."""
    words = _RS_OPTION_IN_NAME.sub("rollout_rs_", name.rsplit("/", 1)[-1]).split("_")
    return "max" if "max" in words else "min" if "min" in words else "mean"


class MetricSum:
    """Accumulates metrics with weights: means are weighted (by valid tokens, or sequences), max/min stay extremes."""

    def __init__(self):
        self.sums: dict[str, list[float]] = {}

    def add(self, metrics: dict, weight: float) -> None:
        for k, v in metrics.items():
            v = float(v)
            kind = metric_kind(k)
            if kind == "mean":
                s = self.sums.setdefault(k, [0.0, 0.0])
                s[0] += weight * v
                s[1] += weight
            elif k not in self.sums:
                self.sums[k] = [v, 1.0]
            else:
                self.sums[k][0] = max(self.sums[k][0], v) if kind == "max" else min(self.sums[k][0], v)

    def local(self) -> dict:
        return {k: (s[0] / s[1] if metric_kind(k) == "mean" and s[1] else s[0]) for k, s in self.sums.items()}


def reduce_metrics(acc: MetricSum, host: HostGroup) -> dict:
    """Metrics of all ranks: weighted means (each rank's sum of weight x value over the sum of weights) and global
    max/min, over the union of the ranks' keys. A rank that lacks a key (e.g. every response of its micro-batch was
    dropped) contributes weight 0 to it; a key no rank has a weight for comes out NaN. No hang: every rank takes
    part in the same collectives with the same key list."""
    if host.world == 1:
        return acc.local()
    keys = sorted(set().union(*host.gather(sorted(acc.sums))))
    means = [k for k in keys if metric_kind(k) == "mean"]
    sums = host.sum([x for k in means for x in acc.sums.get(k, [0.0, 0.0])])
    out = {k: s / w if w > 0 else float("nan") for k, s, w in zip(means, sums[0::2], sums[1::2])}
    for kind, fill in (("max", -float("inf")), ("min", float("inf"))):
        names = [k for k in keys if metric_kind(k) == kind]
        out.update(zip(names, host.extreme([acc.sums[k][0] if k in acc.sums else fill for k in names], kind)))
    return out


def accumulating(accelerator, model, last_micro_batch: bool, fsdp: bool):
    """The context of one micro-batch's backward: gradients are reduced across ranks only on the last micro-batch
    of an optimizer step. DDP: no_sync on the others. FSDP2: no reduce-scatter until the last
    (set_requires_gradient_sync); the unsharded gradients accumulate meanwhile."""
    if fsdp:
        model.set_requires_gradient_sync(last_micro_batch)
        return contextlib.nullcontext()
    if last_micro_batch or accelerator.num_processes == 1:
        return contextlib.nullcontext()
    return accelerator.no_sync(model)


def clip_and_step(accelerator, model, optimizer, max_norm: float) -> float:
    """Clip the gradients to a global L2 norm, take the optimizer step, and return the norm before clipping.
    Under FSDP2 the norm is a DTensor over the sharded gradients, replicated on every rank: its full value is the
    global norm (torch.nn.utils.clip_grad_norm_ computes it from the shards' partial sums)."""
    from torch.distributed.tensor import DTensor

    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


# ---------------------------------------------------------------------------------------------
# The step's bookkeeping: engine faults, the rollout batch's metrics, the progress bar
# ---------------------------------------------------------------------------------------------
def drop_nonfinite(mask: torch.Tensor, rollout_log_prob: torch.Tensor) -> int:
    """Responses with a NaN/inf rollout log-prob (an engine fault) are dropped: mask zeroed, those log-probs set to 0.
    Returns the number of such tokens (rollout/nonfinite_logprob_tokens)."""
    bad = ~torch.isfinite(rollout_log_prob) & (mask > 0)
    mask[bad.any(-1)] = 0.0
    rollout_log_prob[~torch.isfinite(rollout_log_prob)] = 0.0
    return int(bad.sum())


def batch_metrics(args, rewards: list, corrects: list, mask, n_nonfinite: int, version: int, step: int, stale):
    """reward/*, response_length/* and rollout/* of this rank's rollout batch (means over its responses). Every
    response of the batch was sampled by policy version `version`: its staleness is step - version."""
    lengths, staleness = mask.sum(-1), torch.full((len(mask),), step - version)
    return {
        "reward/mean": float(np.mean(rewards)),
        "reward/std": float(np.std(rewards)),
        "reward/correct": float(np.mean(corrects)),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float((lengths >= args.max_response_length).float().mean()),
        "rollout/nonfinite_logprob_tokens": float(n_nonfinite),
        "rollout/policy_version": float(version),
        "rollout/staleness_mean": float(staleness.float().mean()),
        "rollout/staleness_max": float(staleness.max()),
        "rollout/dropped_samples": float(stale.sum()),
    }


def pass_metrics(size: Counter, seconds: float) -> dict:
    """perf/* of the trainer's forward passes this step (pi_old, reference, update): `size` as
    rc_train.forward_log_probs counts it, `seconds` their wall time."""
    return {
        "perf/padding_fraction": 1.0 - size["tokens"] / max(1, size["positions"]),
        "perf/train_tokens_per_s": size["tokens"] / max(1e-9, seconds),
    }


def progress(metrics: dict, last_eval: dict | None, accuracy_key: str) -> dict:
    """The few numbers on the progress bar (eval: the task's accuracy key, Task.accuracy_key)."""
    shown = {"reward": f"{metrics['reward/mean']:.3f}", "len": f"{metrics['response_length/mean']:.0f}"}
    if last_eval:
        name = f"eval/accuracy_{accuracy_key}"
        shown["eval"] = f"{last_eval[name]:.3f}"
    return {**shown, "k3": f"{metrics.get('rollout_corr/k3_kl', 0):.1e}", "step_s": f"{metrics['timing/step_s']:.1f}"}


def progress_bar(start_step: int, num_steps: int, show: bool):
    """The console's progress bar over the run's steps, shown by the main process (its numbers: progress)."""
    from tqdm import tqdm

    return tqdm(range(start_step, num_steps), initial=start_step, total=num_steps, disable=not show, dynamic_ncols=True)


# ---------------------------------------------------------------------------------------------
# Data order and evaluation
# ---------------------------------------------------------------------------------------------
def prompt_indices(n_rows: int, seed: int, position: int, count: int) -> list[int]:
    """Rows position .. position+count-1 of an endless stream of seeded epoch permutations.

    The stream depends only on (seed, position), so a checkpoint needs nothing but the position.
    """
    out = []
    while len(out) < count:
        epoch, offset = divmod(position + len(out), n_rows)
        perm = np.random.default_rng([seed, epoch]).permutation(n_rows)
        out.extend(perm[offset : offset + count - len(out)].tolist())
    return out


def evaluate(task, rollouts, prompts, rows, rank, world, host, version: int, restore: bool = True):
    """Greedy pass@1 of policy version `version` on the eval set (each rank its shard): metrics (eval/accuracy_<key>
    for each score key of the task), and every problem with its response and scores (gathered from all ranks, in
    problem order; the row's question and gold when it has them)."""
    shard = list(range(rank, len(prompts), world))
    outs = rollouts.evaluate([prompts[i] for i in shard], version, restore)  # every rank: a load can be collective
    samples = []
    for i, group in zip(shard, outs):
        ids, _, text = group[0]
        scores = task.score(text, rows[i])
        samples.append(
            {
                "index": i,
                **{k: rows[i][k] for k in ("question", "gold") if k in rows[i]},
                "response": text,
                **{k: scores[k] for k in task.score_keys},
                "tokens": len(ids),
            }
        )
    samples = [s for part in host.gather(samples) for s in part]
    samples.sort(key=lambda r: r["index"])
    n = max(1, len(samples))
    metrics = {f"eval/accuracy_{k}": sum(r[k] for r in samples) / n for k in task.score_keys}
    metrics["eval/response_length"] = sum(r["tokens"] for r in samples) / n
    return metrics, samples


# ---------------------------------------------------------------------------------------------
# Checkpoints, resume, run bookkeeping
# ---------------------------------------------------------------------------------------------
def checkpoint_dirs(run_dir: str) -> list[str]:
    """Complete checkpoints, oldest first. A complete one was renamed from *.tmp after its last file."""
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    names = sorted(
        n
        for n in os.listdir(root)
        if n.startswith("step_")
        and not n.endswith(".tmp")
        and os.path.isfile(os.path.join(root, n, "trainer_state.json"))
    )
    return [os.path.join(root, n) for n in names]


def newest_checkpoint_state(run_dir: str) -> dict | None:
    """trainer_state.json of the run's newest complete checkpoint (None when it has none)."""
    dirs = checkpoint_dirs(run_dir)
    if not dirs:
        return None
    with open(os.path.join(dirs[-1], "trainer_state.json")) as f:
        return json.load(f)


def save_checkpoint(
    run_dir, step, model, optimizer, scheduler, accelerator, counters, in_flight: dict, max_staleness: int
):
    """checkpoints/step_N: model and optimizer through torch distributed checkpoint (each rank writes its own shards
    under FSDP2; replicated DDP tensors are written once), every rank's RNG state and the batches it has in flight
    (--max-staleness k: those of the next k steps, sampled by older versions), the scheduler, and
    trainer_state.json. All of it goes into step_N.tmp, trainer_state.json last, then one rename: a process killed
    during a save leaves a .tmp folder that --resume never loads."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = os.path.join(run_dir, "checkpoints", f"step_{step:06d}")
    tmp = final + ".tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    accelerator.wait_for_everyone()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(tmp, "state"))
    torch.save(
        {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        os.path.join(tmp, f"rng_rank{accelerator.process_index}.pt"),
    )
    torch.save(in_flight, os.path.join(tmp, f"in_flight_rank{accelerator.process_index}.pt"))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        torch.save(scheduler.state_dict(), os.path.join(tmp, "scheduler.pt"))
        if os.environ.get("RC_TRAIN_KILL_IN_CHECKPOINT") == str(step):  # test hook: SIGKILL mid-write
            os.kill(os.getpid(), signal.SIGKILL)
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:  # written last
            json.dump(
                {
                    "step": step,
                    "world_size": accelerator.num_processes,  # the step fixes the data position
                    "max_staleness": max_staleness,
                    **counters,
                },
                f,
            )
        os.replace(tmp, final)
    accelerator.wait_for_everyone()


def load_checkpoint(path, model, optimizer, scheduler, accelerator) -> dict:
    """Model and optimizer state (resharded onto this run's ranks by DCP), the scheduler, and the trainer state. The
    RNG states are restored separately, by restore_rng, once the engine has started: vLLM seeds the global
    generators when it starts, which would overwrite them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    with open(os.path.join(path, "trainer_state.json")) as f:
        state = json.load(f)
    model_state, optim_state = get_state_dict(model, optimizer)  # the layout to load into (creates Adam's state)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(path, "state"))
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    scheduler.load_state_dict(torch.load(os.path.join(path, "scheduler.pt"), weights_only=False))
    return state


def load_in_flight(path: str, rank: int) -> dict:
    """The batches this rank had in flight when the checkpoint was written ({step: result}; empty at k = 0, and for a
    checkpoint written before asynchronous rollout existed, which has no such file)."""
    file = os.path.join(path, f"in_flight_rank{rank}.pt")
    return torch.load(file, weights_only=False) if os.path.isfile(file) else {}


def restore_rng(path: str, rank: int) -> None:
    rng = torch.load(os.path.join(path, f"rng_rank{rank}.pt"), weights_only=False)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])


def truncate_metrics(path: str, start_step: int) -> None:
    """On resume, drop lines of steps that will be run again (rewritten atomically)."""
    if not os.path.isfile(path):
        return
    keep = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] < start_step:
                    keep.append(line)
            except (json.JSONDecodeError, KeyError):  # a line torn by the kill that interrupted the run
                continue
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)


def wandb_run_id(run_dir: str, resume: bool) -> str:
    """The W&B run id of this run folder: stored in wandb_id.txt when the run starts, read back on --resume, so a
    resumed run continues the same W&B run instead of starting a new one."""
    path = os.path.join(run_dir, "wandb_id.txt")
    if resume and os.path.isfile(path):
        with open(path) as f:
            return f.read().strip()
    run_id = hashlib.blake2b(os.urandom(16), digest_size=6).hexdigest()
    with open(path, "w") as f:
        f.write(run_id + "\n")
    return run_id


def weights_sha256(weights) -> str:
    """SHA-256 of (name, tensor) pairs in name order: names and a 64-bit fingerprint of each tensor's bits, computed
    on its device (every word of the tensor times a position weight, summed in int64), so a GPU copies 8 bytes per
    tensor to the host, not the weights. Any changed bit changes the fingerprint."""

    def fingerprint(t: torch.Tensor) -> int:
        t = t.detach().contiguous()
        words = {8: torch.int64, 4: torch.int32, 2: torch.int16}.get(t.element_size())
        bits = (t.view(words) if words else t).flatten().to(torch.int64)
        pos = torch.arange(1, bits.numel() + 1, device=bits.device, dtype=torch.int64) % 1_000_003 + 1
        return int((bits * pos).sum())

    h = hashlib.sha256()  # one tensor at a time (under FSDP2 each is a gathered full tensor), then in name order
    for name, value in sorted((name, fingerprint(t)) for name, t in weights):
        h.update(name.encode() + str(value).encode())
    return h.hexdigest()


def log_rank_checksums(run_dir: str, step: int, rank: int, world: int, token_ids: list, weights) -> None:
    """Data-parallel sanity: every rank appends {step, world_size, SHA-256 of its sampled tokens and of the full
    weights it holds (under FSDP2: gathers the full weights, what its engine receives)} to ranks/rank{r}.jsonl: the
    weights must agree across ranks, the samples must not."""
    rollout = hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()
    os.makedirs(os.path.join(run_dir, "ranks"), exist_ok=True)
    with open(os.path.join(run_dir, "ranks", f"rank{rank}.jsonl"), "a") as f:
        f.write(
            json.dumps(
                {
                    "step": step,
                    "rank": rank,
                    "world_size": world,
                    "rollout_sha256": rollout,
                    "weights_sha256": weights_sha256(weights),
                }
            )
            + "\n"
        )


# ---------------------------------------------------------------------------------------------
# The run folder: creation, config.yaml, logs, resume, final weights
# ---------------------------------------------------------------------------------------------
def check_run_dir(run_dir: str, resume: bool, overwrite: bool, world: int = 1, max_staleness: int = 0) -> bool:
    """Refuse to touch an existing run unless --resume or --overwrite (before anything is written), and a resume
    with another number of processes than its checkpoint's (each rank's RNG state and data shard are in it) or another
    --max-staleness (its batches in flight were sampled for that schedule); True when the folder must be emptied first
    (--overwrite of an existing run)."""
    exists = os.path.isdir(run_dir) and bool(os.listdir(run_dir))
    state = newest_checkpoint_state(run_dir) if resume else None
    if resume and state is None:
        raise FileNotFoundError(f"--resume: no complete checkpoint under {run_dir!r}")
    if resume:
        written_by, k = state.get("world_size", 1), state.get("max_staleness", 0)
        if written_by != world:
            raise ValueError(
                f"--resume: the checkpoint under {run_dir!r} was written by {written_by} process(es), "
                f"this run has {world}: resume with as many"
            )
        if k != max_staleness:
            raise ValueError(
                f"--resume: the checkpoint under {run_dir!r} was written with --max-staleness {k}, this "
                f"run has --max-staleness {max_staleness}: resume with the same bound"
            )
    if exists and not (resume or overwrite):
        raise FileExistsError(f"run folder {run_dir!r} exists; pass --overwrite to replace it or --resume")
    return exists and overwrite and not resume


def open_run_dir(run_dir: str, replace: bool, accelerator, args, rc_config, **facts) -> None:
    """Create the run folder (emptied first when `replace`) and write config.yaml: the arguments, the processes,
    the resolved correction config and `facts` (model path, training rows)."""
    if replace and accelerator.is_main_process:
        shutil.rmtree(run_dir)
    accelerator.wait_for_everyone()
    os.makedirs(run_dir, exist_ok=True)
    if accelerator.is_main_process:
        correction = {
            f.name: (str(v) if isinstance(v := getattr(rc_config, f.name), str) else v)  # str(): an unset
            for f in dataclasses.fields(rc_config)
            if f.init
        }  # loss_type is a str subclass
        config = {
            "args": dataclasses.asdict(args),
            "world_size": accelerator.num_processes,
            "distributed_type": str(accelerator.distributed_type),
            "model_path": facts.pop("model_path"),
            "rollout_correction": correction,
            **facts,
        }
        with open(os.path.join(run_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(config, f, sort_keys=False)


def resume(run_dir: str, model, optimizer, scheduler, accelerator, counters: dict) -> tuple[str, int, dict]:
    """Load the newest complete checkpoint; drop the log lines of the steps that will run again.
    Returns (checkpoint path, first step to run, counters). The RNG states are restored later, by
    restore_rng, once the engine has started."""
    ckpt = checkpoint_dirs(run_dir)[-1]
    state = load_checkpoint(ckpt, model, optimizer, scheduler, accelerator)
    start_step = state["step"] + 1
    if accelerator.is_main_process:
        for name in ("metrics.jsonl", "eval_samples.jsonl"):
            truncate_metrics(os.path.join(run_dir, name), start_step)
    truncate_metrics(os.path.join(run_dir, "ranks", f"rank{accelerator.process_index}.jsonl"), start_step)
    if accelerator.is_main_process:
        print(f"resumed from {ckpt} at step {start_step}")
    return ckpt, start_step, {k: state[k] for k in counters}


class RunLog:
    """The run's logs, written by the main process only: metrics.jsonl (one line per step, keys sorted),
    eval_samples.jsonl, and the same figures to every tracker of --log-with through Accelerate (init_trackers /
    accelerator.log, main process only). A W&B run keeps its id in wandb_id.txt, so --resume continues it."""

    def __init__(self, run_dir: str, accelerator):
        self.run_dir, self.accelerator, self.main = run_dir, accelerator, accelerator.is_main_process
        self.file = open(os.path.join(run_dir, "metrics.jsonl"), "a") if self.main else None

    def start_trackers(self, args, run_name: str) -> None:
        if not args.log_with:
            return
        init = {
            "wandb": {
                "name": run_name,
                "entity": args.wandb_entity,
                "dir": self.run_dir,
                "resume": "allow",
                "id": wandb_run_id(self.run_dir, args.resume) if self.main else None,
            }
        }
        self.accelerator.init_trackers(
            args.wandb_project_name,
            config=flat_config(dataclasses.asdict(args)),
            init_kwargs={k: v for k, v in init.items() if k in args.log_with},
        )

    def log(self, step: int, metrics: dict, trackers: bool = True) -> None:
        """One line of metrics.jsonl; with `trackers`, keys sorted and the same figures to the trackers."""
        if trackers:
            self.accelerator.log(metrics, step=step)
        if self.main:
            self.file.write(
                json.dumps({"step": step, **(dict(sorted(metrics.items())) if trackers else metrics)}) + "\n"
            )
            self.file.flush()

    def eval_samples(self, step: int, samples: list[dict]) -> None:
        if self.main:
            with open(os.path.join(self.run_dir, "eval_samples.jsonl"), "a") as f:
                f.writelines(json.dumps({"step": step, **s}) + "\n" for s in samples)

    def close(self) -> None:
        for tracker in self.accelerator.trackers:  # end_training() would also destroy the process group, which the
            tracker.finish()  # engine (and exit_cleanly) still need
        if self.main:
            self.file.close()


def flat_config(config: dict, prefix: str = "") -> dict:
    """Nested settings as one level of 'a.b' keys with scalar values (what TensorBoard's hparams accept)."""
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(flat_config(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


class LogRatioDump:
    """--dump-log-ratio-every: log(pi_trainer/pi_rollout) of the valid tokens of one step, rows one after another,
    to log_ratio/step_N.npy, and each row's number of valid tokens to log_ratio/lengths/step_N.npy (so the flat
    array splits back into responses: the lab's length law). `add` takes (B, T) log-ratio and response-mask pairs:
    decoupled mode adds log(pi_old/pi_rollout) once, bypass mode the first minibatch's log(pi_theta/pi_rollout).
    Inactive on a step off the schedule (every `every` steps; 0 = never) and on all but the main process."""

    def __init__(self, run_dir: str, step: int, every: int, main_process: bool):
        self.folder, self.step, self.chunks = os.path.join(run_dir, "log_ratio"), step, []
        self.active = bool(every) and step % every == 0 and main_process

    def add(self, log_ratio: torch.Tensor, response_mask: torch.Tensor) -> None:
        if self.active:
            self.chunks.append((log_ratio.detach().cpu(), response_mask.cpu()))

    def save(self) -> None:
        if not self.active:
            return
        os.makedirs(os.path.join(self.folder, "lengths"), exist_ok=True)
        flat = [ratio[m > 0] for ratio, m in self.chunks]
        flat = torch.cat(flat).float().numpy() if flat else np.zeros(0, np.float32)
        lengths = [m.sum(-1) for _, m in self.chunks]
        lengths = torch.cat(lengths).to(torch.int32).numpy() if lengths else np.zeros(0, np.int32)
        np.save(os.path.join(self.folder, f"step_{self.step:06d}.npy"), flat)
        np.save(os.path.join(self.folder, "lengths", f"step_{self.step:06d}.npy"), lengths)


class StepTimer:
    """The timing/* seconds of one step: `with timer("timing/update_s"): ...` adds that block's wall time to the
    name; `seconds` starts from the figures given (the rollout's, measured by the engine) and `elapsed()` is the
    time since the timer was made (timing/step_s)."""

    def __init__(self, seconds: dict | None = None):
        self.start, self.seconds = time.time(), dict(seconds or {})

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.time()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.time() - t0

    def elapsed(self) -> float:
        return time.time() - self.start


def save_final(run_dir: str, model, tokenizer, accelerator) -> None:
    """final/: the trained weights with save_pretrained (loadable by transformers and vLLM). Under FSDP2 the full
    state dict is gathered onto the main process's CPU memory (torch's get_model_state_dict), the other ranks keep
    none of it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    unwrapped = accelerator.unwrap_model(model)
    state_dict = get_model_state_dict(unwrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # a tied lm_head comes back as a separate gathered copy: keep each parameter under its first name only
    owned = {n for n, _ in unwrapped.named_parameters()} | {n for n, _ in unwrapped.named_buffers()}
    state_dict = {k: v for k, v in state_dict.items() if k in owned}
    if accelerator.is_main_process:
        unwrapped.save_pretrained(os.path.join(run_dir, "final"), state_dict=state_dict)
        tokenizer.save_pretrained(os.path.join(run_dir, "final"))


def print_summary(
    first_eval: dict | None, last_eval: dict | None, n_eval: int, seconds: float, run_dir: str, accuracy_key: str
) -> None:
    """The closing lines on the console: greedy accuracy under the task's accuracy key (Task.accuracy_key) before ->
    after, wall time, where the run is."""
    name = f"eval/accuracy_{accuracy_key}"
    line = f"eval accuracy ({accuracy_key}, greedy, {n_eval} problems): "
    if first_eval and last_eval:
        line += f"{first_eval[name]:.3f} before -> {last_eval[name]:.3f} after"
    elif last_eval:
        line += f"{last_eval[name]:.3f} after training"
    print(f"{line}\nwall time: {seconds:.0f} s\nrun folder: {run_dir}\ndashboard: python rc_train.py plot {run_dir}")


def exit_cleanly(world: int) -> None:
    """End a multi-process run: destroy the process group, flush, and leave with os._exit(0). A plain interpreter
    exit after gloo collectives or torch distributed checkpoint aborts some of the time on these machines
    ("terminate called without an active exception", SIGABRT, though every file is written: docs/gpus.md)."""
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
