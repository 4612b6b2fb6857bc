"""Training side of one GRPO update at the real GSM8K shape, without vLLM: the trainer's update, from its modules.

Builds a randomly initialised Qwen2.5 (0.5B, 1.5B or 7B) from its published shape (nothing is downloaded) and a
synthetic rollout batch shaped like the trainer's (each rank's share of num_prompts_per_step x num_samples_per_prompt
sequences: left-padded prompts, right-padded responses, rollout log-probs, GRPO advantages from 0/1 rewards), then
runs on it what a step of rc_train.py runs after the rollout, composed here from the modules that own each part (this
file does not import rc_train.py, a script): for a decoupled preset the no-grad pi_old pass (rc_forward.no_grad_pass)
and the correction (rc_core.compute_rollout_correction_and_rejection_mask), then the update's loop: epochs x
minibatches x micro-batches (rc_forward.micro_batches), the shared-prompt pass (rc_forward.sequence_log_probs), global
denominators, the loss (rc_core.compute_policy_loss_bypass_mode / compute_policy_loss_vanilla), gradient accumulation
(rc_run.accumulating), clipping and AdamW (rc_run.clip_and_step). tests/test_bench_gpu_step.py::
test_the_update_equals_rc_train_update_policy proves it equal to rc_train.update_policy (with
rc_train.decoupled_correction) on the same batch: the same loss, gradient norm and weights, bit for bit. A config's
KL penalty (kl_coef) is not run: no reference model is built. One warm-up update, then --repeats timed updates.
Prints peak memory, seconds per update and per optimizer step, and tokens per second.

    python -m benchmarks.bench_gpu_step                     # one GPU: Qwen2.5-0.5B, configs/gsm8k_qwen0.5b_bypass.yaml
    python -m benchmarks.bench_gpu_step --config configs/gsm8k_qwen1.5b_bypass.yaml
    torchrun --nproc_per_node 8 -m benchmarks.bench_gpu_step                                         # DDP, 8 GPUs
    torchrun --nproc_per_node 8 -m benchmarks.bench_gpu_step --config configs/gsm8k_qwen7b_fsdp2.yaml  # FSDP2, 8 GPUs
    python -m benchmarks.bench_gpu_step --tiny              # CPU: a 2-layer model, 8 short sequences, seconds

The batch settings (prompts, samples, minibatches, micro-batch, gradient checkpointing, dtype, fsdp, maximum response
length, learning rate, loss and correction settings) come from the trainer's YAML config (UpdateSettings: the keys
the update reads, with the trainer's defaults; the config's other keys are not the update's and are ignored) and are
checked as rc_train.py checks them. Also reported: peak allocated and reserved CUDA memory, the allocator's device
allocations per update, the padding the update computes, and MFU as the field counts it (PaLM's appendix B,
nanoGPT's estimate_mfu, Megatron-LM's accounting; conventional_flops): 6 x non-embedding parameters per token the
algorithm needs (a shared prompt once per group, whether or not the run computed it once), the lm_head's 6 x d x V
per logit position and the causal attention's 12 x L x d per (query, key) pair, per second, against the card's dense
bf16 peak named from the device (CARD_PEAKS; --card-peak-tflops for another), median and range of the timed updates;
beside it the same FLOPs "of measured matmul peak" (a bf16 8192^3 matmul measured first, or --peak-tflops), and the
old accounting (mfu: 6 x all parameters x tokens computed + 2 x parameters x pi_old-pass tokens, against the measured
matmul). benchmarks/mfu_table.py recomputes the committed runs' (benchmarks/gpu_runs/). The last line printed is one
JSON object with the figures.

--breakdown (one process) then looks inside one micro-batch, on the update's own micro-batches (the first optimizer
step's, cut from the same seed):

  * phases, timed with CUDA events on a GPU (perf_counter on a CPU, where every op is synchronous) and on the host
    clock: forward (the model's logits), log-prob, entropy, loss (the micro-batch's tensors to the device and
    policy_loss), backward (the model's) and the log-prob's own backward (rc_forward._ChunkedTokenLogProb),
    metrics (micro_batch_metrics), the optimizer step (clip + AdamW + zero_grad), median of --repeats passes. The
    pass is the update's own optimizer step (run_step) with marks between its calls (rc_forward's log-prob, entropy
    and log-prob backward are wrapped for the time of the pass); the phases partition the pass, and the gap to the
    timed update's seconds per micro-batch is what the marks miss;
  * the same pass without the shared-prompt pass (compiled too under --compile layers: the compiled update with and
    without the shared prompt, side by side), and the no-grad pass (the decoupled pi_old pass), for comparison;
  * the aten ops and the host synchronisations per micro-batch of the update itself (one unmarked update under a
    TorchFunctionMode and a TorchDispatchMode): a value read to the host (.item(), float(), bool(), .tolist()),
    a tensor copied to the host, a blocking copy to the device, an op whose output size depends on the data
    (nonzero, unique, boolean-mask indexing), each with its call site. On a CPU the tensors a GPU run would hold on
    the device are tracked (the parameters, what .to(device) and device= factories make, and what ops make from
    them), so the count is the one a GPU run would make; on a GPU, torch.cuda.set_sync_debug_mode confirms it;
  * --profile DIR: torch.profiler over two micro-batches and one optimizer step: the top ops and CUDA kernels by
    time, kernels launched, CUDA runtime calls (launches, synchronisations, copies, cudaMalloc) per micro-batch,
    and a gzipped Chrome trace, written to DIR.

    python -m benchmarks.bench_gpu_step --breakdown --profile runs/gpu_profile     # one GPU, 0.5B
    python -m benchmarks.bench_gpu_step --tiny --breakdown                         # CPU, seconds
    bash benchmarks/gpu_check.sh                     # the GPU check: three shapes with --breakdown, one table
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import json
import math
import os
import resource
import shutil
import statistics
import sys
import time
import warnings
from collections import Counter
from typing import Any, Literal

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

import rc_config
import rc_core
import rc_forward
import rc_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
_THIS_FILE = os.path.abspath(__file__)
DEFAULT_CONFIG = "configs/gsm8k_qwen0.5b_bypass.yaml"

# Published shapes of Qwen2.5-0.5B and -1.5B (their config.json), plus a tiny CPU stand-in.
# pad_token_id is the tokenizer's <|endoftext|>; random token ids are drawn below it.
_QWEN25 = {
    "vocab_size": 151936,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "pad_token_id": 151643,
}
MODEL_SHAPES = {
    "0.5b": {
        **_QWEN25,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
    },
    "1.5b": {
        **_QWEN25,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
    },
    "7b": {
        **_QWEN25,
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
    },
    "tiny": {
        **_QWEN25,
        "vocab_size": 1024,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "head_dim": 32,
        "num_key_value_heads": 1,
        "max_position_embeddings": 2048,
        "pad_token_id": 1023,
    },
}

# --tiny replaces these config values (everything else still comes from the config).
TINY_ARGS = {
    "num_prompts_per_step": 2,
    "num_samples_per_prompt": 4,
    "micro_batch_size": 2,
    "max_response_length": 16,
    "compile": False,  # a config's compile: true stays off (a CPU's compilation takes minutes); --compile still works
}
TINY_PROMPT_LEN, TINY_RESPONSE_LEN = 16, 12
DEFAULT_PROMPT_LEN, DEFAULT_RESPONSE_LEN = 160, 300
BREAKDOWN_MICRO_BATCHES = 8  # micro-batches per phase pass: bounded, whatever the update's count
PROFILE_MICRO_BATCHES = 2  # micro-batches under torch.profiler (a whole update's trace does not finish in time)
MAX_TRACE_BYTES = 12 * 2**20  # a larger gzipped trace is not kept


@dataclasses.dataclass
class UpdateSettings(rc_forward.ForwardArgs):
    """The trainer's settings that one update reads, each with rc_train.Args' name, type and default (the forward's
    own group, rc_forward.ForwardArgs, inherited as Args inherits it; tests/test_bench_gpu_step.py checks the rest
    against Args). The KL penalty's settings are not here: the benchmark builds no reference model."""

    model: str = "tiny"  # names the Qwen2.5 shape to build (--model-size), nothing else
    max_model_len: int = 512
    num_prompts_per_step: int = 32
    num_samples_per_prompt: int = 16
    max_response_length: int = 64
    temperature: float = 1.0
    train_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    ppo_epochs: int = 1
    num_minibatches: int = 4
    micro_batch_size: int = 32
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    adv_estimator: str = "grpo"
    norm_adv_by_std: bool = True
    routing_replay: Literal["none", "r3", "reference"] = "none"  # rc_forward.shares_prefix reads these two
    routing_metrics: bool | None = None
    rc: rc_config.CorrectionArgs = dataclasses.field(default_factory=rc_config.CorrectionArgs)


def load_settings(path: str) -> UpdateSettings:
    """UpdateSettings from the trainer's YAML config, read by the trainer's own loader: the keys the update reads; the
    others (engine, evaluation, logging, ...) are skipped. The rc: section is the whole rc_config.CorrectionArgs, so
    an unknown key in it is refused."""
    return rc_config.load_yaml_defaults(UpdateSettings, path, ignore_unknown=True)


def check_settings(args: UpdateSettings, world: int) -> None:
    """rc_config.validate_args' checks of the settings the update reads, with its messages (it needs the whole
    rc_train.Args); the correction settings are checked when their config is built (build_correction_config)."""
    rc_config.check_field_types(args)
    batch = args.num_prompts_per_step // world * args.num_samples_per_prompt
    checks = [
        (args.num_samples_per_prompt >= 2, f"--num-samples-per-prompt must be >= 2, got {args.num_samples_per_prompt}"),
        (
            args.num_prompts_per_step >= 1 and args.num_prompts_per_step % world == 0,
            f"--num-prompts-per-step ({args.num_prompts_per_step}) must be a positive multiple of the world size "
            f"({world})",
        ),
        (
            args.num_minibatches >= 1 and batch % args.num_minibatches == 0,
            f"--num-minibatches ({args.num_minibatches}) must divide the per-rank rollout batch ({batch})",
        ),
        (args.micro_batch_size >= 1, f"--micro-batch-size must be >= 1, got {args.micro_batch_size}"),
        (
            args.max_tokens_per_micro_batch is None or args.max_tokens_per_micro_batch >= 1,
            f"--max-tokens-per-micro-batch must be >= 1, got {args.max_tokens_per_micro_batch}",
        ),
        (args.max_response_length >= 1, f"--max-response-length must be >= 1, got {args.max_response_length}"),
        (
            args.max_model_len > args.max_response_length,
            f"--max-model-len must be > --max-response-length ({args.max_response_length}), got {args.max_model_len}",
        ),
        (
            args.temperature > 0 and math.isfinite(args.temperature),
            f"--temperature must be > 0, got {args.temperature}",
        ),
        (args.train_dtype != "float16", f"--train-dtype must be float32 or bfloat16, got {args.train_dtype}"),
        (
            args.learning_rate > 0 and math.isfinite(args.learning_rate),
            f"--learning-rate must be a finite number > 0, got {args.learning_rate}",
        ),
        (
            args.weight_decay >= 0 and math.isfinite(args.weight_decay),
            f"--weight-decay must be a finite number >= 0, got {args.weight_decay}",
        ),
        (args.ppo_epochs >= 1, f"--ppo-epochs must be >= 1, got {args.ppo_epochs}"),
        (args.max_grad_norm > 0, f"--max-grad-norm must be > 0 (inf: no clipping), got {args.max_grad_norm}"),
        (not (args.compile and args.fsdp), "--compile with --fsdp: not built or verified here; drop one of them"),
        (
            args.adv_estimator in rc_core.ADVANTAGE_ESTIMATORS,
            f"--adv-estimator must be one of {', '.join(rc_core.ADVANTAGE_ESTIMATORS)}, got {args.adv_estimator!r}",
        ),
        (
            args.routing_replay == "none" and not args.routing_metrics,
            "--routing-replay / --routing-metrics need a Mixture-of-Experts model: the benchmark builds a dense one",
        ),
    ]
    for ok, message in checks:
        rc_config.need(ok, message)
    low, high = rc_config.clip_bounds(args)
    rc_core.check_loss_settings(low, high, args.clip_ratio_c, args.loss_agg_mode, args.loss_scale_factor)


