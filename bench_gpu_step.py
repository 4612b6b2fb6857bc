"""Training side of one GRPO optimizer step at the real GSM8K shape, without vLLM.

Builds a randomly initialised Qwen2.5-0.5B (or -1.5B) from its published shape (nothing is
downloaded) and a synthetic rollout batch shaped like the trainer's (num_prompts_per_step x
num_samples_per_prompt sequences: left-padded prompts, right-padded responses, rollout log-probs,
GRPO advantages from 0/1 rewards), then runs rc_train's update on the batch's first minibatch,
the way rc_train.py runs it: micro-batches through rc_train.sequence_log_probs (autocast to
train_dtype, float32 master weights), the bypass PPO-clip loss of rc_core over the minibatch's
token and sequence counts, backward per micro-batch, gradient clipping, one AdamW step.  One
warm-up step, then --repeats timed steps.  Prints peak memory, seconds per optimizer step,
seconds per full update of the rollout batch and tokens per second.

    python bench_gpu_step.py                     # GPU: Qwen2.5-0.5B, configs/gsm8k_qwen0.5b_bypass.yaml
    python bench_gpu_step.py --config configs/gsm8k_qwen1.5b_bypass.yaml   # GPU: Qwen2.5-1.5B
    python bench_gpu_step.py --tiny              # CPU: a 2-layer model, 8 short sequences, seconds

The batch settings (prompts, samples, minibatches, micro-batch, gradient checkpointing, dtype,
maximum response length, learning rate, loss settings) come from the trainer's YAML config and are
checked as rc_train.py checks them.  The last line printed is one JSON object with the figures.
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

import torch

import rc_core
import rc_train

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG = "configs/gsm8k_qwen0.5b_bypass.yaml"

# Published shapes of Qwen2.5-0.5B and -1.5B (their config.json), plus a tiny CPU stand-in.
# pad_token_id is the tokenizer's <|endoftext|>; random token ids are drawn below it.
_QWEN25 = {"vocab_size": 151936, "num_key_value_heads": 2, "max_position_embeddings": 32768,
           "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "pad_token_id": 151643}
MODEL_SHAPES = {
    "0.5b": {**_QWEN25, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14},
    "1.5b": {**_QWEN25, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
             "num_attention_heads": 12},
    "tiny": {**_QWEN25, "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 2, "head_dim": 32, "num_key_value_heads": 1, "max_position_embeddings": 2048,
             "pad_token_id": 1023},
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
    note: str = ""  # said once in the report (e.g. which preset stands in for a decoupled one)

    @property
    def sequences(self) -> int:
        return self.train.num_prompts_per_step * self.train.num_samples_per_prompt

    @property
    def minibatch(self) -> int:
        return self.sequences // self.train.num_minibatches

    def length_ranges(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(min, max) prompt and response lengths: symmetric around the means, so the means hold."""
        p, r = self.prompt_len, self.response_len
        dp = p // 4
        dr = min(r // 2, self.train.max_response_length - r)
        return (p - dp, p + dp), (r - dr, r + dr)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_gpu_step.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=DEFAULT_CONFIG,
                   help=f"trainer YAML config with the batch settings (default {DEFAULT_CONFIG}; "
                        "a relative path is tried from the current folder, then from this script's folder)")
    p.add_argument("--model-size", choices=["0.5b", "1.5b"],
                   help="Qwen2.5 shape to build (default: 1.5b when the config's model names Qwen2.5-1.5B, else 0.5b)")
    p.add_argument("--prompt-len", type=int,
                   help=f"mean prompt length in tokens, chat template included (default {DEFAULT_PROMPT_LEN}; "
                        f"tiny {TINY_PROMPT_LEN}); lengths vary by +-25%%")
    p.add_argument("--response-len", type=int,
                   help=f"mean response length in tokens, at most the config's max_response_length "
                        f"(default {DEFAULT_RESPONSE_LEN}, a typical GSM8K answer; tiny {TINY_RESPONSE_LEN}); "
                        "lengths vary symmetrically by up to +-50%% within [1, max_response_length]")
    p.add_argument("--repeats", type=int, default=3, help="timed optimizer steps after one warm-up step (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model weights and the synthetic batch (default 0)")
    p.add_argument("--tiny", action="store_true",
                   help="a 2-layer, 64-wide model with a 1024-token vocabulary and "
                        f"{TINY_ARGS['num_prompts_per_step']} prompts x {TINY_ARGS['num_samples_per_prompt']} "
                        f"samples, micro-batch {TINY_ARGS['micro_batch_size']}, max_response_length "
                        f"{TINY_ARGS['max_response_length']}: seconds on a CPU (other settings from the config)")
    return p


