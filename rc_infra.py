"""Infrastructure of rc_train.py, kept out of its reading path: configuration (YAML defaults, the CLI, checks), the
engine's scheduler limits, log files and memory on GPU, metric reduction across ranks, gradient norms, the run folder
and its logs, checkpoints and resume, data-parallel checksums.

Nothing here changes the algorithm; every piece is unit-tested on CPU (test_infra.py) or end to end (test_train.py).
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
import warnings

from typing import Annotated

import numpy as np
import torch
import tyro
import yaml


def _number_or_text(text: str) -> float | str:
    """'3' -> 3.0, '1e-4' -> 0.0001; 'L_U' bounds and option lists stay text ('0.5_5' is not the number 0.55)."""
    try:
        return text if "_" in text else float(text)
    except ValueError:
        return text


# A threshold: a number, or the text forms rc_core parses ('L_U', one entry per RS option, 'none').
Threshold = Annotated[float | str | None, tyro.constructors.PrimitiveConstructorSpec(
    nargs=1, metavar="{FLOAT,L_U,...,none}", instance_from_str=lambda a: _number_or_text(a[0]),
    is_instance=lambda x: x is None or isinstance(x, (int, float, str)), str_from_instance=lambda x: [str(x)])]



# ---------------------------------------------------------------------------------------------
# Configuration: YAML defaults, the command line, checks (all before any engine starts)
# ---------------------------------------------------------------------------------------------
class _YamlLoader(yaml.SafeLoader):
    """yaml.safe_load, with YAML 1.2 floats: '1e-4' is a number (YAML 1.1 reads it as a string) and '0.5_5' stays
    the string it is meant to be (YAML 1.1 drops the underscore and reads 0.55), so an IcePop bound 'L_U' or a
    multi-option RS threshold may be written unquoted, and every number reaches its field as a number."""


_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:float"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9]+\.[0-9]*(?:[eE][-+]?[0-9]+)?|\.[0-9]+(?:[eE][-+]?[0-9]+)?|[0-9]+[eE][-+]?[0-9]+)$"
               r"|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"), list("-+0123456789."))


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
    import tyro

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


def validate_args(args, world_size: int) -> None:
    """Fail fast with a message naming the bad value (before tokenizer, data or engine)."""
    import rc_core

    def need(cond, msg):
        if not cond:
            raise ValueError(msg)
    need(args.num_steps >= 1, f"--num-steps must be >= 1, got {args.num_steps}")
    need(args.num_samples_per_prompt >= 1, f"--num-samples-per-prompt must be >= 1, got {args.num_samples_per_prompt}")
    need(args.num_prompts_per_step >= 1 and args.num_prompts_per_step % world_size == 0,
         f"--num-prompts-per-step ({args.num_prompts_per_step}) must be a positive multiple of the world size ({world_size})")
    batch = args.num_prompts_per_step // world_size * args.num_samples_per_prompt
    need(args.num_minibatches >= 1 and batch % args.num_minibatches == 0,
         f"--num-minibatches ({args.num_minibatches}) must divide the per-rank rollout batch ({batch})")
    need(args.micro_batch_size >= 1, f"--micro-batch-size must be >= 1, got {args.micro_batch_size}")
    need(args.max_tokens_per_micro_batch is None or args.max_tokens_per_micro_batch >= 1,
         f"--max-tokens-per-micro-batch must be >= 1, got {args.max_tokens_per_micro_batch}")
    need(args.max_response_length >= 1, f"--max-response-length must be >= 1, got {args.max_response_length}")
    need(args.temperature > 0 and math.isfinite(args.temperature),
         f"--temperature must be > 0 (greedy rollouts have no log-probs to correct), got {args.temperature}")
    need(0 < args.top_p <= 1, f"--top-p must be in (0, 1], got {args.top_p}")
    need(args.sync_every >= 0, f"--sync-every must be >= 0, got {args.sync_every}")
    need(0.0 <= args.rollout_corrupt_prob < 1.0,
         f"--rollout-corrupt-prob must be in [0, 1), got {args.rollout_corrupt_prob}")
    need(args.rollout_weight_noise >= 0 and math.isfinite(args.rollout_weight_noise),
         f"--rollout-weight-noise must be a finite number >= 0, got {args.rollout_weight_noise}")
    need(args.rollout_temperature is None or (args.rollout_temperature > 0 and math.isfinite(args.rollout_temperature)),
         f"--rollout-temperature must be > 0, got {args.rollout_temperature}")
    need(args.dump_log_ratio_every >= 0, f"--dump-log-ratio-every must be >= 0, got {args.dump_log_ratio_every}")
    need(args.learning_rate > 0, f"--learning-rate must be > 0, got {args.learning_rate}")
    need(args.ppo_epochs >= 1, f"--ppo-epochs must be >= 1, got {args.ppo_epochs}")
    need(args.kl_coef >= 0, f"--kl-coef must be >= 0, got {args.kl_coef}")
    need(args.format_bonus >= 0, f"--format-bonus must be >= 0, got {args.format_bonus}")
    need(args.max_grad_norm > 0, f"--max-grad-norm must be > 0, got {args.max_grad_norm}")
    need(args.vllm_sleep_level in (1, 2), f"--vllm-sleep-level must be 1 or 2, got {args.vllm_sleep_level}")
    need(args.vllm_sleep_level == 1 or args.sync_every == 1,
         f"--vllm-sleep-level 2 discards the engine's weights while it sleeps, so every rollout needs fresh ones: "
         f"it needs --sync-every 1, got --sync-every {args.sync_every}")
    need(args.vllm_max_num_seqs is None or args.vllm_max_num_seqs >= 1,
         f"--vllm-max-num-seqs must be >= 1, got {args.vllm_max_num_seqs}")
    tokens = args.vllm_max_num_batched_tokens
    if tokens is not None and not torch.cuda.is_available():
        # CPU: prefills are never split (see engine_limits), so one step must hold the longest sequence.
        need(tokens >= args.max_model_len,
             f"--vllm-max-num-batched-tokens {tokens} is below --max-model-len {args.max_model_len}: the CPU engine "
             f"never splits a prefill, so raise --vllm-max-num-batched-tokens or lower --max-model-len")
    need(tokens is None or args.vllm_max_num_seqs is None or tokens >= args.vllm_max_num_seqs,
         f"--vllm-max-num-batched-tokens {tokens} must be >= --vllm-max-num-seqs {args.vllm_max_num_seqs}")
    if args.kl_coef > 0:
        rc_core.kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), args.kl_estimator)  # raises on unknown names
    low = args.clip_ratio if args.clip_ratio_low is None else args.clip_ratio_low
    high = args.clip_ratio if args.clip_ratio_high is None else args.clip_ratio_high
    rc_core.check_loss_settings(low, high, args.clip_ratio_c, args.loss_agg_mode, args.loss_scale_factor)


# ---------------------------------------------------------------------------------------------
# Processes and devices
# ---------------------------------------------------------------------------------------------
def check_distributed(accelerator, micro_batches_per_step: int | None) -> None:
    """Refuse the Accelerate backends whose weights are sharded: FSDP and DeepSpeed ZeRO-3.

    Every rank pushes the FULL weights into its own colocated engine after each update, runs the decoupled pi_old
    pass on the unwrapped module, and checkpoints from rank 0's copy. With sharded parameters each of these needs a
    gather (streamed into the engine parameter by parameter) and a sharded optimizer checkpoint per rank, which this
    trainer does not implement: it says so at start instead of half-working. DDP and DeepSpeed ZeRO-1/2 keep the
    parameters replicated and are supported. DeepSpeed steps its optimizer inside the backward of the last micro-batch
    of each accumulation window, so its gradient_accumulation_steps must equal the trainer's micro-batches per
    optimizer step, or it would step at the wrong times."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        raise ValueError("FSDP is not supported (sharded parameters: the engine sync, the pi_old pass and checkpoints "
                         "need full weights on every rank); use DDP (configs/accelerate/multi_gpu.yaml) or DeepSpeed "
                         "ZeRO-2 (configs/accelerate/deepspeed_zero2.yaml)")
    if kind == DistributedType.DEEPSPEED:
        plugin = accelerator.state.deepspeed_plugin
        if plugin.zero_stage == 3:
            raise ValueError("DeepSpeed ZeRO stage 3 is not supported (sharded parameters); use zero_stage 1 or 2 "
                             "(configs/accelerate/deepspeed_zero2.yaml)")
        steps = plugin.deepspeed_config.get("gradient_accumulation_steps")
        if micro_batches_per_step is None:
            raise ValueError("DeepSpeed needs the same number of micro-batches in every optimizer step: "
                             "drop --max-tokens-per-micro-batch (its micro-batch count varies with the lengths)")
        if steps != micro_batches_per_step:
            raise ValueError(f"DeepSpeed gradient_accumulation_steps is {steps!r} but the trainer runs "
                             f"{micro_batches_per_step} micro-batches per optimizer step (per-rank rollout batch / "
                             f"--num-minibatches / --micro-batch-size, rounded up): set it to {micro_batches_per_step}")


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
    kwargs = dict(model=model_path, dtype=args.rollout_dtype, seed=seed, max_model_len=args.max_model_len,
                  # processed: temperature/top-p applied, i.e. the distribution that sampled ('raw' is a lab dial)
                  logprobs_mode=f"{args.rollout_logprobs}_logprobs",
                  enable_prefix_caching=True, **limits, **placement)
    if args.rollout_corrupt_prob > 0:  # the veto lab's sampler dial (planted_tokens_processor)
        kwargs["logits_processors"] = [planted_tokens_processor()]
    if torch.cuda.is_available():
        kwargs.update(gpu_memory_utilization=args.vllm_gpu_memory_utilization, enable_sleep_mode=args.vllm_sleep)
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
        return not (record.getMessage().startswith("RotaryEmbedding") and "Failed to load weights" in record.getMessage())


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