@dataclasses.dataclass
class Plan:
    """Everything the benchmark runs with, checked before any model is built."""

    config_path: str
    train: UpdateSettings  # the trainer's settings from the YAML config (shrunk by --tiny)
    model_size: str  # a key of MODEL_SHAPES
    prompt_len: int
    response_len: int
    repeats: int
    seed: int
    correction: rc_core.RolloutCorrectionConfig
    world: int = 1  # processes (torchrun); each takes its share of the prompts, as in rc_train.py
    breakdown: bool = False  # phases, op and sync counts of one micro-batch (one process)
    breakdown_micro_batches: int = BREAKDOWN_MICRO_BATCHES  # the phase passes' micro-batches (of the first step's)
    profile_dir: str | None = None  # torch.profiler of two micro-batches, written here (implies breakdown)
    peak_tflops: float | None = None  # the matmul peak (None: measured on a GPU, n/a on a CPU)
    card_peak_tflops: float | None = None  # the card's dense bf16 peak (None: CARD_PEAKS by the device's name)
    compile: str | None = None  # torch.compile: "model" (the whole model) or "layers" (each decoder layer); --compile
    compile_backend: str = "inductor"  # torch.compile's backend (--compile-backend)

    @property
    def sequences(self) -> int:
        """This rank's rollout batch."""
        return self.train.num_prompts_per_step // self.world * self.train.num_samples_per_prompt

    def length_ranges(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(min, max) prompt and response lengths: symmetric around the means, so the means hold."""
        p, r = self.prompt_len, self.response_len
        dp = p // 4
        dr = min(r // 2, self.train.max_response_length - r)
        return (p - dp, p + dp), (r - dr, r + dr)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_gpu_step",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config",
        default=DEFAULT_CONFIG,
        help=f"trainer YAML config with the batch settings (default {DEFAULT_CONFIG}; "
        "a relative path is tried from the current folder, then from this script's folder)",
    )
    p.add_argument(
        "--model-size",
        choices=["0.5b", "1.5b", "7b"],
        help="Qwen2.5 shape to build (default: the size the config's model names, else 0.5b)",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="shard with FSDP2 as rc_train.py --fsdp does (torchrun, >= 2 "
        "processes); the config's fsdp: true does the same",
    )
    p.add_argument(
        "--prompt-len",
        type=int,
        help=f"mean prompt length in tokens, chat template included (default {DEFAULT_PROMPT_LEN}; "
        f"tiny {TINY_PROMPT_LEN}); lengths vary by +-25%%",
    )
    p.add_argument(
        "--response-len",
        type=int,
        help=f"mean response length in tokens, at most the config's max_response_length "
        f"(default {DEFAULT_RESPONSE_LEN}, a typical GSM8K answer; tiny {TINY_RESPONSE_LEN}); "
        "lengths vary symmetrically by up to +-50%% within [1, max_response_length]",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed updates after one warm-up update (default 3)")
    p.add_argument(
        "--compile",
        nargs="?",
        const="model",
        choices=["layers", "off", "model"],
        help="torch.compile before the update, dynamic shapes: how much of the per-micro-batch host overhead fusion "
        "removes. 'layers': the trainer's --compile (rc_forward.compile_layers: each decoder layer on its own, the "
        "same graphs for all; the shared-prompt pass on, as the config has it, unless --no-share-prompt-prefix; "
        "--breakdown times both); 'off': eager; 'model' (a bare --compile): the whole model, an experiment of this "
        "benchmark. Default: the config's compile (layers when true). The warm-up update's seconds, which include "
        "the compilation, are reported",
    )
    p.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile's backend (default inductor; aot_eager checks the capture on a CPU without compiling)",
    )
    p.add_argument(
        "--no-share-prompt-prefix",
        action="store_true",
        help="forward every row's prompt with its response (the config's share_prompt_prefix off)",
    )
    p.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="sequences per forward/backward, in place of the config's micro_batch_size (checked as the trainer "
        "checks it)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the model weights and the synthetic batch (default 0)")
    p.add_argument(
        "--tiny",
        action="store_true",
        help="a 2-layer, 64-wide model with a 1024-token vocabulary and "
        f"{TINY_ARGS['num_prompts_per_step']} prompts x {TINY_ARGS['num_samples_per_prompt']} "
        f"samples, micro-batch {TINY_ARGS['micro_batch_size']}, max_response_length "
        f"{TINY_ARGS['max_response_length']}: seconds on a CPU (other settings from the config)",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="after the timed updates (one process): the phases of a micro-batch (forward, log-prob, entropy, loss, "
        "backward, metrics, optimizer step; CUDA events on a GPU), the same without the shared-prompt pass, the "
        "no-grad pass, and the update's aten ops and host synchronisations per micro-batch with their "
        "call sites",
    )
    p.add_argument(
        "--breakdown-micro-batches",
        type=int,
        default=BREAKDOWN_MICRO_BATCHES,
        help=f"micro-batches of the first optimizer step timed by each phase pass (default {BREAKDOWN_MICRO_BATCHES}; "
        "fewer if the step has fewer)",
    )
    p.add_argument(
        "--profile",
        metavar="DIR",
        help=f"also run torch.profiler over {PROFILE_MICRO_BATCHES} micro-batches and one optimizer step and write "
        "profile_<run>.txt (top ops and kernels, launches and runtime calls per micro-batch) and "
        "trace_<run>.json.gz to DIR (implies --breakdown)",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        help="the measured-matmul peak TFLOP/s, for the old MFU and the conventional FLOPs 'of measured matmul peak' "
        "(default: on a GPU, a bf16 8192^3 matmul measured before the model is built; on a CPU, not reported)",
    )
    p.add_argument(
        "--card-peak-tflops",
        type=float,
        help="the card's dense bf16 peak TFLOP/s for the conventional MFU (default: from the device's name, "
        f"{', '.join(f'{card} {peak:g}' for _, _, card, peak in CARD_PEAKS)}; another card or a CPU: not reported)",
    )
    return p


def resolve_config_path(path: str) -> str:
    if os.path.isabs(path) or os.path.isfile(path):
        return path
    beside = os.path.join(ROOT, path)
    return beside if os.path.isfile(beside) else path


def make_plan(ns: argparse.Namespace, world: int = 1) -> Plan:
    """Read and check the config and the flags; raises ValueError / FileNotFoundError naming the bad value."""
    path = resolve_config_path(ns.config)
    train = load_settings(path)  # FileNotFoundError / ValueError name the file
    named = next((k for k in ("7b", "1.5b", "0.5b") if k in str(train.model).lower()), "0.5b")
    if ns.tiny:
        train = dataclasses.replace(train, **TINY_ARGS)
    train = dataclasses.replace(train, fsdp=train.fsdp or ns.fsdp)
    if ns.micro_batch_size is not None:
        train = dataclasses.replace(train, micro_batch_size=ns.micro_batch_size)
    if ns.no_share_prompt_prefix:
        train = dataclasses.replace(train, share_prompt_prefix=False)
    compile_mode = ns.compile or ("layers" if train.compile else "off")
    train = dataclasses.replace(train, compile=compile_mode == "layers")  # check_settings reads it
    check_settings(train, world)  # the trainer's own checks of these settings
    if train.fsdp and world < 2:
        raise ValueError(
            "--fsdp (or fsdp: true in the config) shards over several processes: run under torchrun --nproc_per_node N"
        )
    size = "tiny" if ns.tiny else ns.model_size or named
    prompt_len = ns.prompt_len if ns.prompt_len is not None else (TINY_PROMPT_LEN if ns.tiny else DEFAULT_PROMPT_LEN)
    response_len = (
        ns.response_len if ns.response_len is not None else TINY_RESPONSE_LEN if ns.tiny else DEFAULT_RESPONSE_LEN
    )
    if ns.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {ns.repeats}")
    if prompt_len < 1:
        raise ValueError(f"--prompt-len must be >= 1, got {prompt_len}")
    if response_len < 1:
        raise ValueError(f"--response-len must be >= 1, got {response_len}")
    breakdown = ns.breakdown or ns.profile is not None
    if breakdown and world > 1:
        raise ValueError("--breakdown / --profile time one process's micro-batch: run without torchrun")
    if ns.breakdown_micro_batches < 1:
        raise ValueError(f"--breakdown-micro-batches must be >= 1, got {ns.breakdown_micro_batches}")
    for flag, value in (("--peak-tflops", ns.peak_tflops), ("--card-peak-tflops", ns.card_peak_tflops)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{flag} must be a finite number > 0, got {value}")
    if response_len > train.max_response_length:
        raise ValueError(
            f"--response-len {response_len} is larger than max_response_length "
            f"{train.max_response_length}{' (--tiny)' if ns.tiny else ''} of config {path!r}"
        )
    correction = rc_config.build_correction_config(train.rc)
    plan = Plan(
        path,
        train,
        size,
        prompt_len,
        response_len,
        ns.repeats,
        ns.seed,
        correction,
        world,
        breakdown=breakdown,
        breakdown_micro_batches=ns.breakdown_micro_batches,
        profile_dir=ns.profile,
        peak_tflops=ns.peak_tflops,
        card_peak_tflops=ns.card_peak_tflops,
        compile=None if compile_mode == "off" else compile_mode,
        compile_backend=ns.compile_backend,
    )
    (_, p_max), (_, r_max) = plan.length_ranges()
    if p_max + r_max > train.max_model_len:
        raise ValueError(
            f"the longest sequence ({p_max} prompt + {r_max} response tokens) exceeds max_model_len "
            f"{train.max_model_len} of config {path!r}: lower --prompt-len or --response-len"
        )
    return plan


def parse_plan(argv=None, world: int = 1) -> Plan:
    """Flags -> checked Plan; a bad value exits (status 2) with a message naming it, before any model exists."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return make_plan(ns, world)
    except (ValueError, TypeError, FileNotFoundError) as e:
        parser.error(str(e))


def model_config(size: str):
    from transformers import Qwen2Config

    shape = MODEL_SHAPES[size]
    return Qwen2Config(**shape, use_sliding_window=False, attn_implementation="sdpa")


def build_model(plan: Plan, device: torch.device):
    """A randomly initialised Qwen2ForCausalLM in float32 (the trainer's master weights) on `device`."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(plan.seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(model_config(plan.model_size))
    model = model.float()
    if plan.train.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def make_rollout(plan: Plan, rank: int = 0) -> dict:
    """A synthetic rollout batch in the trainer's layout (rc_forward.make_batch's, built here; the tests compare the
    two) plus GRPO advantages: input_ids (B, P + T) with each prompt left-padded to column P and its response
    right-padded after it, attention_mask, rollout_log_prob and response_mask (B, T), prompt_len, response_len, group.

    Token ids are uniform below the pad id.  Rollout log-probs are uniform in log(1/V) +- 1, the range a
    freshly initialised model gives, so the PPO ratios are of order 1 and both clip branches run.
    Rewards are random 0/1 per sample, with one correct and one wrong answer forced into every group of
    two or more: a group of equal rewards has advantage 0 (same cost, but a zero gradient would hide a
    broken backward).
    """
    shape = MODEL_SHAPES[plan.model_size]
    vocab, pad_id = shape["vocab_size"], shape["pad_token_id"]
    gen = torch.Generator().manual_seed(plan.seed * 1000 + rank)  # each rank its own prompts
    (p_lo, p_hi), (r_lo, r_hi) = plan.length_ranges()
    n_prompts, n_samples = plan.train.num_prompts_per_step // plan.world, plan.train.num_samples_per_prompt
    centre = -math.log(vocab)

    def randint(lo, hi, size=()):
        return torch.randint(lo, hi + 1, size, generator=gen)

    samples, rewards = [], []  # (prompt ids, response ids, rollout log-probs, group) per sequence
    for g in range(n_prompts):
        prompt = randint(0, pad_id - 1, (int(randint(p_lo, p_hi)),))
        wins = (torch.rand(n_samples, generator=gen) < 0.5).float()
        if n_samples >= 2:
            wins[0], wins[1] = 1.0, 0.0
        for k in range(n_samples):
            length = int(randint(r_lo, r_hi))
            ids = randint(0, pad_id - 1, (length,))
            samples.append((prompt, ids, centre + 2 * torch.rand(length, generator=gen) - 1, g))
            rewards.append(float(wins[k]))
    B, P, T = len(samples), max(len(s[0]) for s in samples), max(len(s[1]) for s in samples)
    input_ids = torch.full((B, P + T), pad_id, dtype=torch.long)
    attention = torch.zeros((B, P + T), dtype=torch.long)
    rollout_log_prob, mask = torch.zeros((B, T)), torch.zeros((B, T))
    for i, (prompt, ids, lps, _) in enumerate(samples):
        input_ids[i, P - len(prompt) : P + len(ids)] = torch.cat([prompt, ids])
        attention[i, P - len(prompt) : P + len(ids)] = 1
        rollout_log_prob[i, : len(ids)], mask[i, : len(ids)] = lps, 1.0
    group = torch.tensor([s[3] for s in samples])
    return dict(
        input_ids=input_ids,
        attention_mask=attention,
        rollout_log_prob=rollout_log_prob,
        response_mask=mask,
        prompt_len=attention[:, :P].sum(-1),
        response_len=attention[:, P:].sum(-1),
        group=group,
        advantages=rc_core.compute_advantage(
            plan.train.adv_estimator,
            torch.tensor(rewards),
            group,
            response_mask=mask,
            norm_adv_by_std=plan.train.norm_adv_by_std,
        ),
    )


@dataclasses.dataclass
class Learner:
    """What every update works on (the fields of rc_train.Learner)."""

    accelerator: Any
    host: rc_run.HostGroup
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any


@dataclasses.dataclass
class Bench:
    plan: Plan
    learner: Learner  # accelerator, host group, model, optimizer, scheduler: as rc_train.py makes them
    batch: dict

    @property
    def share_prefix(self) -> bool:
        return rc_forward.shares_prefix(self.plan.train)

    def prepare(self) -> tuple[dict, dict, Counter]:
        """The update's inputs as rc_train.py's step builds them after the rollout: the step's (B, T) tensors, the
        decoupled correction's batch metrics, and the size of the pi_old pass. Decoupled presets (§7.2): pi_old
        scored once per batch without gradients, its IS weights and rejection mask frozen for the update (what
        rc_train.decoupled_correction does); bypass: none."""
        args, batch, correction, learner = self.plan.train, self.batch, self.plan.correction, self.learner
        tensors = {k: batch[k] for k in ("response_mask", "advantages", "rollout_log_prob")}
        if correction.bypass_mode:
            return tensors, {}, Counter()
        unwrapped = learner.accelerator.unwrap_model(learner.model)
        unwrapped.eval()
        old_log_prob, size = rc_forward.no_grad_pass(unwrapped, batch, args)
        is_weights, keep_mask, batch_correction = rc_core.compute_rollout_correction_and_rejection_mask(
            old_log_prob=old_log_prob,
            rollout_log_prob=tensors["rollout_log_prob"],
            response_mask=tensors["response_mask"],
            config=correction,
        )
        weights = {} if is_weights is None else {"rollout_is_weights": is_weights}
        tensors.update(old_log_prob=old_log_prob, **weights, keep_mask=keep_mask)
        return tensors, batch_correction, size

    def policy_update(self, tensors: dict, batch_correction: dict):
        """The update on the batch (rc_train.update_policy's loop): epochs x minibatches (update_schedule), one
        optimizer step each (run_step). Returns (micro-batch metrics, actor/* figures, size of its passes)."""
        world, metrics, size = self.learner.accelerator.num_processes, rc_run.MetricSum(), Counter()
        loss_sums, grad_norms = [], []
        for i, (rows, micro) in enumerate(update_schedule(self)):
            loss_sum, grad_norm, step_size = run_step(
                self, tensors, batch_correction, rows, micro, first=i == 0, metrics=metrics
            )
            loss_sums, grad_norms, size = loss_sums + [loss_sum], grad_norms + [grad_norm], size + step_size
        actor = {
            "actor/pg_loss": float(np.mean(loss_sums)) * world,
            "actor/grad_norm": float(np.mean(grad_norms)),
            "actor/lr": self.learner.scheduler.get_last_lr()[0],
        }
        return metrics, actor, size

    def update(self) -> dict:
        """One update of the rollout batch, as rc_train.py's step runs it after the rollout: the decoupled pi_old
        pass and correction (decoupled presets only), then the update's loop."""
        tensors, batch_correction, size = self.prepare()
        _, actor, update_size = self.policy_update(tensors, batch_correction)
        # the trainer's perf/* counts the same; summed over the ranks
        tokens, no_grad_tokens, positions = self.learner.host.sum(
            [float((size + update_size)["tokens"]), float(size["tokens"]), float(update_size["positions"])]
        )
        return {
            "loss": actor["actor/pg_loss"],
            "grad_norm": actor["actor/grad_norm"],
            "tokens": tokens,  # both passes
            "update_tokens": tokens - no_grad_tokens,  # real tokens of the gradient pass (a shared prompt once)
            "no_grad_tokens": no_grad_tokens,
            "update_positions": positions,  # positions the gradient pass computes, padding included
        }


def setup(plan: Plan, accelerator=None) -> Bench:
    """Model (sharded with rc_run.shard_model under FSDP2, else prepared by Accelerate: DDP on several processes),
    optimizer and scheduler as rc_train.py builds them, and this rank's synthetic batch."""
    from accelerate import Accelerator

    accelerator = accelerator or Accelerator(cpu=not torch.cuda.is_available())
    args = plan.train
    model = build_model(plan, accelerator.device)
    if plan.compile == "model":
        model = torch.compile(model, dynamic=True, backend=plan.compile_backend)
    elif plan.compile == "layers":  # the trainer's --compile
        rc_forward.compile_layers(model, backend=plan.compile_backend)
    if args.fsdp:
        model = rc_run.shard_model(model, accelerator.device.type)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    if not args.fsdp:
        model, optimizer = accelerator.prepare(model, optimizer)
    learner = Learner(accelerator, rc_run.HostGroup(accelerator.num_processes), model, optimizer, scheduler)
    return Bench(plan, learner, make_rollout(plan, accelerator.process_index))


# ---------------------------------------------------------------------------------------------
# --breakdown: the phases of a micro-batch, the ops and host synchronisations of the update
# ---------------------------------------------------------------------------------------------
PHASES = (
    "forward",
    "log_prob",
    "entropy",
    "loss",
    "backward",
    "log_prob_backward",
    "metrics",
    "optimizer",
    "other",
)
PHASE_TITLES = {
    "forward": "forward (model logits; inputs to the device)",
    "log_prob": "log-prob (rc_forward, chunked)",
    "entropy": "entropy (rc_forward, chunked, no grad)",
    "loss": "loss (tensors to the device, policy_loss)",
    "backward": "backward (model)",
    "log_prob_backward": "backward of the log-prob (rc_forward)",
    "metrics": "metrics (micro_batch_metrics)",
    "optimizer": "optimizer step (clip, AdamW, zero_grad) / micro-batches per step",
    "other": "other (step denominators) / micro-batches per step",
}
PER_STEP = ("optimizer", "other")  # phases that run once per optimizer step: shared by its micro-batches
SYNC_KINDS = ("read", "to_host", "to_device", "data_dependent")


def update_schedule(bench: Bench) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Each optimizer step of one update as rc_train.update_policy cuts it: (the step's rows, its micro-batches),
    each epoch a permutation of the rows from a generator seeded with --seed, cut into num_minibatches steps."""
    args, batch = bench.plan.train, bench.batch
    B = batch["response_mask"].shape[0]
    per_minibatch = B // args.num_minibatches
    gen = torch.Generator().manual_seed(bench.plan.seed)
    steps = []
    for _ in range(args.ppo_epochs):
        perm = torch.randperm(B, generator=gen)
        for minibatch in range(args.num_minibatches):
            rows = perm[minibatch * per_minibatch : (minibatch + 1) * per_minibatch]
            micro = rc_forward.micro_batches(rows, batch, args, bench.learner.host)
            steps.append((rows, list(micro)))
    return steps


class Marks:
    """Points of one pass, each opening a phase that lasts until the next: a CUDA event on the current stream (on a
    GPU) and the host clock. The phases therefore partition the pass. With a counter, each point also sets the
    phase its ops and synchronisations are counted under."""

    def __init__(self, device: torch.device, counter: OpCounter | None = None, events: bool = True):
        self.cuda = device.type == "cuda" and events
        self.counter = counter
        self.points: list[tuple[str, object, float]] = []
        self.current = "other"
        self.calls = Counter()  # phase -> times opened

    def mark(self, phase: str) -> None:
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.points.append((phase, event, time.perf_counter()))
        self.current = phase
        self.calls[phase] += 1
        if self.counter is not None:
            self.counter.phase = phase

    def seconds(self) -> tuple[dict, dict]:
        """(stream seconds, host seconds) per phase; the device must be synchronised first. On a CPU the stream is
        the host."""
        stream, host = Counter(), Counter()
        for (phase, ev0, t0), (_, ev1, t1) in zip(self.points, self.points[1:]):
            host[phase] += t1 - t0
            stream[phase] += ev0.elapsed_time(ev1) / 1e3 if self.cuda else t1 - t0
        return {p: stream[p] for p in PHASES}, {p: host[p] for p in PHASES}


@contextlib.contextmanager
def phase_hooks(marks: Marks):
    """rc_forward's log-prob, entropy and the log-prob's backward, wrapped to mark where they start and end (the trainer
    calls them through the module, so the wrapping reaches it); restored on exit."""
    log_probs, entropy = rc_forward.log_probs_from_logits, rc_forward.entropy_from_logits
    backward = rc_forward._ChunkedTokenLogProb.__dict__["backward"]
    depth = [0]  # log_probs_from_logits calls itself on a flattened view: mark the outer call only

    def wrap(fn, phase):
        def wrapped(*args, **kwargs):
            if depth[0]:
                return fn(*args, **kwargs)
            resume = marks.current
            depth[0] += 1
            marks.mark(phase)
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                marks.mark(resume)

        return wrapped

    rc_forward.log_probs_from_logits = wrap(log_probs, "log_prob")
    rc_forward.entropy_from_logits = wrap(entropy, "entropy")
    rc_forward._ChunkedTokenLogProb.backward = staticmethod(wrap(backward.__func__, "log_prob_backward"))
    try:
        yield
    finally:
        rc_forward.log_probs_from_logits, rc_forward.entropy_from_logits = log_probs, entropy
        rc_forward._ChunkedTokenLogProb.backward = backward


def policy_loss(args, correction, log_prob, micro: dict, denominators: dict, *, first: bool, check: bool):
    """The policy-gradient loss of a micro-batch (rc_train.policy_loss): bypass corrects inside rc_core (§7.3/§7.4),
    decoupled (§7.2) takes the frozen weights and rejection mask of Bench.prepare."""
    mask = micro["response_mask"]
    if mask.sum() == 0:  # every response dropped: nothing to learn
        return (log_prob * 0).sum(), {}
    low, high = rc_config.clip_bounds(args)
    common = dict(
        log_prob=log_prob,
        rollout_log_prob=micro["rollout_log_prob"],
        advantages=micro["advantages"],
        response_mask=mask,
        loss_agg_mode=args.loss_agg_mode,
        clip_ratio_low=low,
        clip_ratio_high=high,
        clip_ratio_c=args.clip_ratio_c,
        config=correction,
        validate=check,
        **denominators,
    )
    if correction.bypass_mode:
        return rc_core.compute_policy_loss_bypass_mode(**common, with_correction_metrics=first)
    return rc_core.compute_policy_loss_vanilla(
        **common,
        old_log_prob=micro["old_log_prob"],
        keep_mask=micro["keep_mask"],
        rollout_is_weights=micro.get("rollout_is_weights"),
    )


def micro_batch_metrics(loss_metrics: dict, log_prob, entropy, micro: dict, *, bypass: bool, first: bool, skip: dict):
    """Loss metrics, approx_kl, entropy; rollout_corr/* from the first minibatch only (rc_train.micro_batch_metrics)."""
    mask = micro["response_mask"]
    if mask.sum() == 0:
        return {}
    prox = micro["rollout_log_prob"] if bypass else micro["old_log_prob"]
    with torch.no_grad():
        k3 = rc_core.kl_penalty(prox, log_prob.detach(), "low_var_kl")
        out = {
            **loss_metrics,
            "actor/ppo_kl_k3": float(k3[mask > 0].mean()),
            "actor/entropy": float(entropy[mask > 0].mean()),
        }
    return {k: v for k, v in out.items() if k not in skip and (first or not k.startswith("rollout_corr/"))}


def _unmarked(phase: str) -> None:
    """The marks of an update that is not broken down: none."""


def run_step(
    bench: Bench,
    tensors: dict,
    batch_correction: dict,
    rows: torch.Tensor,
    micro: list[torch.Tensor],
    marks: Marks | None = None,
    share_prefix: bool = True,
    *,
    first: bool = True,
    metrics: rc_run.MetricSum | None = None,
) -> tuple[float, float, Counter]:
    """One optimizer step of the update over `micro` (micro-batches of the step's `rows`): the body of
    rc_train.update_policy's loop, call for call (tests/test_bench_gpu_step.py proves the update equal to it), with a
    mark between the calls when `marks` is given (--breakdown). `first`: the update's first step (its correction
    metrics; the loss inputs checked); `share_prefix` False runs the step without the shared-prompt pass. Returns the
    step's loss (summed over its micro-batches), its gradient norm before clipping and the size of its passes; the
    micro-batch metrics go to `metrics`."""
    args = bench.plan.train if share_prefix else dataclasses.replace(bench.plan.train, share_prompt_prefix=False)
    correction, learner, batch = bench.plan.correction, bench.learner, bench.batch
    accelerator, model = learner.accelerator, learner.model
    world, mask = accelerator.num_processes, tensors["response_mask"]
    mark = _unmarked if marks is None else marks.mark
    metrics = rc_run.MetricSum() if metrics is None else metrics
    model.train()
    mark("other")
    # the loss denominators of the step's rows over all ranks, pre-rejection (§7.5; rc_train.global_denominators)
    n_tok, n_seq = learner.host.sum([float(mask[rows].sum()), float((mask[rows].sum(-1) > 0).sum())])
    scale_k = args.loss_scale_factor or float(args.max_response_length)
    denominators = dict(global_token_count=max(n_tok, 1.0), global_seq_count=max(n_seq, 1.0), loss_scale_factor=scale_k)
    loss_sum, size = 0.0, Counter()
    for j, micro_rows in enumerate(micro):
        # the forward inside too: DDP decides there whether the backward reduces
        with rc_run.accumulating(accelerator, model, j == len(micro) - 1, args.fsdp):
            mark("forward")
            log_prob, entropy, micro_size = rc_forward.sequence_log_probs(model, batch, micro_rows, args, True, True)
            mark("loss")
            part = {k: v[micro_rows].to(log_prob.device) for k, v in tensors.items()}
            loss, loss_metrics = policy_loss(
                args, correction, log_prob, part, denominators, first=first, check=first and j == 0
            )
            loss_sum, size = loss_sum + float(loss.detach()), size + micro_size
            mark("backward")
            accelerator.backward(loss * world)  # DDP averages over ranks
        mark("metrics")
        part_metrics = micro_batch_metrics(
            loss_metrics, log_prob, entropy, part, bypass=correction.bypass_mode, first=first, skip=batch_correction
        )
        metrics.add(part_metrics, weight=float(part["response_mask"].sum()))
    mark("optimizer")
    grad_norm = rc_run.clip_and_step(accelerator, model, learner.optimizer, args.max_grad_norm)
    learner.scheduler.step()
    learner.optimizer.zero_grad(set_to_none=True)
    mark("end")
    return loss_sum, grad_norm, size


def run_no_grad(bench: Bench, micro: list[torch.Tensor], marks: Marks) -> None:
    """The no-grad pass over `micro`, as rc_forward.no_grad_pass runs it (the decoupled pi_old pass)."""
    net = bench.learner.accelerator.unwrap_model(bench.learner.model)
    net.eval()
    out = torch.zeros(bench.batch["response_mask"].shape)
    for rows in micro:
        marks.mark("forward")
        log_prob, _, _ = rc_forward.sequence_log_probs(net, bench.batch, rows, bench.plan.train, False)
        out[rows] = log_prob.cpu()
    marks.mark("end")
    bench.learner.model.train()


def _short_path(path: str) -> str:
    """A call site's file: relative to the repository, or from the installed package's folder."""
    if path.startswith(ROOT + os.sep) and os.sep + ".venv" + os.sep not in path:
        return os.path.relpath(path, ROOT)
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in path:
            return path.split(marker, 1)[1]
    return os.path.basename(path)


def _in_repo(path: str) -> bool:
    return (
        path.startswith(ROOT + os.sep)
        and os.sep + ".venv" + os.sep not in path
        and "site-packages" not in path
        and os.path.abspath(path) != _THIS_FILE
    )


class _FunctionLevel(TorchFunctionMode):
    def __init__(self, counter: OpCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.counter.on_function(func, args, kwargs or {})


class _DispatchLevel(TorchDispatchMode):
    def __init__(self, counter: OpCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.counter.on_op(func, args, kwargs, out)
        return out


_OWN_FRAMES = {"on_function", "on_op", "_move", "__torch_function__", "__torch_dispatch__", "_quietly", "_record"}
_HOST_READS = {"__float__", "__int__", "__bool__", "__index__", "__complex__", "item", "tolist", "numpy"}
_TO_DEVICE = {"to", "cuda", "cpu"}
_FROM_DATA = {"tensor", "as_tensor", "asarray"}  # factories that copy host data to their device
_DATA_DEPENDENT = {  # ops whose output size is read back from the device
    "aten::nonzero",
    "aten::masked_select",
    "aten::_unique",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
    "aten::unique_dim_consecutive",
    "aten::bincount",
    "aten::equal",
}
_MASK_INDEXED = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}


class OpCounter:
    """While active (`with counter:`): the aten ops dispatched (forward, backward and optimizer alike, under a
    TorchDispatchMode) and the host synchronisations a CUDA device makes, by phase and by call site.

    Synchronisations, each of which waits for the device's queue to drain:
      read            a value to the host: .item(), float(), int(), bool() (an `if` on a tensor), .tolist(), .numpy()
      to_host         a tensor copied to the host (.cpu(), .to("cpu"), or a copy_ between devices)
      to_device       a blocking host -> device copy: .to(device) without non_blocking, torch.tensor(..., device=)
                      (a non_blocking copy is counted apart, in async_copies)
      data_dependent  an op whose output size depends on the data: nonzero, unique, masked_select, bincount,
                      torch.equal, indexing with a boolean mask
    On a GPU the devices are the tensors' own. On a CPU every tensor is a host tensor, so the tensors that a GPU run
    holds on the device are tracked instead: the parameters given (`resident`), what .to(device) / .cuda() and
    factories given device= make, and what any op makes from a tracked tensor; .cpu() hands a tensor back (a move
    that returns its source, as every move does on a CPU, returns a copy instead, as a GPU would).
    Reads of the host's own tensors (the batch's lengths, the rows of a micro-batch) are therefore not counted
    either way, as on a GPU.
    """

    def __init__(self, device: torch.device, resident=()):
        self.cuda = device.type == "cuda"
        self.phase = "other"
        self.ops = Counter()  # phase -> aten ops
        self.compute_ops = Counter()  # phase -> aten ops that are not views
        self.syncs = Counter()  # phase -> host synchronisations
        self.kinds = Counter()  # sync kind -> count
        self.sites = Counter()  # (kind, site) -> count
        self.op_names = Counter()  # aten op -> count
        self.async_copies = 0
        self._tracked = WeakIdKeyDictionary()  # CPU: tensors a GPU run holds on the device
        for t in resident:
            self._tracked[t] = True
        self._quiet = 0  # > 0 while a function-level sync runs: its own dispatch is not counted twice
        self._modes: list = []

    def __enter__(self):
        self._modes = [_FunctionLevel(self), _DispatchLevel(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []
        return False

    # residency -------------------------------------------------------------------------------------
    def on_device(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        return t.device.type == "cuda" if self.cuda else t in self._tracked

    def _track(self, t, on: bool = True) -> None:
        if self.cuda or not isinstance(t, torch.Tensor):
            return
        if on:
            self._tracked[t] = True
        else:
            self._tracked.pop(t, None)

    # recording -------------------------------------------------------------------------------------
    def _record(self, kind: str) -> None:
        self.syncs[self.phase] += 1
        self.kinds[kind] += 1
        self.sites[(kind, self._call_site())] += 1

    @staticmethod
    def _call_site() -> str:
        """The innermost frame in this repository ('rc_core.py:1671 _check_mask_values'), the next two such frames
        after '<', and the innermost library frame in brackets when the synchronisation happens inside a library."""
        frame, repo, library = sys._getframe(2), [], None
        while frame is not None and len(repo) < 3:
            code = frame.f_code
            mine = os.path.abspath(code.co_filename) == _THIS_FILE
            if not (mine and code.co_name in _OWN_FRAMES):
                where = f"{_short_path(code.co_filename)}:{frame.f_lineno} {code.co_name}"
                if mine or _in_repo(code.co_filename):
                    repo.append(where)
                elif library is None and not repo and not where.startswith("torch/"):
                    library = where  # the library that synchronises (transformers, accelerate), torch's own skipped
            frame = frame.f_back
        if not repo:
            return library or "?"
        return " < ".join(repo) + (f" [in {library}]" if library else "")

    def _quietly(self, func, args, kwargs):
        self._quiet += 1
        try:
            return func(*args, **kwargs)
        finally:
            self._quiet -= 1

    # the two levels --------------------------------------------------------------------------------
    def on_function(self, func, args, kwargs):
        """Python-level calls: value reads, moves between host and device, factories given a device."""
        name = getattr(func, "__name__", "")
        first = args[0] if args else None
        if name in _HOST_READS and isinstance(first, torch.Tensor):
            if not self.on_device(first):
                return func(*args, **kwargs)
            self._record("read")
            return self._quietly(func, args, kwargs)
        if name in _TO_DEVICE and isinstance(first, torch.Tensor):
            return self._move(name, func, args, kwargs)
        if kwargs.get("device") is not None:  # a factory on a device (torch.zeros(..., device=x.device))
            out = self._quietly(func, args, kwargs)
            if isinstance(out, torch.Tensor):
                self._track(out)
                from_host = not (isinstance(first, torch.Tensor) and self.on_device(first))
                if name in _FROM_DATA and self.on_device(out) and from_host and out.numel():  # nothing to copy
                    self._record("to_device")
            return out
        return func(*args, **kwargs)

    def _move(self, name, func, args, kwargs):
        src = args[0]
        was_on_device = self.on_device(src)
        target = kwargs.get("device")
        non_blocking = bool(kwargs.get("non_blocking", False))
        for a in args[1:]:
            if isinstance(a, bool):
                non_blocking = non_blocking or a
            elif isinstance(a, (torch.device, str, int)) and target is None:
                target = a
            elif isinstance(a, torch.Tensor) and target is None:
                target = a.device
        out = self._quietly(func, args, kwargs)
        if not isinstance(out, torch.Tensor):
            return out
        if self.cuda:
            to_device = src.device.type == "cpu" and out.device.type == "cuda"
            to_host = src.device.type == "cuda" and out.device.type == "cpu"
        else:  # a CPU: .to(device) moves a host tensor to "the device", .cpu() a device tensor to the host
            to_device = not was_on_device and (name == "cuda" or (name == "to" and target is not None))
            to_host = was_on_device and name == "cpu"
            if (to_device or to_host) and out is src:  # a copy, as on a GPU: the source keeps its side
                out = src.clone()
            if to_device or (was_on_device and not to_host):
                self._track(out)
            elif to_host:
                self._track(out, False)
        if (to_device or to_host) and src.numel():  # an empty tensor copies nothing
            if non_blocking:
                self.async_copies += 1
            else:
                self._record("to_device" if to_device else "to_host")
        return out

    def on_op(self, func, args, kwargs, out) -> None:
        """Every aten op: counted; tracked residency passed on (CPU); device-side syncs a Python call does not show."""
        name = func.name() if hasattr(func, "name") else str(func)
        base = name.split(".")[0]
        self.ops[self.phase] += 1
        self.op_names[base] += 1
        if not getattr(func, "is_view", False):
            self.compute_ops[self.phase] += 1
        leaves = None
        if not self.cuda:
            leaves = tree_leaves((args, kwargs))
            if any(isinstance(x, torch.Tensor) and x in self._tracked for x in leaves):
                for t in tree_leaves(out):
                    self._track(t)
        if base in _DATA_DEPENDENT:
            leaves = leaves if leaves is not None else tree_leaves((args, kwargs))
            if any(self.on_device(x) for x in leaves):
                self._record("data_dependent")
        elif base == "aten::repeat_interleave" and name.endswith(".Tensor") and kwargs.get("output_size") is None:
            if self.on_device(args[0]):
                self._record("data_dependent")
        elif base in _MASK_INDEXED:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            masks = [i for i in indices or () if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)]
            if any(self.on_device(i) for i in masks):
                self._record("data_dependent")
        elif self._quiet:
            return
        elif base == "aten::_local_scalar_dense":
            if self.on_device(args[0]):
                self._record("read")
        elif self.cuda and base in ("aten::_to_copy", "aten::copy_"):
            src, dst = (args[1], args[0]) if base == "aten::copy_" else (args[0], out)
            if isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and src.device != dst.device:
                blocking = not (kwargs.get("non_blocking") or (base == "aten::copy_" and len(args) > 2 and args[2]))
                if not blocking:
                    self.async_copies += 1
                else:
                    self._record("to_device" if dst.device.type == "cuda" else "to_host")

    # results ---------------------------------------------------------------------------------------
    def top_sites(self, n: int, scale: float = 1.0) -> list[dict]:
        return [
            {"kind": kind, "site": site, "count": round(count * scale, 3)}
            for (kind, site), count in self.sites.most_common(n)
        ]


def sync_debug_warnings(device: torch.device):
    """A context that counts CUDA's own synchronisation warnings (torch.cuda.set_sync_debug_mode("warn")) in the list
    it yields; on a CPU, yields None."""

    @contextlib.contextmanager
    def ctx():
        if device.type != "cuda":
            yield None
            return
        found: list = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield found
            finally:
                torch.cuda.set_sync_debug_mode("default")
        found.extend(w for w in caught if "synchroniz" in str(w.message))

    return ctx()


def _median_phases(passes: list[dict]) -> dict:
    return {p: statistics.median(d[p] for d in passes) for p in PHASES}


def _per_micro_batch(phases: dict, n_micro: int, micro_per_step: float) -> dict:
    """Seconds per micro-batch: a per-step phase shared by the step's micro-batches of the real update."""
    return {p: v / (micro_per_step if p in PER_STEP else n_micro) for p, v in phases.items()}


def breakdown(bench: Bench, seconds_per_update: float) -> dict:
    """--breakdown: see the module's docstring. Returns the figures (seconds, counts per micro-batch)."""
    plan, device = bench.plan, bench.learner.accelerator.device
    schedule = update_schedule(bench)
    micro_per_update = sum(len(m) for _, m in schedule)
    micro_per_step = micro_per_update / len(schedule)
    rows, first_step = schedule[0]
    micro = first_step[: plan.breakdown_micro_batches]
    tensors, batch_correction, _ = bench.prepare()

    def timed(share_prefix: bool, warm_up: bool = False) -> tuple[dict, dict]:
        if warm_up:  # a shape the timed updates did not run: its first kernels and allocations are not timed
            run_step(bench, tensors, batch_correction, rows, micro[:2], Marks(device, events=False), share_prefix)
        stream, host = [], []
        for _ in range(plan.repeats):
            marks = Marks(device)
            with phase_hooks(marks):
                run_step(bench, tensors, batch_correction, rows, micro, marks, share_prefix)
            _sync(device)
            s, h = marks.seconds()
            stream.append(s)
            host.append(h)
        return _median_phases(stream), _median_phases(host)

    stream, host = timed(bench.share_prefix)
    unshared = timed(False, warm_up=True)[0] if bench.share_prefix else None
    run_no_grad(bench, micro[:1], Marks(device, events=False))  # warm-up
    no_grad = []
    for _ in range(plan.repeats):
        marks = Marks(device)
        run_no_grad(bench, micro, marks)
        _sync(device)
        no_grad.append(sum(marks.seconds()[0].values()))

    # ops and syncs by phase: the same loop once more, counted
    counted = OpCounter(device, resident=_device_tensors(bench))
    marks = Marks(device, counter=counted, events=False)
    with counted, phase_hooks(marks):
        run_step(bench, tensors, batch_correction, rows, micro, marks, bench.share_prefix)
    _sync(device)
    # the update itself (unmarked), counted (with CUDA's own sync warnings on a GPU)
    update_counter = OpCounter(device, resident=_device_tensors(bench))
    with sync_debug_warnings(device) as cuda_warnings, update_counter:
        bench.policy_update(tensors, batch_correction)
    _sync(device)

    n = len(micro)
    per_micro = _per_micro_batch(stream, n, micro_per_step)
    total = sum(per_micro.values())
    update_per_micro = seconds_per_update / micro_per_update
    counts = {}
    for key, counter in (("ops", counted.ops), ("compute_ops", counted.compute_ops), ("syncs", counted.syncs)):
        counts[key] = {p: round(v, 3) for p, v in _per_micro_batch(dict(counter), n, micro_per_step).items()}
        counts[key] = {p: counts[key].get(p, 0.0) for p in PHASES}
    scale = 1 / micro_per_update
    return {
        "micro_batches_per_update": micro_per_update,
        "optimizer_steps_per_update": len(schedule),
        "micro_batches_timed": n,
        "rows_per_micro_batch": [len(r) for r in micro],
        "passes": plan.repeats,
        "clock": "cuda_events" if device.type == "cuda" else "perf_counter",
        "phase_ms": {p: 1e3 * v for p, v in per_micro.items()},
        "host_ms": {p: 1e3 * v for p, v in _per_micro_batch(host, n, micro_per_step).items()},
        "sum_ms": 1e3 * total,
        "update_ms": 1e3 * update_per_micro,  # the timed updates' seconds per micro-batch
        "gap_ms": 1e3 * (update_per_micro - total),
        "optimizer_step_ms": 1e3 * stream["optimizer"],
        "no_grad_forward_ms": 1e3 * statistics.median(no_grad) / n,
        "unshared_phase_ms": None
        if unshared is None
        else {p: 1e3 * v for p, v in _per_micro_batch(unshared, n, micro_per_step).items()},
        "unshared_sum_ms": None
        if unshared is None
        else 1e3 * sum(_per_micro_batch(unshared, n, micro_per_step).values()),
        "phase_aten_ops": counts["ops"],
        "phase_compute_ops": counts["compute_ops"],
        "phase_host_syncs": counts["syncs"],
        "log_prob_backward_calls": marks.calls["log_prob_backward"],
        # the update itself
        "aten_ops_per_micro_batch": sum(update_counter.ops.values()) * scale,
        "aten_compute_ops_per_micro_batch": sum(update_counter.compute_ops.values()) * scale,
        "host_syncs_per_micro_batch": sum(update_counter.syncs.values()) * scale,
        "host_syncs_per_update": sum(update_counter.syncs.values()),
        "sync_kinds_per_update": {k: update_counter.kinds.get(k, 0) for k in SYNC_KINDS},
        "async_copies_per_update": update_counter.async_copies,
        "sync_sites_per_update": update_counter.top_sites(40),
        "top_aten_ops_per_micro_batch": {k: round(v * scale, 2) for k, v in update_counter.op_names.most_common(12)},
        "cuda_sync_warnings_per_micro_batch": None if cuda_warnings is None else len(cuda_warnings) * scale,
    }


def _device_tensors(bench: Bench) -> list[torch.Tensor]:
    """What a GPU run holds on the device before the update: the parameters and buffers (the optimizer's state is
    made from them)."""
    model = bench.learner.accelerator.unwrap_model(bench.learner.model)
    return [*model.parameters(), *model.buffers()]


def profile(bench: Bench, out_dir: str, tag: str) -> dict:
    """torch.profiler over PROFILE_MICRO_BATCHES micro-batches and one optimizer step of the first step (bounded:
    a whole update's trace does not finish in time). Writes profile_<tag>.txt and trace_<tag>.json.gz to out_dir;
    returns a summary (per micro-batch). Any failure is reported in the summary and the file, not raised."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    device = bench.learner.accelerator.device
    os.makedirs(out_dir, exist_ok=True)
    text_path = os.path.join(out_dir, f"profile_{tag}.txt")
    trace_path = os.path.join(out_dir, f"trace_{tag}.json")
    rows, first_step = update_schedule(bench)[0]
    micro = first_step[:PROFILE_MICRO_BATCHES]
    tensors, batch_correction, _ = bench.prepare()
    summary: dict = {"file": text_path, "micro_batches": len(micro)}
    lines = [f"torch.profiler: {len(micro)} micro-batch(es) and one optimizer step of the first step ({tag})", ""]
    try:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        _sync(device)
        t0 = time.perf_counter()
        with torch_profile(activities=activities) as prof:
            run_step(bench, tensors, batch_correction, rows, micro, Marks(device, events=False), bench.share_prefix)
            _sync(device)
        wall = time.perf_counter() - t0
        t1 = time.perf_counter()
        averages = prof.key_averages()
        n = len(micro)
        runtime = {}  # CUDA runtime / driver calls on the host: launches, syncs, copies, allocations
        for row in averages:
            key = str(row.key)
            if key.startswith(("cuda", "cu")) and not key.startswith("cudnn"):
                runtime[key] = round(row.count / n, 2)
        kernels, kernel_us = 0, 0.0
        if device.type == "cuda":
            for event in prof.events():
                if getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA:
                    kernels += 1
                    kernel_us += event.time_range.elapsed_us()
        summary.update(
            wall_s=wall,
            cuda_events_per_micro_batch=kernels / n if device.type == "cuda" else None,
            device_busy_fraction=(kernel_us / 1e6) / wall if device.type == "cuda" and wall > 0 else None,
            runtime_calls_per_micro_batch=dict(sorted(runtime.items(), key=lambda kv: -kv[1])[:15]),
        )
        lines += [
            f"wall {wall:.3f} s (profiler on); device busy {summary['device_busy_fraction']}",
            f"CUDA events (kernels, copies, memsets) per micro-batch: {summary['cuda_events_per_micro_batch']}",
            "CUDA runtime calls per micro-batch: "
            + ", ".join(f"{k} {v}" for k, v in summary["runtime_calls_per_micro_batch"].items()),
            "",
        ]
        sorts = ["self_cpu_time_total"]
        if device.type == "cuda":
            sorts = ["self_device_time_total", "self_cuda_time_total", *sorts]
        for sort_by in sorts:
            try:
                lines += [f"top 40 by {sort_by}:", averages.table(sort_by=sort_by, row_limit=40), ""]
                break
            except Exception as e:  # the column's name differs between torch versions
                lines.append(f"(sort by {sort_by}: {e!r})")
        if device.type == "cuda":
            lines += ["top 25 by self_cpu_time_total:", averages.table(sort_by="self_cpu_time_total", row_limit=25)]
        prof.export_chrome_trace(trace_path)
        with open(trace_path, "rb") as src, gzip.open(trace_path + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(trace_path)
        size = os.path.getsize(trace_path + ".gz")
        if size > MAX_TRACE_BYTES:
            os.remove(trace_path + ".gz")
            lines.append(f"trace not kept: {size / 2**20:.1f} MiB gzipped")
        else:
            summary["trace"] = trace_path + ".gz"
        summary["analysis_s"] = time.perf_counter() - t1
    except Exception as e:  # the profile is optional: the run's figures stand without it
        summary["error"] = repr(e)
        lines.append(f"profile failed: {e!r}")
    with open(text_path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return summary


# ---------------------------------------------------------------------------------------------
# MFU as the field counts it (PaLM, appendix B; nanoGPT's estimate_mfu; Megatron-LM's accounting)
# ---------------------------------------------------------------------------------------------
# Dense bf16 tensor-core peaks in TFLOP/s (NVIDIA's datasheets print twice these, "with sparsity"), matched on the
# CUDA device name: (the name contains, unless it contains, the card, its peak). Any other card (an H100 PCIe or NVL,
# an H200 NVL, an L40S...) has no conventional MFU here unless --card-peak-tflops gives its peak.
CARD_PEAKS = (
    ("H200", ("NVL",), "H200 SXM", 989.0),
    ("H100", ("PCIe", "NVL"), "H100 SXM", 989.0),
    ("A100", (), "A100", 312.0),
)


def card_peak(device_name: str) -> tuple[str | None, float | None]:
    """(the card, its dense bf16 peak in TFLOP/s) for a CUDA device name; (None, None) for a card CARD_PEAKS lacks."""
    for part, unless, card, peak in CARD_PEAKS:
        if part in device_name and not any(u in device_name for u in unless):
            return card, peak
    return None, None


def non_embedding_params(shape: dict) -> int:
    """N of 6N: a Qwen2 shape's parameters without the token embedding and the lm_head (the lm_head is counted on the
    logit positions instead): per layer the q, k, v projections (with biases), o (without), the SwiGLU MLP's three
    matrices and two RMSNorm weights; then the final norm."""
    d, ff, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    q_width = heads * shape.get("head_dim", d // heads)
    kv_width = kv_heads * shape.get("head_dim", d // heads)
    attention = (d * q_width + q_width) + 2 * (d * kv_width + kv_width) + q_width * d
    return layers * (attention + 3 * d * ff + 2 * d) + d


# What one pass over a batch needs (tokens, logit positions, causal attention pairs; a shared prompt once per group):
# the trainer's own count, which it logs each step as perf/mfu_* (benchmarks/gpu_smoke.py turns them into its MFU).
conventional_counts = rc_run.conventional_counts


def conventional_flops(shape: dict, counts: dict, fwd_bwd_passes: int = 1, forward_passes: int = 0) -> dict:
    """Model FLOPs of an update over `counts` (conventional_counts): `fwd_bwd_passes` forward+backward passes (the
    epochs) and `forward_passes` forward-only ones (the decoupled pi_old pass). A forward pass does 2 FLOPs per
    multiply-add: 2 x N_non-embedding per token, 2 x d x V per logit position (the lm_head), and 4 x L x (heads x
    head_dim) per attended (query, key) pair (QK^T and AV); the backward twice the forward (PaLM's 6N + 12LHQT,
    Megatron's 72Bslh^2 (1 + s/6h + V/12lh)). PaLM, nanoGPT and Megatron's paper count the full s^2 of attention
    (every token against T keys); this counts the causal pairs, s(s+1)/2 for an s-token sequence, FlashAttention's
    causal convention (its benchmarks halve the s^2 count) up to the diagonal's s/2."""
    d, layers, vocab = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    heads = shape["num_attention_heads"]
    q_width = heads * shape.get("head_dim", d // heads)
    passes = 3 * fwd_bwd_passes + forward_passes  # forward-pass equivalents
    terms = {
        "dense": passes * 2 * non_embedding_params(shape) * counts["tokens"],
        "lm_head": passes * 2 * d * vocab * counts["logit_positions"],
        "attention": passes * 4 * layers * q_width * counts["attention_pairs"],
    }
    return {**terms, "total": sum(terms.values())}


COUNTS = ("tokens", "logit_positions", "attention_pairs")  # conventional_counts' keys


def measure_peak_tflops(device: torch.device, n: int = 8192, iters: int = 10) -> float:
    """bf16 n^3 matmul TFLOP/s on `device` (three warm-ups, then the mean of `iters`), as docs/gpus.md measured."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    torch.cuda.synchronize(device)
    seconds = start.elapsed_time(end) / 1e3
    del a, b
    torch.cuda.empty_cache()
    return 2 * n**3 * iters / seconds / 1e12


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def run_tag(plan: Plan) -> str:
    """A short name of the run for file names: model size, preset, prompt and response lengths."""
    return f"{plan.model_size}_{plan.train.rc.preset}_p{plan.prompt_len}_r{plan.response_len}"


def _allocator_counts(device: torch.device) -> Counter:
    if device.type != "cuda":
        return Counter()
    stats = torch.cuda.memory_stats(device)
    return Counter(
        {
            "device_allocations": stats.get("segment.all.allocated", 0),  # cudaMalloc calls
            "device_frees": stats.get("segment.all.freed", 0),  # cudaFree calls
            "alloc_retries": stats.get("num_alloc_retries", 0),  # frees of the whole cache, then a retry
        }
    )


def _fmt_ms(value) -> str:
    return "n/a" if value is None else f"{value:9.2f}"


def breakdown_rows(b: dict, cuda: bool) -> list[str]:
    """The breakdown as a readable table (one string a line)."""
    per_step = b["micro_batches_per_update"] / b["optimizer_steps_per_update"]
    lines = [
        f"  per micro-batch: {b['micro_batches_timed']} micro-batches of the first optimizer step "
        f"({b['rows_per_micro_batch']} rows), median of {b['passes']} pass(es), "
        f"{'CUDA events' if cuda else 'perf_counter'}; the update has {b['micro_batches_per_update']} micro-batches "
        f"in {b['optimizer_steps_per_update']} optimizer step(s), {per_step:g} a step",
    ]
    unshared = b["unshared_phase_ms"]
    head = f"    {'phase':<66} {'stream ms' if cuda else 'ms':>9}"
    head += f" {'host ms':>9}" if cuda else ""
    head += f" {'aten ops':>9} {'syncs':>7}"
    head += f" {'no shared':>9}" if unshared is not None else ""
    lines.append(head)
    for p in PHASES:
        row = f"    {PHASE_TITLES[p]:<66} {_fmt_ms(b['phase_ms'][p])}"
        row += f" {_fmt_ms(b['host_ms'][p])}" if cuda else ""
        row += f" {b['phase_aten_ops'][p]:9.1f} {b['phase_host_syncs'][p]:7.2f}"
        row += f" {_fmt_ms(unshared[p])}" if unshared is not None else ""
        lines.append(row)
    total = f"    {'sum of the phases':<66} {_fmt_ms(b['sum_ms'])}"
    total += f" {_fmt_ms(sum(b['host_ms'].values()))}" if cuda else ""
    total += f" {sum(b['phase_aten_ops'].values()):9.1f} {sum(b['phase_host_syncs'].values()):7.2f}"
    total += f" {_fmt_ms(b['unshared_sum_ms'])}" if unshared is not None else ""
    lines += [
        total,
        f"    {'the update (timed updates: s / update / micro-batches)':<66} {_fmt_ms(b['update_ms'])}",
        f"    {'gap (update - sum): what the phase loop does not see':<66} {_fmt_ms(b['gap_ms'])}",
        f"    {'no-grad sequence_log_probs (the decoupled pi_old pass)':<66} {_fmt_ms(b['no_grad_forward_ms'])}",
        "  the update (rc_train.update_policy's loop), counted over one update: "
        f"{b['aten_ops_per_micro_batch']:.1f} aten ops per "
        f"micro-batch ({b['aten_compute_ops_per_micro_batch']:.1f} not views), "
        f"{b['host_syncs_per_micro_batch']:.2f} host synchronisations per micro-batch "
        f"({b['host_syncs_per_update']} per update: "
        + ", ".join(f"{k} {v}" for k, v in b["sync_kinds_per_update"].items())
        + f"; non_blocking copies {b['async_copies_per_update']})"
        + (
            f"; CUDA's sync debug mode: {b['cuda_sync_warnings_per_micro_batch']:.2f} warnings per micro-batch"
            if b["cuda_sync_warnings_per_micro_batch"] is not None
            else ""
        ),
        "  host synchronisations by call site, per update (innermost repository frame first):",
    ]
    lines += [f"    {s['count']:>7g}  {s['kind']:<14} {s['site']}" for s in b["sync_sites_per_update"]]
    lines.append(
        "  most frequent aten ops per micro-batch: "
        + ", ".join(f"{k.replace('aten::', '')} {v:g}" for k, v in b["top_aten_ops_per_micro_batch"].items())
    )
    return lines


def _dig(result: dict, *keys):
    for key in keys:
        if not isinstance(result, dict) or result.get(key) is None:
            return None
        result = result[key]
    return result


def _cell(value, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value) if isinstance(value, (int, float)) else str(value)


def _figure(*keys: str, fmt: str = "{:.2f}"):
    return lambda result: _cell(_dig(result, *keys), fmt)


def summary_table(results: list[dict]) -> str:
    """The JSON lines of several runs (with a "check" name each, as benchmarks/gpu_check.sh writes them) side by side:
    one column a run, one row a figure; "-" where a run lacks it."""
    rows = [
        ("device", lambda r: r["device"]),
        (
            "parameters, sequences x padded length",
            lambda r: f"{r['params'] / 1e9:.3g}B, {r['sequences']} x {r['padded_length']}",
        ),
        (
            "micro-batch x micro-batches per update",
            lambda r: f"{r['micro_batch_size']} x {_cell(_dig(r, 'breakdown', 'micro_batches_per_update'), '{}')}",
        ),
        ("s / update", _figure("seconds_per_update", fmt="{:.3f}")),
        ("warm-up update s (compile included)", _figure("warmup_seconds", fmt="{:.1f}")),
        ("torch.compile", lambda r: r.get("compile") or "off"),
        (
            "  graphs compiled, graph breaks",
            lambda r: f"{r['compiled_graphs']['unique_graphs']}, {r['compiled_graphs']['graph_breaks']}",
        ),
        ("ms / micro-batch (update)", _figure("breakdown", "update_ms")),
        *[(f"  {p} ms", _figure("breakdown", "phase_ms", p)) for p in PHASES],
        ("  sum of the phases ms", _figure("breakdown", "sum_ms")),
        ("  gap (update - sum) ms", _figure("breakdown", "gap_ms")),
        ("  host ms, all phases", lambda r: _cell(sum((_dig(r, "breakdown", "host_ms") or {}).values()) or None)),
        ("  without the shared-prompt pass ms", _figure("breakdown", "unshared_sum_ms")),
        ("no-grad forward ms (pi_old pass)", _figure("breakdown", "no_grad_forward_ms")),
        ("host syncs / micro-batch (counted)", _figure("breakdown", "host_syncs_per_micro_batch")),
        ("CUDA sync warnings / micro-batch", _figure("breakdown", "cuda_sync_warnings_per_micro_batch")),
        ("aten ops / micro-batch", _figure("breakdown", "aten_ops_per_micro_batch", fmt="{:.0f}")),
        ("CUDA kernels+copies / micro-batch", _figure("profile", "cuda_events_per_micro_batch", fmt="{:.0f}")),
        ("device busy (profiled micro-batches)", _figure("profile", "device_busy_fraction", fmt="{:.0%}")),
        ("MFU (conventional, card's dense bf16 peak)", _figure("mfu_conventional", fmt="{:.1%}")),
        ("  card, its peak TFLOP/s", lambda r: f"{r['card']}, {r['peak_tflops_card']:g}"),
        ("  of measured matmul peak", _figure("mfu_of_measured_peak", fmt="{:.1%}")),
        ("MFU, old accounting (6 x params x tokens)", _figure("mfu", fmt="{:.1%}")),
        ("measured matmul peak TFLOP/s", _figure("peak_tflops", fmt="{:.4g}")),
        ("peak allocated GiB", _figure("peak_memory_gib")),
        ("peak reserved GiB", _figure("peak_reserved_gib")),
        ("  allocator settings", lambda r: r.get("alloc_conf") or "default"),
        ("cudaMalloc / update", _figure("allocator_per_update", "device_allocations", fmt="{:g}")),
        ("allocator retries / update", _figure("allocator_per_update", "alloc_retries", fmt="{:g}")),
        (
            "padding (update, full batch)",
            lambda r: f"{r['update_padding_fraction']:.1%}, {r['batch_padding_fraction']:.1%}",
        ),
    ]
    names = [str(r.get("check", i)) for i, r in enumerate(results)]
    cells = []
    for title, get in rows:
        line = []
        for r in results:
            try:
                line.append(str(get(r)))
            except (KeyError, TypeError, ValueError):
                line.append("-")
        cells.append((title, line))
    width = max(len(t) for t, _ in cells)
    widths = [max(len(n), *(len(line[i]) for _, line in cells)) for i, n in enumerate(names)]
    out = [f"{'':<{width}}  " + "  ".join(f"{n:>{w}}" for n, w in zip(names, widths))]
    out += [f"{t:<{width}}  " + "  ".join(f"{c:>{w}}" for c, w in zip(line, widths)) for t, line in cells]
    return "\n".join(out)


def summarize(path: str) -> int:
    """Print summary_table of a JSON-lines file (benchmarks/gpu_check.sh's results.jsonl)."""
    with open(path) as f:
        results = [json.loads(line) for line in f if line.strip()]
    print(summary_table(results) if results else f"{path}: no results")
    return 0 if results else 1


def _compiled_graphs() -> dict:
    """Dynamo's own counters after the timed updates: the graphs it compiled (recompiles included) and the graph
    breaks, whose reasons are the keys of its graph_break counter."""
    from torch._dynamo.utils import counters

    return {
        "unique_graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "graph_break_reasons": sorted(counters["graph_break"])[:5],
    }


def timed_updates(bench: Bench, device: torch.device) -> tuple[list[float], dict, Counter, float]:
    """One warm-up update (kernels, allocator, AdamW state, --compile's compilation), then --repeats timed ones: their
    seconds, the last one's figures, the allocator's counts over the timed ones (peak memory statistics reset after
    the warm-up), and the warm-up's seconds."""
    t0 = time.perf_counter()
    bench.update()
    _sync(device)
    warmup_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    allocator_before = _allocator_counts(device)
    times = []
    for _ in range(bench.plan.repeats):
        _sync(device)
        t0 = time.perf_counter()
        stats = bench.update()
        _sync(device)
        times.append(time.perf_counter() - t0)
    allocator = _allocator_counts(device)
    allocator.subtract(allocator_before)
    return times, stats, allocator, warmup_s


def result_rows(
    plan: Plan, bench: Bench, result: dict, stats: dict, times: list, memory_kind: str, layout: str
) -> list:
    """The report's (name, text) lines of a run: `result` (main's JSON object), `stats` (the last update's)."""
    args = plan.train
    (p_lo, p_hi), (r_lo, r_hi) = plan.length_ranges()
    B, L = bench.batch["input_ids"].shape
    params, peak_gib, reserved_gib = result["params"], result["peak_memory_gib"], result["peak_reserved_gib"]
    update_s, steps_per_update = result["seconds_per_update"], args.num_minibatches * args.ppo_epochs
    update_padding, batch_padding = result["update_padding_fraction"], result["batch_padding_fraction"]
    rows = [
        ("device", f"{result['device']}; {layout}"),
        ("model", f"Qwen2.5-{plan.model_size} shape, {params:,} parameters, float32 master weights"),
        (
            "rollout batch",
            f"{args.num_prompts_per_step} prompts x {args.num_samples_per_prompt} samples = "
            f"{B * plan.world} sequences ({B} per process), padded to {L} tokens",
        ),
        (
            "lengths",
            f"prompts {p_lo}-{p_hi} (mean {plan.prompt_len}), responses {r_lo}-{r_hi} "
            f"(mean {plan.response_len}, max_response_length {args.max_response_length})",
        ),
        (
            "update",
            f"preset {args.rc.preset}, {args.num_minibatches} minibatches x {args.ppo_epochs} epoch(s), "
            f"micro-batch {args.micro_batch_size}, shared-prompt pass {'on' if bench.share_prefix else 'off'}",
        ),
        (
            "compute",
            f"{args.train_dtype} autocast, gradient checkpointing "
            f"{'on' if args.gradient_checkpointing else 'off'}, AdamW lr {args.learning_rate:g}",
        ),
        ("peak memory", f"{peak_gib:.3f} GiB: {memory_kind}"),
    ]
    if reserved_gib is not None:
        rows.append(
            (
                "peak reserved",
                f"{reserved_gib:.3f} GiB (cuda max_memory_reserved, allocator settings "
                f"{result['alloc_conf'] or 'default'}); per update: "
                + ", ".join(f"{k} {v:g}" for k, v in result["allocator_per_update"].items()),
            )
        )
    rows += [
        (
            "s / update",
            f"{update_s:.3f} (median of {plan.repeats}, slowest rank: "
            f"{', '.join(f'{t:.3f}' for t in times)} on this one)",
        ),
        (
            "warm-up update",
            f"{result['warmup_seconds']:.3f} s"
            + (
                f", torch.compile {result['compile']} included: {result['compiled_graphs']['unique_graphs']} graphs "
                f"compiled, {result['compiled_graphs']['graph_breaks']} graph breaks"
                if result["compile"]
                else ""
            ),
        ),
        ("s / optimizer step", f"{update_s / steps_per_update:.3f}"),
        ("tokens / s", f"{result['tokens_per_second']:,.0f} (tokens computed by all ranks; a shared prompt once)"),
        (
            "padding",
            f"{update_padding:.1%} of the positions the update computes (micro-batches trimmed to their longest); "
            f"{batch_padding:.1%} of the full-width batch",
        ),
        *mfu_rows(result, plan.repeats),
        ("loss, grad norm", f"{stats['loss']:.4f}, {stats['grad_norm']:.4f} (last timed update)"),
    ]
    return rows


def mfu_rows(result: dict, repeats: int) -> list:
    """The report's MFU lines: the field's accounting against the card's peak and against the measured matmul, its
    FLOPs by term, then the old accounting."""
    c, flops = result["conventional"], result["conventional"]["flops"]
    mfu, card, peak = result["mfu_conventional"], result["card"], result["peak_tflops_card"]
    if mfu is None:
        conventional = (
            f"n/a: no dense bf16 peak known for {result['device']} (CARD_PEAKS: "
            f"{', '.join(card for _, _, card, _ in CARD_PEAKS)}; --card-peak-tflops gives one)"
        )
    else:
        low, high = result["mfu_conventional_range"]
        conventional = (
            f"{mfu:.1%} (median of {repeats} updates, {low:.1%}-{high:.1%}) of {card}'s {peak:g} TFLOP/s "
            f"({result['peak_tflops_card_source']}), as PaLM (app. B), nanoGPT and Megatron count it"
        )
    measured, old = result["mfu_of_measured_peak"], result["mfu"]
    return [
        ("MFU", conventional),
        (
            "  of measured matmul peak",
            "n/a (no matmul measured on a CPU: --peak-tflops)"
            if measured is None
            else f"{measured:.1%} of {result['peak_tflops']:.0f} TFLOP/s ({result['peak_tflops_source']})",
        ),
        (
            "  FLOPs / update",
            f"{flops['total']:.4g}: 6N x {c['tokens']:,} tokens needed (a shared prompt once per group) "
            f"{flops['dense']:.3g} + lm_head 6dV x {c['logit_positions']:,} logit positions {flops['lm_head']:.3g} "
            f"+ attention 12Ld x {c['attention_pairs']:,} causal pairs {flops['attention']:.3g}; "
            f"{c['fwd_bwd_passes']} epoch(s)" + (", the pi_old pass at a third" if c["forward_passes"] else ""),
        ),
        (
            "MFU, old accounting",
            "n/a (no matmul peak)"
            if old is None
            else f"{old:.1%} of {result['peak_tflops']:.0f} TFLOP/s: 6 x all params x {result['update_tokens']:,.0f} "
            "tokens computed (+ 2 x params x pi_old tokens): embeddings on every token, prompt copies counted",
        ),
    ]


def main(argv=None) -> int:
    plan = parse_plan(argv, world=int(os.environ.get("WORLD_SIZE", "1")))
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    device, main_process = accelerator.device, accelerator.is_main_process
    say = print if main_process else (lambda *a, **k: None)
    peak_tflops, peak_source = plan.peak_tflops, "--peak-tflops" if plan.peak_tflops else None
    card, card_tflops, card_source = None, None, None
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
        if peak_tflops is None:
            peak_tflops, peak_source = measure_peak_tflops(device), "bf16 8192^3 matmul, measured"
        card, card_tflops = card_peak(device_name)
        card_source = "dense bf16, NVIDIA's datasheet" if card else None
        torch.cuda.reset_peak_memory_stats(device)
    else:
        device_name = f"cpu ({torch.get_num_threads()} threads)"
    if plan.card_peak_tflops:
        card, card_tflops, card_source = card or device_name, plan.card_peak_tflops, "--card-peak-tflops"
    args = plan.train
    layout = f"{plan.world} process(es), {'FSDP2' if args.fsdp else 'DDP' if plan.world > 1 else 'unsharded'}"
    say(
        f"bench_gpu_step: Qwen2.5-{plan.model_size} shape (random init) on {device_name}, {layout}, config "
        f"{plan.config_path}: one warm-up update, then {plan.repeats} timed"
        + (", then the breakdown" if plan.breakdown else ""),
        flush=True,
    )
    import transformers  # noqa: F401  (imported before the RSS baseline, so it is not counted)

    rss_before = _peak_rss_kib()
    bench = setup(plan, accelerator)
    params = sum(p.numel() for p in accelerator.unwrap_model(bench.learner.model).parameters())  # DTensor: in full
    (p_lo, p_hi), (r_lo, r_hi) = plan.length_ranges()
    B, L = bench.batch["input_ids"].shape

    times, stats, allocator, warmup_s = timed_updates(bench, device)
    reserved_gib = None
    if device.type == "cuda":
        peak_gib = torch.cuda.max_memory_allocated(device) / 2**30
        reserved_gib = bench.learner.host.extreme([torch.cuda.max_memory_reserved(device) / 2**30], "max")[0]
        memory_kind = "cuda max_memory_allocated (timed updates), the largest rank's"
    else:
        peak_gib = max(0, _peak_rss_kib() - rss_before) / 2**20
        memory_kind = "peak RSS growth from just before the model was built (getrusage), the largest rank's"
    peak_gib = bench.learner.host.extreme([peak_gib], "max")[0]  # the largest rank's
    update_s = bench.learner.host.extreme([statistics.median(times)], "max")[0]  # the slowest rank's
    slowest = bench.learner.host.extreme(times, "max")  # each timed update's slowest rank
    steps_per_update = args.num_minibatches * args.ppo_epochs
    # the old accounting: every parameter (embeddings included) on every token computed, prompt copies included
    flops = 6 * params * stats["update_tokens"] + 2 * params * stats["no_grad_tokens"]  # per update, all ranks
    mfu = flops / update_s / (peak_tflops * 1e12 * plan.world) if peak_tflops else None
    # the field's: non-embedding 6N on the tokens the algorithm needs, the lm_head on the logit positions, attention
    own = conventional_counts(bench.batch)  # this rank's batch; integers, exact in a float64 sum over the ranks
    counts = {k: round(v) for k, v in zip(COUNTS, bench.learner.host.sum([float(own[k]) for k in COUNTS]))}
    pi_old = 0 if plan.correction.bypass_mode else 1  # the decoupled presets' forward-only pass
    conventional = conventional_flops(MODEL_SHAPES[plan.model_size], counts, args.ppo_epochs, pi_old)

    def of(peak, seconds):  # the conventional FLOPs' share of `peak` TFLOP/s per process
        return conventional["total"] / seconds / (peak * 1e12 * plan.world) if peak else None

    mfu_range = None if card_tflops is None else [of(card_tflops, max(slowest)), of(card_tflops, min(slowest))]
    batch_padding = 1 - float(bench.batch["attention_mask"].float().mean())
    update_padding = 1 - stats["update_tokens"] / stats["update_positions"] if stats["update_positions"] else 0.0
    result = {
        "device": device_name,
        "processes": plan.world,
        "fsdp": args.fsdp,
        "params": params,
        "sequences": B * plan.world,
        "padded_length": L,
        "micro_batch_size": args.micro_batch_size,
        "dtype": args.train_dtype,
        "gradient_checkpointing": args.gradient_checkpointing,
        "shared_prompt_pass": bench.share_prefix,
        "preset": args.rc.preset,
        "prompt_len": plan.prompt_len,
        "response_len": plan.response_len,
        "peak_memory_gib": round(peak_gib, 4),
        "peak_memory_kind": "cuda_max_allocated" if device.type == "cuda" else "cpu_rss_growth",
        "peak_reserved_gib": None if reserved_gib is None else round(reserved_gib, 4),
        "allocator_per_update": {k: v / plan.repeats for k, v in allocator.items()} if device.type == "cuda" else None,
        "seconds_per_update": update_s,
        "warmup_seconds": bench.learner.host.extreme([warmup_s], "max")[0],
        "compile": None if plan.compile is None else f"{plan.compile} ({plan.compile_backend})",
        "compiled_graphs": _compiled_graphs() if plan.compile else None,
        "alloc_conf": rc_config.allocator_conf(),
        "seconds_per_optimizer_step": update_s / steps_per_update,
        "tokens_per_second": stats["tokens"] / update_s,
        "update_padding_fraction": update_padding,
        "batch_padding_fraction": batch_padding,
        "peak_tflops": peak_tflops,
        "peak_tflops_source": peak_source,
        "mfu": mfu,  # the old accounting: 6 x all parameters x tokens computed, against peak_tflops
        "model_size": plan.model_size,
        "config": os.path.relpath(plan.config_path, ROOT) if plan.config_path.startswith(ROOT) else plan.config_path,
        "seed": plan.seed,
        "repeats": plan.repeats,
        "seconds_per_update_range": [min(slowest), max(slowest)],
        "update_tokens": round(stats["update_tokens"]),  # tokens computed per update (a float sum of integers)
        "no_grad_tokens": round(stats["no_grad_tokens"]),
        "conventional": {**counts, "fwd_bwd_passes": args.ppo_epochs, "forward_passes": pi_old, "flops": conventional},
        "flops_per_update_old": flops,
        "flops_per_update_conventional": conventional["total"],
        "card": card,
        "peak_tflops_card": card_tflops,
        "peak_tflops_card_source": card_source,
        "mfu_conventional": of(card_tflops, update_s),
        "mfu_conventional_range": mfu_range,
        "mfu_of_measured_peak": of(peak_tflops, update_s),
    }
    rows = result_rows(plan, bench, result, stats, times, memory_kind, layout)
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        say(f"  {key:<{width}}  {value}")
    if plan.breakdown:
        result["breakdown"] = breakdown(bench, update_s)
        for line in breakdown_rows(result["breakdown"], device.type == "cuda"):
            say(line)
        sys.stdout.flush()
    if plan.profile_dir:
        result["profile"] = profile(bench, plan.profile_dir, run_tag(plan))
        p = result["profile"]
        say(
            f"  profile ({p['micro_batches']} micro-batches + one optimizer step): {p['file']}"
            + (f"; error {p['error']}" if "error" in p else "")
            + (
                f"; {p['cuda_events_per_micro_batch']:.0f} CUDA kernels/copies per micro-batch, device busy "
                f"{p['device_busy_fraction']:.0%} of the wall time"
                if p.get("cuda_events_per_micro_batch") is not None
                else ""
            )
        )
    say(json.dumps(result))
    rc_run.exit_cleanly(plan.world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