def resolve_config_path(path: str) -> str:
    if os.path.isabs(path) or os.path.isfile(path):
        return path
    beside = os.path.join(HERE, path)
    return beside if os.path.isfile(beside) else path


def make_plan(ns: argparse.Namespace) -> Plan:
    """Read and check the config and the flags; raises ValueError / FileNotFoundError naming the bad value."""
    path = resolve_config_path(ns.config)
    train = rc_train.load_yaml_defaults(path)  # FileNotFoundError / ValueError (unknown keys) name the file
    rc_train.validate_args(train, world_size=1)  # the trainer's own checks of the config
    if train.train_dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"config {path!r}: train_dtype must be float32, bfloat16 or float16, "
                         f"got {train.train_dtype!r}")
    if ns.tiny:
        train = dataclasses.replace(train, **TINY_ARGS)
    size = "tiny" if ns.tiny else ns.model_size or ("1.5b" if "1.5b" in str(train.model).lower() else "0.5b")
    prompt_len = ns.prompt_len if ns.prompt_len is not None else (TINY_PROMPT_LEN if ns.tiny else DEFAULT_PROMPT_LEN)
    response_len = (ns.response_len if ns.response_len is not None
                    else TINY_RESPONSE_LEN if ns.tiny else DEFAULT_RESPONSE_LEN)
    if ns.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {ns.repeats}")
    if prompt_len < 1:
        raise ValueError(f"--prompt-len must be >= 1, got {prompt_len}")
    if response_len < 1:
        raise ValueError(f"--response-len must be >= 1, got {response_len}")
    if response_len > train.max_response_length:
        raise ValueError(f"--response-len {response_len} is larger than max_response_length "
                         f"{train.max_response_length}{' (--tiny)' if ns.tiny else ''} of config {path!r}")
    batch = train.num_prompts_per_step * train.num_samples_per_prompt
    if batch % train.num_minibatches:  # validate_args checked the config; --tiny changed the batch
        raise ValueError(f"num_minibatches {train.num_minibatches} of config {path!r} must divide the rollout "
                         f"batch ({batch}{' with --tiny' if ns.tiny else ''})")
    correction = rc_train.build_correction_config(train.rc)
    note = ""
    if not correction.bypass_mode:  # decoupled: the same update plus one no-grad old-log-prob pass per rollout
        note = (f"config preset {train.rc.preset!r} is decoupled; its update is timed as bypass_ppo_clip "
                "(the extra no-grad old-log-prob pass over the rollout batch is not timed)")
        correction = rc_core.RolloutCorrectionConfig.from_name("bypass_ppo_clip")
    plan = Plan(path, train, size, prompt_len, response_len, ns.repeats, ns.seed, correction, note)
    (_, p_max), (_, r_max) = plan.length_ranges()
    if p_max + r_max > train.max_model_len:
        raise ValueError(f"the longest sequence ({p_max} prompt + {r_max} response tokens) exceeds max_model_len "
                         f"{train.max_model_len} of config {path!r}: lower --prompt-len or --response-len")
    return plan


