"""A race, side by side in one run: this trainer against Hugging Face TRL's GRPOTrainer (not a test).

All three train the miniature GSM8K (the embedded default task and its warm-started base model) from the same
weights on the same prompts in the same order, one after the other on this machine, for each seed:

  ours           python rc_train.py (the default job; --max-staleness 1 by default: the asynchronous rollout,
                 docs/async.md, with the trainer's own thread choice, one thread per process)
  trl_vllm       GRPOTrainer, use_vllm=True, vllm_mode="colocate" (vLLM in the trainer's process)
  trl_generate   GRPOTrainer, use_vllm=False (transformers `generate`)

Each at its best thread setting on 2 cores (measured: docs/results.md "The race against TRL"): ours the trainer's own
default, TRL OMP_NUM_THREADS=2 (--ours-threads / --trl-threads to change them).

Matched: base model, prompt order (ours: rc_train.prompt_indices; TRL: the same rows in that order, no
shuffle), 32 prompts x 16 samples per rollout, 64 response tokens, temperature 1, 4 optimizer steps of 128
responses per rollout in micro-batches of 32, AdamW at a constant 1e-4 (no weight decay, grad-norm clip 1),
clip 0.2 both sides, token-mean over each optimizer step's tokens (TRL's "dapo" = our "token-mean"),
group-std advantages, no KL, fp32. Everything else is each trainer's default (TRL recomputes pi_old and applies
its sequence-mask IS with vLLM; ours uses pi_old := pi_rollout, docs/corrections.md §7.3).

Measured for each: seconds per rollout step, training seconds to reach each --targets strict greedy accuracy on
the 200 test problems (wall time from the first step, evaluation time subtracted: ours from timing/step_s -
timing/eval_s, whose clock starts once the engine has finished the batches queued before it; TRL from a callback
clock that stops while it evaluates), and the final accuracy. Start-up (model load, engine start) is reported
apart. Ours evaluates with vLLM greedy decoding, TRL with transformers greedy `generate` of the same policy; both
score with tasks.py's strict scorer.

TRL lives in its own virtual environment, created here on first use (pinned: TRL_PIN, on top of this
project's requirements-cpu.txt) and never a dependency of the trainer. TRL's colocate weight sync
(`model.load_weights` on the engine's model) crashes on vLLM's CPU build, which pre-packs linear weights;
the worker replaces it with vLLM's `reload_weights` over the full state dict (docs/running.md "The CPU engine").

Usage:  python -m benchmarks.bench_trl                  (3 seeds x 50 rollout steps, each trainer)
        python -m benchmarks.bench_trl --quick --seeds 1 --variants ours,trl_vllm    (a quick look: 20 steps, one seed)
        python -m benchmarks.bench_trl --from-results runs/bench_trl/results.json   (the report again, no runs)
The report gives every ratio ours/TRL (against the faster TRL variant) per seed and target, and their medians
(`inf` where ours never reached the target, `0` where no TRL variant did). The last line is exactly
`ours/TRL time-to-accuracy: <median ratio at the first target>` (0.5 by default). Goal: <= 0.3 at each target.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
TRL_PIN = "trl==1.16.0"
VARIANTS = ("ours", "trl_vllm", "trl_generate")
# The default job's shape (rc_train.Args defaults); TRL gets the same numbers.
SHAPE = dict(
    prompts_per_step=32,
    samples_per_prompt=16,
    max_response_length=64,
    max_model_len=512,
    learning_rate=1e-4,
    clip=0.2,
    num_minibatches=4,
    micro_batch_size=32,
    eval_limit=200,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="20 rollout steps per trainer (default 50)")
    p.add_argument("--steps", type=int, help="rollout steps per trainer (overrides --quick)")
    p.add_argument(
        "--targets",
        default="0.5,0.8,0.9",
        help="strict greedy eval accuracies to reach (default 0.5,0.8,0.9; the last line is the first)",
    )
    p.add_argument("--eval-every", type=int, default=2, help="evaluate every N rollout steps (default 2)")
    p.add_argument(
        "--seeds", help="comma list of run seeds (default 1,2,3; with --from-results: the seeds to report, default all)"
    )
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {VARIANTS}")
    p.add_argument(
        "--max-staleness",
        type=int,
        default=1,
        help="ours: rc_train.py --max-staleness (default 1, the asynchronous rollout; 0 = synchronous)",
    )
    p.add_argument(
        "--preset",
        default="bypass_ppo_clip",
        help="ours: rc_train.py --rc.preset (default bypass_ppo_clip, as in the README's figures: PPO-clip against the "
        "engine's log-probs, like TRL's loss with its vLLM IS correction; no pi_old pass)",
    )
    p.add_argument(
        "--ours-threads",
        type=int,
        help="ours: OMP_NUM_THREADS (default: unset, the trainer's own choice, rc_config.torch_threads)",
    )
    p.add_argument("--trl-threads", type=int, default=2, help="TRL: OMP_NUM_THREADS (default 2, its faster setting)")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_trl"), help="folder for runs and results")
    p.add_argument(
        "--trl-env",
        default=os.path.join(ROOT, ".bench", "trl-env"),
        help="TRL's virtual environment (created on first use)",
    )
    p.add_argument("--from-results", help="print the report of an earlier results.json (no runs)")
    p.add_argument("--worker", choices=("trl_vllm", "trl_generate"), help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    if args.steps is None:
        args.steps = 20 if args.quick else 50
    try:
        args.targets = [float(t) for t in args.targets.split(",")]
        if args.seeds is None and not args.from_results:
            args.seeds = "1,2,3"
        args.seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None  # None: every seed saved
    except ValueError as e:
        p.error(f"--targets takes numbers and --seeds integers, comma-separated: {e}")
    args.variants = args.variants.split(",")
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or "ours" not in args.variants or len(args.variants) < 2:
        p.error(f"--variants: need ours and a TRL variant from {VARIANTS}, got {args.variants}")
    bad = [t for t in args.targets if not 0 < t <= 1]
    if args.steps < 1 or args.eval_every < 1 or bad or args.max_staleness < 0:
        p.error(
            f"need --steps >= 1 (got {args.steps}), --eval-every >= 1 (got {args.eval_every}), "
            f"--max-staleness >= 0 (got {args.max_staleness}) and 0 < each target <= 1 (got {bad or 'ok'})"
        )
    import rc_core

    if args.preset not in rc_core.PRESET_NAMES:
        p.error(f"--preset must be one of rc_core.PRESET_NAMES, got {args.preset!r}")
    for name in ("ours_threads", "trl_threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


# ---- The shared specification: model, prompts in order, eval set --------------------------------------------
def write_spec(args, seed: int, out: str) -> str:
    """Build (or reuse) the base model and write everything both trainers must share to out/spec.json."""
    import tasks
    from rc_train import prompt_indices  # importing rc_train also sets its environment defaults for both trainers

    mini = tasks.MiniGSMArgs()
    task = tasks.make_task("minigsm", mini)
    model_path = tasks.base_model_path(task, mini, seed, log=lambda m: print(f"[base] {m}", flush=True))
    train_rows, _ = task.problems("train", None)
    eval_rows, _ = task.problems("test", SHAPE["eval_limit"])
    order = prompt_indices(len(train_rows), seed, 0, args.steps * SHAPE["prompts_per_step"])
    spec = {
        **SHAPE,
        "model_path": model_path,
        "steps": args.steps,
        "seed": seed,
        "eval_every": args.eval_every,
        "train": [train_rows[i] for i in order],
        "eval": eval_rows,
    }
    path = os.path.join(out, "spec.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    return path


# ---- Ours: the real script, default job, fewer steps ------------------------------------------------------------
def run_ours(args, seed: int, out: str) -> dict:
    run = os.path.join(out, "ours")
    cmd = [
        sys.executable,
        os.path.join(ROOT, "rc_train.py"),
        "--seed",
        str(seed),
        "--num-steps",
        str(args.steps),
        "--eval-every",
        str(args.eval_every),
        "--max-staleness",
        str(args.max_staleness),
        "--rc.preset",
        args.preset,
        "--output-dir",
        out,
        "--run-name",
        "ours",
        "--overwrite",
        "--no-save-final",
    ]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if args.ours_threads:
        env["OMP_NUM_THREADS"] = str(args.ours_threads)
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    wall = time.time() - t0
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    evals, train_s = [], 0.0
    for r in rows:
        if r["step"] >= 0:  # the eval's clock starts after the engine has finished the batches queued before it
            train_s += r["timing/step_s"] - r.get("timing/eval_s", 0.0)
        if "eval/accuracy_strict" in r:
            evals.append({"step": r["step"] + 1, "train_s": train_s, "accuracy": r["eval/accuracy_strict"]})
    return {
        "evals": evals,
        "train_s": train_s,
        "wall_s": wall,
        "threads": env.get("OMP_NUM_THREADS", "default"),
        "command": " ".join(cmd[1:]),
    }


# ---- TRL: its own environment, then one worker process per variant -----------------------------------------------
def trl_python(env: str) -> str:
    """The TRL environment's python, created on first use: this project's CPU requirements plus TRL_PIN."""
    python = os.path.join(env, "bin", "python")
    stamp = os.path.join(env, "installed.txt")
    if os.path.exists(stamp) and open(stamp).read().strip() == TRL_PIN:
        return python
    print(f"[trl] creating {env} with {TRL_PIN} (several minutes, once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", env], check=True)
    pip = [python, "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["-r", os.path.join(ROOT, "requirements-cpu.txt"), TRL_PIN], check=True)
    # As for the trainer's own environment: CUDA builds of these break `import transformers` beside CPU torch.
    subprocess.run([python, "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"])
    with open(stamp, "w") as f:
        f.write(TRL_PIN + "\n")
    return python


def run_trl(args, variant: str, spec_path: str, python: str, out: str) -> dict:
    result = os.path.join(out, variant, "result.json")
    os.makedirs(os.path.dirname(result), exist_ok=True)
    cmd = [
        python,
        "-m",
        "benchmarks.bench_trl",
        "--worker",
        variant,
        "--spec",
        spec_path,
        "--out",
        os.path.dirname(result),
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.trl_threads))
    t0 = time.time()
    with open(os.path.join(os.path.dirname(result), "worker.log"), "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{variant} failed (exit {proc.returncode}); see {log.name}")
    out = json.load(open(result))
    return {
        **out,
        "wall_s": time.time() - t0,
        "threads": str(args.trl_threads),  # GRPOConfig: result.json
        "command": " ".join(cmd[1:]),
    }


def trl_config(spec: dict, out: str, use_vllm: bool) -> dict:
    """GRPOConfig's keyword arguments for the race, from the spec (the settings matched to ours, module docstring):
    one rollout batch of prompts x samples per generation, num_minibatches optimizer steps per rollout batch (micro-
    batches accumulated), DAPO's token-mean loss, no KL, a symmetric clip, a constant learning rate."""
    per_rollout = spec["prompts_per_step"] * spec["samples_per_prompt"]
    optimizer_steps = spec["num_minibatches"]
    accumulation = per_rollout // optimizer_steps // spec["micro_batch_size"]
    return dict(
        output_dir=out,
        seed=spec["seed"],
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        shuffle_dataset=False,
        max_steps=spec["steps"] * optimizer_steps,
        num_generations=spec["samples_per_prompt"],
        per_device_train_batch_size=spec["micro_batch_size"],
        gradient_accumulation_steps=accumulation,
        generation_batch_size=per_rollout,
        num_iterations=1,
        max_completion_length=spec["max_response_length"],
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=spec["learning_rate"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        epsilon=spec["clip"],
        epsilon_high=spec["clip"],
        beta=0.0,
        loss_type="dapo",
        scale_rewards="group",
        gradient_checkpointing=False,
        use_vllm=use_vllm,
        vllm_mode="colocate",
        vllm_max_model_length=spec["max_model_len"],
    )


def greedy_strict_accuracy(policy, tokenizer, task, prompts: list[str], spec: dict) -> float:
    """Greedy strict accuracy of `policy` on the eval prompts (the spec's eval rows), 100 prompts at a time."""
    import torch

    tokenizer.padding_side = "left"
    correct = 0
    policy.eval()
    with torch.no_grad():
        for i in range(0, len(prompts), 100):
            enc = tokenizer(prompts[i : i + 100], return_tensors="pt", padding=True, add_special_tokens=False)
            out = policy.generate(
                **enc,
                max_new_tokens=spec["max_response_length"],
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            correct += sum(task.score(t, r)["strict"] for t, r in zip(texts, spec["eval"][i : i + 100]))
    policy.train()
    return correct / len(prompts)


def trl_worker(args) -> None:
    """Runs inside TRL's environment: GRPOTrainer on the spec, a greedy eval every few rollout steps."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import tasks

    spec = json.load(open(args.spec))
    torch.manual_seed(spec["seed"])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    task = tasks.make_task("minigsm", tasks.MiniGSMArgs())
    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
    prompts = [task.prompt(r) for r in spec["train"]]
    # The prompt tokens must be the trainer's: rc_train encodes without special tokens, TRL with the default.
    for text in prompts[:8]:
        assert tokenizer(text)["input_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"], text
    data = Dataset.from_list([{"prompt": p, "gold": r["gold"]} for p, r in zip(prompts, spec["train"])])

    def strict_reward(completions, gold, **_):
        return [float(task.score(c, {"gold": g})["strict"]) for c, g in zip(completions, gold)]

    optimizer_steps = spec["num_minibatches"]
    config = GRPOConfig(**trl_config(spec, args.out, use_vllm=args.worker == "trl_vllm"))

    eval_prompts = [task.prompt(r) for r in spec["eval"]]

    class RaceClock(TrainerCallback):
        """Training time from the first step with evaluation subtracted; an eval every eval_every rollouts."""

        def __init__(self):
            self.evals, self.t0, self.paused = [], None, 0.0

        def on_train_begin(self, _args, state, control, model=None, **_):
            self.t0 = time.time()

        def on_step_end(self, _args, state, control, model=None, **_):
            if state.global_step % optimizer_steps:
                return
            rollout = state.global_step // optimizer_steps
            if rollout % spec["eval_every"] and rollout != spec["steps"]:
                return
            train_s = time.time() - self.t0 - self.paused
            t = time.time()
            accuracy = greedy_strict_accuracy(model, tokenizer, task, eval_prompts, spec)
            self.paused += time.time() - t
            self.evals.append({"step": rollout, "train_s": train_s, "accuracy": accuracy})
            print(f"[{args.worker}] rollout {rollout}: accuracy {accuracy:.3f}, {train_s:.1f} s", flush=True)

    if args.worker == "trl_vllm":
        patch_colocate_sync()
    clock = RaceClock()
    t_setup = time.time()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=strict_reward,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    setup_s = time.time() - t_setup
    trainer.train()
    train_s = clock.evals[-1]["train_s"] if clock.evals else time.time() - clock.t0 - clock.paused
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(
            {
                "evals": clock.evals,
                "train_s": train_s,
                "setup_s": setup_s,
                "trl": TRL_PIN,
                "config": {k: v for k, v in config.to_dict().items() if isinstance(v, (int, float, str, bool))},
            },
            f,
            indent=1,
        )


def patch_colocate_sync() -> None:
    """TRL's colocate sync calls the engine model's load_weights, which crashes on vLLM's CPU build (its linear
    weights are pre-packed). vLLM's reload_weights takes the new tensors and repacks them; send every tensor of the
    state dict, the tied output layer included (the CPU build keeps its own packed copy of it)."""
    from trl.generation import vllm_generation

    original = vllm_generation.VLLMGeneration.sync_weights

    def sync_weights(self):
        if self.mode != "colocate":
            return original(self)
        weights = [(name, tensor.detach()) for name, tensor in self.model.state_dict().items()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()

    vllm_generation.VLLMGeneration.sync_weights = sync_weights


# ---- Report ----------------------------------------------------------------------------------------------------
def time_to(evals: list[dict], target: float) -> float | None:
    return next((e["train_s"] for e in evals if e["accuracy"] >= target), None)


def ratio(results: dict, target: float) -> float:
    """Ours' training seconds to `target` over the faster TRL variant's: inf if ours never reached it, 0 if no
    TRL variant did (and ours did)."""
    ours = time_to(results["ours"]["evals"], target)
    trl = [t for t in (time_to(r["evals"], target) for v, r in results.items() if v != "ours") if t is not None]
    if ours is None:
        return float("inf")
    return ours / min(trl) if trl else 0.0


def report(args, runs: dict) -> list[str]:
    """runs: seed -> variant -> result. A table per seed, every ratio per seed and target, their medians; the last
    line is the median at the first target."""
    head = " | ".join(f"s to {t} (step)" for t in args.targets)
    lines = [
        f"miniature GSM8K, {args.steps} rollout steps of 32 x 16, greedy strict accuracy on 200 test problems "
        f"every {args.eval_every} steps; ours --max-staleness {args.max_staleness}",
        "",
    ]
    for seed, results in runs.items():
        lines += [
            f"seed {seed}:",
            "",
            f"| trainer | threads | s / rollout step | {head} | final strict accuracy | start-up + eval s |",
            "|---|---|---|" + "---|" * len(args.targets) + "---|---|",
        ]
        for name, r in results.items():
            cells = []
            for t in args.targets:
                reach = time_to(r["evals"], t)
                step = next((e["step"] for e in r["evals"] if e["accuracy"] >= t), None)
                cells.append("never" if reach is None else f"{reach:.1f} ({step})")
            final = r["evals"][-1]["accuracy"] if r["evals"] else float("nan")
            lines.append(
                f"| {name} | {r.get('threads', '?')} | {r['train_s'] / args.steps:.2f} | {' | '.join(cells)} | "
                f"{final:.3f} | {r['wall_s'] - r['train_s']:.0f} |"
            )
        lines.append("")
    medians = {}
    for t in args.targets:
        per_seed = [ratio(results, t) for results in runs.values()]
        medians[t] = statistics.median(per_seed)
        lines.append(f"ours/TRL at {t}: per seed {', '.join(f'{x:.3f}' for x in per_seed)}; median {medians[t]:.3f}")
    lines += ["", f"ours/TRL time-to-accuracy: {medians[args.targets[0]]:.3f}"]
    return lines


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        return trl_worker(args)
    if args.from_results:
        with open(args.from_results) as f:
            saved = json.load(f)
        for k in ("steps", "eval_every", "max_staleness"):  # the runs' own; --targets may be chosen anew
            setattr(args, k, saved["args"][k])
        runs = {int(seed): results for seed, results in saved["runs"].items()}
        missing = sorted(set(args.seeds or runs) - set(runs))
        if missing:
            sys.exit(f"bench_trl: --seeds {missing} not in {args.from_results} (it holds seeds {sorted(runs)})")
        runs = {seed: results for seed, results in runs.items() if seed in (args.seeds or runs)}
        print("\n".join(report(args, runs)))
        return
    os.makedirs(args.out, exist_ok=True)
    python = trl_python(args.trl_env)  # fail early, before any run
    runs = {}
    for seed in args.seeds:
        out = os.path.join(args.out, f"seed{seed}")
        os.makedirs(out, exist_ok=True)
        spec_path = write_spec(args, seed, out)
        runs[seed] = {}
        for variant in args.variants:
            print(f"[bench_trl] seed {seed}, {variant} ...", flush=True)
            r = run_ours(args, seed, out) if variant == "ours" else run_trl(args, variant, spec_path, python, out)
            runs[seed][variant] = r
            print(
                f"[bench_trl] seed {seed}, {variant}: {r['train_s']:.1f} s training, "
                f"evals {[round(e['accuracy'], 3) for e in r['evals']]}",
                flush=True,
            )
        with open(os.path.join(args.out, "results.json"), "w") as f:  # after every seed: a stopped race keeps it
            json.dump({"args": {k: v for k, v in vars(args).items()}, "runs": runs}, f, indent=1)
    lines = report(args, runs)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
