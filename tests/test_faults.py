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


def worker_of(pid: int) -> int | None:
    """The trainer's rollout worker: its child that multiprocessing spawned (not the resource tracker)."""
    for child in descendants(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"spawn_main" in f.read() and os.getppid() != child:
                    with open(f"/proc/{child}/stat") as s:
                        if int(s.read().rsplit(")", 1)[1].split()[1]) == pid:  # a direct child of the trainer
                            return child
        except FileNotFoundError:
            continue
    return None


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_dead_rollout_worker_ends_the_run_in_one_line(tmp_path, sig):
    """The rollout worker killed mid-run (by any signal): the trainer ends with one line `rc_train.py: error: the
    rollout worker died (exit code -N); see .../engine.log`, exit code 1, and no traceback (today: a traceback of
    RolloutWorker._receive's RuntimeError, that line its last; sometimes a second one, of multiprocessing's resource
    sharer thread, killed mid-handshake; and the resource tracker's warning of the worker's leaked semaphore)."""
    flags = [*ADD, "--num-steps", "200", "--max-staleness", "1", "--max-response-length", "1", "--no-save-final"]
    cmd = [sys.executable, os.path.join(ROOT, "rc_train.py"), "--output-dir", str(tmp_path), "--run-name", "run"]
    err = tmp_path / "stderr.txt"  # a file, not a pipe that nobody reads until the end
    with open(err, "w") as f:
        proc = subprocess.Popen([*cmd, *flags], stdout=subprocess.DEVNULL, stderr=f, env=train_env(tmp_path), cwd=ROOT)
    metrics = tmp_path / "run" / "metrics.jsonl"
    worker = None
    try:
        deadline = time.time() + 240
        while proc.poll() is None and time.time() < deadline and not (metrics.exists() and logged(metrics) >= 2):
            time.sleep(0.05)
        assert proc.poll() is None, f"rc_train.py ended early ({proc.returncode})"
        worker = worker_of(proc.pid)
        assert worker is not None, "no rollout worker"
        os.kill(worker, sig)
        proc.wait(timeout=60)  # the trainer looks at its worker every 5 s while it waits for a result
        stderr = err.read_text()
        assert proc.returncode == 1, stderr[-3000:]
        assert "Traceback" not in stderr and "leaked semaphore" not in stderr, stderr[-3000:]
        errors = [line for line in stderr.splitlines() if line.startswith("rc_train.py: error:")]
        assert errors == [
            f"rc_train.py: error: the rollout worker died (exit code {-sig}); see {tmp_path / 'run' / 'engine.log'}"
        ], stderr[-3000:]
    finally:  # never leave an orphan on the machine, whatever failed
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in descendants(proc.pid) | ({worker} if worker else set()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_worker_that_exits_with_an_error_is_one_line(tmp_path):
    """A worker process that ends by itself with a non-zero exit code: RolloutWorker's wait for a result raises
    rc_run.RunError naming the code and the engine log, the one line rc_run.report_faults prints (today: a
    RuntimeError, printed with its traceback)."""
    import multiprocessing

    import rc_rollout
    import rc_run

    ctx = multiprocessing.get_context("spawn")
    worker = object.__new__(rc_rollout.RolloutWorker)
    worker.requests, worker.results = ctx.Queue(), ctx.Queue()
    worker.process = ctx.Process(target=os._exit, args=(3,), daemon=True)
    worker.process.start()
    worker.process.join(timeout=60)
    worker.log_path = str(tmp_path / "engine.log")
    worker.kept = {}
    worker.requests.put(("generate", 0, "a request nobody will read"))
    with pytest.raises(rc_run.RunError) as info:
        worker.result(0)
    line = rc_run.fault_line(info.value)
    assert line == f"the rollout worker died (exit code 3); see {tmp_path / 'engine.log'}"


def test_a_connection_lost_in_the_resource_sharer_is_silent(monkeypatch, capsys):
    """A worker that dies while it fetches a shared tensor's file descriptor from the trainer breaks the handshake
    of multiprocessing's resource sharer thread, which hands its exception to sys.excepthook: rc_run.report_faults's
    hook says nothing of it (the worker's death gets its own line at the trainer's next wait; today: a traceback)."""
    import socket
    from multiprocessing import resource_sharer

    import rc_run

    passed_on = []
    monkeypatch.setattr(sys, "excepthook", lambda *a: passed_on.append(a[1]))
    rc_run.report_faults()
    hook, seen = sys.excepthook, []
    monkeypatch.setattr(sys, "excepthook", lambda *a: (seen.append(a[1]), hook(*a)))
    r, w = os.pipe()
    try:
        resource_sharer.DupFd(r)  # starts the sharer's listener thread, as torch's first shared tensor does
        with socket.socket(socket.AF_UNIX) as peer:
            peer.connect(resource_sharer._resource_sharer._address)
        deadline = time.time() + 10  # then gone, mid-handshake, like a killed worker
        while not seen and time.time() < deadline:
            time.sleep(0.01)
    finally:
        resource_sharer.stop(timeout=10)
        os.close(r)
        os.close(w)
    assert seen and isinstance(seen[0], (ConnectionError, EOFError)), seen
    assert passed_on == [] and capsys.readouterr().err == ""
    hook(ValueError, ValueError("a bug"), None)  # any other exception still reaches the previous hook
    assert [type(e) for e in passed_on] == [ValueError]
