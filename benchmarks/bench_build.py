"""The base-model build beside busy processes: spinning OpenMP threads against sleeping ones, side by side in one run
(a benchmark, not a test).

Every arm runs the real build loop (tasks.build_warm_base: the minigsm base model's warm start, batch 64, its own
tokenizer, model and data order) for a few steps in a worker process of its own, whose OpenMP settings are in place
before torch loads (libgomp reads OMP_WAIT_POLICY once, when it is loaded). OMP_NUM_THREADS is unset in every worker,
as in README command 1.

  before      OMP_WAIT_POLICY unset (libgomp's default: a waiting thread spins), every core, fixed: the build as it was
  after       OMP_WAIT_POLICY unset and tasks.BuildThreads: every core while the machine is idle, the cores the others
              leave free beside busy ones, re-decided every 5 s (what `python rc_train.py` does now)
  one_thread  OMP_WAIT_POLICY unset, one thread (what OMP_NUM_THREADS=1 gave the build): the target under load
  passive_adaptive  (only when named in --arms) OMP_WAIT_POLICY=PASSIVE and tasks.BuildThreads: waiting threads that
              sleep, which rc_train.py does not set (it would slow a 2-thread engine's decode on an idle machine)

Each arm is measured as the machine is found ("idle": close other work for a clean figure) and beside --busy
processes that spin on a core each (`python -c "while True: pass"`, started by the benchmark). The steps of one load
are run in --rounds chunks, the arms in turn (reversed every other round), so a drift in the machine's speed hits them
alike; each chunk's first step (warm-up) is not counted. Reported per arm and load: the median step [the mean], the
threads the arm used, each arm's busy/idle ratio, and after/before and after/one_thread at each load.

Usage (from the repository root):
    python -m benchmarks.bench_build                    (20 steps per arm and load in 2 rounds: about 4 min, 2 cores)
    python -m benchmarks.bench_build --steps 4          (a quick check that it runs: about 2 min)
The last line is `after/before step time: idle <ratio>, beside N busy <ratio>`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
ARMS = ("before", "after", "one_thread", "passive_adaptive")
DEFAULT_ARMS = ARMS[:3]
SPIN = "while True: pass"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="build steps per arm and load (default 20)")
    p.add_argument("--rounds", type=int, default=2, help="chunks the steps are run in, arms in turn (default 2)")
    p.add_argument("--busy", type=int, default=2, help="busy processes beside the build in the busy load (default 2)")
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma list of {ARMS} (default the first 3)")
    p.add_argument("--json", help="also write the step times to this file")
    p.add_argument("--worker", choices=ARMS, help=argparse.SUPPRESS)  # internal: one arm's worker process
    args = p.parse_args(argv)
    args.arms = args.arms.split(",")
    bad = [a for a in args.arms if a not in ARMS]
    if bad or args.rounds < 1 or args.steps < 2 * args.rounds or args.busy < 0:
        p.error(f"unknown arm(s) {bad}" if bad else "need --rounds >= 1, --steps >= 2 x --rounds, --busy >= 0")
    return args


def worker_env(arm: str) -> dict:
    """The environment of an arm's worker: OMP_NUM_THREADS unset, the wait policy of the arm."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if arm == "passive_adaptive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env


def worker(arm: str) -> None:
    """One arm: reads a step count per line on stdin, runs the real build loop for that many steps into a temporary
    folder, answers one JSON line {"times": [...], "threads": [...]}. Everything else it prints goes to stderr."""
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import torch  # first: libgomp takes the policy in the environment now

    import tasks

    make_tokenizer = tasks.make_tokenizer  # the same texts every chunk: trained once (a second a chunk saved)
    if arm == "before":
        tasks.build_threads = lambda *a, **k: tasks.usable_cores()  # every core, never re-decided
    elif arm == "one_thread":
        tasks.build_threads = lambda *a, **k: 1
    made = {}

    def tokenizer_once(texts, size, alphabet=None):
        if size not in made:
            made[size] = make_tokenizer(texts, size, alphabet)
        return made[size]

    tasks.make_tokenizer = tokenizer_once
    mini = tasks.MiniGSMArgs()
    task = tasks.make_task("minigsm", mini)
    prompts, solutions = tasks.warm_start_corpus(task, mini)
    print(f"ready {torch.get_num_threads()}", file=answer, flush=True)
    for line in sys.stdin:
        times = []
        with tempfile.TemporaryDirectory() as path:
            chunk = dataclasses.replace(mini, sft_steps=int(line))
            info = tasks.build_warm_base(task, chunk, prompts, solutions, path, lambda _: None, step_times=times)
        print(json.dumps({"times": times[1:], "threads": info["threads"]}), file=answer, flush=True)


