"""Faults from outside: the trainer killed by a signal leaves no process of its own behind (docs/async.md §4).

The real script with the rollout worker (--max-staleness 1) and batches whose results (the log-probs alone ~140 KB
pickled) are larger than a pipe holds (64 KiB on Linux): the trainer is killed mid-run, while the worker generates
the next batch, and every descendant it had (the worker, the multiprocessing resource tracker) must be gone a few
seconds later.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.test_train import ADD, ROOT, read_jsonl, train_env

PIPE_BYTES = 64 * 1024  # a Linux pipe's default capacity: a larger message blocks its writer until someone reads
SAMPLES = 32 * 32  # configs/cpu_add.yaml: 32 prompts x 32 samples per step
RESPONSE = 16  # tokens per response (the random start rarely ends one early): 16 log-probs of 9 pickled bytes each


def descendants(pid: int) -> set[int]:
    """Every live descendant of pid (Linux lists each thread's children under /proc)."""
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except FileNotFoundError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{parent}/task/{t}/children") as f:
                    children = {int(c) for c in f.read().split()} - found
            except (FileNotFoundError, ProcessLookupError):
                continue
            found |= children
            todo.extend(children)
    return found


def logged(path) -> int:
    """Complete lines of metrics.jsonl so far."""
    return path.read_text().count("\n")


def waiting(pid: int, after: float = 0.0) -> bool:
    """The process's main thread asleep in poll() (`after` seconds from now): the trainer waiting for the worker's
    next result (RolloutWorker._receive), so the worker is generating that batch."""
    time.sleep(after)
    try:
        with open(f"/proc/{pid}/wchan") as f:
            return "poll" in f.read()
    except OSError:
        return False


def alive(pid: int) -> bool:
    """An exited process that nobody reaped yet is a zombie ('Z'): gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_trainer_killed_mid_generation_leaves_no_process_behind(tmp_path, sig):
    flags = [
        *ADD,
        "--num-steps",
        "200",  # never reached: there is always a next batch for the worker to generate
        "--max-staleness",
        "1",  # the rollout worker process, one batch ahead of the update
        "--max-response-length",
        str(RESPONSE),
        "--no-save-final",
    ]
    cmd = [sys.executable, os.path.join(ROOT, "rc_train.py"), "--output-dir", str(tmp_path), "--run-name", "run"]
    proc = subprocess.Popen(
        [*cmd, *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=train_env(tmp_path), cwd=ROOT
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    family: set[int] = set()
    try:
        # Steady state: step 0 logged (after the evaluation before training, step -1), then the trainer waiting
        # for the next batch, which the worker is generating (the batch takes longer to sample than to train on).
        deadline = time.time() + 240
        while proc.poll() is None and time.time() < deadline and not (metrics.exists() and logged(metrics) >= 2):
            time.sleep(0.05)
        deadline = time.time() + 30  # where /proc shows no wait channel, the kill just comes later in the run
        while proc.poll() is None and time.time() < deadline and not (waiting(proc.pid) and waiting(proc.pid, 0.05)):
            time.sleep(0.01)
        assert proc.poll() is None, f"rc_train.py ended early ({proc.returncode})"
        family = descendants(proc.pid)
        assert family, "no rollout worker"
        assert all(map(alive, family))
        proc.send_signal(sig)  # the trainer alone: not its process group
        proc.wait(timeout=30)
        assert proc.returncode == -sig
        t0 = time.time()
        while time.time() - t0 < 5 and any(map(alive, family)):
            time.sleep(0.05)
        left = sorted(p for p in family if alive(p))
        assert not left, f"still alive {time.time() - t0:.1f} s after the trainer's {sig.name}: {left}"
        rows = [r for r in read_jsonl(metrics) if r["step"] >= 0]
        assert rows[0]["response_length/mean"] * SAMPLES * 9 > PIPE_BYTES  # the log-probs alone overfill a pipe
    finally:  # never leave an orphan on the machine, whatever failed
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in family | descendants(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
