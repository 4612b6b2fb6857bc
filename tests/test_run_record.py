"""A run's record survives every fault (issue 35): the run folder is owned by one process at a time (RunLock), a
resume checks everything before it touches anything, a resume is exact or refused (the settings that decide what a
step computes, the batches in flight past a run's end), a damaged checkpoint is refused naming the file, every fault
of the machine's files is one line, and checkpoints are kept to the newest --keep-checkpoints.

Unit tests call rc_run / rc_checkpoint / rc_config / tasks directly (fast); the end-to-end ones run the real script on
the one-token fixture with tiny budgets, from one finished two-step run with a checkpoint after each step (built once
per module, copied by each test that damages or resumes it).
"""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

import rc_checkpoint
import rc_config
import rc_run
import rc_train
import tasks
from tests.test_train import ENGINE_STARTED, QUICK, ROOT, _same_metrics, read_jsonl, run_train, train_env

# Asynchronous k = 1 (the default on a CPU), two evaluations over four steps (one at the end of a two-step run too).
FLAGS = [*QUICK, "--max-staleness", "1", "--eval-every", "2", "--checkpoint-every", "1"]
RECORD = ("metrics.jsonl", "eval_samples.jsonl", "config.yaml", "engine.log")  # what a refused resume leaves alone


def record(run_dir) -> dict:
    return {name: (run_dir / name).read_bytes() for name in RECORD if (run_dir / name).exists()}


def refused(proc, *needles):
    """A refusal: exit code != 0, one line `rc_train.py: error: ...` holding every needle, no traceback."""
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("rc_train.py: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished two-step run (k = 1) with a checkpoint after each step: runs/finished, read-only to the tests."""
    root = tmp_path_factory.mktemp("finished")
    run_train(root, *FLAGS, "--num-steps", "2", name="run")
    return root / "run"


@pytest.fixture
def copy_of(finished, tmp_path):
    """A copy of the finished run in this test's folder (its lock file left behind: a fresh owner)."""
    shutil.copytree(finished, tmp_path / "run", ignore=shutil.ignore_patterns(".lock"))  # rc_run.LOCK_FILE
    return tmp_path / "run"


def newest(run_dir):
    return max((run_dir / "checkpoints").glob("step_*[0-9]"))


def rewrite_checksums(ckpt):
    """Make checksums.json agree with the files again (every file but itself, trainer_state.json included; its other
    keys kept): a checkpoint whose damage its checksums cannot see."""
    import hashlib

    manifest = ckpt / "checksums.json"  # rc_checkpoint.CHECKSUMS (spelt out: these tests also run against older code)
    if manifest.exists():
        files = [p for p in ckpt.rglob("*") if p.is_file() and p != manifest]
        sums = {str(p.relative_to(ckpt)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "sha256": sums}))