# ---------------------------------------------------------------------------------------------
# Mismatch dials of the lab (README "What the lab shows"): the weights the engine receives
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


def rollout_weights(state_dict: dict, args) -> dict:
    """The weights the engine receives: the trainer's, or a perturbed copy when a weight dial is on.

    Only matrices (dim >= 2: projections, embedding/lm_head) are perturbed; norms and biases are kept,
    as weight-only quantisers do. The noise eps is drawn from a generator seeded by (--seed, tensor index),
    so every sync sends the same perturbation pattern: a persistent error, like a quantiser's, not fresh noise.
    """
    if not has_weight_dial(args):
        return state_dict
    out = {}
    for i, (name, w) in enumerate(state_dict.items()):
        if w.dim() >= 2 and w.is_floating_point():
            w = w.detach().float()
            if args.rollout_weight_noise:
                gen = torch.Generator(device="cpu").manual_seed(args.seed * 100_003 + i)
                eps = torch.randn(w.shape, generator=gen).to(w.device)
                w = w + args.rollout_weight_noise * w.pow(2).mean().sqrt() * eps
            if args.rollout_weight_quant != "none":
                w = fake_quantise(w, int(args.rollout_weight_quant[3:]))
        out[name] = w
    return out


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
# Metrics across micro-batches and ranks
# ---------------------------------------------------------------------------------------------
def metric_kind(name: str) -> str:
    """'max' / 'min' for names whose last part has a max/min word (rollout_is_max, log_ppl_diff_min,
    rollout_is_seq_max_deviation), else 'mean'."""
    words = name.rsplit("/", 1)[-1].split("_")
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