def parse_plan(argv=None) -> Plan:
    """Flags -> checked Plan; a bad value exits (status 2) with a message naming it, before any model exists."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return make_plan(ns)
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


def make_rollout(plan: Plan) -> dict:
    """A synthetic rollout batch in the trainer's layout (rc_train.make_batch) plus GRPO advantages.

    Token ids are uniform below the pad id.  Rollout log-probs are uniform in log(1/V) +- 1, the range a
    freshly initialised model gives, so the PPO ratios are of order 1 and both clip branches run.
    Rewards are random 0/1 per sample, with one correct and one wrong answer forced into every group of
    two or more: a group of equal rewards has advantage 0 (same cost, but a zero gradient would hide a
    broken backward).
    """
    shape = MODEL_SHAPES[plan.model_size]
    vocab, pad_id = shape["vocab_size"], shape["pad_token_id"]
    gen = torch.Generator().manual_seed(plan.seed)
    (p_lo, p_hi), (r_lo, r_hi) = plan.length_ranges()
    n_prompts, n_samples = plan.train.num_prompts_per_step, plan.train.num_samples_per_prompt
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
    batch = rc_train.make_batch(prompts, responses, pad_id)
    batch["advantages"] = rc_core.compute_grpo_outcome_advantage(
        torch.tensor(rewards), torch.tensor(group_ids), norm_adv_by_std=plan.train.norm_adv_by_std,
        response_mask=batch["response_mask"])
    return batch


def optimizer_step(model, optimizer, batch: dict, rows: torch.Tensor, plan: Plan) -> dict:
    """One optimizer step over `rows` of the rollout batch, as rc_train.py's update loop runs it (one rank).

    Returns the policy-gradient loss, the gradient norm before clipping, the micro-batch count and the
    non-padded tokens processed.
    """
    args, device = plan.train, next(model.parameters()).device
    mask, rollout_lp, advantages = batch["response_mask"], batch["rollout_log_prob"], batch["advantages"]
    T = mask.shape[1]
    n_tok, n_seq = float(mask[rows].sum()), float((mask[rows].sum(-1) > 0).sum())
    denominators = {"global_token_count": max(n_tok, 1.0), "global_seq_count": max(n_seq, 1.0),
                    "loss_scale_factor": args.loss_scale_factor or float(args.max_response_length)}
    model.train()
    loss_sum = 0.0
    micro = [rows[s:s + args.micro_batch_size] for s in range(0, len(rows), args.micro_batch_size)]
    for mrows in micro:
        with torch.enable_grad():
            log_prob, entropy = rc_train.sequence_log_probs(
                model, batch["input_ids"][mrows].to(device), batch["attention_mask"][mrows].to(device), T,
                args.temperature, args.train_dtype, with_entropy=True)
        m, a, rlp = mask[mrows].to(device), advantages[mrows].to(device), rollout_lp[mrows].to(device)
        if m.sum() == 0:
            loss = (log_prob * 0).sum()
        else:
            loss, _ = rc_core.compute_policy_loss_bypass_mode(
                log_prob, rlp, a, m, plan.correction, args.loss_agg_mode, rc_train.clip_low(args),
                rc_train.clip_high(args), args.clip_ratio_c, **denominators)
            with torch.no_grad():  # the trainer's per-micro-batch metrics (they synchronise the device)
                k3 = rc_core.kl_penalty(rlp, log_prob.detach(), "low_var_kl")
                float(k3[m > 0].mean()), float(entropy[m > 0].mean())
        loss_sum += float(loss.detach())
        loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": loss_sum, "grad_norm": float(grad_norm), "micro_batches": len(micro),
            "tokens": int(batch["attention_mask"][rows].sum())}


@dataclasses.dataclass
class Bench:
    plan: Plan
    device: torch.device
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    batch: dict
    rows: torch.Tensor  # the first minibatch

    def step(self) -> dict:
        return optimizer_step(self.model, self.optimizer, self.batch, self.rows, self.plan)


def setup(plan: Plan, device: torch.device | None = None) -> Bench:
    """Model, optimizer (AdamW over the float32 weights, as the trainer) and synthetic batch."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batch = make_rollout(plan)
    model = build_model(plan, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=plan.train.learning_rate, weight_decay=plan.train.weight_decay)
    return Bench(plan, device, model, optimizer, batch, torch.arange(plan.minibatch))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def main(argv=None) -> int:
    plan = parse_plan(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        device_name = f"cpu ({torch.get_num_threads()} threads)"
    print(f"bench_gpu_step: Qwen2.5-{plan.model_size} shape (random init) on {device_name}, config "
          f"{plan.config_path}: one warm-up step, then {plan.repeats} timed", flush=True)
    if plan.note:
        print(f"note: {plan.note}")
    import transformers  # noqa: F401  (imported before the RSS baseline, so it is not counted)

    rss_before = _peak_rss_kib()
    bench = setup(plan, device)
    params = sum(p.numel() for p in bench.model.parameters())
    args = plan.train
    (p_lo, p_hi), (r_lo, r_hi) = plan.length_ranges()
    B, L = bench.batch["input_ids"].shape

    first = bench.step()  # warm-up: kernels, allocator, AdamW state
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, stats = [], first
    for _ in range(plan.repeats):
        _sync(device)
        t0 = time.perf_counter()
        stats = bench.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    if device.type == "cuda":
        peak_gib = torch.cuda.max_memory_allocated(device) / 2 ** 30
        reserved_gib = torch.cuda.max_memory_reserved(device) / 2 ** 30
        memory_kind = "cuda max_memory_allocated (timed steps)"
    else:
        peak_gib = max(0, _peak_rss_kib() - rss_before) / 2 ** 20
        reserved_gib = math.nan
        memory_kind = "peak RSS growth from just before the model was built, getrusage ru_maxrss"
    step_s = statistics.median(times)
    steps_per_update = args.num_minibatches * args.ppo_epochs
    result = {"device": device_name, "params": params, "sequences": B, "minibatch_sequences": plan.minibatch,
              "padded_length": L, "micro_batch_size": args.micro_batch_size, "dtype": args.train_dtype,
              "gradient_checkpointing": args.gradient_checkpointing, "peak_memory_gib": round(peak_gib, 4),
              "peak_memory_kind": "cuda_max_allocated" if device.type == "cuda" else "cpu_rss_growth",
              "seconds_per_optimizer_step": step_s, "seconds_per_update": step_s * steps_per_update,
              "tokens_per_second": stats["tokens"] / step_s}

    batch_text = (f"{args.num_prompts_per_step} prompts x {args.num_samples_per_prompt} samples = {B} "
                  f"sequences, padded to {L} tokens")
    lengths_text = (f"prompts {p_lo}-{p_hi} (mean {plan.prompt_len}), responses {r_lo}-{r_hi} "
                    f"(mean {plan.response_len}, max_response_length {args.max_response_length})")
    step_text = (f"minibatch of {plan.minibatch} sequences ({stats['tokens']:,} non-padded tokens) = "
                 f"{stats['micro_batches']} micro-batch(es) of {args.micro_batch_size}")
    compute_text = (f"{args.train_dtype} autocast, gradient checkpointing "
                    f"{'on' if args.gradient_checkpointing else 'off'}, AdamW lr {args.learning_rate:g}")
    memory_text = f"{peak_gib:.3f} GiB: {memory_kind}"
    if device.type == "cuda":
        memory_text += f"; reserved {reserved_gib:.3f} GiB"
    times_text = ", ".join(f"{t:.3f}" for t in times)
    update_text = (f"{step_s * steps_per_update:.3f} ({steps_per_update} optimizer steps: "
                   f"{args.num_minibatches} minibatches x {args.ppo_epochs} epoch(s))")
    rows = [
        ("device", device_name),
        ("model", f"Qwen2.5-{plan.model_size} shape, {params:,} parameters, float32 master weights"),
        ("rollout batch", batch_text),
        ("lengths", lengths_text),
        ("optimizer step", step_text),
        ("compute", compute_text),
        ("peak memory", memory_text),
        ("s / optimizer step", f"{step_s:.3f} (median of {plan.repeats}: {times_text})"),
        ("s / update", update_text),
        ("tokens / s", f"{result['tokens_per_second']:,.0f}"),
        ("loss, grad norm", f"{stats['loss']:.4f}, {stats['grad_norm']:.4f} (last timed step)"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