# ---- 1. The run folder is owned: a lock for the life of a run ------------------------------------------------
def test_a_second_resume_of_a_running_run_is_refused_naming_its_pid(copy_of, tmp_path):
    """A resume runs; a second --resume of the same folder is refused with one line naming the first one's pid
    before anything is written, and the first run's record is whole (every step once, its final evaluation)."""
    cmd = [sys.executable, os.path.join(ROOT, "rc_train.py"), "--output-dir", str(tmp_path), "--run-name", "run"]
    console = tmp_path / "first.out"
    with open(console, "w") as out:
        first = subprocess.Popen(
            [*cmd, *FLAGS, "--num-steps", "10", "--resume"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=train_env(tmp_path),
            cwd=ROOT,
        )
    lock = copy_of / ".lock"  # rc_run.LOCK_FILE
    deadline = time.time() + 300  # the first holds the folder (today's main: it has loaded its checkpoint)
    while time.time() < deadline and first.poll() is None:
        if (
            lock.exists() and lock.read_text().split()[:1] == [str(first.pid)]
        ) or "resumed from" in console.read_text():
            break
        time.sleep(0.05)
    _, second = run_train(tmp_path, *FLAGS, "--num-steps", "10", "--resume", name="run", check=False, timeout=300)
    first.wait(timeout=600)
    assert first.returncode == 0, console.read_text()[-3000:]
    refused(second, f"in use by pid {first.pid}")
    assert ENGINE_STARTED not in second.stdout + second.stderr
    rows = read_jsonl(copy_of / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(-1, 10))  # every step once: the second wrote nothing
    assert "eval/accuracy_strict" in rows[-1]  # the first run's final evaluation is there


def test_the_lock_names_its_holder_and_never_outlives_it(tmp_path):
    """Two fresh starts of one name: the second is refused (naming the pid) even though the folder holds nothing yet;
    the lock goes with its holder, whatever kills it (SIGKILL here); a start refused before it wrote anything leaves
    no folder behind."""
    run_dir = tmp_path / "fresh"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import rc_run, time; rc_run.RunLock({str(run_dir)!r}); print('held', flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(rc_run.RunError, match=f"in use by pid {holder.pid}"):
        rc_run.RunLock(str(run_dir))
    _, proc = run_train(tmp_path, *QUICK, "--num-steps", "1", name="fresh", check=False, timeout=300)
    refused(proc, f"in use by pid {holder.pid}")
    assert os.listdir(run_dir) == [rc_run.LOCK_FILE]  # the refused start wrote nothing
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    lock = rc_run.RunLock(str(run_dir))  # the kernel released the dead holder's lock
    assert (run_dir / rc_run.LOCK_FILE).read_text().split()[0] == str(os.getpid())
    os.close(lock.fd)
    probe = subprocess.run(  # a process whose start is refused before it writes anything removes the folder it made
        [sys.executable, "-c", f"import rc_run; rc_run.RunLock({str(tmp_path / 'gone')!r}); raise SystemExit(3)"],
        cwd=ROOT,
    )
    assert probe.returncode == 3 and not (tmp_path / "gone").exists()


def _died_before_training(run_dir, *, metrics='{"step": -1, "eval/accuracy_strict": 0.1}\n'):
    """A run folder as a run killed before its first step leaves it: lock, config, engine log, the eval at step -1."""
    run_dir.mkdir()
    for name, text in ((".lock", "999 host\n"), ("config.yaml", "args: {}\n"), ("engine.log", "...\n")):
        (run_dir / name).write_text(text)
    if metrics is not None:
        (run_dir / "metrics.jsonl").write_text(metrics)
        (run_dir / "eval_samples.jsonl").write_text('{"step": -1}\n')
    return run_dir


def _claim(run_dir, **changes):
    """claim_run_dir by this process (one rank); the lock released again. (whether to empty, None) or (None, the
    refusal)."""
    try:
        lock, replace = rc_checkpoint.claim_run_dir(str(run_dir), _args(**changes), rc_run.HostGroup(1), True)
    except rc_run.RunError as e:
        return None, str(e)
    os.close(lock.fd)
    return replace, None


def test_a_run_that_died_before_its_first_step_is_started_again(tmp_path, capsys):
    """A run killed (or crashed) before its first training step (during the base-model build or the engine's start)
    left a folder with its config, engine log and at most the evaluation at step -1: the next run of that name takes
    it over and empties it, saying so, instead of refusing it. Anything a step writes (a metrics line of step >= 0, a
    checkpoint, final/), any other file, a torn line, or no lock file (not a run's folder): refused as before."""
    for metrics in (None, "", '{"step": -1, "x": 1}\n'):
        run_dir = _died_before_training(tmp_path / f"r{len(os.listdir(tmp_path))}", metrics=metrics)
        assert rc_checkpoint.ended_before_training(str(run_dir))
        assert _claim(run_dir, run_name=run_dir.name) == (True, None)
        assert (run_dir / ".lock").read_text().split()[0] == str(os.getpid())  # ours now
        assert "ended before its first step" in capsys.readouterr().out
    refusals = {
        "a step": lambda d: (d / "metrics.jsonl").write_text('{"step": -1}\n{"step": 0, "x": 1}\n'),
        "a torn line": lambda d: (d / "metrics.jsonl").write_text('{"step": -1}\n{"st'),
        "a checkpoint": lambda d: (d / "checkpoints" / "step_000000.tmp").mkdir(parents=True),
        "final": lambda d: (d / "final").mkdir(),
        "another file": lambda d: (d / "notes.txt").write_text("mine"),
        "no lock file": lambda d: (d / ".lock").unlink(),
    }
    for what, change in refusals.items():
        run_dir = _died_before_training(tmp_path / what.replace(" ", "_"))
        change(run_dir)
        assert not rc_checkpoint.ended_before_training(str(run_dir)), what
        before = sorted(os.listdir(run_dir))
        replace, error = _claim(run_dir, run_name=run_dir.name)
        assert "exists; pass --overwrite to replace it" in error, what
        assert sorted(os.listdir(run_dir)) == before
    assert _claim(tmp_path / "a_step", run_name="a_step", overwrite=True) == (True, None)  # --overwrite still does


def test_a_folder_whose_run_is_alive_is_never_taken_over(tmp_path):
    """A run before its first step (building its base model, starting its engine) holds its folder's lock: a start of
    the same name is refused naming it, and the folder is left exactly as it was."""
    run_dir = _died_before_training(tmp_path / "live")
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import rc_run, time; rc_run.RunLock({str(run_dir)!r}); print('held', flush=True); "
         "time.sleep(600)"],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
        replace, error = _claim(run_dir, run_name="live")
        assert f"in use by pid {holder.pid}" in error
        assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before
    finally:
        holder.kill()
        holder.wait()
    assert _claim(run_dir, run_name="live") == (True, None)  # its holder gone: started again


def test_starts_killed_before_they_wrote_anything_leave_no_folder(tmp_path, capsys):
    """A start killed during the base-model build (the default run name has a timestamp, so no later run reuses it)
    leaves a folder holding only its lock file: the next run's claim removes it, once it is ABANDONED_AFTER_S old and
    its lock free. A held lock, a recent one (a start under way), a .lock RunLock did not write, another file: kept."""
    import fcntl

    old = time.time() - 2 * rc_checkpoint.ABANDONED_AFTER_S
    for name in ("killed", "held", "recent", "with_config", "not_a_run"):
        (tmp_path / name).mkdir()
        (tmp_path / name / ".lock").write_text("999 host\n" if name != "not_a_run" else "my notes")
        if name != "recent":
            os.utime(tmp_path / name / ".lock", (old, old))
    (tmp_path / "with_config" / "config.yaml").write_text("args: {}\n")
    (tmp_path / "a_file").write_text("x")
    with open(tmp_path / "held" / ".lock") as holder:  # another open file: flock refuses this process too
        fcntl.flock(holder, fcntl.LOCK_EX)
        assert _claim(tmp_path / "new", run_name="new") == (False, None)
    assert sorted(os.listdir(tmp_path)) == ["a_file", "held", "new", "not_a_run", "recent", "with_config"]
    assert f"removed {str(tmp_path / 'killed')!r}" in capsys.readouterr().out
    os.utime(tmp_path / "new" / ".lock", (old, old))  # the caller's own folder is never removed
    assert rc_checkpoint.remove_abandoned_claims(str(tmp_path), str(tmp_path / "new")) == [str(tmp_path / "held")]


def test_two_processes_hold_and_refuse_together(tmp_path):
    """Under two processes rank 0 holds the lock and every rank learns a refusal, with no hang and nothing written:
    a folder another process holds, and a resume whose damage only rank 1 sees (its batches in flight), which rank 0
    reports too. (The launcher stops the other rank once one exits, so a rank may not get to print its line.)"""
    from tests.test_train import launch

    launch(tmp_path, "torchrun", "dp", *FLAGS, "--num-steps", "2")
    run_dir = tmp_path / "dp"
    for damage in (None, "in_flight_rank1.pt"):
        if damage is None:  # another process holds the folder
            holder = subprocess.Popen(
                [sys.executable, "-c", f"import rc_run, time; rc_run.RunLock({str(run_dir)!r}); print('held', "
                 "flush=True); time.sleep(600)"],
                stdout=subprocess.PIPE, text=True, cwd=ROOT,
            )  # fmt: skip
            assert holder.stdout.readline().strip() == "held"
            needles = [f"in use by pid {holder.pid}"]
        else:
            ckpt = newest(run_dir)
            (ckpt / damage).write_bytes(b"not a torch file")
            rewrite_checksums(ckpt)
            needles = [f"{damage} cannot be loaded"]
        before = record(run_dir)
        _, proc = launch(tmp_path, "torchrun", "dp", *FLAGS, "--num-steps", "4", "--resume", check=False)
        if damage is None:
            holder.kill()
            holder.wait()
        assert proc.returncode != 0  # not a hang: the launcher's timeout would raise
        said = proc.stderr.split("rc_train.py: error: ")[1:]  # one per rank that got to say it (they may interleave)
        assert said and all(n in part for n in needles for part in said), proc.stderr[-3000:]
        assert ENGINE_STARTED not in proc.stdout + proc.stderr and record(run_dir) == before
        assert not (run_dir / "ranks").exists()


# ---- 2. A resume touches nothing until it has proven it can continue ----------------------------------------------
def _nan_weights(ckpt):
    """One weight of the checkpoint set to NaN, written back through torch distributed checkpoint."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    flat = ckpt / "flat.pt"
    dcp_to_torch_save(str(ckpt / "state"), str(flat))
    state = torch.load(flat, weights_only=False)
    name = next(k for k, v in state["model"].items() if ".layers." in k and v.is_floating_point())  # not tied
    state["model"][name].view(-1)[0] = float("nan")
    torch.save(state, flat)
    shutil.rmtree(ckpt / "state")
    torch_save_to_dcp(str(flat), str(ckpt / "state"))
    flat.unlink()
    return f"the weight {name} is not finite"


@pytest.mark.parametrize("damage", ["in_flight_rank0.pt", "rng_rank0.pt", "nan weights"])
def test_a_resume_that_fails_late_touches_nothing(copy_of, damage):
    """Damage the checksums cannot see (they were rewritten to agree): a checkpoint file that does not load, or a
    non-finite weight. The resume is refused in one line naming it, before the engine starts, and metrics.jsonl,
    eval_samples.jsonl and config.yaml are byte for byte as they were (today's main cut the logs and rewrote
    config.yaml first)."""
    ckpt = newest(copy_of)
    if damage == "nan weights":
        needle = _nan_weights(ckpt)
    else:
        (ckpt / damage).write_bytes(b"not a torch file")
        needle = damage
    rewrite_checksums(ckpt)
    before = record(copy_of)
    _, proc = run_train(copy_of.parent, *FLAGS, "--num-steps", "4", "--resume", name="run", check=False, timeout=300)
    refused(proc, needle)
    assert ENGINE_STARTED not in proc.stdout + proc.stderr
    assert record(copy_of) == before


def test_a_torn_or_newline_less_last_line_is_repaired_and_said():
    """truncate_metrics: a last line cut mid-write is dropped, a complete one without its newline gets it back, and
    the console is told of each (today: the torn line silently, the newline never: the next record joined it)."""
    import tempfile

    said = []
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "metrics.jsonl")
        with open(path, "w") as f:
            f.write('{"step": 0, "a": 1}\n{"step": 1, "a": 2}')  # complete, no newline
        rc_checkpoint.truncate_metrics(path, 5, said.append)
        assert open(path).read() == '{"step": 0, "a": 1}\n{"step": 1, "a": 2}\n'
        assert len(said) == 1 and "line 2" in said[0] and "newline" in said[0]
        with open(path, "a") as f:
            f.write('{"step": 2, "a"')  # torn by a kill
        rc_checkpoint.truncate_metrics(path, 5, said.append)
        assert open(path).read() == '{"step": 0, "a": 1}\n{"step": 1, "a": 2}\n'
        assert len(said) == 2 and "line 3 is torn" in said[1]


def test_a_last_line_without_its_newline_is_repaired_on_resume(copy_of):
    """The last line of metrics.jsonl is complete but lost its newline: the resume adds it and says so, so the next
    record starts a line of its own (today's main appended to it: two steps on one unparseable line, exit 0)."""
    metrics = copy_of / "metrics.jsonl"
    metrics.write_bytes(metrics.read_bytes().rstrip(b"\n"))
    _, out = run_train(copy_of.parent, *FLAGS, "--num-steps", "3", "--resume", name="run")
    assert "line 3 (step 1) had no newline at its end: added" in out.stdout
    assert [r["step"] for r in read_jsonl(metrics)] == [-1, 0, 1, 2]


def test_a_failed_write_leaves_no_torn_line(tmp_path):
    """The disk fills in the middle of a record of metrics.jsonl or eval_samples.jsonl (a file size limit here: the
    write stops part way, then fails): RunError, and the file ends at its last whole line (today: a fragment stayed
    until a resume dropped it); once there is room again the next record starts a line of its own."""
    script = f"""
import json, os, resource, signal, sys, types
sys.path.insert(0, {ROOT!r})
import rc_run
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over the limit: EFBIG, not a signal
run_dir = sys.argv[1]
log = rc_run.RunLog(run_dir, types.SimpleNamespace(is_main_process=True, log=lambda *a, **k: None, trackers=[]))
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
for name, write in (("metrics.jsonl", log.log), ("eval_samples.jsonl", lambda s, m: log.eval_samples(s, [m, m]))):
    path = os.path.join(run_dir, name)
    write(0, {{"a": 1.0}})
    resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path) + 10, hard))  # full 10 bytes into the record
    try:
        write(1, {{"a": 2.0}})
        raise SystemExit("no fault")
    except rc_run.RunError as e:
        print(name, "refused:", e, flush=True)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    with open(path, "rb") as f:
        print(name, "after the fault:", json.dumps(f.read().decode()), flush=True)
    write(2, {{"a": 3.0}})
log.close()
"""
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name, lines in (("metrics.jsonl", 1), ("eval_samples.jsonl", 2)):
        assert f"{name} refused:" in proc.stdout and str(tmp_path / name) in proc.stdout, proc.stdout
        after = json.loads(proc.stdout.split(f"{name} after the fault: ")[1].splitlines()[0])
        assert after.endswith("\n") and after.count("\n") == lines, after  # whole lines only: step 0's
        assert [r["step"] for r in read_jsonl(tmp_path / name)] == [0] * lines + [2] * lines


def test_resuming_a_finished_run_prints_no_empty_line_and_clears_leftovers(copy_of):
    """--resume of a run that has finished (its checkpoint at its last step) runs no step and no evaluation: its
    console holds no empty line (today: 'eval accuracy (...): ' and nothing after). A step_N.deleting folder left by
    a kill during pruning is removed once the resume has loaded its checkpoint."""
    leftover = copy_of / "checkpoints" / "step_000000.deleting"
    shutil.copytree(copy_of / "checkpoints" / "step_000000", leftover)
    _, proc = run_train(copy_of.parent, *FLAGS, "--num-steps", "2", "--resume", name="run", timeout=300)
    lines = proc.stdout.splitlines()
    assert any(line.startswith("eval accuracy") for line in lines), proc.stdout
    assert all(line.strip() and not line.rstrip().endswith(":") for line in lines), proc.stdout
    assert not leftover.exists()
    assert sorted(p.name for p in (copy_of / "checkpoints").iterdir()) == ["step_000000", "step_000001"]


# ---- 3. A resume is exact or refused ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "flags, needles",
    [
        (["--seed", "2"], ["--seed is 1 in the checkpoint, 2 now"]),
        (["--num-prompts-per-step", "4"], ["--num-prompts-per-step is 8 in the checkpoint, 4 now"]),
        (
            ["--num-samples-per-prompt", "4", "--rc.preset", "decoupled_token_is"],
            ["--num-samples-per-prompt is 8 in the checkpoint, 4 now", "--rc.preset is 'bypass_ppo_clip'"],
        ),
        (["--task", "minigsm"], ["--task is 'add' in the checkpoint, 'minigsm' now"]),
    ],
)
def test_a_resume_with_other_settings_is_refused(copy_of, flags, needles):
    """Settings that change what a resumed step computes must be the checkpoint's: one line names each and both
    values, before the engine starts; nothing is touched (today's main trained the saved batch against other
    problems, or rewrote config.yaml to describe another task)."""
    before = record(copy_of)
    _, proc = run_train(
        copy_of.parent, *FLAGS, "--num-steps", "4", *flags, "--resume", name="run", check=False, timeout=300
    )
    refused(proc, *needles)
    assert ENGINE_STARTED not in proc.stdout + proc.stderr
    assert record(copy_of) == before


def test_every_setting_is_compared_or_named_free():
    """The settings a resume may change are fields of Args (no stale name), and every other field is compared."""
    fields = set(rc_checkpoint._flat(__import__("dataclasses").asdict(rc_train.Args())))
    free, late = rc_checkpoint.RESUME_MAY_CHANGE, rc_checkpoint.RESOLVED_LATE
    assert free <= fields and late <= fields - free
    assert set(rc_checkpoint.run_settings(rc_train.Args())) == fields - free
    for name in ("seed", "num_prompts_per_step", "task", "model", "max_staleness", "learning_rate", "rc.preset"):
        assert name in rc_checkpoint.run_settings(rc_train.Args())


def test_a_run_continued_past_its_end_equals_the_uninterrupted_run(copy_of, tmp_path):
    """k = 1: two steps with a checkpoint at the end, then --resume --num-steps 4, equal four uninterrupted steps bit
    for bit (today's main: the resumed step 2 was sampled by version 2 instead of 1). Two checkpoints are kept
    (--keep-checkpoints' default)."""
    reference, _ = run_train(tmp_path, *FLAGS, "--num-steps", "4", name="reference")
    rows, out = run_train(tmp_path, *FLAGS, "--num-steps", "4", "--resume", name="run")
    assert "step_000001 at step 2" in out.stdout
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["rollout/policy_version"] for r in rows] == [0, 0, 1, 2]
    for a, b in zip(rows, reference):
        assert _same_metrics(a, b), (a["step"], {k: (a[k], b[k]) for k in a if k in b and a[k] != b[k]})
    assert sorted(p.name for p in (copy_of / "checkpoints").iterdir()) == ["step_000002", "step_000003"]