def reduce_metrics(acc: MetricSum, world: int) -> dict:
    """Metrics of all ranks: weighted means (each rank's sum of weight x value over the sum of weights) and global
    max/min, over the union of the ranks' keys. A rank that lacks a key (e.g. every response of its micro-batch was
    dropped) contributes weight 0 to it; a key no rank has a weight for comes out NaN. No hang: every rank takes
    part in the same collectives with the same key list."""
    if world == 1:
        return acc.local()
    import torch.distributed as dist

    key_lists = [None] * world
    dist.all_gather_object(key_lists, sorted(acc.sums))
    keys = sorted(set().union(*key_lists))
    means = [k for k in keys if metric_kind(k) == "mean"]
    sums = torch.tensor([acc.sums.get(k, [0.0, 0.0]) for k in means], dtype=torch.float64).reshape(-1, 2)
    dist.all_reduce(sums)
    out = {k: float(s / w) if w > 0 else float("nan") for k, (s, w) in zip(means, sums.tolist())}
    for kind, op, fill in (("max", dist.ReduceOp.MAX, -float("inf")), ("min", dist.ReduceOp.MIN, float("inf"))):
        names = [k for k in keys if metric_kind(k) == kind]
        vals = torch.tensor([acc.sums[k][0] if k in acc.sums else fill for k in names], dtype=torch.float64)
        dist.all_reduce(vals, op=op)
        out.update(zip(names, vals.tolist()))
    return out


def global_sum(values: list[float], accelerator) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        t = accelerator.reduce(t, reduction="sum")
    return t.tolist()


