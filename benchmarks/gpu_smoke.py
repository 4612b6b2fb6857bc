"""The table benchmarks/gpu_smoke.sh prints at the end of its run: one run folder of rc_train.py, summarised.

Read from the folder's config.yaml and metrics.jsonl (nothing is re-run):

  * seconds per step by phase: the median of each timing/* key the trainer logged, over steps 1 .. N-1 (step 0 is
    left out: the engine's first generation, the allocator's growth and --compile's compilation fall in it; a
    one-step run keeps it); timing/eval_s over the evaluations, the one before training included;
  * memory: the largest step's perf/max_memory_allocated_gib and perf/max_memory_reserved_gib (torch's peaks in the
    trainer's process, which holds vLLM at --max-staleness 0) and the engine's share, perf/engine_memory_gib (its
    weights and KV cache) beside perf/engine_budget_gib (--vllm-gpu-memory-utilization x the device's memory); a CPU
    run logs none of them (n/a);
  * the update's MFU as bench_gpu_step counts it (conventional_flops over the perf/mfu_* counts the trainer logs:
    non-embedding 6N per token needed, the lm_head on the logit positions, causal attention; a shared prompt once per
    group), per step over timing/update_s, against the card's dense bf16 peak (bench_gpu_step.card_peak, by the device
    name); median and range over steps 1 .. N-1. The model's shape comes from its config.json (config.yaml's
    model_path). On a CPU: n/a, with the update's TFLOP/s;
  * accuracy: each eval/accuracy_* at every evaluation, the one before training (step -1) first.

    python -m benchmarks.gpu_smoke runs/gpu_smoke/smoke                       # on the machine that ran it
    python -m benchmarks.gpu_smoke RUN_DIR --device "NVIDIA H200"             # elsewhere: name the card
    python -m benchmarks.gpu_smoke RUN_DIR --card-peak-tflops 989             # a card bench_gpu_step does not know
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import yaml

from benchmarks import bench_gpu_step as bench

# timing/* keys in a step's order, with the row names of the table; a key the trainer logs beyond these is shown
# after them under its own name.
PHASES = (
    ("timing/rollout_s", "rollout"),
    ("timing/rollout_wait_s", "rollout wait"),
    ("timing/engine_idle_s", "engine idle"),
    ("timing/reward_s", "reward"),
    ("timing/old_log_prob_s", "pi_old"),
    ("timing/routing_s", "routing"),
    ("timing/ref_log_prob_s", "reference"),
    ("timing/update_s", "update"),
    ("timing/sync_s", "sync"),
    ("timing/eval_s", "eval"),
    ("timing/step_s", "step"),
)
MEMORY = (
    ("perf/max_memory_allocated_gib", "allocated", "torch max_memory_allocated, the trainer's process"),
    ("perf/max_memory_reserved_gib", "reserved", "torch max_memory_reserved"),
    ("perf/engine_memory_gib", "engine", "vLLM's weights + KV cache when awake"),
)
COUNT_KEYS = {  # bench_gpu_step.conventional_counts' keys -> the trainer's metrics (rc_run.flop_inputs)
    "tokens": "perf/mfu_tokens",
    "logit_positions": "perf/mfu_logit_positions",
    "attention_pairs": "perf/mfu_attention_pairs",
}
# verl's documented GSM8K test scores of Qwen2.5-0.5B-Instruct (docs/algo/baseline.md): the released checkpoint
# (from Qwen's blog) and after verl's PPO example (batch 256, prompts 1,024 and responses 512 tokens).
VERL_0_5B_GSM8K = {"released": 36.4, "after PPO": 56.7}


def read_run(run_dir: str) -> tuple[dict, list[dict]]:
    """config.yaml and the metrics.jsonl rows of a run folder (a torn last line is skipped)."""
    with open(os.path.join(run_dir, "config.yaml")) as f:
        config = yaml.safe_load(f)
    rows = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return config, rows


def timed_rows(steps: list[dict]) -> tuple[list[dict], str]:
    """The training steps whose seconds count (all but step 0, unless it is the only one) and their description."""
    if len(steps) <= 1:
        return steps, "step 0 alone (a one-step run: warm-up included)"
    kept = [r for r in steps if r["step"] != steps[0]["step"]]
    first, last = kept[0]["step"], kept[-1]["step"]
    return kept, (
        f"median of steps {first}-{last}" if first != last else f"step {first}"
    ) + f" (step {steps[0]['step']} left out: the engine's first batch, allocator growth, torch.compile)"


def phase_rows(rows: list[dict], steps: list[dict], timed: list[dict]) -> list[tuple[str, str]]:
    """One row per timing/* key: its median over `timed` (timing/eval_s: over every evaluation)."""
    logged = {k for r in rows for k in r if k.startswith("timing/")}
    names = dict(PHASES)
    out = []
    for key in [k for k, _ in PHASES if k in logged] + sorted(logged - set(names)):
        if key == "timing/eval_s":
            values = [r[key] for r in rows if key in r]
            where = ", ".join("before" if r["step"] < 0 else f"step {r['step']}" for r in rows if key in r)
            note = f"median of {len(values)} evaluation(s): {where}"
        else:
            values = [r[key] for r in timed if key in r] or [r[key] for r in steps if key in r]
            note = key
        if values:
            out.append((names.get(key, key), f"{statistics.median(values):9.3f}  {note}"))
    return out


def memory_rows(steps: list[dict]) -> list[tuple[str, str]]:
    """The largest step's memory figures (GiB), or one n/a row when the run logged none (a CPU run)."""
    if not any(k in r for r in steps for k, _, _ in MEMORY):
        return [("memory", "n/a on CPU (the trainer logs perf/max_memory_*_gib and perf/engine_*_gib on CUDA only)")]
    budget = [r["perf/engine_budget_gib"] for r in steps if "perf/engine_budget_gib" in r]
    budget = f"; its budget {max(budget):.2f} GiB (--vllm-gpu-memory-utilization x the device's)" if budget else ""
    out = []
    for key, name, what in MEMORY:
        extra = budget if key == "perf/engine_memory_gib" else ""
        values = [(r[key], r["step"]) for r in steps if key in r]
        if not values:
            out.append(
                (name, f"{'n/a':>9}  not logged (an engine in a rollout worker, or without --vllm-sleep){extra}")
            )
            continue
        peak, step = max(values, key=lambda v: v[0])  # the first step at the peak
        out.append((name, f"{peak:9.2f}  GiB, {what}; largest at step {step}{extra}"))
    return out


def memory_table(steps: list[dict]) -> list[tuple[str, str]]:
    """memory_rows under their heading; a CPU run's one n/a row alone."""
    rows = memory_rows(steps)
    if len(rows) == 1 and rows[0][0] == "memory":
        return rows
    return [("memory", "the largest step's peak"), *[("  " + name, value) for name, value in rows]]


def model_shape(model_path: str) -> dict:
    """The model's config.json as a dict (hidden_size, layers, heads, vocabulary: what conventional_flops reads)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path).to_dict()


def card_of(steps: list[dict], device: str | None, card_peak_tflops: float | None) -> tuple[str, str | None, float]:
    """(the device's name, the card, its dense bf16 peak in TFLOP/s): `device` if given, else this machine's GPU for a
    run that logged CUDA memory; 'cpu' for one that did not."""
    cuda_run = any("perf/max_memory_allocated_gib" in r for r in steps)
    if device is None:
        import torch

        device = torch.cuda.get_device_name(0) if cuda_run and torch.cuda.is_available() else None
        device = device or ("an unnamed GPU" if cuda_run else "cpu")
    card, peak = bench.card_peak(device) if device != "cpu" else (None, None)
    if card_peak_tflops:
        card, peak = card or device, card_peak_tflops
    return device, card, peak


def mfu_rows(config: dict, steps: list[dict], timed: list[dict], device: str, card, peak) -> list[tuple[str, str]]:
    """The update's MFU (bench_gpu_step's accounting) and its FLOPs, from the perf/mfu_* counts of each timed step."""
    args = config["args"]
    usable = [r for r in timed if all(k in r for k in COUNT_KEYS.values()) and r.get("timing/update_s", 0) > 0]
    if not usable:
        return [("MFU", "n/a: no step logged perf/mfu_* and timing/update_s")]
    try:
        shape = model_shape(config["model_path"])
    except Exception as e:  # a hub model not in this machine's cache, a folder gone
        return [("MFU", f"n/a: the model's config.json is unreadable ({type(e).__name__}: {e})")]
    if any(k in shape for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        return [("MFU", "n/a: a Mixture-of-Experts model (bench_gpu_step's accounting is the dense one)")]
    flops = [
        bench.conventional_flops(shape, {k: r[key] for k, key in COUNT_KEYS.items()}, args["ppo_epochs"])["total"]
        for r in usable
    ]
    rates = [f / r["timing/update_s"] / 1e12 for f, r in zip(flops, usable)]  # TFLOP/s per process
    rate, lo, hi = statistics.median(rates), min(rates), max(rates)
    detail = (
        f"{statistics.median(flops):.4g} per update per process (6N x tokens needed + lm_head + attention, "
        f"{args['ppo_epochs']} epoch(s)): {rate:.3g} TFLOP/s, median of {len(usable)} step(s)"
    )
    if device == "cpu":
        mfu = "n/a on CPU (MFU is of a GPU's dense bf16 peak)"
    elif peak is None:
        mfu = f"n/a: no dense bf16 peak known for {device} (--card-peak-tflops)"
    else:
        mfu = (
            f"{rate / peak:.1%} (steps' range {lo / peak:.1%}-{hi / peak:.1%}) of {card}'s {peak:g} TFLOP/s, "
            "as PaLM (app. B), nanoGPT and Megatron count it (bench_gpu_step.conventional_flops)"
        )
    return [("MFU of the update", mfu), ("  FLOPs", detail)]


def accuracy_rows(config: dict, rows: list[dict]) -> list[tuple[str, str]]:
    """Each eval/accuracy_* key at every evaluation, first -> last; verl's figures beside a Qwen2.5-0.5B GSM8K run."""
    args = config["args"]
    evals = [r for r in rows if any(k.startswith("eval/accuracy_") for k in r)]
    if not evals:
        return [("accuracy", "n/a: no evaluation logged")]
    keys = sorted({k for r in evals for k in r if k.startswith("eval/accuracy_")})
    main = f"eval/accuracy_{args.get('reward_mode')}"
    keys = sorted(keys, key=lambda k: k != main)  # the reward's own key first
    limit = args.get("eval_limit")
    problems = f"{limit} test problems" if limit else "the whole test split"
    out = []
    for key in keys:
        points = [
            f"{r[key]:.3f} ({'before' if r['step'] < 0 else 'step ' + str(r['step'])})" for r in evals if key in r
        ]
        out.append((key.removeprefix("eval/"), " -> ".join(points) + f", greedy, {problems}"))
    if "qwen2.5-0.5b-instruct" in str(args.get("model", "")).lower() and args.get("task") == "gsm8k":
        verl = ", ".join(f"{v} {k}" for k, v in VERL_0_5B_GSM8K.items())
        out.append(("  verl's figures", f"Qwen2.5-0.5B-Instruct on GSM8K, %: {verl} (verl docs: algo/baseline)"))
    return out


def summarise(run_dir: str, device: str | None = None, card_peak_tflops: float | None = None) -> str:
    """The smoke run's table: seconds per step by phase, memory, the update's MFU, accuracy before and after."""
    config, rows = read_run(run_dir)
    args = config["args"]
    steps = [r for r in rows if r.get("step", -1) >= 0]
    if not steps:
        return f"gpu_smoke: {run_dir}: no training step logged"
    timed, which = timed_rows(steps)
    device, card, peak = card_of(steps, device, card_peak_tflops)
    table = [
        (
            "run",
            f"{args['model']} on {args['task']}, preset {args['rc']['preset']}, {len(steps)} step(s) of "
            f"{args['num_prompts_per_step']} prompts x {args['num_samples_per_prompt']} samples, "
            f"{config.get('world_size', 1)} process(es), {device}",
        ),
        ("seconds / step", which),
        *[("  " + name, value) for name, value in phase_rows(rows, steps, timed)],
        *memory_table(steps),
        *mfu_rows(config, steps, timed, device, card, peak),
        *accuracy_rows(config, rows),
    ]
    width = max(len(name) for name, _ in table)
    return "\n".join([f"gpu_smoke: {run_dir}"] + [f"  {name:<{width}}  {value}" for name, value in table])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a run folder of rc_train.py (config.yaml, metrics.jsonl)")
    parser.add_argument("--device", help="the GPU's name for the card's peak (default: this machine's GPU)")
    parser.add_argument("--card-peak-tflops", type=float, help="the card's dense bf16 peak (TFLOP/s)")
    ns = parser.parse_args(argv)
    if not os.path.exists(os.path.join(ns.run_dir, "metrics.jsonl")):
        print(f"gpu_smoke: {ns.run_dir}: no metrics.jsonl", file=sys.stderr)
        return 1
    print(summarise(ns.run_dir, ns.device, ns.card_peak_tflops))
    return 0


if __name__ == "__main__":
    sys.exit(main())