def test_a_checkpoint_without_the_batches_past_the_end_is_refused(copy_of):
    """A checkpoint at a run's end written before checkpoints kept the batches past the end cannot be continued
    exactly: refused, naming the missing step and its version."""
    ckpt = newest(copy_of)
    torch.save({}, ckpt / "in_flight_rank0.pt")
    rewrite_checksums(ckpt)
    before = record(copy_of)
    _, proc = run_train(copy_of.parent, *FLAGS, "--num-steps", "4", "--resume", name="run", check=False, timeout=300)
    refused(proc, "no batch in flight for step 2", "version 1")
    assert record(copy_of) == before


# ---- 4. A damaged checkpoint is refused, naming the file and the way back --------------------------------------
def test_a_damaged_checkpoint_is_refused_naming_the_file_and_the_previous_one(copy_of, tmp_path):
    """One flipped byte in the tensor data of the newest checkpoint: refused before loading, naming the file, and
    saying how to resume from the one before (today's main loaded it silently). Following that advice resumes from
    step_000000."""
    ckpt = newest(copy_of)
    data = max((ckpt / "state").glob("*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    before = record(copy_of)
    _, proc = run_train(tmp_path, *FLAGS, "--num-steps", "3", "--resume", name="run", check=False, timeout=300)
    line = refused(proc, str(data), "does not match its checksum", "step_000000", f"mv {ckpt} {ckpt}.damaged")
    assert ENGINE_STARTED not in proc.stdout + proc.stderr and record(copy_of) == before
    os.rename(ckpt, f"{ckpt}.damaged")  # the advice
    rows, out = run_train(tmp_path, *FLAGS, "--num-steps", "3", "--resume", name="run")
    assert "step_000000 at step 1" in out.stdout, line
    assert [r["step"] for r in rows] == [0, 1, 2]


def test_a_checkpoint_without_trainer_state_is_refused_and_never_breaks_a_save(tmp_path):
    """A step_N folder that lost trainer_state.json is the newest checkpoint, damaged: refused naming it (today: the
    previous one loaded silently, then every save failed on 'Directory not empty: step_N.tmp -> step_N'). A save
    over such a folder replaces it."""
    tiny, args = _tiny(), _args(keep_checkpoints=5)
    for step in (0, 1):
        _save(tmp_path, step, tiny, args)
    (tmp_path / "checkpoints" / "step_000001" / "trainer_state.json").unlink()
    with pytest.raises(rc_run.RunError, match="step_000001 is damaged: it has no trainer_state.json") as info:
        rc_checkpoint.check_resume(str(tmp_path), _args(resume=True, run_name="x"))
    assert "step_000000" in str(info.value)
    _save(tmp_path, 1, tiny, args)
    assert (tmp_path / "checkpoints" / "step_000001" / "trainer_state.json").is_file()
    assert rc_checkpoint.check_resume(str(tmp_path), _args(resume=True, run_name="x")).endswith("step_000001")


def _edit_manifest(ckpt, change):
    manifest = ckpt / "checksums.json"
    sums = json.loads(manifest.read_text())
    change(sums)
    manifest.write_text(json.dumps(sums))


def _entry_removed_and_file_damaged(ckpt):
    data = max((ckpt / "state").glob("*.distcp"), key=lambda p: p.stat().st_size)
    _edit_manifest(ckpt, lambda sums: sums["sha256"].pop(str(data.relative_to(ckpt))))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    return [str(data), "is not listed in", str(ckpt / "checksums.json")]


def _unlisted_file(ckpt):
    shutil.copy(ckpt / "rng_rank0.pt", ckpt / "rng_rank1.pt")  # a stray file from a run of two processes
    return [str(ckpt / "rng_rank1.pt"), "is not listed in"]


def _listed_file_missing(ckpt):
    (ckpt / "state" / ".metadata").unlink()
    return [str(ckpt / "state" / ".metadata"), "is missing"]


def _trainer_state_edited(ckpt):
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["step"] = 0
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    return [str(ckpt / "trainer_state.json"), "does not match its checksum"]


@pytest.mark.parametrize(
    "damage", [_entry_removed_and_file_damaged, _unlisted_file, _listed_file_missing, _trainer_state_edited]
)
def test_the_manifest_covers_every_file_of_a_checkpoint(copy_of, damage):
    """checksums.json lists every file of a checkpoint, trainer_state.json included, and nothing else: a file whose
    entry was removed (and which was then damaged), a file present but not listed, a listed file missing, an edited
    trainer_state.json: the resume is refused in one line naming the file and the checkpoint before it, and nothing
    is touched (today's main loaded the unlisted damaged weights, cut metrics.jsonl, rewrote config.yaml and crashed;
    the edited step was refused by luck, blaming an old rc_train.py)."""
    ckpt = newest(copy_of)
    needles = damage(ckpt)
    before = record(copy_of)
    _, proc = run_train(copy_of.parent, *FLAGS, "--num-steps", "4", "--resume", name="run", check=False, timeout=300)
    refused(proc, f"{ckpt} is damaged", *needles, "step_000000")
    assert ENGINE_STARTED not in proc.stdout + proc.stderr
    assert record(copy_of) == before


def test_checkpoints_written_before_the_manifest_covered_everything_still_load(tmp_path, capsys):
    """A manifest of the previous format (every file but itself and trainer_state.json, no "version") still loads,
    every other file checked exactly (an unlisted one refused) and trainer_state.json said to be unchecked; a
    checkpoint written before checksums existed loads unchecked, said; a checksums.json present is checked even when
    trainer_state.json no longer names it."""
    _save(tmp_path, 0, _tiny(), _args())
    ckpt = tmp_path / "checkpoints" / "step_000000"
    resume = _args(resume=True, run_name="x")
    assert json.loads((ckpt / "checksums.json").read_text())["version"] == 2
    assert "trainer_state.json" in json.loads((ckpt / "checksums.json").read_text())["sha256"]
    _edit_manifest(ckpt, lambda sums: (sums.pop("version"), sums["sha256"].pop("trainer_state.json")))
    assert rc_checkpoint.check_resume(str(tmp_path), resume) == str(ckpt)
    assert f"{ckpt / 'trainer_state.json'} carries no checksum" in capsys.readouterr().out
    (ckpt / "notes.txt").write_text("mine")
    with pytest.raises(rc_run.RunError, match="notes.txt is not listed in"):
        rc_checkpoint.check_resume(str(tmp_path), resume)
    (ckpt / "notes.txt").unlink()
    state = json.loads((ckpt / "trainer_state.json").read_text())
    del state["checksums"]  # as if written before checksums existed, but checksums.json is there: checked
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    (ckpt / "scheduler.pt").write_bytes(b"damaged")
    with pytest.raises(rc_run.RunError, match="scheduler.pt does not match its checksum"):
        rc_checkpoint.check_resume(str(tmp_path), resume)
    (ckpt / "checksums.json").unlink()
    assert rc_checkpoint.check_resume(str(tmp_path), resume) == str(ckpt)
    assert "carries no checksums (written before checkpoints had them): loaded unchecked" in capsys.readouterr().out


def test_an_edited_trainer_state_is_damage_before_any_of_its_fields_is_read(tmp_path):
    """The first reads of trainer_state.json (the world size and staleness bound a resume must match, the default
    --max-staleness) check its checksum first: an edited field is refused as damage, not as another run's setting."""
    _save(tmp_path, 0, _tiny(), _args())
    state_file = tmp_path / "checkpoints" / "step_000000" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "world_size": 2}))
    with pytest.raises(rc_run.RunError, match="trainer_state.json does not match its checksum"):
        rc_checkpoint.check_run_dir(str(tmp_path), resume=True, overwrite=False, world=2)


