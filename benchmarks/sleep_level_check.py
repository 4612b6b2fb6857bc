"""GPU check: rollouts after a level-2 sleep equal rollouts after a level-1 sleep, token for token (issue 51, item 3).

`--vllm-sleep-level` defaults to 2 at --sync-every 1 (rc_rollout.sleep_level): asleep, the engine frees its weights
instead of parking them in pinned host memory, and the next weight push has to rewrite every one of them. This check
runs the trainer's own engine code (rc_rollout.start_engine, EngineMemory, load_weights, generate, rc_run.full_weights)
on one vLLM engine in this process, with a randomly initialised Qwen2.5-0.5B of the published shape (nothing is
downloaded; a word-level tokenizer of its vocabulary is written beside it). Each of `--cycles` cycles does to the
engine what a training step does: the trainer's fp32 weights change (a small seeded perturbation, standing for an
update) and are pushed, then one seeded request (--prompts prompts x --samples samples) is generated three times on
those same weights:
  0. awake (no sleep since the push);
  1. after a level-1 sleep, a wake-up of the weights, a push of the same weights and a wake-up of the KV cache;
  2. the same after a level-2 sleep.
1 and 2 must agree token for token in every cycle (their log-probs are printed: equal unless the engine's kernels are
not deterministic, which 0 against 1 shows). A negative control ends the check: a level-2 sleep and a wake-up without a
push, whose rollout should differ (the weights it ran on were discarded). Also printed: the seconds of each sleep and
wake-up + push, and the GPU memory each level frees.

    python -m benchmarks.sleep_level_check                # a GPU with vLLM's CUDA build: 2-4 min, mostly the start
    python -m benchmarks.sleep_level_check --cpu-dry-run  # vLLM's CPU build: the same calls, a tiny shape, no sleep

The last line printed is one JSON object; exit status 0 when levels 1 and 2 agree in every cycle, 1 when not, 2 when
the check cannot run here (no CUDA without --cpu-dry-run, or no vLLM). --cpu-dry-run checks the plumbing only: the CPU
engine never sleeps (EngineMemory is off there), so its three rollouts of a cycle must agree trivially.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# the dry run's shape: head_dim 64 (vLLM's CPU attention rejects smaller heads), tied embeddings as Qwen2.5's
CPU_SHAPE = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    pad_token_id=511,
)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sleep_level_check", description=__doc__.split("\n")[0])
    p.add_argument("--cycles", type=int, default=3, help="training-step cycles, each with its own pushed weights")
    p.add_argument("--prompts", type=int, default=8, help="prompts per rollout")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--response-len", type=int, default=64, help="most tokens sampled per response")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-dry-run", action="store_true", help="vLLM's CPU build, a tiny shape, no sleep: the plumbing")
    p.add_argument("--work-dir", default=None, help="model, tokenizer and engine log (default: a temporary folder)")
    ns = p.parse_args(argv)
    for name in ("cycles", "prompts", "samples", "prompt_len", "response_len"):
        if getattr(ns, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(ns, name)}")
    if not 0 < ns.gpu_memory_utilization <= 1:
        p.error(f"--gpu-memory-utilization must be in (0, 1], got {ns.gpu_memory_utilization}")
    return ns


def refusal(cpu_dry_run: bool) -> str | None:
    """Why the check cannot run here (None: it can)."""
    import torch

    if not cpu_dry_run and not torch.cuda.is_available():
        return (
            "needs a CUDA GPU (torch.cuda.is_available() is False): the engine's sleep mode exists only there; "
            "--cpu-dry-run runs the same calls on vLLM's CPU build without sleeping"
        )
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        return f"needs vLLM ({e}): on a GPU its CUDA build, pip install -r requirements.txt"
    return None


def word_tokenizer(vocab_size: int, eos: int):
    """A word-level tokenizer with one token '<i>' per id (vLLM loads the model folder's tokenizer and detokenizes
    every sampled id; Qwen2.5's own is not downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token=f"<{eos}>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"<{eos}>", pad_token=f"<{eos}>")


def build_model(shape: dict, seed: int, path: str, dtype):
    """A randomly initialised Qwen2 of `shape`, written to `path` in `dtype` with its tokenizer; returned in fp32 (the
    trainer's master weights)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**shape, use_sliding_window=False)).float()
    model.to(dtype).save_pretrained(path)
    word_tokenizer(shape["vocab_size"], shape["pad_token_id"]).save_pretrained(path)
    return model.float()


def rollout_key(groups) -> tuple[list, list]:
    """(token ids, log-probs) of every response, prompt by prompt."""
    return [r.token_ids for g in groups for r in g], [r.log_probs for g in groups for r in g]


def max_abs_diff(a: list, b: list) -> float | None:
    """Largest |a - b| over the log-probs of two rollouts with equal tokens (None when their tokens differ)."""
    if [len(x) for x in a] != [len(y) for y in b]:
        return None
    return max((abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys)), default=0.0)


def run(ns: argparse.Namespace, work: str) -> dict:
    import torch

    import rc_rollout
    import rc_run
    import rc_train  # sets the engine's environment on import (VLLM_ENABLE_V1_MULTIPROCESSING=0, ...)

    on_gpu = not ns.cpu_dry_run
    device = torch.device("cuda" if on_gpu else "cpu")
    if on_gpu:
        from benchmarks.bench_gpu_step import MODEL_SHAPES

        shape, dtype, name = MODEL_SHAPES["0.5b"], torch.bfloat16, "Qwen2.5-0.5B shape, random weights"
    else:
        shape, dtype, name = CPU_SHAPE, torch.float32, "tiny Qwen2, random weights"
    path = os.path.join(work, "model")
    model = build_model(shape, ns.seed, path, dtype).to(device)
    args = dataclasses.replace(
        rc_train.Args(),
        model=path,
        seed=ns.seed,
        rollout_dtype="bfloat16" if on_gpu else "float32",
        max_model_len=ns.prompt_len + ns.response_len,
        max_response_length=ns.response_len,
        num_prompts_per_step=ns.prompts,
        num_samples_per_prompt=ns.samples,
        vllm_gpu_memory_utilization=ns.gpu_memory_utilization,
        max_staleness=0,
    )
    limits = rc_rollout.engine_limits(args, 1, ns.prompt_len, on_gpu)
    log_path = os.path.join(work, "engine.log")
    t0 = time.time()
    llm = rc_rollout.start_engine(args, path, ns.seed, limits, log_path, {})
    start_s = time.time() - t0
    memory = rc_rollout.EngineMemory(llm, on_gpu, 1)  # the trainer's: enabled on a GPU (off on a CPU, as there)
    gen = torch.Generator().manual_seed(ns.seed + 1)
    below_pad = shape["pad_token_id"]
    prompts = [torch.randint(0, below_pad, (ns.prompt_len,), generator=gen).tolist() for _ in range(ns.prompts)]
    seconds = {"sleep_1": [], "sleep_2": [], "wake_push_1": [], "wake_push_2": []}
    freed = {"1": [], "2": []}

    def push():
        memory.wake("weights")  # as LocalEngine.load: the KV cache sleeps on
        rc_rollout.load_weights(llm, rc_run.full_weights(model))

    def rollout(cycle: int):
        memory.wake("weights", "kv_cache")
        request = rc_rollout.Request(prompts, ns.samples, (ns.seed, cycle, 0), 0)
        return rollout_key(rc_rollout.generate(llm, request, args))

    def sleep_then_push(level: int, again: bool = True):
        free = torch.cuda.mem_get_info()[0] if on_gpu else 0
        memory.level, t = level, time.time()
        memory.sleep()
        seconds[f"sleep_{level}"].append(time.time() - t)
        if on_gpu:
            freed[str(level)].append((torch.cuda.mem_get_info()[0] - free) / 2**30)
        if again:
            t = time.time()
            push()
            seconds[f"wake_push_{level}"].append(time.time() - t)

    cycles = []
    for cycle in range(ns.cycles):
        with torch.no_grad():  # the update: every weight moves a little
            for p in model.parameters():
                p.mul_(1 + 1e-3 * torch.randn(p.shape, generator=gen).to(device))
        push()
        awake = rollout(cycle)
        sleep_then_push(1)
        level1 = rollout(cycle)
        sleep_then_push(2)
        level2 = rollout(cycle)
        cycles.append(
            {
                "tokens_equal_level1_level2": level1[0] == level2[0],
                "tokens_equal_awake_level1": awake[0] == level1[0],
                "max_abs_logprob_diff_level1_level2": max_abs_diff(level1[1], level2[1]),
                "max_abs_logprob_diff_awake_level1": max_abs_diff(awake[1], level1[1]),
                "tokens": sum(map(len, level2[0])),
            }
        )
    control = None
    if on_gpu:  # a level-2 sleep, then no push: the rollout runs on whatever the freed weights' memory holds
        sleep_then_push(2, again=False)
        control = rollout(ns.cycles - 1)[0] != level2[0]
    rc_rollout.shutdown_engine(llm)
    import vllm

    return {
        "check": "sleep_levels",
        "device": torch.cuda.get_device_name() if on_gpu else "cpu (dry run: the engine never sleeps)",
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "model": name,
        "engine_start_s": round(start_s, 1),
        "cycles": cycles,
        "negative_control_differs": control,
        "seconds": {k: [round(s, 3) for s in v] for k, v in seconds.items()},
        "freed_gib": {k: [round(g, 2) for g in v] for k, v in freed.items()},
        "pass": all(c["tokens_equal_level1_level2"] for c in cycles),
    }


def main(argv=None) -> int:
    ns = parse(argv)
    why = refusal(ns.cpu_dry_run)
    if why:
        print(f"sleep_level_check: {why}", file=sys.stderr)
        return 2
    work = ns.work_dir or tempfile.mkdtemp(prefix="sleep_level_check.")
    os.makedirs(work, exist_ok=True)
    try:
        result = run(ns, work)
    except Exception:
        log = os.path.join(work, "engine.log")
        if os.path.exists(log):
            with open(log, errors="replace") as f:
                print("".join(f.readlines()[-30:]), file=sys.stderr)
        raise
    finally:
        if ns.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    for i, c in enumerate(result["cycles"]):
        print(
            f"cycle {i}: level 1 = level 2 token for token: {c['tokens_equal_level1_level2']} ({c['tokens']} tokens; "
            f"max |log-prob diff| {c['max_abs_logprob_diff_level1_level2']}); awake = level 1: "
            f"{c['tokens_equal_awake_level1']}"
        )
    if result["negative_control_differs"] is not None:
        print(f"negative control (level-2 sleep, no push) differs: {result['negative_control_differs']}")
    print(f"{'PASS' if result['pass'] else 'FAIL'}: seconds {result['seconds']}, freed GiB {result['freed_gib']}")
    print(json.dumps(result))
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
