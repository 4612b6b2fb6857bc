"""CPU benchmark of rc_core and rc_forward's log-prob and entropy kernels (not a test).  One run prints measured
numbers and ratios.

(a) cost of the full correction + metrics + loss (decoupled: entry point + vanilla PPO loss with
    backward to log_prob; bypass: the bypass loss with its inner correction and backward) for a
    B x T batch, as a fraction of one forward+backward of a small Qwen2 transformer on the same
    B x T tokens.  The transformer is timed on a slice of rows and scaled linearly in the number
    of rows (the sequence length, hence the attention cost per row, is unchanged).  Goal < 2 %.
(b) vectorised GRPO advantage vs a per-sample Python loop.  Goal >= 50x.
(c) peak extra memory of log_probs_from_logits vs a full log_softmax + gather at V = 151,936,
    each measured in a fresh subprocess as the peak-RSS growth (VmHWM reset through
    /proc/self/clear_refs; ru_maxrss fallback).  Goal <= 25 %.
(d) the trainer's case: log_probs_from_logits on the non-contiguous slice logits[:, :-1] of a
    (16, 97, 151,936) fp32 tensor, forward+backward, against the same call on a contiguous copy of
    the slice: time (goal <= 1.5x) and peak extra memory over the logits (goal <= 2.5x: the gradient
    of the slice and of the full tensor already make 2x).  After one untimed call, as in a training
    loop: the very first call of a process also pays the first touch of ~2 GB of fresh pages (measured:
    slice 4.2 s, copy 1.6 s for that call alone).
(e) the token entropy on that slice: rc_forward.entropy_from_logits (chunked, no grad) against a
    full-vocabulary fp32 softmax entropy: time and peak extra memory.

Usage:  python -m benchmarks.bench_rc            (B=512, T=2048: several minutes on 2 cores)
        python -m benchmarks.bench_rc --quick    (small sizes, about 30 s)
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

import rc_core as rc
import rc_forward

#: log_probs_from_logits's own chunk_size default, so the report cannot drift from the code
DEFAULT_CHUNK = inspect.signature(rc_forward.log_probs_from_logits).parameters["chunk_size"].default

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes (~30 s)")
    p.add_argument("--batch", type=int, help="B rows for (a) (default 512; quick 64)")
    p.add_argument("--seq-len", type=int, help="T response length for (a) (default 2048; quick 512)")
    p.add_argument("--slice-rows", type=int, help="rows of the transformer timing slice (default 2; quick 1)")
    p.add_argument("--repeats", type=int, help="timing repeats, median reported (default 3)")
    p.add_argument("--grpo-samples", type=int, help="samples for (b) (default 65536; quick 16384)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--mem-tokens", type=int, help="tokens for (c) (default 2048; quick 1024)")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument(
        "--mem-chunks",
        default=f"{DEFAULT_CHUNK},1024,128",
        help=f"comma list of chunk_size values for (c); {DEFAULT_CHUNK} is the default",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for every timing (default 1: on a 2-core machine\n"
        "shared with a training job, 2 OpenMP threads thrash and make small\n"
        "torch ops 10-50x slower; both sides of each ratio use this setting)",
    )
    p.add_argument(
        "--mem-tokens-big",
        type=int,
        help="extra (c) row at this many tokens with the default chunk_size\n"
        "(default 8192 = the 151,936 x 8k design case; quick 0 = off)",
    )
    p.add_argument(
        "--slice-shape", help="B,T,V of the logits for (d) and (e) (default 16,97,151936; quick 4,97,151936)"
    )
    p.add_argument("--_mem-child", dest="mem_child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    quick = args.quick
    defaults = {
        "batch": 64 if quick else 512,
        "seq_len": 512 if quick else 2048,
        "slice_rows": 1 if quick else 2,
        "repeats": 2 if quick else 3,
        "grpo_samples": 16384 if quick else 65536,
        "mem_tokens": 1024 if quick else 2048,
        "mem_tokens_big": 0 if quick else 8192,
        "slice_shape": "4,97,151936" if quick else "16,97,151936",
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def timed(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ------------------------------------------------------------------------------------------
# (a) correction cost vs transformer forward + backward
# ------------------------------------------------------------------------------------------


def correction_inputs(b, t, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rollout = -torch.rand((b, t), generator=gen) * 4
    old = rollout + 0.05 * torch.randn((b, t), generator=gen)
    current = old + 0.02 * torch.randn((b, t), generator=gen)
    lengths = torch.randint(t // 4, t + 1, (b,), generator=gen)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    adv = torch.randn((b, 1), generator=gen).expand(b, t).contiguous()
    return old, rollout, current, adv, mask


DECOUPLED = rc.RolloutCorrectionConfig(
    rollout_is="token",
    rollout_is_threshold=2.0,
    rollout_is_batch_normalize=True,
    rollout_rs="token_k1,seq_mean_k1,seq_max_k2",
    rollout_rs_threshold="0.5_2.0,0.99_1.01,2.0",
    rollout_token_veto_threshold=1e-4,
)
BYPASS = rc.RolloutCorrectionConfig(
    rollout_is="sequence",
    rollout_is_threshold=2.0,
    rollout_rs="seq_mean_k1,seq_max_k3",
    rollout_rs_threshold="0.99_1.01,0.5",
    rollout_token_veto_threshold=1e-4,
    bypass_mode=True,
    loss_type="reinforce",
)


def decoupled_step(old, rollout, current, adv, mask):
    weights, keep, _ = rc.compute_rollout_correction_and_rejection_mask(old, rollout, mask, DECOUPLED)
    log_prob = current.clone().requires_grad_()
    loss, _ = rc.compute_policy_loss_vanilla(
        old,
        log_prob,
        adv,
        mask,
        "token-mean",
        0.2,
        0.28,
        3.0,
        weights,
        keep_mask=keep,
        rollout_log_prob=rollout,
        global_token_count=mask.sum(),
    )
    loss.backward()


def bypass_step(old, rollout, current, adv, mask):
    log_prob = current.clone().requires_grad_()
    loss, _ = rc.compute_policy_loss_bypass_mode(
        log_prob,
        rollout,
        adv,
        mask,
        BYPASS,
        "seq-mean-token-mean",
        global_token_count=mask.sum(),
        global_seq_count=mask.shape[0],
    )
    loss.backward()


def transformer_step_time(rows, t, repeats):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max(t, 512),
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.train()
    ids = torch.randint(0, config.vocab_size, (rows, t))

    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()

    desc = (
        "Qwen2 (transformers) hidden 256, 4 layers, 4 heads / 2 kv heads, MLP 1024, "
        "vocab 32000, tied embeddings, fp32, sdpa"
    )
    return timed(step, repeats), desc


def bench_correction(args):
    b, t = args.batch, args.seq_len
    inputs = correction_inputs(b, t)
    dec = timed(lambda: decoupled_step(*inputs), args.repeats)
    byp = timed(lambda: bypass_step(*inputs), args.repeats)
    slice_time, desc = transformer_step_time(args.slice_rows, t, max(1, args.repeats - 1))
    scale = b / args.slice_rows
    model_time = slice_time * scale
    return {
        "B": b,
        "T": t,
        "decoupled_s": dec,
        "bypass_s": byp,
        "slice_rows": args.slice_rows,
        "slice_s": slice_time,
        "model_s": model_time,
        "model_desc": desc,
        "scale": scale,
    }


# ------------------------------------------------------------------------------------------
# (b) GRPO: vectorised vs per-sample loop
# ------------------------------------------------------------------------------------------


def grpo_python_loop(scores, index, epsilon=1e-6):
    """The straightforward per-sample implementation (what the vectorised code replaces)."""
    groups = {}
    for i in range(len(index)):
        groups.setdefault(index[i], []).append(scores[i])
    mean, std = {}, {}
    for key, values in groups.items():
        if len(values) == 1:
            mean[key], std[key] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            stacked = torch.stack(values)
            mean[key], std[key] = stacked.mean(), stacked.std()
    out = scores.clone()
    for i in range(len(index)):
        out[i] = (scores[i] - mean[index[i]]) / (std[index[i]] + epsilon)
    return out


def bench_grpo(args):
    n, g = args.grpo_samples, args.group_size
    gen = torch.Generator().manual_seed(0)
    scores = (torch.rand(n, generator=gen) > 0.5).float()
    index = [f"uid-{i // g}" for i in range(n)]
    vec = timed(lambda: rc.compute_grpo_outcome_advantage(scores, index), 5)
    start = time.perf_counter()
    loop_out = grpo_python_loop(scores, index)
    loop = time.perf_counter() - start
    vec_out = rc.compute_grpo_outcome_advantage(scores, index)
    max_diff = (loop_out - vec_out).abs().max().item()
    ids = torch.arange(n) // g
    vec_tensor = timed(lambda: rc.compute_grpo_outcome_advantage(scores, ids), 5)
    return {
        "n": n,
        "group": g,
        "vector_s": vec,
        "vector_tensor_ids_s": vec_tensor,
        "loop_s": loop,
        "max_abs_diff": max_diff,
    }


# ------------------------------------------------------------------------------------------
# (c) memory of log_probs_from_logits vs full log_softmax (fresh subprocess each)
# ------------------------------------------------------------------------------------------


def _status_kib(field):
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_peak():
    """Reset the kernel's peak-RSS counter (VmHWM) to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def mem_child(spec):
    """Measure the peak RSS growth of one op: reset VmHWM, run, read VmHWM - VmRSS(before)."""
    method, tokens, vocab, chunk, backward = spec.split(":")
    tokens, vocab, chunk, backward = int(tokens), int(vocab), int(chunk), backward == "1"
    torch.manual_seed(0)
    logits = torch.empty((tokens, vocab)).normal_()
    labels = torch.randint(0, vocab, (tokens,))
    if backward:
        logits.requires_grad_()
    warm = torch.randn(4, 8, requires_grad=True)  # warm the kernels on a tiny input
    rc_forward.log_probs_from_logits(warm, torch.zeros(4, dtype=torch.long), chunk_size=2).sum().backward()
    torch.log_softmax(warm, -1).sum().backward()
    reset = _reset_peak()
    before = _status_kib("VmRSS") if reset else (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    if method == "full":
        out = torch.log_softmax(logits, dim=-1).gather(-1, labels[:, None])[:, 0]
    else:
        out = rc_forward.log_probs_from_logits(logits, labels, chunk_size=chunk)
    if backward:
        out.sum().backward()
    after = _status_kib("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        json.dumps(
            {
                "extra_bytes": (after - before) * 1024,
                "logits_bytes": logits.numel() * 4,
                "method": "VmHWM reset" if reset else "ru_maxrss",
            }
        )
    )