# ---- 5. Every fault a line ----------------------------------------------------------------------------------------
def _tiny():
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)


ACCELERATOR = types.SimpleNamespace(
    is_main_process=True, process_index=0, num_processes=1, wait_for_everyone=lambda: None
)
COUNTERS = {"old_log_prob_passes": 0, "sync_count": 0}


def _args(**changes):
    import dataclasses

    return dataclasses.replace(rc_train.Args(), max_staleness=0, **changes)


def _save(run_dir, step: int, tiny: tuple, args) -> None:
    """save_checkpoint of _tiny()'s model, optimizer and scheduler by one process, with no batch in flight."""
    model, optimizer, scheduler = tiny
    rc_checkpoint.save_checkpoint(
        str(run_dir),
        step,
        ACCELERATOR,
        args,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        counters=COUNTERS,
        in_flight={},
    )


@pytest.mark.parametrize("where", ["state", "in_flight_rank0.pt", "torch's zip writer"])
def test_a_full_disk_during_a_save_is_one_line_naming_the_file(tmp_path, monkeypatch, where):
    """ENOSPC inside torch distributed checkpoint's writer or in torch.save, or the RuntimeError torch's zip writer
    raises instead on a full file system (seen on a full tmpfs): a RunError saying 'no space left on device' and the
    file, the unfinished .tmp folder removed, the checkpoint before it untouched."""
    import torch.distributed.checkpoint.filesystem as dcp_fs

    tiny = _tiny()
    _save(tmp_path, 0, tiny, _args())
    kept = rc_checkpoint.checksum_files(str(tmp_path / "checkpoints" / "step_000000"))

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def zip_writer(*a, **k):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    if where == "torch's zip writer":
        monkeypatch.setattr(dcp_fs, "_write_item", zip_writer)
        with pytest.raises(BaseException, match="unexpected pos"):  # a disk with room: a fault of the program
            _save(tmp_path, 1, tiny, _args())
        monkeypatch.setattr(rc_checkpoint, "disk_full", lambda path: True)
        where = "state"
    elif where == "state":
        monkeypatch.setattr(dcp_fs, "_write_item", full)
    else:
        save = torch.save
        monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: full() if "in_flight" in str(f) else save(obj, f))
    with pytest.raises(rc_run.RunError) as info:
        _save(tmp_path, 1, tiny, _args())
    line = str(info.value)
    assert "\n" not in line and "no space left on device while writing" in line
    assert os.path.join("step_000001.tmp", where) in line
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_000000"]
    assert rc_checkpoint.checksum_files(str(tmp_path / "checkpoints" / "step_000000")) == kept
    assert rc_run.fault_line(info.value) == line  # what rc_train.py prints


