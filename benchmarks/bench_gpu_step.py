"""Training side of one GRPO update at the real GSM8K shape, without vLLM: rc_train.py's own update path.

Builds a randomly initialised Qwen2.5 (0.5B, 1.5B or 7B) from its published shape (nothing is downloaded) and a
synthetic rollout batch shaped like the trainer's (each rank's share of num_prompts_per_step x num_samples_per_prompt
sequences: left-padded prompts, right-padded responses, rollout log-probs, GRPO advantages from 0/1 rewards), then
runs what rc_train.py runs on it: for a decoupled preset the no-grad pi_old pass and the correction
(rc_train.no_grad_pass, rc_core), then rc_train.update_policy (epochs x minibatches x micro-batches, the shared-prompt
pass, global denominators, gradient accumulation, clipping, AdamW). One warm-up update, then --repeats timed
updates. Prints peak memory, seconds per update and per optimizer step, and tokens per second.

    python -m benchmarks.bench_gpu_step                     # one GPU: Qwen2.5-0.5B, configs/gsm8k_qwen0.5b_bypass.yaml
    python -m benchmarks.bench_gpu_step --config configs/gsm8k_qwen1.5b_bypass.yaml
    torchrun --nproc_per_node 8 -m benchmarks.bench_gpu_step                                         # DDP, 8 GPUs
    torchrun --nproc_per_node 8 -m benchmarks.bench_gpu_step --config configs/gsm8k_qwen7b_fsdp2.yaml  # FSDP2, 8 GPUs
    python -m benchmarks.bench_gpu_step --tiny              # CPU: a 2-layer model, 8 short sequences, seconds

The batch settings (prompts, samples, minibatches, micro-batch, gradient checkpointing, dtype, fsdp, maximum response
length, learning rate, loss and correction settings) come from the trainer's YAML config and are checked as
rc_train.py checks them. The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import statistics
import sys
import time
from collections import Counter

import torch

import rc_config
import rc_core
import rc_run
import rc_train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
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
TINY_ARGS = {"num_prompts_per_step": 2, "num_samples_per_prompt": 4, "micro_batch_size": 2, "max_response_length": 16}
TINY_PROMPT_LEN, TINY_RESPONSE_LEN = 16, 12
DEFAULT_PROMPT_LEN, DEFAULT_RESPONSE_LEN = 160, 300


@dataclasses.dataclass
class Plan:
    """Everything the benchmark runs with, checked before any model is built."""

    config_path: str
    train: rc_train.Args  # the trainer's settings from the YAML config (shrunk by --tiny)
    model_size: str  # a key of MODEL_SHAPES
    prompt_len: int
    response_len: int
    repeats: int
    seed: int
    correction: rc_core.RolloutCorrectionConfig
    world: int = 1  # processes (torchrun); each takes its share of the prompts, as in rc_train.py

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
    p.add_argument("--repeats", type=int, default=3, help="timed optimizer steps after one warm-up step (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model weights and the synthetic batch (default 0)")
    p.add_argument(
        "--tiny",
        action="store_true",
        help="a 2-layer, 64-wide model with a 1024-token vocabulary and "
        f"{TINY_ARGS['num_prompts_per_step']} prompts x {TINY_ARGS['num_samples_per_prompt']} "
        f"samples, micro-batch {TINY_ARGS['micro_batch_size']}, max_response_length "
        f"{TINY_ARGS['max_response_length']}: seconds on a CPU (other settings from the config)",
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
    train = rc_train.load_yaml_defaults(path)  # FileNotFoundError / ValueError (unknown keys) name the file
    named = next((k for k in ("7b", "1.5b", "0.5b") if k in str(train.model).lower()), "0.5b")
    if ns.tiny:
        train = dataclasses.replace(train, **TINY_ARGS)
    train = dataclasses.replace(train, model="tiny", fsdp=train.fsdp or ns.fsdp)  # the shape is built here
    rc_config.validate_args(train, world_size=world)  # the trainer's own checks of the config
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
    if response_len > train.max_response_length:
        raise ValueError(
            f"--response-len {response_len} is larger than max_response_length "
            f"{train.max_response_length}{' (--tiny)' if ns.tiny else ''} of config {path!r}"
        )
    correction = rc_config.build_correction_config(train.rc)
    plan = Plan(path, train, size, prompt_len, response_len, ns.repeats, ns.seed, correction, world)
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
    """A synthetic rollout batch in the trainer's layout (rc_train.make_batch) plus GRPO advantages.

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

    prompts, responses, group_ids, rewards = [], [], [], []
    for g in range(n_prompts):
        prompt = randint(0, pad_id - 1, (int(randint(p_lo, p_hi)),)).tolist()
        wins = (torch.rand(n_samples, generator=gen) < 0.5).float()
        if n_samples >= 2:
            wins[0], wins[1] = 1.0, 0.0
        for k in range(n_samples):
            length = int(randint(r_lo, r_hi))
            ids = randint(0, pad_id - 1, (length,)).tolist()
            lps = (centre + 2 * torch.rand(length, generator=gen) - 1).tolist()
            prompts.append(prompt)
            responses.append((ids, lps, ""))
            group_ids.append(g)
            rewards.append(float(wins[k]))
    batch = rc_train.make_batch(prompts, responses, pad_id, group_ids)
    batch["advantages"] = rc_core.compute_grpo_outcome_advantage(
        torch.tensor(rewards),
        torch.tensor(group_ids),
        norm_adv_by_std=plan.train.norm_adv_by_std,
        response_mask=batch["response_mask"],
    )
    return batch