def accumulating(accelerator, model, last_micro_batch: bool):
    """The context of one micro-batch's backward: DDP skips the gradient all-reduce on all but the last micro-batch
    of an optimizer step (no_sync). DeepSpeed accumulates by itself (its no_sync refuses ZeRO-2)."""
    import contextlib

    from accelerate.utils import DistributedType

    if last_micro_batch or accelerator.num_processes == 1 or accelerator.distributed_type == DistributedType.DEEPSPEED:
        return contextlib.nullcontext()
    return accelerator.no_sync(model)


def clip_and_step(accelerator, model, optimizer, max_norm: float) -> float:
    """Clip the gradients, take the optimizer step, and return the global gradient norm before clipping.

    DDP: accelerator.clip_grad_norm_ clips and returns the norm. DeepSpeed clips inside its own step (the
    `gradient_clipping` of its config) and clip_grad_norm_ returns None; its engine reports the norm after the
    step (get_global_grad_norm)."""
    from accelerate.utils import DistributedType

    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    if norm is None and accelerator.distributed_type == DistributedType.DEEPSPEED:
        norm = model.get_global_grad_norm()
    return float("nan") if norm is None else float(norm)


# ---------------------------------------------------------------------------------------------
# Checkpoints, resume, run bookkeeping
# ---------------------------------------------------------------------------------------------
def checkpoint_dirs(run_dir: str) -> list[str]:
    """Complete checkpoints, oldest first. A complete one was renamed from *.tmp after its last file."""
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    names = sorted(n for n in os.listdir(root) if n.startswith("step_") and not n.endswith(".tmp")
                   and os.path.isfile(os.path.join(root, n, "trainer_state.json")))
    return [os.path.join(root, n) for n in names]


def save_checkpoint(run_dir, step, position, model, optimizer, scheduler, tokenizer, accelerator, counters):
    """Write checkpoints/step_N.tmp (every rank its RNG state; rank 0 the rest), then rename it."""
    final = os.path.join(run_dir, "checkpoints", f"step_{step:06d}")
    tmp = final + ".tmp"
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    accelerator.wait_for_everyone()
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
               os.path.join(tmp, f"rng_rank{accelerator.process_index}.pt"))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(os.path.join(tmp, "model"), state_dict=state_dict)
        tokenizer.save_pretrained(os.path.join(tmp, "model"))
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                   os.path.join(tmp, "optim.pt"))
        if os.environ.get("RC_TRAIN_KILL_IN_CHECKPOINT") == str(step):  # test hook: SIGKILL mid-write
            os.kill(os.getpid(), signal.SIGKILL)
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:  # written last
            json.dump({"step": step, "position": position, **counters}, f)
        os.replace(tmp, final)
    accelerator.wait_for_everyone()


def load_checkpoint(path, model, optimizer, scheduler, accelerator) -> dict:
    """Model, optimizer and scheduler state (onto this rank's device), and the trainer state. The RNG states are
    restored separately, by restore_rng, once the engine has started: vLLM seeds the global generators when it
    starts, which would overwrite them."""
    from safetensors.torch import load_file

    weights = {}
    for name in sorted(os.listdir(os.path.join(path, "model"))):
        if name.endswith(".safetensors"):
            weights.update(load_file(os.path.join(path, "model", name)))
    unwrapped = accelerator.unwrap_model(model)
    missing, unexpected = unwrapped.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and unwrapped.config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path!r} does not match the model: missing {missing}, unexpected {unexpected}")
    opt = torch.load(os.path.join(path, "optim.pt"), map_location=accelerator.device, weights_only=False)
    optimizer.load_state_dict(opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])
    with open(os.path.join(path, "trainer_state.json")) as f:
        return json.load(f)


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