def run_patched(tmp_path, patch: str, flags: list[str]) -> subprocess.CompletedProcess:
    """The real rc_train.py run by a wrapper script that first executes `patch` (Python source: a fault injected,
    a task replaced as a fork would), with `flags`."""
    wrapper = tmp_path / "patched_rc_train.py"
    script = os.path.join(ROOT, "rc_train.py")
    run = f"sys.argv = ['rc_train.py', *sys.argv[1:]]\nrunpy.run_path({script!r}, run_name='__main__')\n"
    wrapper.write_text(f"import runpy, sys\nsys.path.insert(0, {ROOT!r})\n" + patch + run)
    cmd = [sys.executable, str(wrapper), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, env=train_env(tmp_path), cwd=ROOT, timeout=600)


def test_a_full_disk_during_a_real_run_is_one_line(tmp_path):
    """The real script, ENOSPC injected into the first checkpoint's batches-in-flight file: one line on stderr naming
    it, exit code 1, no traceback."""
    patch = (
        "import errno, os, torch\n"
        "save = torch.save\n"
        "def full(obj, f, *a, **k):\n"
        "    if 'in_flight' in str(f):\n"
        "        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))\n"
        "    return save(obj, f, *a, **k)\n"
        "torch.save = full\n"
    )
    flags = [*QUICK, "--num-steps", "2", "--checkpoint-every", "1", "--output-dir", str(tmp_path), "--run-name", "r"]
    proc = run_patched(tmp_path, patch, flags)
    refused(proc, "no space left on device while writing", "step_000000.tmp/in_flight_rank0.pt")
    assert not (tmp_path / "r" / "checkpoints" / "step_000000.tmp").exists()


