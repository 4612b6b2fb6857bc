"""Configuration: the command line and YAML files become one checked Args, before anything is built.

What belongs here decides what a run is, and is read or refused before the tokenizer, the data, the model or the engine
exist and before anything is written: the YAML loader and the command line (tyro), the type and range checks of every
Args section (validate_args; the correction settings are checked by rc_core when build_correction_config builds
them), the launcher and process checks, and the defaults that depend on the machine (the staleness bound, torch's
threads). Unit-tested in tests/test_infra.py and tests/test_cli.py.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Annotated, Any, Literal, NamedTuple

import torch
import tyro
import yaml

import rc_checkpoint
import rc_core
import rc_run
import tasks


# ---------------------------------------------------------------------------------------------
# The command line and YAML files: values typed as the fields are
# ---------------------------------------------------------------------------------------------
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


class _YamlLoader(yaml.SafeLoader):
    """yaml.safe_load, with YAML 1.2 floats: '1e-4' is a number (YAML 1.1 reads it as a string) and '0.5_5' stays
    the string it is meant to be (YAML 1.1 drops the underscore and reads 0.55), so an IcePop bound 'L_U' or a
    multi-option RS threshold may be written unquoted, and every number reaches its field as a number.
    A key given twice in one mapping is refused (_DuplicateKey), not settled silently by the last value."""

    def get_single_node(self):
        node = super().get_single_node()
        _refuse_duplicate_keys(node)
        return node


class _DuplicateKey(ValueError):
    """A YAML mapping that names a key twice: the key (dotted, e.g. rc.preset), both values and their lines."""


def _refuse_duplicate_keys(node, prefix: str = "", seen_nodes: set | None = None) -> None:
    """Raise _DuplicateKey for the first key given twice in a mapping of the composed YAML `node` (merge keys `<<`
    and what they merge in are the override YAML means, not a duplicate). An aliased node is looked at once."""
    seen_nodes = set() if seen_nodes is None else seen_nodes
    if id(node) in seen_nodes:
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(item, f"{prefix[:-1]}[{i}].", seen_nodes)
    if not isinstance(node, yaml.MappingNode):
        return

    def said(value) -> str:
        if isinstance(value, yaml.ScalarNode):
            return repr(value.value) if value.style or value.value == "" else value.value
        return "a mapping" if isinstance(value, yaml.MappingNode) else "a list"

    seen = {}
    for key, value in node.value:
        if key.tag == "tag:yaml.org,2002:merge" or not isinstance(key, yaml.ScalarNode):
            continue
        if (key.tag, key.value) in seen:
            first = seen[(key.tag, key.value)]
            raise _DuplicateKey(
                f"{prefix}{key.value} is given twice: {said(first)} (line {first.start_mark.line + 1}) and "
                f"{said(value)} (line {value.start_mark.line + 1}); keep one"
            )
        seen[(key.tag, key.value)] = value
        _refuse_duplicate_keys(value, f"{prefix}{key.value}.", seen_nodes)


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


def load_yaml_defaults(cls, path: str, *, ignore_unknown: bool = False, **extra):
    """An instance of the dataclass `cls` whose values come from a YAML file: flat keys, plus one mapping per nested
    dataclass field (e.g. `rc:`). Values are handed over as YAML typed them (numbers as numbers); unknown keys fail,
    or with `ignore_unknown` the top-level keys `cls` lacks are skipped (a benchmark that reads part of a config)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file not found: {path!r}")
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.load(f, Loader=_YamlLoader) or {}
    except _DuplicateKey as e:
        raise ValueError(f"config {path!r}: {e}") from None
    except OSError as e:
        raise ValueError(f"config {path!r} cannot be read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"config {path!r} is not UTF-8 text (byte {e.start})") from None
    except yaml.YAMLError as e:  # a syntax error: where it is, in the file's own line and column numbers
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = " ".join(str(getattr(e, "problem", None) or e).split())
        raise ValueError(f"config {path!r}: YAML syntax error at {where}{what}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"config {path!r} must hold a mapping, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    nested = {k: f.default_factory for k, f in fields.items() if dataclasses.is_dataclass(f.default_factory)}
    if ignore_unknown:
        raw = {k: v for k, v in raw.items() if k in fields}
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
    with rc_run.refused(ValueError, TypeError, FileNotFoundError):  # a bad config file: one line
        default = load_defaults(config) if config else cls()
        if config:  # a YAML value of the wrong type, refused even where a flag overrides it: tyro misreads its flag
            check_field_types(default, config=config)
    return tyro.cli(cls, default=default, args=argv)


def check_field_types(obj, prefix: str = "", config: str | None = None) -> None:
    """Raise ValueError naming the first field of the dataclass `obj` whose value does not have its annotated type
    (int, float, bool, str, None, Literal choices, a nested dataclass). tyro checks the command line, but YAML
    values reach the fields as YAML typed them ('ten' steps, reward_mode 'strik'), so they are checked here.
    With `config` (the YAML file `obj` was read from): the fields of its nested dataclasses too, each named as its
    key in that file (`config 'f.yaml': rc.bypass_mode must be ...`) instead of as its flag."""
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
        if config is not None and dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_field_types(value, f"{prefix}{name}.", config)
        if fits(value, hint):
            continue
        if config is not None:
            raise ValueError(f"config {config!r}: {prefix}{name} must be {describe(hint)}, got {value!r}")
        raise ValueError(f"--{prefix}{name.replace('_', '-')} must be {describe(hint)}, got {value!r}")


def _local_path(model: str) -> bool:
    """--model names a local folder (not a Hugging Face id such as Qwen/Qwen2.5-0.5B-Instruct): it starts with '/',
    '.' or '~', has more than one '/', or exists."""
    return model.startswith(("/", ".", "~")) or model.count("/") > 1 or os.path.exists(model)


# ---------------------------------------------------------------------------------------------
# Checks of every Args section, before anything is built or written
# ---------------------------------------------------------------------------------------------
def validate_args(args, world_size: int) -> tasks.Task:
    """Fail fast with a message naming the bad value (before tokenizer, data or engine, and before anything is
    written to the run folder); return the task the checks built. The correction settings (--rc.*) are checked by
    rc_core when the config is built (build_correction_config), the task and its settings (--task, --mini.*,
    --reward-mode, --format-bonus) by tasks.make_task and tasks.check_reward_settings, the loss settings by
    rc_core.check_loss_settings. Types first (YAML values arrive unchecked), so every later comparison compares
    numbers."""
    check_field_types(args)
    check_field_types(args.mini, prefix="mini.")
    _check_names_and_paths(args)
    _check_trackers(args)
    task = _check_data_and_task(args, world_size)
    _check_rollout(args, world_size)
    _check_schedule_and_dials(args)
    _check_engine(args)
    _check_optimisation(args)
    _check_loss(args)
    _check_moe_settings(args)
    return task


def need(cond, msg: str) -> None:
    """Raise ValueError(msg) unless cond: each check states the condition that must hold and what to say if not."""
    if not cond:
        raise ValueError(msg)


def _check_names_and_paths(args) -> None:
    """--exp-name, --run-name, --resume, --output-dir and --model name something usable."""
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
    need(
        model.strip() != "",
        f"--model must be 'tiny', 'tiny-moe', a local model folder or a Hugging Face model id, got {model!r}",
    )
    if model not in (tasks.TINY_MODEL, tasks.TINY_MOE_MODEL) and _local_path(model) and not os.path.isdir(model):
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


def _check_trackers(args) -> None:
    """--log-with names installed Accelerate trackers; a W&B project name W&B accepts."""
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


def _check_data_and_task(args, world_size: int) -> tasks.Task:
    """The seed, the data limits and the task's own settings (tasks.make_task checks --mini.*); the task built."""
    need(
        0 <= args.seed <= 2**32 - world_size,
        f"--seed must be in [0, {2**32 - world_size}] (numpy and vLLM take 32-bit seeds; rank r's engine uses "
        f"seed + r), got {args.seed}",
    )

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
    return task


def _check_rollout(args, world_size: int) -> None:
    """Batch shapes over the ranks, lengths, sampling."""
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
    batch = rollout_batch_size(args, world_size)
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
    _check_replay(args, world_size)
    _check_partial_rollout(args)
    need(
        args.train_dtype != "float16",
        f"--train-dtype must be float32 or bfloat16, got {args.train_dtype}: the trainer has no gradient scaler, "
        f"so float16 gradients underflow; use bfloat16 (no scaler needed) or float32",
    )


def _check_replay(args, world_size: int) -> None:
    """--replay-window and --replay-fraction give each step at least one fresh and one replayed whole group."""
    W, f = args.replay_window, args.replay_fraction
    need(W >= 0, f"--replay-window must be >= 0 (steps whose fresh groups are kept; 0 = no buffer), got {W}")
    need(
        0.0 <= f < 1.0,
        f"--replay-fraction must be in [0, 1) (the share of a step's groups replayed; 1 would sample nothing), got {f}",
    )
    if f == 0:
        return
    need(W >= 1, f"--replay-fraction {f} needs --replay-window >= 1 (the steps it replays from), got {W}")
    per_rank, replayed = prompts_per_rank(args, world_size), replay_groups(args, world_size)
    need(
        replayed >= 1,
        f"--replay-fraction {f} replays round({f} x {per_rank} prompt groups per rank) = 0 whole groups (a group is "
        f"replayed whole, for its GRPO baseline): raise it or --num-prompts-per-step",
    )
    need(
        replayed < per_rank,
        f"--replay-fraction {f} replays all {per_rank} prompt groups per rank (round({f} x {per_rank})), leaving no "
        f"fresh group: lower it or raise --num-prompts-per-step",
    )


def _check_partial_rollout(args) -> None:
    """--partial-rollout (docs/async.md §9): its round length and token bound, and what reads one version per row."""
    tokens, bound, k = args.partial_rollout_tokens, args.partial_rollout_max_staleness, args.max_staleness or 0
    need(tokens >= 1, f"--partial-rollout-tokens must be >= 1 (tokens per response per round), got {tokens}")
    need(
        bound is None or bound >= k,
        f"--partial-rollout-max-staleness {bound} is below --max-staleness {k}: every token of every response would "
        f"be masked; use >= {k} (None = {k} + 1)",
    )
    if not args.partial_rollout:
        return
    one_version = [
        ("--replay-fraction > 0", args.replay_fraction > 0),
        ("--mismatch-split", args.mismatch_split),
        (f"--prox-logp {args.prox_logp}", args.prox_logp in ("sampling", "loglinear")),
        ("--routing-replay / --routing-metrics", routing_capture(args)),
    ]
    for flag, on in one_version:
        need(
            not on,
            f"--partial-rollout with {flag}: it reads one policy version (or one routing) per response, and a partial "
            f"response has several (docs/async.md §9); drop one",
        )


def _check_schedule_and_dials(args) -> None:
    """The weight-sync and staleness schedule (the rollout worker is CPU-only), and the lab's mismatch dials."""
    need(args.sync_every >= 0, f"--sync-every must be >= 0, got {args.sync_every}")
    k = args.max_staleness
    need(k is None or k >= 0, f"--max-staleness must be >= 0 (0 = the synchronous loop), got {k}")
    if uses_rollout_worker(args):
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


def _check_engine(args) -> None:
    """The engine's memory and scheduler settings."""
    need(
        args.vllm_sleep_level in (None, 1, 2),
        f"--vllm-sleep-level must be 1, 2 or None (by rule: rc_rollout.sleep_level), got {args.vllm_sleep_level}",
    )
    need(
        args.vllm_sleep_level != 2 or args.sync_every == 1,
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
        # CPU: prefills are never split (see rc_rollout.engine_limits), so one step must hold the longest sequence.
        need(
            tokens >= args.max_model_len,
            f"--vllm-max-num-batched-tokens {tokens} is below --max-model-len {args.max_model_len}: the CPU engine "
            f"never splits a prefill, so raise --vllm-max-num-batched-tokens or lower --max-model-len",
        )
    need(
        tokens is None or args.vllm_max_num_seqs is None or tokens >= args.vllm_max_num_seqs,
        f"--vllm-max-num-batched-tokens {tokens} must be >= --vllm-max-num-seqs {args.vllm_max_num_seqs}",
    )


def _check_optimisation(args) -> None:
    """The optimiser, the update's loops, evaluation and checkpoint cadence."""
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
    need(
        not (args.compile and args.fsdp),
        "--compile with --fsdp: compiling the layers that FSDP2 shards (its hooks gather every layer's weights) is "
        "not built or verified here; drop one of them",
    )
    need(
        not (args.compile and (args.routing_replay != "none" or args.routing_metrics)),
        "--compile with --routing-replay or --routing-metrics: the router hooks that replay and record the routing "
        "(rc_moe) run inside the layers, which torch.compile would trace; drop one of them",
    )

    need(args.eval_every >= 0, f"--eval-every must be >= 0 (0 = only at the end), got {args.eval_every}")
    need(args.checkpoint_every >= 0, f"--checkpoint-every must be >= 0 (0 = never), got {args.checkpoint_every}")
    need(
        args.keep_checkpoints >= 1,
        f"--keep-checkpoints must be >= 1 (the checkpoint just written is always kept), got {args.keep_checkpoints}",
    )


def _check_loss(args) -> None:
    """The advantage estimator, the KL penalty and the loss settings (rc_core's own checks; the message says which
    flag gave a clip value that was not set itself)."""
    need(
        args.adv_estimator in rc_core.ADVANTAGE_ESTIMATORS,
        f"--adv-estimator must be one of {', '.join(rc_core.ADVANTAGE_ESTIMATORS)} (rc_core.ADVANTAGE_ESTIMATORS), "
        f"got {args.adv_estimator!r}",
    )
    if args.kl_coef > 0:
        rc_core.kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), args.kl_estimator)  # raises on unknown names
    low, high = clip_bounds(args)
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


def _check_moe_settings(args) -> None:
    """The Mixture-of-Experts settings that need no model: the router scale, replay on the dense tiny model, replay
    under gradient checkpointing, and the routing capture, which only the CPU engine provides. The rest needs the
    model's config: rc_moe.check_model, before the engine starts."""
    need(
        args.moe_router_scale > 0 and math.isfinite(args.moe_router_scale),
        f"--moe-router-scale must be a finite number > 0 (the standard deviation of the router's initial weights), "
        f"got {args.moe_router_scale}",
    )
    replay = args.routing_replay
    need(
        replay == "none" or args.model != "tiny",
        f"--routing-replay {replay} needs a Mixture-of-Experts model, and --model tiny is dense: use --model tiny-moe",
    )
    need(
        args.routing_metrics is not True or args.model != "tiny",
        "--routing-metrics needs a Mixture-of-Experts model, and --model tiny is dense: use --model tiny-moe",
    )
    need(
        replay == "none" or not args.gradient_checkpointing,
        f"--routing-replay {replay} cannot run under --gradient-checkpointing: the recomputed forward would run "
        f"outside the replayed pass and route on its own",
    )
    if torch.cuda.is_available():  # vLLM's native enable_return_routed_experts is not wired up (docs/moe.md)
        need(
            replay != "r3",
            "--routing-replay r3 needs the engine's routing, and only vLLM's CPU build is captured here (docs/moe.md): "
            "use --routing-replay reference on GPUs",
        )
        need(
            not args.routing_metrics,
            "--routing-metrics needs the engine's routing, and only vLLM's CPU build is captured here (docs/moe.md)",
        )


def routing_capture(args) -> bool:
    """The engine records each sample's MoE routing (rc_rollout.MoEEngine): for r3 replay and the routing metrics."""
    return args.routing_replay == "r3" or bool(args.routing_metrics)


# ---------------------------------------------------------------------------------------------
# Settings derived from others: one rule each, read wherever the setting is used
# ---------------------------------------------------------------------------------------------
def clip_bounds(args) -> tuple[float, float]:
    """The PPO clip range (epsilon_low, epsilon_high): --clip-ratio-low / --clip-ratio-high, each --clip-ratio when
    unset."""
    return tuple(args.clip_ratio if eps is None else eps for eps in (args.clip_ratio_low, args.clip_ratio_high))


def uses_rollout_worker(args) -> bool:
    """The engine runs in a rollout worker process of its own: asynchronous rollout (--max-staleness k >= 1), or
    --rollout-worker at k = 0."""
    return bool(args.max_staleness) or args.rollout_worker


def prompts_per_rank(args, world: int) -> int:
    """Each rank's share of --num-prompts-per-step (validate_args: a multiple of the world size)."""
    return args.num_prompts_per_step // world


def replay_groups(args, world: int) -> int:
    """The whole prompt groups each rank replays per step once the buffer holds enough: round(f x its prompts)."""
    return math.floor(args.replay_fraction * prompts_per_rank(args, world) + 0.5)


def rollout_batch_size(args, world: int) -> int:
    """Each rank's rollout batch: its prompts x --num-samples-per-prompt responses."""
    return prompts_per_rank(args, world) * args.num_samples_per_prompt


@dataclass
class CorrectionArgs:
    """Rollout correction: a preset from rc_core, then optional per-field overrides. Fields have the types of
    rc_core.RolloutCorrectionConfig; None (the default) keeps the preset's value, and the literal 'none' (CLI or
    YAML) switches an option off (it becomes None in the config)."""

    preset: str = "decoupled_k3_rs_token_tis"
    """name of a RolloutCorrectionConfig preset (rc_core.PRESET_NAMES), e.g. decoupled_token_is, disabled. The default,
    token-TIS with a k3 rejection gate in decoupled mode, logs every dashboard panel (docs/corrections.md §9.2)"""
    rollout_is: str | None = None
    """override: IS level 'token' | 'sequence' | 'geometric' (opt-in, warns: docs/design-readings.md §10); 'none'
    switches IS off"""
    rollout_is_threshold: Threshold = None
    """override: TIS cap (a number, e.g. 3; inf = no truncation) or IcePop bounds 'L_U' (e.g. 0.5_5, read as text,
    not as 0.55)"""
    rollout_is_batch_normalize: bool | None = None
    """override: self-normalise IS weights over the batch (docs/corrections.md §3.7)"""
    rollout_rs: str | None = None
    """override: comma-separated rejection options (e.g. 'seq_mean_k1,token_k3'); 'none' switches RS off"""
    rollout_rs_threshold: Threshold = None
    """override: rejection thresholds, one entry or one per option (0.999_1.001, 0.01, '0.999_1.001,0.01')"""
    rollout_rs_threshold_lower: float | None = None
    """override: lower bound for the legacy RS names token/sequence/geometric"""
    rollout_token_veto_threshold: float | Literal["none"] | None = None
    """override: veto tau in (0,1): reject a sequence if any token ratio < tau; 'none' switches the veto off"""
    bypass_mode: bool | None = None
    """override: True = bypass (pi_old := pi_rollout), False = decoupled"""
    loss_type: str | None = None
    """override: 'ppo_clip' or 'reinforce' (reinforce needs bypass mode); 'none' = unset: ppo_clip, or what
    use_policy_gradient implies"""
    use_policy_gradient: bool | None = None
    """override, legacy alias of loss_type: True = reinforce, False = ppo_clip; an explicit loss_type (the preset's
    or --rc.loss-type) that differs is refused (docs/corrections.md §9.1)"""
    loss_mode: str | None = None
    """override: the policy objective, a name of rc_core.POLICY_LOSSES (verl's policy_loss.loss_mode): vanilla
    (PPO-clip, the default), gspo, gspo_token, cispo, cispo_verl, sapo, geo_mean, dppo_tv, dppo_kl, clip_cov,
    kl_cov, luspo, vespo, dro, gpg, ipo (docs/corrections.md §7.7); with loss_type ppo_clip, in decoupled or bypass
    mode"""
    clip_cov_ratio: float | None = None
    """override: clip_cov: share of tokens in (0, 1) whose covariance gets its gradient cut (verl: 0.0002)"""
    clip_cov_lb: float | None = None
    """override: clip_cov: lower bound of the covariance band (verl: 1.0)"""
    clip_cov_ub: float | None = None
    """override: clip_cov: upper bound of the covariance band (verl: 5.0)"""
    kl_cov_ratio: float | None = None
    """override: kl_cov: share of tokens in (0, 1) with the largest covariance that get the KL term (verl: 0.0002)"""
    ppo_kl_coef: float | None = None
    """override: kl_cov: coefficient of its per-token KL term (verl: 0.1)"""
    tau_pos: float | None = None
    """override: sapo: gate temperature for positive advantages (verl: 1.0)"""
    tau_neg: float | None = None
    """override: sapo: gate temperature for negative advantages (verl: 1.05)"""
    rollout_is_threshold_lower: float | Literal["none"] | None = None
    """override: two-sided TIS, the lower clamp C_min of the IS weight (0 < C_min < the cap; e.g. 0.5 with cap 5)"""
    rollout_opsm_threshold: float | Literal["none"] | None = None
    """override: off-policy sequence mask delta > 0: drop a negative-advantage response whose mean log(mu/pi) > delta
    (DeepSeek-V3.2; docs/corrections.md §4.6)"""
    rollout_m2_threshold: float | Literal["none"] | None = None
    """override: M2PO: mask the tokens with the largest squared log-ratio until its batch mean <= this (> 0; §4.7)"""
    rollout_outlier_threshold_low: float | Literal["none"] | None = None
    """override: two-sided worst-token rejection: a response with a token ratio below this is rejected (§4.8)"""
    rollout_outlier_threshold_high: float | Literal["none"] | None = None
    """override: two-sided worst-token rejection: a response with a token ratio above this is rejected (§4.8)"""
    vespo_k_pos: float | None = None
    """override: vespo: power k of its gate W^k e^(lambda (1 - W)) for A >= 0 (TRL: 2.0)"""
    vespo_lambda_pos: float | None = None
    """override: vespo: decay lambda > 0 of its gate for A >= 0 (TRL: 3.0)"""
    vespo_k_neg: float | None = None
    """override: vespo: power k of its gate for A < 0 (TRL: 3.0)"""
    vespo_lambda_neg: float | None = None
    """override: vespo: decay lambda > 0 of its gate for A < 0 (TRL: 2.0)"""
    dro_beta: float | None = None
    """override: dro: beta > 0 of its penalty (beta/2)(log pi_theta - log pi_prox)^2 (ours 0.1; verl has no default)"""
    rollout_sq_log_ratio_coef: float | None = None
    """override: tau >= 0 of tau (log pi_theta - log mu)^2, mu the rollout's (Kimi-K2.5; corrections §7.9); 0 = off"""


def check_prox_logp(args, correction: rc_core.RolloutCorrectionConfig) -> None:
    """--prox-logp loglinear | metrics | sampling change how decoupled mode gets pi_old from each sample's version
    (§7.10, §6.9): they need decoupled mode and samples older than the weights; loglinear corrects per micro-batch,
    so nothing that needs the whole batch's pi_old. --mismatch-split and sampling score rows at kept weights: not
    under FSDP2 (sharded weights) or routing replay (that pass has no replayed routing)."""
    method, k = args.prox_logp, args.max_staleness
    if args.mismatch_split or method == "sampling":
        flag = "--mismatch-split" if args.mismatch_split else "--prox-logp sampling"
        need(not args.fsdp, f"{flag} with --fsdp: the kept weights are whole copies, FSDP2's are sharded; drop one")
        need(
            args.routing_replay == "none",
            f"{flag} with --routing-replay {args.routing_replay}: the pass at a kept version has no replayed "
            f"routing; drop one",
        )
    if method == "recompute":
        return
    need(
        not correction.bypass_mode,
        f"--prox-logp {method} changes decoupled mode's pi_old, but preset {args.rc.preset!r} is bypass (pi_old "
        f"is mu there, no pass to change): use a decoupled preset or --prox-logp recompute",
    )
    why = "alpha = 0: pi_old = mu, bypass" if method != "sampling" else "the sampling weights are the current ones"
    need(
        bool(k) or args.replay_fraction > 0,
        f"--prox-logp {method} needs samples older than the trainer's weights, but with --max-staleness {k} and no "
        f"replay every sample is current ({why}): set --max-staleness >= 1 or --replay-fraction > 0",
    )
    if method != "loglinear":
        return
    for name, on in (
        ("--rc.rollout-is-batch-normalize", correction.rollout_is_batch_normalize),
        ("--rc.rollout-m2-threshold", correction.rollout_m2_threshold is not None),
        ("--dump-log-ratio-every", args.dump_log_ratio_every > 0),
    ):
        need(
            not on,
            f"--prox-logp loglinear with {name}: it needs the whole batch's pi_old, which loglinear has per "
            f"micro-batch only; use --prox-logp recompute",
        )


SWITCH_OFF = "none"  # the value that switches a correction option off from the CLI or YAML (build_correction_config)


def build_correction_config(rc) -> rc_core.RolloutCorrectionConfig:
    """The preset, with every field the user set replaced; SWITCH_OFF ('none') becomes None. rc_core validates."""
    set_fields = {
        k: None if isinstance(v, str) and v.strip().lower() == SWITCH_OFF else v
        for k, v in dataclasses.asdict(rc).items()
        if k != "preset" and v is not None
    }
    preset = rc_core.RolloutCorrectionConfig.from_name(rc.preset)
    # replace() constructs anew; without overrides keep the preset itself, so that a preset's deliberate construction
    # (ppo_is_bypass: metrics-only IS, no warning; docs/design-readings.md §9) reaches the trainer unchanged
    return dataclasses.replace(preset, **set_fields) if set_fields else preset


# ---------------------------------------------------------------------------------------------
# The launcher and the processes it started; defaults that depend on the machine
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


def check_token_budget(args, longest_prompt: int) -> None:
    """A micro-batch token budget must hold the longest sequence a step can train on: the longest training prompt
    (tokenized, chat template included: known only once the tokenizer exists, so rc_train.py calls this after
    encoding the prompts, before the engine starts) plus --max-response-length. Checked against the prompts rather
    than --max-model-len, which would refuse budgets that every real sequence fits. Below it, such a sequence could
    only go alone and over the budget that was meant to bound the micro-batch's memory."""
    budget, longest = args.max_tokens_per_micro_batch, longest_prompt + args.max_response_length
    need(
        budget is None or budget >= longest,
        f"--max-tokens-per-micro-batch {budget} is below the longest sequence a step can hold: the longest training "
        f"prompt ({longest_prompt} tokens) + --max-response-length {args.max_response_length} = {longest}",
    )


def resolve_max_staleness(args, on_gpu: bool, run_dir: str) -> int:
    """--max-staleness as given, or its default (None): on --resume the bound the checkpoint was written with (its
    batches in flight belong to that schedule); else 0 on GPUs (the rollout worker is CPU-only) or with --sync-every
    other than 1 (the synchronous loop's own lag dial), and 1 on a CPU."""
    if args.max_staleness is not None:
        return args.max_staleness
    state = rc_checkpoint.newest_checkpoint_state(run_dir) if args.resume else None
    if state is not None:
        return state.get("max_staleness", 0)
    return 0 if on_gpu or args.sync_every != 1 else 1


def check_environment(environ=os.environ) -> None:
    """The environment variables the trainer reads, checked at start like its flags (one line naming the variable and
    its value): OMP_NUM_THREADS (torch's and the CPU engine's threads: a positive integer), RC_CACHE_DIR (the tiny
    models' cache: a folder, or a path where one can be made; whether it can be written is checked when a model is
    built there, tasks.cached_build, since a read-only cache that holds the model serves), RC_TRAIN_KILL_IN_CHECKPOINT
    (the tests' hook: a step number)."""
    threads = environ.get("OMP_NUM_THREADS")
    if threads is not None and threads.strip():
        need(
            threads.strip().isdigit() and int(threads) >= 1,
            f"OMP_NUM_THREADS must be a positive integer (the threads of torch and of the CPU engine), got {threads!r}",
        )
    cache = environ.get("RC_CACHE_DIR")
    if cache is not None:
        need(cache.strip() != "", "RC_CACHE_DIR is set but empty: unset it (~/.cache/rc_train) or name a folder")
        existing = os.path.abspath(cache)
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        need(
            os.path.isdir(existing),
            f"RC_CACHE_DIR {cache!r} cannot be a folder: {existing!r} is a file (the tiny models are cached there)",
        )
    kill = environ.get("RC_TRAIN_KILL_IN_CHECKPOINT")
    if kill is not None:
        need(
            kill.strip().lstrip("-").isdigit(),
            f"RC_TRAIN_KILL_IN_CHECKPOINT must be a step number (the tests' hook: SIGKILL inside that step's "
            f"checkpoint), got {kill!r}",
        )


def allocator_conf(environ=os.environ) -> str | None:
    """torch's CUDA allocator settings as the environment gives them (PYTORCH_ALLOC_CONF wins over the older
    PYTORCH_CUDA_ALLOC_CONF, as in torch), or None."""
    return environ.get("PYTORCH_ALLOC_CONF") or environ.get("PYTORCH_CUDA_ALLOC_CONF") or None


def allocator_advice(args, on_gpu: bool, environ=os.environ) -> str | None:
    """A warning when --compile runs on a GPU without the allocator's expandable segments: the compiled layers' varying
    shapes then leave the caching allocator holding about twice the memory in use (108 GiB reserved for 44 GiB
    allocated at the 0.5B config, as reported without a committed record; docs/gpus.md "Compiled layers"). Not set
    here: it must be in the environment before CUDA starts, and the trainer leaves the allocator to the user."""
    conf = allocator_conf(environ) or ""
    if not (args.compile and on_gpu) or "expandable_segments:true" in conf.replace(" ", "").lower():
        return None
    return (
        "--compile on a GPU without PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the compiled layers' varying "
        'shapes can leave the allocator holding twice the memory in use (docs/gpus.md, "Compiled layers")'
    )


def torch_threads(max_staleness: int, environ=os.environ) -> int:
    """Threads of torch (and of a CPU engine's kernels) in each process: OMP_NUM_THREADS when it is set; otherwise
    the setting measured best on the 2-core machines (docs/async.md §7). At --max-staleness 0 rollout and update take
    turns, so each takes every core of this process (the default job ran in 0.72x the time of one thread, same
    accuracy); at k >= 1 the trainer and the rollout worker run side by side, so each takes half."""
    if environ.get("OMP_NUM_THREADS", "").strip():
        return max(1, int(environ["OMP_NUM_THREADS"]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores if max_staleness == 0 else max(1, cores // 2)


# ---------------------------------------------------------------------------------------------
# The start: the processes, the model's config, the warnings that need them
# ---------------------------------------------------------------------------------------------
class Started(NamedTuple):
    """What the start made: the Accelerator, the trainer's own collectives, the run's name and folder, rank, world."""

    accelerator: Any
    host: rc_run.HostGroup
    name: str
    dir: str
    rank: int
    world: int


def start(args) -> Started:
    """The processes of a run, after the checks that need no model: the environment, the launcher (DeepSpeed refused;
    an Accelerate FSDP2 config turns --fsdp on), the Accelerator, --max-staleness's default (by device, or the
    checkpoint's), torch's threads (vLLM and torch share the cores)."""
    import time

    from accelerate import Accelerator
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the console holds our progress bar only
    name = args.run_name or f"{args.task}__{args.exp_name}__{args.rc.preset}__{args.seed}__{int(time.time())}"
    run_dir = os.path.join(args.output_dir, name)
    check_environment()
    launcher_settings(args)
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), log_with=args.log_with or None, project_dir=run_dir)
    args.max_staleness = resolve_max_staleness(args, torch.cuda.is_available(), run_dir)
    torch.set_num_threads(torch_threads(args.max_staleness))
    world = accelerator.num_processes
    return Started(accelerator, rc_run.HostGroup(world), name, run_dir, accelerator.process_index, world)


def model_config(model_path: str):
    """The model's Hugging Face config (dense or MoE: replay and capture need the latter) and its tokenizer."""
    from transformers import AutoConfig, AutoTokenizer

    return AutoConfig.from_pretrained(model_path), AutoTokenizer.from_pretrained(model_path)


def warn_allocator(args, accelerator) -> None:
    """allocator_advice's warning, on the main process's console."""
    advice = allocator_advice(args, accelerator.device.type == "cuda")
    if advice and accelerator.is_main_process:
        print(f"rc_train.py: warning: {advice}", flush=True)