def weights_sha256(model) -> str:
    """SHA-256 of a model's weights (names and bytes, in name order): the data-parallel consistency check."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode() + tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def log_rank_checksums(run_dir: str, step: int, rank: int, world: int, token_ids: list, model) -> None:
    """Data-parallel sanity: every rank appends {step, world_size, SHA-256 of its sampled tokens and of its weights}
    to ranks/rank{r}.jsonl: the weights must agree across ranks, the samples must not."""
    rollout = hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()
    os.makedirs(os.path.join(run_dir, "ranks"), exist_ok=True)
    with open(os.path.join(run_dir, "ranks", f"rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps({"step": step, "rank": rank, "world_size": world, "rollout_sha256": rollout,
                            "weights_sha256": weights_sha256(model)}) + "\n")


# ---------------------------------------------------------------------------------------------
# The run folder: creation, config.yaml, logs, resume, final weights
# ---------------------------------------------------------------------------------------------
def check_run_dir(run_dir: str, resume: bool, overwrite: bool) -> bool:
    """Refuse to touch an existing run unless --resume or --overwrite (before anything is written); True when the
    folder must be emptied first (--overwrite of an existing run)."""
    exists = os.path.isdir(run_dir) and bool(os.listdir(run_dir))
    if resume and not checkpoint_dirs(run_dir):
        raise FileNotFoundError(f"--resume: no complete checkpoint under {run_dir!r}")
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
        correction = {f.name: (str(v) if isinstance(v := getattr(rc_config, f.name), str) else v)  # str(): an unset
                      for f in dataclasses.fields(rc_config) if f.init}  # loss_type is a str subclass
        config = {"args": dataclasses.asdict(args), "world_size": accelerator.num_processes,
                  "distributed_type": str(accelerator.distributed_type), "model_path": facts.pop("model_path"),
                  "rollout_correction": correction, **facts}
        with open(os.path.join(run_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(config, f, sort_keys=False)


def resume(run_dir: str, model, optimizer, scheduler, accelerator, counters: dict) -> tuple[str, int, int, dict]:
    """Load the newest complete checkpoint; drop the log lines of the steps that will run again.
    Returns (checkpoint path, first step to run, data position, counters). The RNG states are restored later, by
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
    return ckpt, start_step, state["position"], {k: state[k] for k in counters}


class RunLog:
    """The run's logs, written by the main process only: metrics.jsonl (one line per step, keys sorted),
    eval_samples.jsonl, and with --tensorboard / --track the event files and the W&B run."""

    def __init__(self, run_dir: str, accelerator):
        self.run_dir, self.main = run_dir, accelerator.is_main_process
        self.file = open(os.path.join(run_dir, "metrics.jsonl"), "a") if self.main else None
        self.writer = self.wandb = None

    def start_trackers(self, args, run_name: str) -> None:
        if self.main and args.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(self.run_dir)
        if self.main and args.track:
            import wandb

            wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=dataclasses.asdict(args),
                       name=run_name, dir=self.run_dir, id=wandb_run_id(self.run_dir, args.resume), resume="allow")
            self.wandb = wandb

    def log(self, step: int, metrics: dict, trackers: bool = True) -> None:
        """One line of metrics.jsonl; with `trackers`, keys sorted and the same figures to tensorboard and W&B."""
        if not self.main:
            return
        self.file.write(json.dumps({"step": step, **(dict(sorted(metrics.items())) if trackers else metrics)}) + "\n")
        self.file.flush()
        if trackers and self.writer:
            for k, v in metrics.items():
                self.writer.add_scalar(k, v, step)
        if trackers and self.wandb:
            self.wandb.log(metrics, step=step)

    def eval_samples(self, step: int, samples: list[dict]) -> None:
        if self.main:
            with open(os.path.join(self.run_dir, "eval_samples.jsonl"), "a") as f:
                f.writelines(json.dumps({"step": step, **s}) + "\n" for s in samples)

    def close(self) -> None:
        if self.main:
            self.file.close()
            if self.writer:
                self.writer.close()


def save_log_ratios(run_dir: str, step: int, chunks: list) -> None:
    """--dump-log-ratio-every: log(pi_trainer/pi_rollout) of the valid tokens of one step, rows one after another,
    to log_ratio/step_N.npy, and each row's number of valid tokens to log_ratio/lengths/step_N.npy (so the flat
    array splits back into responses: the lab's length law). chunks: (log-ratio, response mask) pairs, (B, T) each."""
    folder = os.path.join(run_dir, "log_ratio")
    os.makedirs(os.path.join(folder, "lengths"), exist_ok=True)
    flat = torch.cat([ratio[m > 0].cpu() for ratio, m in chunks]).float().numpy() if chunks else np.zeros(0, np.float32)
    lengths = torch.cat([m.sum(-1).cpu() for _, m in chunks]).to(torch.int32).numpy() if chunks else np.zeros(0, np.int32)
    np.save(os.path.join(folder, f"step_{step:06d}.npy"), flat)
    np.save(os.path.join(folder, "lengths", f"step_{step:06d}.npy"), lengths)


def save_final(run_dir: str, model, tokenizer, accelerator) -> None:
    """final/: the trained weights with save_pretrained (loadable by transformers and vLLM)."""
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(os.path.join(run_dir, "final"), state_dict=state_dict)
        tokenizer.save_pretrained(os.path.join(run_dir, "final"))