@pytest.mark.parametrize(
    "env, config, needles",
    [
        ({"OMP_NUM_THREADS": "abc"}, None, ["OMP_NUM_THREADS", "'abc'"]),
        ({"RC_CACHE_DIR": "FILE/cache"}, None, ["RC_CACHE_DIR", "is a file"]),
        ({"RC_CACHE_DIR": ""}, None, ["RC_CACHE_DIR is set but empty"]),
        ({"RC_TRAIN_KILL_IN_CHECKPOINT": "three"}, None, ["RC_TRAIN_KILL_IN_CHECKPOINT", "'three'"]),
        ({}, "num_steps: 3\n  bad: [\n", ["YAML syntax error at line 2, column 6"]),
        ({}, "num_steps: [3\n", ["YAML syntax error at line 2, column 1"]),
        ({}, b"num_steps: 3\n\xff\xfe\n", ["is not UTF-8 text"]),
    ],
)
def test_bad_environment_and_yaml_are_one_line(tmp_path, env, config, needles):
    """Bad environment values and YAML syntax errors: one line naming the variable and value, or the file, line and
    column (today: tracebacks), before any run folder exists."""
    (tmp_path / "FILE").write_text("a file, not a folder")
    env = {k: v.replace("FILE", str(tmp_path / "FILE")) for k, v in env.items()}
    flags = [*QUICK, "--num-steps", "1"]
    if config is not None:
        path = tmp_path / "bad.yaml"
        path.write_bytes(config if isinstance(config, bytes) else config.encode())
        flags = ["--config", str(path)]
        needles = [*needles, str(path)]
    cmd = [sys.executable, os.path.join(ROOT, "rc_train.py"), "--output-dir", str(tmp_path), "--run-name", "r", *flags]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env={**train_env(tmp_path), **env}, cwd=ROOT, timeout=300
    )
    refused(proc, *needles)
    assert not (tmp_path / "r").exists()