def slice_child(spec):
    """(d)/(e) in a fresh process: one untimed call of the op on logits[:, :-1] of a (B, T, V) tensor (the first
    call also pays the kernel's first touch of fresh pages, which a training loop pays once), then the peak RSS
    growth of the next call and the median seconds of `repeats` calls."""
    mode, b, t, v, repeats = spec.split(":")
    b, t, v, repeats = int(b), int(t), int(v), int(repeats)
    torch.manual_seed(0)
    full = torch.empty((b, t, v)).normal_()
    labels = torch.randint(0, v, (b, t - 1))
    warm = torch.randn(2, 3, 8, requires_grad=True)  # warm the kernels on a tiny input
    rc_forward.log_probs_from_logits(warm[:, :-1], torch.zeros(2, 2, dtype=torch.long)).sum().backward()
    rc_forward.entropy_from_logits(warm[:, :-1])
    if mode == "copy":  # the baseline: the same call on a contiguous tensor, made before the clock starts
        x = full[:, :-1].contiguous().requires_grad_()
        del full
    elif mode == "slice":
        full.requires_grad_()

    def op():
        if mode == "copy":
            rc_forward.log_probs_from_logits(x, labels).sum().backward()
            x.grad = None
        elif mode == "slice":
            rc_forward.log_probs_from_logits(full[:, :-1], labels).sum().backward()
            full.grad = None
        elif mode == "entropy":
            rc_forward.entropy_from_logits(full[:, :-1])
        else:  # entropy_full: the whole vocabulary in fp32 at once
            with torch.no_grad():
                scaled = full[:, :-1].float()
                torch.logsumexp(scaled, -1) - (scaled.softmax(-1) * scaled).sum(-1)

    op()
    reset = _reset_peak()
    before = _status_kib("VmRSS") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seconds = [timed_once(op)]
    after = _status_kib("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seconds += [timed_once(op) for _ in range(repeats - 1)]
    print(
        json.dumps(
            {
                "extra_bytes": (after - before) * 1024,
                "seconds": statistics.median(seconds),
                "logits_bytes": b * (t - 1) * v * 4,
            }
        )
    )


def timed_once(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_slice(args):
    b, t, v = (int(x) for x in args.slice_shape.split(","))
    out = {}
    for mode in ("copy", "slice", "entropy", "entropy_full"):
        out[mode] = run_child(f"slice:{mode}:{b}:{t}:{v}:{args.repeats}", args.threads)
    return {"shape": (b, t, v), **out}


def run_child(spec, threads):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_rc", "--_mem-child", spec],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=True,
    )
    return json.loads(res.stdout.strip().splitlines()[-1])


def run_mem(method, tokens, vocab, chunk, backward, threads=1):
    return run_child(f"{method}:{tokens}:{vocab}:{chunk}:{int(backward)}", threads)


def bench_memory(args):
    """Rows (pass, tokens, chunk_size, chunked bytes, full bytes)."""
    rows, th, vocab = [], args.threads, args.vocab
    full = run_mem("full", args.mem_tokens, vocab, 0, False, th)
    for chunk in [int(c) for c in args.mem_chunks.split(",")]:
        ours = run_mem("chunked", args.mem_tokens, vocab, chunk, False, th)
        rows.append(("forward", args.mem_tokens, chunk, ours["extra_bytes"], full["extra_bytes"]))
    default_chunk = DEFAULT_CHUNK
    full_b = run_mem("full", args.mem_tokens, vocab, 0, True, th)
    ours_b = run_mem("chunked", args.mem_tokens, vocab, default_chunk, True, th)
    rows.append(("fwd+bwd", args.mem_tokens, default_chunk, ours_b["extra_bytes"], full_b["extra_bytes"]))
    if args.mem_tokens_big:
        big_full = run_mem("full", args.mem_tokens_big, vocab, 0, False, th)
        big = run_mem("chunked", args.mem_tokens_big, vocab, default_chunk, False, th)
        rows.append(("forward", args.mem_tokens_big, default_chunk, big["extra_bytes"], big_full["extra_bytes"]))
    return {"vocab": vocab, "rows": rows, "how": full["method"]}


# ------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------


def verdict(ok):
    return "PASS" if ok else "MISS"


def report_correction(a: dict) -> None:
    """(a): the correction, its metrics and the loss against the model's forward and backward."""
    print(
        f"\n(a) correction + metrics + loss vs model forward+backward, B={a['B']} T={a['T']} "
        f"({a['B'] * a['T']:,} token positions)"
    )
    print(f"    model: {a['model_desc']}")
    print(
        f"    model fwd+bwd timed on {a['slice_rows']} row(s) x {a['T']} tokens = "
        f"{a['slice_s']:.3f} s, scaled linearly x{a['scale']:.0f} -> {a['model_s']:.1f} s"
    )
    print(f"    {'path':<50}{'seconds':>10}{'% of model':>13}{'goal':>8}")
    for name, key in (
        ("decoupled: entry point + PPO loss + backward", "decoupled_s"),
        ("bypass: reinforce loss (inner correction) + bwd", "bypass_s"),
    ):
        pct = 100 * a[key] / a["model_s"]
        print(f"    {name:<50}{a[key]:>10.3f}{pct:>12.3f}%{verdict(pct < 2):>8}")


def report_grpo(g: dict) -> None:
    """(b): the vectorised GRPO advantage against a per-sample loop."""
    print(f"\n(b) GRPO advantage, {g['n']:,} samples in groups of {g['group']}")
    print(f"    {'implementation':<50}{'seconds':>10}{'speed-up':>13}{'goal':>8}")
    print(f"    {'per-sample Python loop':<50}{g['loop_s']:>10.3f}{'1x':>13}")
    for name, key in (
        ("vectorised (string ids, dict map)", "vector_s"),
        ("vectorised (int tensor ids)", "vector_tensor_ids_s"),
    ):
        speed = g["loop_s"] / g[key]
        print(f"    {name:<50}{g[key]:>10.4f}{speed:>12.0f}x{verdict(speed >= 50):>8}")
    print(f"    max |loop - vectorised| = {g['max_abs_diff']:.2e}")


def report_memory(m: dict) -> None:
    """(c): peak memory of the chunked log-prob against a full log-softmax."""
    mib = 1024**2
    print(
        f"\n(c) peak extra memory ({m['how']} delta, fresh process each), V={m['vocab']:,}, "
        f"fp32 logits; chunk_size {DEFAULT_CHUNK} is the default"
    )
    print(
        f"    {'pass':<9}{'tokens':>7}{'chunk':>7}{'logits MiB':>12}{'chunked MiB':>13}"
        f"{'full MiB':>10}{'ratio':>8}{'goal':>7}"
    )
    for kind, tokens, chunk, ours, full in m["rows"]:
        ratio = ours / full if full > 0 else math.nan
        goal = verdict(ratio <= 0.25) if kind == "forward" else "(info)"
        logits_mib = tokens * m["vocab"] * 4 / mib
        print(
            f"    {kind:<9}{tokens:>7}{chunk:>7}{logits_mib:>12.0f}{ours / mib:>13.1f}"
            f"{full / mib:>10.1f}{100 * ratio:>7.1f}%{goal:>7}"
        )
    print(
        "    forward = log_probs_from_logits vs log_softmax(logits).gather.  The chunked peak is "
        "one chunk_size x V fp32\n    buffer, so the ratio is min(chunk_size, tokens) / tokens: "
        "<= 25 % once tokens >= 4 x chunk_size."
    )


def report_slice(d: dict, repeats: int) -> None:
    """(d), (e): log-probs and entropy of a sliced logits tensor, time and memory."""
    gib = 1024**3
    logits = d["slice"]["logits_bytes"]
    print(
        f"\n(d) log_probs_from_logits forward+backward on logits[:, :-1] of a {d['shape']} fp32 tensor "
        f"(slice logits {logits / gib:.2f} GiB): a fresh process each, one untimed call, then the median "
        f"of {repeats}"
    )
    speed = d["slice"]["seconds"] / d["copy"]["seconds"]
    extra = d["slice"]["extra_bytes"] / logits
    print(
        f"    contiguous copy {d['copy']['seconds']:.2f} s, slice {d['slice']['seconds']:.2f} s: "
        f"{speed:.2f}x (goal <= 1.5x) {verdict(speed <= 1.5)}"
    )
    print(
        f"    slice peak extra memory {d['slice']['extra_bytes'] / gib:.2f} GiB = {extra:.2f}x the logits "
        f"(goal <= 2.5x) {verdict(extra <= 2.5)}; contiguous copy {d['copy']['extra_bytes'] / gib:.2f} GiB"
    )
    print(
        f"\n(e) token entropy of the same slice: chunked entropy_from_logits {d['entropy']['seconds']:.2f} s, "
        f"peak extra {d['entropy']['extra_bytes'] / gib:.3f} GiB; full fp32 softmax "
        f"{d['entropy_full']['seconds']:.2f} s, peak extra {d['entropy_full']['extra_bytes'] / gib:.2f} GiB: "
        f"memory ratio {d['entropy']['extra_bytes'] / max(1, d['entropy_full']['extra_bytes']):.3f}, "
        f"time ratio {d['entropy']['seconds'] / d['entropy_full']['seconds']:.2f}"
    )


def main(argv=None):
    args = parse_args(argv)
    if args.mem_child:
        if args.mem_child.startswith("slice:"):
            slice_child(args.mem_child.split(":", 1)[1])
        else:
            mem_child(args.mem_child)
        return
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cpus, "
        f"load average {load:.1f} at start, {'quick' if args.quick else 'full'} mode"
    )

    report_correction(bench_correction(args))
    report_grpo(bench_grpo(args))
    report_memory(bench_memory(args))
    report_slice(bench_slice(args), args.repeats)


if __name__ == "__main__":
    main()
