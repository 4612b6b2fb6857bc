"""Asynchronous rollout against the synchronous loop, side by side in one run (a benchmark, not a test).

Every arm is the default job (`python rc_train.py`: the miniature GSM8K, its warm-started base model, 50 steps,
greedy evaluation on 200 test problems) with one correction preset (--preset, default bypass_ppo_clip), one process
at a time on this machine:

  sync      --max-staleness 0, OMP_NUM_THREADS=1: rollout, then update, each on one core in turn
  sync_2t   --max-staleness 0, OMP_NUM_THREADS=2: the same loop, each phase given both cores (the default on 2 cores)
  async     --max-staleness 1, OMP_NUM_THREADS=1: the rollout worker samples the next batch on one core while the
            trainer updates on the other (docs/async.md)

The arms of one seed run back to back (sync, async, sync_2t for seed 1, then seed 2, ...), so a drift in the
machine's speed hits them alike. Per run: the wall time of the whole process (start to exit: what a user waits),
the training loop's seconds (the sum of timing/step_s), the median step, the seconds the trainer waited for
rollouts and the engine sat idle, and the final strict accuracy. Then, against `sync`: each seed's wall-time ratio
and their median, and the difference of the mean final accuracies. Targets (issue: bounded-staleness
asynchronous training): async/sync wall time <= 0.6, accuracy within 0.03.

Usage (from the repository root):
    python -m benchmarks.bench_async                       (3 seeds x 3 arms x 50 steps: about 40 minutes, 2 cores)
    python -m benchmarks.bench_async --seeds 1 --steps 10    (a quick look)
    python -m benchmarks.bench_async --from-results runs/bench_async/results.json   (the report again, no runs)
The last line is `async/sync wall time: <median ratio> (target: <= 0.6)`.
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
ARMS = {  # name: (rc_train.py flags, OMP_NUM_THREADS)
    "sync": (["--max-staleness", "0"], "1"),
    "async": (["--max-staleness", "1"], "1"),
    "sync_2t": (["--max-staleness", "0"], "2"),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seeds", default="1,2,3", help="comma list of run seeds (default 1,2,3)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {tuple(ARMS)} (default all)")
    p.add_argument("--steps", type=int, default=50, help="training steps per run (default 50: the default job)")
    p.add_argument(
        "--preset",
        default="bypass_ppo_clip",
        help="correction preset of every arm (default bypass_ppo_clip, the preset of the figures in docs/async.md §7; "
        "the default job's decoupled_k3_rs_token_tis adds a pi_old pass to the trainer's side of the overlap)",
    )
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_async"), help="folder for runs and results")
    p.add_argument("--from-results", help="print the report of an earlier results.json (its seeds and arms)")
    args = p.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.arms = args.arms.split(",")
    bad = [a for a in args.arms if a not in ARMS]
    if bad or "sync" not in args.arms:
        p.error(f"--arms must name {tuple(ARMS)} and include sync (the baseline), got {args.arms}")
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    import rc_core

    if args.preset not in rc_core.PRESET_NAMES:
        p.error(f"--preset must be one of rc_core.PRESET_NAMES, got {args.preset!r}")
    return args


def run_one(args, arm: str, seed: int) -> dict:
    """One default job; its figures from metrics.jsonl."""
    flags, threads = ARMS[arm]
    name = f"{arm}_s{seed}"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "rc_train.py"),
        "--seed",
        str(seed),
        "--num-steps",
        str(args.steps),
        "--output-dir",
        args.out,
        "--run-name",
        name,
        "--overwrite",
        "--no-save-final",
        "--rc.preset",
        args.preset,
        *flags,
    ]
    env = dict(os.environ, OMP_NUM_THREADS=threads)
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.time() - t0
    if proc.returncode != 0:
        sys.exit(f"bench_async: {name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(os.path.join(args.out, name, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if r["step"] >= 0]
    steps = [r["timing/step_s"] for r in rows]
    return {
        "arm": arm,
        "seed": seed,
        "wall_s": wall,
        "loop_s": sum(steps),
        "step_median_s": statistics.median(steps),
        "rollout_wait_s": sum(r["timing/rollout_wait_s"] for r in rows),
        "engine_idle_s": sum(r["timing/engine_idle_s"] for r in rows),
        "accuracy": rows[-1]["eval/accuracy_strict"],
        "max_staleness": max(r["rollout/staleness_max"] for r in rows),
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.from_results:
        with open(args.from_results) as f:
            results = json.load(f)
        args.seeds = list(dict.fromkeys(r["seed"] for r in results))
        args.arms = list(dict.fromkeys(r["arm"] for r in results))
        print("\n".join(report(args, results)))
        return
    os.makedirs(args.out, exist_ok=True)
    results = []
    for seed in args.seeds:
        for arm in args.arms:
            print(f"[bench_async] seed {seed}, {arm} ...", flush=True)
            r = run_one(args, arm, seed)
            results.append(r)
            print(
                f"[bench_async] seed {seed}, {arm}: wall {r['wall_s']:.0f} s, loop {r['loop_s']:.0f} s, "
                f"accuracy {r['accuracy']:.3f}",
                flush=True,
            )
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    lines = report(args, results)
    print("\n".join(lines))
    with open(os.path.join(args.out, "report.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


def report(args, results: list[dict]) -> list[str]:
    """The table of every run, then each arm against sync: wall-time ratio per seed and its median, the training
    loop's ratio, and the difference of the mean final accuracies. Last line: the async/sync median wall ratio."""
    header = f"{'arm':8} {'seed':>4} {'wall s':>7} {'loop s':>7} {'step s':>7} {'wait s':>7} {'idle s':>7} {'acc':>6}"
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r['arm']:8} {r['seed']:>4} {r['wall_s']:7.0f} {r['loop_s']:7.0f} {r['step_median_s']:7.2f} "
            f"{r['rollout_wait_s']:7.0f} {r['engine_idle_s']:7.0f} {r['accuracy']:6.3f}"
        )
    by = {(r["arm"], r["seed"]): r for r in results}
    mean_acc = {a: statistics.mean(by[a, s]["accuracy"] for s in args.seeds) for a in args.arms}
    lines.append("")
    ratio = {}
    for arm in args.arms:
        if arm == "sync":
            continue
        per_seed = [by[arm, s]["wall_s"] / by["sync", s]["wall_s"] for s in args.seeds]
        loop = [by[arm, s]["loop_s"] / by["sync", s]["loop_s"] for s in args.seeds]
        ratio[arm] = statistics.median(per_seed)
        lines.append(
            f"{arm}/sync wall time per seed: {', '.join(f'{x:.3f}' for x in per_seed)} (median "
            f"{ratio[arm]:.3f}); training loop alone: {', '.join(f'{x:.3f}' for x in loop)}"
        )
        lines.append(
            f"{arm} - sync mean final strict accuracy: {mean_acc[arm]:.3f} - {mean_acc['sync']:.3f} = "
            f"{mean_acc[arm] - mean_acc['sync']:+.3f} (target: within 0.03)"
        )
    if "async" in ratio:
        lines.append(f"async/sync wall time: {ratio['async']:.3f} (target: <= 0.6)")
    return lines


if __name__ == "__main__":
    main()
