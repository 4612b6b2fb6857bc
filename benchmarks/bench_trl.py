"""A race, side by side in one run: this trainer against Hugging Face TRL's GRPOTrainer (not a test).

Like with like (issue 33): every arm trains the miniature GSM8K (the embedded default task and its warm-started base
model) from the same weights on the same prompts in the same order, one after the other on this machine, per seed:

  ours_sync          python rc_train.py --max-staleness 0 --rc.preset decoupled_seq_mis (--sync-preset): the
                     synchronous loop, against TRL's synchronous one with TRL's loss (SYNC_PRESET says why)
  ours_async_PRESET  python rc_train.py --max-staleness 1 --rc.preset PRESET (docs/async.md), one arm per preset of
                     --async-presets; default: the presets lab/staleness/summary.md (read from its twin summary.csv)
                     shows holding, i.e. not `below` their own k = 0 row, at its smallest k > 0. The lab has levels
                     0, 2 and 8, no k = 1: its k = 2 holders (3 seeds, 30 steps of 12 prompts) are the evidence
                     available for k = 1: bypass_ppo_clip, decoupled_token_is, decoupled_seq_mis, bypass_pg_is
  trl_vllm           GRPOTrainer, use_vllm=True, vllm_mode="colocate" (vLLM in the trainer's process)
  trl_generate       GRPOTrainer, use_vllm=False (transformers `generate`)

Same samples per step: SHAPE is the one source of the numbers. Ours gets each on its command line (OURS_FLAGS), TRL
in trl_config: 32 prompts x 16 samples per rollout step for both (TRL: generation_batch_size 512 of num_generations
16), the prompts of step t being rows 32t .. 32t+31 of the seed's order (ours: rc_train.prompt_indices, a stream
that depends only on seed and position; TRL: the same rows in that order, no shuffle). tests/test_bench_trl.py parses
ours' command line with rc_train's own Args and checks TRL's batch against the same SHAPE.

Matched: base model, prompt order, 32 prompts x 16 samples per rollout, 64 response tokens, temperature 1, 4
optimizer steps of 128 responses per rollout in micro-batches of 32, AdamW at a constant 1e-4 (no weight decay,
grad-norm clip 1), clip 0.2 both sides, token-mean over each optimizer step's tokens (TRL's "dapo" = our
"token-mean"), group-std advantages, no KL, fp32. Everything else is each trainer's default (TRL recomputes pi_old
and applies its sequence-mask IS with vLLM; its vLLM samples in bf16, ours in fp32).

Each at its best thread setting on 2 cores (measured: docs/results.md "The race against TRL"): every ours arm the
trainer's own default (rc_config.torch_threads: every core at k = 0, half each for trainer and rollout worker at
k = 1), TRL OMP_NUM_THREADS=2 (--ours-threads / --trl-threads to change them). Run it on an otherwise idle machine:
TRL's two OpenMP threads stall when a third process takes a core (a warning is printed when the load says so).

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

Usage:  python -m benchmarks.bench_trl                  (5 seeds x 50 rollout steps, every arm: the race)
        python -m benchmarks.bench_trl --quick --seeds 1 --variants ours_sync,trl_generate   (a quick look: 20 steps)
        python -m benchmarks.bench_trl --from-results runs/bench_trl/results.json   (the report again, no runs)
        python -m benchmarks.bench_trl --seeds 1,2, later --seeds 3,4,5   (the race in two sittings, one results.json)
        python -m benchmarks.bench_trl --seeds 2,3 --out benchmarks/trl_race   (more seeds into the committed record)
The report gives a table per seed, each arm's median and range over the seeds, and, for each ours arm x each TRL
variant x each target, the ratio ours/TRL of training seconds per seed and its median over the seeds (`inf` where
ours never reached the target, `0` where that TRL variant did not), and whether the median meets its goal: <= 0.5
for ours_sync, <= 0.4 for an asynchronous arm. It ends with one line per ours arm x TRL variant, exactly
`ours/TRL time-to-accuracy ARM/VARIANT: T=MEDIAN ...` (each target, in --targets order, with its median ratio to 3
decimals). A results.json of the race before these arms (one `ours` arm) is read as the arm it was.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
TRL_PIN = "trl==1.16.0"
TRL_VARIANTS = ("trl_vllm", "trl_generate")
VARIANTS = ("ours_sync", "ours_async", *TRL_VARIANTS)  # ours_async: one arm per --async-presets preset
# TRL's synchronous loss (num_iterations 1, 4 optimizer steps per generation) recomputes pi_old once per rollout batch,
# clips against it and, with vLLM, multiplies in the sequence ratio pi_old/mu masked to 0 above a cap ("sequence_mask").
# decoupled_seq_mis is that loss here: decoupled (its own pi_old pass), one-sided sequence MIS. Its cap is 2, TRL's 3;
# at k = 0 ours' fp32 engine makes the ratio 1 to rounding (lab/staleness: RS masked 0 at k = 0), so no cap fires.
SYNC_PRESET = "decoupled_seq_mis"
ASYNC_K = 1  # --max-staleness of the asynchronous arms (the default job's)
GOAL_SYNC, GOAL_ASYNC = 0.5, 0.4  # the medians ours/TRL asked for (issue 33), at every target
LAB_STALENESS = os.path.join(ROOT, "lab", "staleness", "summary.csv")
# The default job's shape (rc_train.Args defaults); both trainers get these numbers: ours as OURS_FLAGS, TRL in
# trl_config.
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
OURS_FLAGS = dict(
    prompts_per_step="--num-prompts-per-step",
    samples_per_prompt="--num-samples-per-prompt",
    max_response_length="--max-response-length",
    max_model_len="--max-model-len",
    learning_rate="--learning-rate",
    clip="--clip-ratio",
    num_minibatches="--num-minibatches",
    micro_batch_size="--micro-batch-size",
    eval_limit="--eval-limit",
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="20 rollout steps per trainer (default 50)")
    p.add_argument("--steps", type=int, help="rollout steps per trainer (overrides --quick)")
    p.add_argument(
        "--targets",
        default="0.5,0.8,0.9",
        help="strict greedy eval accuracies to reach (default 0.5,0.8,0.9)",
    )
    p.add_argument("--eval-every", type=int, default=2, help="evaluate every N rollout steps (default 2)")
    p.add_argument(
        "--seeds",
        help="comma list of run seeds (default 1,2,3,4,5; with --from-results: the seeds to report, default all)",
    )
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {VARIANTS} (default all)")
    p.add_argument(
        "--sync-preset",
        default=SYNC_PRESET,
        help=f"ours_sync: rc_train.py --rc.preset (default {SYNC_PRESET}, TRL's loss: SYNC_PRESET)",
    )
    p.add_argument(
        "--async-presets",
        help="comma list, one ours_async arm each (default: the presets lab/staleness/summary.csv shows holding at "
        "its smallest k > 0)",
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
    p.add_argument("--worker", choices=TRL_VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    if args.steps is None:
        args.steps = 20 if args.quick else 50
    try:
        args.targets = [float(t) for t in args.targets.split(",")]
        if args.seeds is None and not args.from_results:
            args.seeds = "1,2,3,4,5"
        args.seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None  # None: every seed saved
    except ValueError as e:
        p.error(f"--targets takes numbers and --seeds integers, comma-separated: {e}")
    args.variants = args.variants.split(",")
    bad = [v for v in args.variants if v not in VARIANTS]
    trl = [v for v in args.variants if v in TRL_VARIANTS]
    if bad or not trl or len(trl) == len(args.variants):
        p.error(f"--variants: need an ours arm and a TRL variant from {VARIANTS}, got {args.variants}")
    bad = [t for t in args.targets if not 0 < t <= 1]
    if args.steps < 1 or args.eval_every < 1 or bad:
        p.error(
            f"need --steps >= 1 (got {args.steps}), --eval-every >= 1 (got {args.eval_every}) "
            f"and 0 < each target <= 1 (got {bad or 'ok'})"
        )
    check_presets(p, args)
    for name in ("ours_threads", "trl_threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def check_presets(p, args) -> None:
    """--async-presets as a list (the lab's holders by default, read only when an async arm runs); every preset a
    name of rc_core.PRESET_NAMES, refused by name before any run."""
    import rc_core

    if args.async_presets:
        args.async_presets = args.async_presets.split(",")
    elif "ours_async" in args.variants and not args.from_results:
        args.async_presets = lab_holders()
    for flag, names in (("--sync-preset", [args.sync_preset]), ("--async-presets", args.async_presets or [])):
        bad = [n for n in names if n not in rc_core.PRESET_NAMES]
        if bad:
            p.error(f"{flag} must name presets of rc_core.PRESET_NAMES, got {bad}")


def lab_holders(path: str = LAB_STALENESS) -> list[str]:
    """The corrected presets the staleness lab shows holding (not `below` their own k = 0 row, its reading rule) at its
    smallest k > 0: the evidence there is for the asynchronous arms' k = 1."""
    from lab.rc_lab import is_naive

    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    k = min(int(r["level"]) for r in rows if int(r["level"]) > 0)
    return [r["preset"] for r in rows if int(r["level"]) == k and r["flag"] == "" and not is_naive(r["preset"])]


def ours_arms(args) -> dict[str, dict]:
    """The ours arms asked for, in run order: name -> rc_train.py's --max-staleness and --rc.preset."""
    arms = {}
    if "ours_sync" in args.variants:
        arms[arm_name(0, args.sync_preset)] = {"max_staleness": 0, "preset": args.sync_preset}
    if "ours_async" in args.variants:
        arms.update({arm_name(ASYNC_K, p): {"max_staleness": ASYNC_K, "preset": p} for p in args.async_presets})
    return arms


def arm_name(max_staleness: int, preset: str) -> str:
    return "ours_sync" if max_staleness == 0 else f"ours_async_{preset}"


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


# ---- Ours: the real script, one run per arm ----------------------------------------------------------------------
def ours_command(args, name: str, arm: dict, seed: int, out: str) -> list[str]:
    """rc_train.py's command line for one arm: SHAPE spelled out (OURS_FLAGS), so that its batch is TRL's."""
    shape = [x for key, flag in OURS_FLAGS.items() for x in (flag, str(SHAPE[key]))]
    return [
        sys.executable,
        os.path.join(ROOT, "rc_train.py"),
        "--seed",
        str(seed),
        "--num-steps",
        str(args.steps),
        "--eval-every",
        str(args.eval_every),
        *shape,
        "--max-staleness",
        str(arm["max_staleness"]),
        "--rc.preset",
        arm["preset"],
        "--output-dir",
        out,
        "--run-name",
        name,
        "--overwrite",
        "--no-save-final",
    ]


def run_ours(args, name: str, arm: dict, seed: int, out: str) -> dict:
    cmd = ours_command(args, name, arm, seed, out)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if args.ours_threads:
        env["OMP_NUM_THREADS"] = str(args.ours_threads)
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    wall = time.time() - t0
    rows = [json.loads(line) for line in open(os.path.join(out, name, "metrics.jsonl"))]
    evals, train_s = [], 0.0
    for r in rows:
        if r["step"] >= 0:  # the eval's clock starts after the engine has finished the batches queued before it
            train_s += r["timing/step_s"] - r.get("timing/eval_s", 0.0)
        if "eval/accuracy_strict" in r:
            evals.append({"step": r["step"] + 1, "train_s": train_s, "accuracy": r["eval/accuracy_strict"]})
    return {
        **arm,
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
def first_reach(evals: list[dict], target: float) -> dict | None:
    """The first evaluation at or above `target` (its step and training seconds), or None."""
    return next((e for e in evals if e["accuracy"] >= target), None)


def time_to(evals: list[dict], target: float) -> float | None:
    reach = first_reach(evals, target)
    return None if reach is None else reach["train_s"]


def ratio(ours: dict, trl: dict, target: float) -> float:
    """Ours' training seconds to `target` over this TRL variant's: inf if ours never reached it, 0 if the TRL variant
    did not (and ours did)."""
    mine, theirs = time_to(ours["evals"], target), time_to(trl["evals"], target)
    if mine is None:
        return float("inf")
    return mine / theirs if theirs is not None else 0.0


def goal(result: dict) -> float:
    return GOAL_SYNC if result["max_staleness"] == 0 else GOAL_ASYNC


def table_head(title: str, columns: list[str]) -> list[str]:
    return [title, "", f"| {' | '.join(columns)} |", "|" + "---|" * len(columns)]


def target_columns(args) -> list[str]:
    return [f"s to {t} (step)" for t in args.targets]


def seed_table(args, seed: int, results: dict) -> list[str]:
    columns = ["trainer", "threads", "s / rollout step", *target_columns(args), "final strict accuracy"]
    lines = table_head(f"seed {seed}:", [*columns, "start-up + eval s"])
    for name, r in results.items():
        cells = []
        for t in args.targets:
            reach = first_reach(r["evals"], t)
            cells.append("never" if reach is None else f"{reach['train_s']:.1f} ({reach['step']})")
        final = r["evals"][-1]["accuracy"] if r["evals"] else float("nan")
        lines.append(
            f"| {name} | {r.get('threads', '?')} | {r['train_s'] / args.steps:.2f} | {' | '.join(cells)} | "
            f"{final:.3f} | {r['wall_s'] - r['train_s']:.0f} |"
        )
    return lines + [""]


def median_table(args, runs: dict) -> list[str]:
    """Each arm over the seeds that ran it: the median and, in brackets, the range of its seconds per rollout step and
    of its final accuracy; per target the median seconds to it, then the median and the range of the step at which it
    was first reached, over the seeds that reached it (and how many never did)."""
    columns = ["trainer", "s / rollout step", *target_columns(args), "final strict accuracy"]
    lines = table_head(f"each arm over seeds {', '.join(map(str, runs))}: median (range)", columns)
    for name in arm_names(runs):
        rs = [results[name] for results in runs.values() if name in results]
        cells = [spread([r["train_s"] / args.steps for r in rs], ".2f")]
        for t in args.targets:
            reached = [e for e in (first_reach(r["evals"], t) for r in rs) if e is not None]
            if not reached:
                cells.append("never")
                continue
            steps = [e["step"] for e in reached]
            never = f", {len(rs) - len(reached)} never" if len(reached) < len(rs) else ""
            cells.append(
                f"{statistics.median(e['train_s'] for e in reached):.1f} "
                f"({statistics.median(steps):g}; {min(steps)}–{max(steps)}){never}"
            )
        cells.append(spread([r["evals"][-1]["accuracy"] for r in rs if r["evals"]], ".3f"))
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return lines + [""]


def arm_names(runs: dict) -> list[str]:
    """Every arm of the race, in the order the seeds ran them."""
    return list(dict.fromkeys(n for results in runs.values() for n in results))


def spread(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}–{max(values):{fmt}})" if values else "?"


def report(args, runs: dict) -> list[str]:
    """runs: seed -> arm -> result. A table per seed, then each arm's medians over the seeds; for each ours arm x TRL
    variant x target the ratio per seed and the median, against its goal; last, one machine-readable line per ours arm
    x TRL variant (module docstring)."""
    names = arm_names(runs)
    ours = [n for n in names if n.startswith("ours")]
    first = {n: next(r[n] for r in runs.values() if n in r) for n in ours}
    lines = [
        f"miniature GSM8K, {args.steps} rollout steps of {SHAPE['prompts_per_step']} prompts x "
        f"{SHAPE['samples_per_prompt']} samples for every arm, greedy strict accuracy on {SHAPE['eval_limit']} test "
        f"problems every {args.eval_every} steps",
        "ours arms (rc_train.py): "
        + "; ".join(f"{n} --max-staleness {a['max_staleness']} --rc.preset {a['preset']}" for n, a in first.items()),
        f"goals: median ours/TRL <= {GOAL_SYNC} synchronous, <= {GOAL_ASYNC} asynchronous, at each target",
        "",
    ]
    for seed, results in runs.items():
        lines += seed_table(args, seed, results)
    lines += median_table(args, runs)
    last = []
    for arm in ours:
        for variant in (n for n in names if n in TRL_VARIANTS):
            both = [r for r in runs.values() if arm in r and variant in r]
            if both:
                pair, line = pair_lines(args, arm, variant, both, goal(first[arm]))
                lines += pair + [""]
                last.append(line)
    return lines + last


def pair_lines(args, arm: str, variant: str, both: list[dict], bound: float) -> tuple[list[str], str]:
    """One ours arm against one TRL variant over the seeds that ran both: a line per target (ratio per seed, median,
    goal met or not) and the machine-readable line of their medians."""
    lines, medians = [], []
    for t in args.targets:
        per_seed = [ratio(r[arm], r[variant], t) for r in both]
        medians.append(statistics.median(per_seed))
        lines.append(
            f"{arm}/{variant} at {t}: per seed {', '.join(f'{x:.3f}' for x in per_seed)}; median {medians[-1]:.3f} "
            f"(goal <= {bound}: {'met' if medians[-1] <= bound else 'not met'})"
        )
    last = f"ours/TRL time-to-accuracy {arm}/{variant}: " + " ".join(
        f"{t}={m:.3f}" for t, m in zip(args.targets, medians)
    )
    return lines, last


def saved_runs(path: str) -> tuple[dict, dict]:
    """(args, runs) of a results.json; a single `ours` arm (the race before issue 33's arms) gets its arm's name and
    settings from its args (bypass_ppo_clip where they name no preset: the default job's before --preset)."""
    with open(path) as f:
        saved = json.load(f)
    saved_args = saved["args"]
    runs = {}
    for seed, results in saved["runs"].items():
        if "ours" in results:
            if "max_staleness" not in saved_args:
                sys.exit(f"bench_trl: {path} is in a layout this version cannot read (no max_staleness for `ours`)")
            arm = {"max_staleness": saved_args["max_staleness"], "preset": saved_args.get("preset", "bypass_ppo_clip")}
            results = {arm_name(**arm): {**results["ours"], **arm}, **{n: r for n, r in results.items() if n != "ours"}}
        runs[int(seed)] = results
    return saved_args, runs


RACE_SETTINGS = ("steps", "eval_every", "variants", "sync_preset", "ours_threads", "trl_threads")  # + the arms


def continued_runs(args, arms: dict) -> dict:
    """The seeds an earlier invocation already raced into args.out (its results.json), when it ran the same race: at
    about an hour per seed the race may be split over several invocations (`--seeds 1,2`, later `--seeds 3,4,5`),
    each adding its seeds to the one results.json and reporting all of them. A results.json of another race is
    refused in one line naming the settings that differ, before anything runs or is overwritten."""
    path = os.path.join(args.out, "results.json")
    if not os.path.isfile(path):
        return {}
    saved, runs = saved_runs(path)
    differ = [k for k in RACE_SETTINGS if saved.get(k) != getattr(args, k)]
    differ += ["the ours arms"] if saved.get("arms") != arms else []
    if differ:
        sys.exit(
            f"bench_trl: {path} holds a race with other {', '.join(differ)}; its seeds cannot be joined to this one: "
            "pass another --out, or move it away"
        )
    return runs


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        return trl_worker(args)
    if args.from_results:
        saved, runs = saved_runs(args.from_results)
        for k in ("steps", "eval_every"):  # the runs' own; --targets may be chosen anew
            setattr(args, k, saved[k])
        missing = sorted(set(args.seeds or runs) - set(runs))
        if missing:
            sys.exit(f"bench_trl: --seeds {missing} not in {args.from_results} (it holds seeds {sorted(runs)})")
        runs = {seed: results for seed, results in runs.items() if seed in (args.seeds or runs)}
        print("\n".join(report(args, runs)))
        return
    os.makedirs(args.out, exist_ok=True)
    arms = ours_arms(args)
    runs = continued_runs(args, arms)  # before anything is built or run
    warn_if_busy()  # before TRL's environment is built: its install loads the machine too
    python = trl_python(args.trl_env)  # fail early, before any run
    trl = [v for v in args.variants if v in TRL_VARIANTS]
    for seed in args.seeds:
        if seed in runs:
            print(f"[bench_trl] seed {seed}: already in {args.out}/results.json, kept", flush=True)
            continue
        out = os.path.join(args.out, f"seed{seed}")
        os.makedirs(out, exist_ok=True)
        spec_path = write_spec(args, seed, out)
        runs[seed] = {}
        for name in [*arms, *trl]:
            print(f"[bench_trl] seed {seed}, {name} ...", flush=True)
            r = (
                run_ours(args, name, arms[name], seed, out)
                if name in arms
                else run_trl(args, name, spec_path, python, out)
            )
            runs[seed][name] = r
            print(
                f"[bench_trl] seed {seed}, {name}: {r['train_s']:.1f} s training, "
                f"evals {[round(e['accuracy'], 3) for e in r['evals']]}",
                flush=True,
            )
        with open(os.path.join(args.out, "results.json"), "w") as f:  # after every seed: a stopped race keeps it
            json.dump(in_repository({"args": {**vars(args), "arms": arms}, "runs": runs}), f, indent=1)
    lines = report(args, runs)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def in_repository(record):
    """The record with this clone's absolute paths written relative to the repository root: results.json may be
    committed (benchmarks/trl_race), and a user's clone lives at another path. Nothing reads those paths back."""
    if isinstance(record, dict):
        return {k: in_repository(v) for k, v in record.items()}
    if isinstance(record, list):
        return [in_repository(v) for v in record]
    return record.replace(ROOT + os.sep, "") if isinstance(record, str) else record


def warn_if_busy() -> None:
    """The race wants an otherwise idle machine (module docstring); say so when the load average says otherwise."""
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"[bench_trl] warning: 1-minute load average {load:.2f}; other jobs will slow TRL's threads", flush=True)


if __name__ == "__main__":
    main()