class Workers:
    """One worker process per arm, started once (torch loaded, corpus made) and asked for chunks of steps."""

    def __init__(self, arms: list[str]):
        self.procs = {}
        for arm in arms:
            self.procs[arm] = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.bench_build", "--worker", arm],
                env=worker_env(arm),
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        for arm, proc in self.procs.items():
            if not proc.stdout.readline().startswith("ready"):
                raise RuntimeError(f"the {arm} worker did not start (run it: python -m benchmarks.bench_build "
                                   f"--worker {arm})")  # fmt: skip

    def run(self, arm: str, steps: int) -> dict:
        proc = self.procs[arm]
        proc.stdin.write(f"{steps}\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {arm} worker ended")
        return json.loads(line)

    def close(self) -> None:
        for proc in self.procs.values():
            proc.stdin.close()
            proc.wait(timeout=60)


def measure(args, workers: Workers, load: str) -> dict:
    """Each arm's step times and threads at one load, in --rounds chunks with the arms in turn."""
    out = {arm: {"times": [], "threads": set()} for arm in args.arms}
    sizes = [args.steps // args.rounds + (r < args.steps % args.rounds) for r in range(args.rounds)]
    for r, size in enumerate(sizes):
        for arm in args.arms if r % 2 == 0 else args.arms[::-1]:
            got = workers.run(arm, size + 1)  # + the chunk's warm-up step, not counted
            out[arm]["times"] += got["times"]
            out[arm]["threads"].update(got["threads"])
            print(
                f"[bench_build] {load}, round {r + 1}, {arm}: {statistics.median(got['times']):.2f} s a step",
                flush=True,
            )
    return {arm: {"times": v["times"], "threads": sorted(v["threads"])} for arm, v in out.items()}


def report(args, results: dict) -> list[str]:
    busy = f"beside {args.busy} busy"
    loads = [load for load in ("idle", busy) if load in results]
    cell = 24
    lines = [
        f"minigsm base build, seconds a step: median [mean] of {args.steps} steps (threads used); "
        f"{os.cpu_count()} cores",
        f"{'arm':12}"
        + "".join(f"{load:>{cell}}" for load in loads)
        + (f"{'busy/idle':>12}" if len(loads) == 2 else ""),
    ]
    med = {}
    for arm in args.arms:
        row = f"{arm:12}"
        for load in loads:
            r = results[load][arm]
            med[arm, load] = statistics.median(r["times"])
            text = f"{med[arm, load]:.2f} [{statistics.mean(r['times']):.2f}] ({','.join(map(str, r['threads']))})"
            row += f"{text:>{cell}}"
        if len(loads) == 2:
            row += f"{med[arm, busy] / med[arm, 'idle']:11.2f}x"
        lines.append(row)
    for other in ("one_thread", "before"):
        if "after" in args.arms and other in args.arms:
            ratios = ", ".join(f"{load} {med['after', load] / med[other, load]:.2f}" for load in loads)
            lines.append(f"after/{other} step time: {ratios}")
    return lines


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker)
    t0 = time.time()
    workers = Workers(args.arms)
    results = {}
    try:
        results["idle"] = measure(args, workers, "idle")
        spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.busy)]
        try:
            time.sleep(0.5)
            results[f"beside {args.busy} busy"] = measure(args, workers, f"beside {args.busy} busy")
        finally:
            for s in spinners:
                s.kill()
                s.wait()
    finally:
        workers.close()
    print(f"[bench_build] {time.time() - t0:.0f} s in all")
    print("\n".join(report(args, results)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