def test_a_cache_that_cannot_be_written_is_one_line(tmp_path, monkeypatch):
    """A model build into a cache that refuses writes (read-only, full): a ValueError naming RC_CACHE_DIR (the CLI
    prints it as one line), nothing half-built left."""
    monkeypatch.setenv("RC_CACHE_DIR", str(tmp_path / "cache"))

    def build(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.path.join(path, "model.safetensors"))

    with pytest.raises(ValueError, match="RC_CACHE_DIR.*cannot be written: Read-only file system") as info:
        tasks.cached_build("m", build, lambda _: None)
    assert "\n" not in str(info.value)
    assert os.listdir(tmp_path / "cache") == ["m.lock"]  # the build's empty lock file (kept: tasks.cached_build)


def test_unreadable_files_are_named(tmp_path, monkeypatch):
    """A file the OS will not let us read, anywhere in the run: fault_line names it (rc_train.py's excepthook prints
    that line instead of a traceback); inside a resume, a RunError names it."""
    assert rc_run.fault_line(PermissionError(errno.EACCES, "Permission denied", "/data/train.jsonl")) == (
        "permission denied: /data/train.jsonl"
    )
    assert rc_run.fault_line(ValueError("a bug")) is None  # a fault of the program keeps its traceback
    path = tmp_path / "trainer_state.json"
    path.write_text("{}")
    real_open = open

    def unreadable(f, *a, **k):
        if str(f) == str(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(f))
        return real_open(f, *a, **k)

    monkeypatch.setattr("builtins.open", unreadable)
    with pytest.raises(rc_run.RunError, match=f"permission denied while reading {path}"):
        rc_checkpoint._read_json(str(path))