@dataclasses.dataclass
class Bench:
    plan: Plan
    learner: rc_train.Learner  # accelerator, host group, model, optimizer, scheduler: as rc_train.py makes them
    batch: dict

    @property
    def share_prefix(self) -> bool:
        return rc_train.shares_prefix(self.plan.train)

    def update(self) -> dict:
        """One update of the rollout batch, as rc_train.py's step runs it after the rollout: the decoupled pi_old
        pass and correction (rc_train.decoupled_correction, decoupled presets only), then rc_train.update_policy."""
        args, batch, correction, learner = self.plan.train, self.batch, self.plan.correction, self.learner
        tensors = {k: batch[k] for k in ("response_mask", "advantages", "rollout_log_prob")}
        batch_correction, size = {}, Counter()
        if not correction.bypass_mode:
            unwrapped = learner.accelerator.unwrap_model(learner.model)
            batch_correction, size = rc_train.decoupled_correction(args, correction, unwrapped, batch, tensors)
        _, actor, update_size = rc_train.update_policy(
            args=args,
            correction=correction,
            learner=learner,
            batch=batch,
            tensors=tensors,
            generator=torch.Generator().manual_seed(self.plan.seed),
            batch_correction=batch_correction,
        )
        tokens = learner.host.sum([float((size + update_size)["tokens"])])[0]  # the trainer's perf/* counts the same
        return {"loss": actor["actor/pg_loss"], "grad_norm": actor["actor/grad_norm"], "tokens": tokens}


def setup(plan: Plan, accelerator=None) -> Bench:
    """Model (sharded with rc_run.shard_model under FSDP2, else prepared by Accelerate: DDP on several processes),
    optimizer and scheduler as rc_train.py builds them, and this rank's synthetic batch."""
    from accelerate import Accelerator

    accelerator = accelerator or Accelerator(cpu=not torch.cuda.is_available())
    args = plan.train
    model = build_model(plan, accelerator.device)
    if args.fsdp:
        model = rc_run.shard_model(model, accelerator.device.type)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    if not args.fsdp:
        model, optimizer = accelerator.prepare(model, optimizer)
    learner = rc_train.Learner(accelerator, rc_run.HostGroup(accelerator.num_processes), model, optimizer, scheduler)
    return Bench(plan, learner, make_rollout(plan, accelerator.process_index))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def main(argv=None) -> int:
    plan = parse_plan(argv, world=int(os.environ.get("WORLD_SIZE", "1")))
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    device, main_process = accelerator.device, accelerator.is_main_process
    say = print if main_process else (lambda *a, **k: None)
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        device_name = f"cpu ({torch.get_num_threads()} threads)"
    args = plan.train
    layout = f"{plan.world} process(es), {'FSDP2' if args.fsdp else 'DDP' if plan.world > 1 else 'unsharded'}"
    say(
        f"bench_gpu_step: Qwen2.5-{plan.model_size} shape (random init) on {device_name}, {layout}, config "
        f"{plan.config_path}: one warm-up update, then {plan.repeats} timed",
        flush=True,
    )
    import transformers  # noqa: F401  (imported before the RSS baseline, so it is not counted)

    rss_before = _peak_rss_kib()
    bench = setup(plan, accelerator)
    params = sum(p.numel() for p in accelerator.unwrap_model(bench.learner.model).parameters())  # DTensor: in full
    (p_lo, p_hi), (r_lo, r_hi) = plan.length_ranges()
    B, L = bench.batch["input_ids"].shape

    bench.update()  # warm-up: kernels, allocator, AdamW state
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(plan.repeats):
        _sync(device)
        t0 = time.perf_counter()
        stats = bench.update()
        _sync(device)
        times.append(time.perf_counter() - t0)
    if device.type == "cuda":
        peak_gib = torch.cuda.max_memory_allocated(device) / 2**30
        memory_kind = "cuda max_memory_allocated (timed updates), the largest rank's"
    else:
        peak_gib = max(0, _peak_rss_kib() - rss_before) / 2**20
        memory_kind = "peak RSS growth from just before the model was built (getrusage), the largest rank's"
    peak_gib = bench.learner.host.extreme([peak_gib], "max")[0]  # the largest rank's
    update_s = bench.learner.host.extreme([statistics.median(times)], "max")[0]  # the slowest rank's
    steps_per_update = args.num_minibatches * args.ppo_epochs
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
        "peak_memory_gib": round(peak_gib, 4),
        "peak_memory_kind": "cuda_max_allocated" if device.type == "cuda" else "cpu_rss_growth",
        "seconds_per_update": update_s,
        "seconds_per_optimizer_step": update_s / steps_per_update,
        "tokens_per_second": stats["tokens"] / update_s,
    }
    rows = [
        ("device", f"{device_name}; {layout}"),
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
        (
            "s / update",
            f"{update_s:.3f} (median of {plan.repeats}, slowest rank: "
            f"{', '.join(f'{t:.3f}' for t in times)} on this one)",
        ),
        ("s / optimizer step", f"{update_s / steps_per_update:.3f}"),
        ("tokens / s", f"{result['tokens_per_second']:,.0f} (tokens computed by all ranks; a shared prompt once)"),
        ("loss, grad norm", f"{stats['loss']:.4f}, {stats['grad_norm']:.4f} (last timed update)"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        say(f"  {key:<{width}}  {value}")
    say(json.dumps(result))
    rc_run.exit_cleanly(plan.world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
