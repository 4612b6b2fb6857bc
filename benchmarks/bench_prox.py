"""--prox-logp loglinear against recompute, side by side in one run (a benchmark, not a test; issue 50 item 2).

Both arms are the same decoupled run (`rc_train.py --task add`, preset decoupled_token_is, --max-staleness 1, one
process at a time, OMP_NUM_THREADS=1); `recompute` scores pi_old with its forward pass, `loglinear` interpolates it
from mu and pi_theta by version (docs/corrections.md §7.10). The arms alternate (recompute, loglinear, recompute, ...)
so a drift in the machine's speed hits both alike. Per run: the median over steps 1.. (step 0 warms up) of
timing/step_s, timing/old_log_prob_s and timing/update_s, and the last step's reward. Then per pair the
loglinear/recompute ratio of the trainer's compute (the pi_old pass + the update) and of the step, and their
medians. The trainer's compute is the figure: with --max-staleness 1 the rollout worker generates the next batch
while the trainer works, so a step takes the longer of the two, and a trainer that finishes sooner waits longer.

Usage (from the repository root):
    python -m benchmarks.bench_prox                    (3 pairs x 12 steps: a few minutes on 2 cores)
    python -m benchmarks.bench_prox --pairs 1 --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
KEYS = ("timing/step_s", "timing/old_log_prob_s", "timing/update_s")


def run_one(args, method: str, pair: int) -> dict:
    name = f"{method}_{pair}"
    cmd = [sys.executable, os.path.join(ROOT, "rc_train.py"), "--task", "add", "--num-steps", str(args.steps)]
    cmd += ["--eval-every", "0", "--no-eval-before", "--eval-limit", "8", "--num-prompts-per-step", "16"]
    cmd += ["--num-samples-per-prompt", "8", "--num-minibatches", "4", "--max-staleness", "1"]
    cmd += ["--rc.preset", "decoupled_token_is", "--prox-logp", method, "--seed", str(args.seed)]
    cmd += ["--output-dir", args.output_dir, "--run-name", name, "--overwrite"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(args.output_dir, name, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if r.get("step", -1) >= 1 and "timing/step_s" in r]
    out = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in KEYS}
    return {"method": method, "pair": pair, **out, "reward": rows[-1]["reward/mean"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=3, help="recompute/loglinear pairs, run alternately")
    p.add_argument("--steps", type=int, default=12, help="training steps per run")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-dir", default=os.path.join(ROOT, "runs", "bench_prox"))
    args = p.parse_args(argv)
    if args.pairs < 1 or args.steps < 2:
        p.error(f"--pairs must be >= 1 and --steps >= 2 (step 0 is not timed), got {args.pairs} and {args.steps}")
    results = []
    for pair in range(args.pairs):
        for method in ("recompute", "loglinear"):
            results.append(run_one(args, method, pair))
            r = results[-1]
            print(
                f"{method:9s} pair {pair}: step {r['timing/step_s']:.3f} s, pi_old pass "
                f"{r['timing/old_log_prob_s']:.3f} s, update {r['timing/update_s']:.3f} s, reward {r['reward']:.3f}",
                flush=True,
            )
    pairs = list(zip(results[::2], results[1::2]))  # (recompute, loglinear) of each pair
    for name, keys in (("step", ("timing/step_s",)), ("trainer compute", KEYS[1:])):
        ratios = [sum(b[k] for k in keys) / sum(a[k] for k in keys) for a, b in pairs]
        listed = ", ".join(f"{x:.3f}" for x in ratios)
        print(f"loglinear/recompute {name}: median {statistics.median(ratios):.3f} (pairs: {listed})")
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