# ---- 6. Checkpoint retention -------------------------------------------------------------------------------------
def test_checkpoints_are_kept_to_the_newest_n(tmp_path):
    """--keep-checkpoints N: after each save the complete checkpoints older than the one just written are deleted
    beyond the newest N; the one just written never is (not even among newer folders), incomplete folders are left
    alone, and N < 1 is refused naming the value."""
    tiny = _tiny()
    for step in range(5):
        _save(tmp_path, step, tiny, _args(keep_checkpoints=2))
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_000003", "step_000004"]
    (tmp_path / "checkpoints" / "step_000002.tmp").mkdir()  # a save cut off by a kill
    _save(tmp_path, 1, tiny, _args(keep_checkpoints=1))
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [
        "step_000001",
        "step_000002.tmp",
        "step_000003",
        "step_000004",
    ]
    _save(tmp_path, 5, tiny, _args(keep_checkpoints=1))
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_000002.tmp", "step_000005"]
    with pytest.raises(ValueError, match=r"--keep-checkpoints must be >= 1 .*got 0"):
        rc_config.validate_args(_args(keep_checkpoints=0), world_size=1)


def test_a_pruning_cut_short_is_finished_by_the_next_save(tmp_path, capsys):
    """A kill during pruning leaves step_N.deleting (renamed out of the checkpoints, partly deleted): the next save
    removes it (today: nothing ever did), and says so; incomplete step_N.tmp folders are still left alone."""
    tiny = _tiny()
    for step in (0, 1):
        _save(tmp_path, step, tiny, _args(keep_checkpoints=5))
    root = tmp_path / "checkpoints"
    os.replace(root / "step_000000", root / "step_000000.deleting")
    shutil.rmtree(root / "step_000000.deleting" / "state")
    (root / "step_000003.tmp").mkdir()
    _save(tmp_path, 2, tiny, _args(keep_checkpoints=5))
    assert sorted(os.listdir(root)) == ["step_000001", "step_000002", "step_000003.tmp"]
    assert str(root / "step_000000.deleting") in capsys.readouterr().out
