"""What outlives the process: save, verify, prune and resume a checkpoint.

A checkpoint (checkpoints/step_N) holds everything a step needs to continue exactly: the model and optimizer (torch
distributed checkpoint), every rank's RNG states, batches in flight and replay buffer, the scheduler,
trainer_state.json and checksums.json (the SHA-256 of every other file, and of nothing else), written last before one
rename. A resume checks before it touches anything: the run folder may be claimed (claim_run_dir, under
rc_run.RunLock), the newest checkpoint is complete and intact (verify_checkpoint) and its settings are the run's
(check_resume, agree_settings); then everything is loaded (load_resume) before the logs are cut back and config.yaml
rewritten (commit_resume). Retention keeps the newest --keep-checkpoints. Every fault of a file is
one line (rc_run.RunError). This module imports rc_run (the faults, the ranks' HostGroup, the lock, config.yaml);
rc_run never imports it.
Unit-tested on CPU (tests/test_run_record.py, tests/test_infra.py) and end to end (tests/test_train.py).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import yaml

import rc_run


# ---------------------------------------------------------------------------------------------
# The checkpoints of a run folder, and the settings a resume must keep
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class CheckpointArgs:
    """The run folder's life: replace, resume, save and keep checkpoints (rc_train.Args inherits these flags)."""

    overwrite: bool = False
    """allow replacing an existing run folder (otherwise an existing run is never touched)"""
    resume: bool = False
    """continue the run in --run-name from its newest complete checkpoint"""
    checkpoint_every: int = 0
    """save model, optimizer, scheduler, RNG, batches in flight and step every N steps (0 = never)"""
    keep_checkpoints: int = 2
    """keep the newest N complete checkpoints (>= 1); the second newest serves if the newest is found damaged"""


STEP_FOLDER = re.compile(r"step_(\d+)")  # checkpoints/step_N; step_N.tmp (cut off mid-write) and others never load
LEFTOVER = re.compile(r"step_\d+\.(deleting|replaced\d+)")  # a pruning or replacement cut short by a kill
# In a checkpoint: the manifest, the SHA-256 of every other file, trainer_state.json included, and of nothing else;
# written last. MANIFEST_VERSION 2 says it covers trainer_state.json; a manifest without "version" (checkpoints
# written before) covers every file but trainer_state.json (verify_checkpoint).
CHECKSUMS = "checksums.json"
MANIFEST_VERSION = 2

# The settings a --resume may change: where the run writes, what it logs, evaluates and keeps, how long it runs,
# where the engine runs and how it uses memory. None of them changes what a step computes (the rollout worker at
# k = 0 gives the in-process engine's samples bit for bit: tests/test_train.py). Every other field of rc_train.Args
# must equal the checkpoint's (check_settings): the seed, the data, the model, the batch shapes, the sampling, the
# schedule, the dials, the optimiser, the loss and every correction field decide what a resumed step computes.
RESUME_MAY_CHANGE = frozenset(
    {
        "exp_name",
        "config",
        "output_dir",
        "run_name",
        "overwrite",
        "resume",
        "log_with",
        "wandb_project_name",
        "wandb_entity",
        "num_steps",
        "eval_before",
        "eval_every",
        "eval_limit",
        "checkpoint_every",
        "keep_checkpoints",
        "log_rank_checksums",
        "save_final",
        "dump_log_ratio_every",
        "rollout_worker",
        "vllm_gpu_memory_utilization",
        "vllm_kv_cache_gb",
        "vllm_sleep",
        "vllm_sleep_level",
        "kept_versions_gib",
    }
)


def _flat(config: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in config.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def run_settings(args) -> dict:
    """The settings that decide what a step computes: every field of `args` (nested ones as 'rc.preset') but
    RESUME_MAY_CHANGE, as JSON values (what trainer_state.json stores)."""
    flat = _flat(dataclasses.asdict(args))
    return json.loads(json.dumps({k: v for k, v in flat.items() if k not in RESUME_MAY_CHANGE}))


def _step_of(folder: str) -> int:
    return int(STEP_FOLDER.fullmatch(os.path.basename(folder)).group(1))


def step_folders(run_dir: str) -> list[str]:
    """Every checkpoints/step_N folder, complete or not (a .tmp one is not a step_N folder), by step."""
    root = os.path.join(run_dir, "checkpoints")
    names = [n for n in os.listdir(root) if STEP_FOLDER.fullmatch(n)] if os.path.isdir(root) else []
    return sorted((os.path.join(root, n) for n in names), key=_step_of)


def checkpoint_dirs(run_dir: str) -> list[str]:
    """Complete checkpoints, oldest first. A complete one was renamed from *.tmp after its last file (whether every
    file is there and intact is verify_checkpoint's to say)."""
    return [d for d in step_folders(run_dir) if os.path.isfile(os.path.join(d, "trainer_state.json"))]


def newest_checkpoint_state(run_dir: str) -> dict | None:
    """trainer_state.json of the run's newest complete checkpoint (None when it has none)."""
    dirs = checkpoint_dirs(run_dir)
    if not dirs:
        return None
    try:  # its checksum checked first (cheap): an edited trainer_state.json is damage, not another run's settings
        state_file = os.path.join(dirs[-1], "trainer_state.json")
        if os.path.isfile(os.path.join(dirs[-1], CHECKSUMS)):
            digest = _manifest(dirs[-1])[0].get("trainer_state.json")
            if digest is not None:
                _check_sum(state_file, digest)
        return _read_json(state_file)
    except rc_run.RunError as e:
        raise _damaged(run_dir, dirs[-1], str(e)) from None


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise rc_run.io_fault(e, "reading", path) from e
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise rc_run.RunError(f"{path} is not valid JSON ({e})") from e


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def files_under(folder: str) -> list[str]:
    """Every file under `folder` (a link too), as sorted paths relative to it."""
    return sorted(
        os.path.relpath(os.path.join(root, name), folder) for root, _, names in os.walk(folder) for name in names
    )


def checksum_files(folder: str) -> dict:
    """{path relative to `folder`: SHA-256} of every file under it. hashlib releases the GIL on large buffers, so
    threads read and hash several files at once (DCP writes one file per rank, and the RNG and batch files)."""
    files = files_under(folder)
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(files)))) as pool:
        return dict(zip(files, pool.map(lambda rel: file_sha256(os.path.join(folder, rel)), files)))


# ---------------------------------------------------------------------------------------------
# Saving: one checkpoint written whole or not at all, then the older ones pruned
# ---------------------------------------------------------------------------------------------
class _Files:
    """The files of a checkpoint being written into `folder`; `path` is the one being written now (or the folder),
    for the message of a fault."""

    def __init__(self, folder: str):
        self.folder = self.path = folder

    def at(self, name: str) -> str:
        self.path = os.path.join(self.folder, name)
        return self.path


def save_checkpoint(
    run_dir: str,
    step: int,
    accelerator,
    args,
    *,
    model,
    optimizer,
    scheduler,
    counters: dict,
    in_flight: dict,
    carried: list | None = None,
    replay=(),
    kept_versions: dict | None = None,
) -> None:
    """checkpoints/step_N: model and optimizer through torch distributed checkpoint (each rank writes its own shards
    under FSDP2; replicated DDP tensors are written once), every rank's RNG state, the batches it has in flight
    (--max-staleness k: those of the next k steps, sampled by older versions), its unfinished responses
    (--partial-rollout: rc_rollout.PartialRollouts.state after the last of them) and its replay buffer (--replay-window:
    rc_rollout.ReplayBuffer.state), the weights kept by version (--mismatch-split, --prox-logp sampling:
    rc_rollout.KeptVersions, written once, by the main process), the scheduler, trainer_state.json (the step, the
    counters, the schedule and the settings that decide what a step computes: run_settings) and checksums.json (the
    SHA-256 of every file above).
    All of it goes into step_N.tmp, checksums.json last, then one rename: a process killed during a save leaves a .tmp
    folder that --resume never loads. Then the older complete checkpoints beyond --keep-checkpoints are deleted
    (prune_checkpoints); the leftovers of a pruning cut short by a kill are removed before the save begins
    (remove_leftovers). A full disk (or any file fault) removes the .tmp folder and raises a RunError naming the file
    being written; the checkpoints before it are untouched."""
    final = os.path.join(run_dir, "checkpoints", f"step_{step:06d}")
    files, main = _Files(final + ".tmp"), accelerator.is_main_process
    tmp = files.folder
    try:
        if main:
            remove_leftovers(run_dir)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        accelerator.wait_for_everyone()
        _write_rank_files(files, accelerator.process_index, args, model, optimizer, in_flight, replay, carried)
        if main and kept_versions is not None:
            torch.save(kept_versions, files.at("kept_versions.pt"))
        accelerator.wait_for_everyone()
        if main:
            _write_main_files(files, step, accelerator.num_processes, args, scheduler, counters, in_flight)
            files.path = final
            _replace_folder(tmp, final)
    except BaseException as e:  # torch's CheckpointException is a BaseException
        fault = _write_fault(e, tmp)
        if fault is None:
            raise
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise rc_run.RunError(
            f"checkpoint of step {step}: {rc_run.io_fault(fault, 'writing', files.path)} (the unfinished {tmp} was "
            f"removed; the checkpoints before it are kept)"
        ) from e
    accelerator.wait_for_everyone()
    if main:
        prune_checkpoints(run_dir, args.keep_checkpoints, final)


def _write_rank_files(files: _Files, rank: int, args, model, optimizer, in_flight: dict, replay, carried) -> None:
    """Every rank's part of a checkpoint: its shards of the model and optimizer (DCP), its RNG states, its batches in
    flight, under --replay-window its replay buffer, under --partial-rollout its unfinished responses."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=files.at("state"))
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save(rng, files.at(f"rng_rank{rank}.pt"))
    # a Result's `carried` (--partial-rollout) is read only for carried_after, which is saved below; a resumed run's
    # next checkpoint reads a batch requested after the resume, so the copy in each in-flight Result is dropped
    in_flight = {t: r._replace(carried=None) for t, r in in_flight.items()}
    torch.save(in_flight, files.at(f"in_flight_rank{rank}.pt"))
    if args.replay_window:
        torch.save(replay, files.at(f"replay_rank{rank}.pt"))
    if args.partial_rollout:
        torch.save(carried, files.at(f"partial_rank{rank}.pt"))


def _write_main_files(files: _Files, step: int, world: int, args, scheduler, counters: dict, in_flight: dict) -> None:
    """The main process's part, once every rank has written its own: the scheduler, trainer_state.json (which makes
    the folder a complete checkpoint once renamed: checkpoint_dirs), then checksums.json, last, covering every file
    before it. The manifest is written last so that it can cover trainer_state.json too (the reverse, trainer_state.json
    last carrying the manifest's SHA-256, would leave trainer_state.json itself unchecked): an edited step or setting
    is damage, refused as such. The folder's completeness does not hang on which file is last (the rename publishes
    it whole); a folder that lost its manifest is refused, since its trainer_state.json names it (verify_checkpoint)."""
    path = files.at("scheduler.pt")
    torch.save(scheduler.state_dict(), path)
    if os.environ.get("RC_TRAIN_KILL_IN_CHECKPOINT") == str(step):  # test hook: SIGKILL mid-write
        os.kill(os.getpid(), signal.SIGKILL)
    with open(files.at("trainer_state.json"), "w") as f:
        json.dump(
            {
                "step": step,
                "world_size": world,  # the step fixes the data position
                "max_staleness": args.max_staleness,
                **counters,
                "in_flight_steps": sorted(in_flight),
                "checksums": CHECKSUMS,
                "settings": run_settings(args),
            },
            f,
        )
    sums = checksum_files(files.folder)
    with open(files.at(CHECKSUMS), "w") as f:  # written last: every other file, trainer_state.json included
        json.dump({"version": MANIFEST_VERSION, "sha256": sums}, f, indent=1)


def _write_fault(e: BaseException, tmp: str) -> OSError | None:
    """The fault of the machine's files behind a failed save into `tmp`, or None: an interrupt, or a fault of the
    program, raised as it is."""
    if isinstance(e, (KeyboardInterrupt, SystemExit)):
        return None
    fault = rc_run.os_error_in(e)
    if fault is None and disk_full(tmp):
        fault = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # torch's zip writer hides the OS error
    return fault


def disk_full(path: str, margin: int = 4 << 20) -> bool:
    """The file system of `path` (or of its nearest existing parent) has less than `margin` bytes left for this
    process (root may use the blocks reserved for it). torch.save's zip writer, which torch distributed checkpoint
    uses for every file, turns a failed write into "RuntimeError: [enforce fail at inline_container.cc] unexpected
    pos" without the OS error (measured on a full tmpfs): a failed save on a full file system is told as one."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path or ".")
    except OSError:
        return False
    return (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize < margin


def _replace_folder(tmp: str, final: str) -> None:
    """Rename tmp to final; a folder already there (a step_N without trainer_state.json, left by a fault, or one moved
    back by hand) is replaced rather than making the rename fail ("Directory not empty") at every later save."""
    if os.path.exists(final):
        old = f"{final}.replaced{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def prune_checkpoints(run_dir: str, keep: int, newest: str) -> list[str]:
    """After a save: delete the complete checkpoints older than `newest` (the one just written, never deleted) beyond
    the newest `keep` (--keep-checkpoints, >= 1). Each is renamed out of the step_N names first, so a deletion cut
    short never leaves a step_N folder that looks like a checkpoint. Incomplete folders are left alone. A folder that
    cannot be deleted is said on the console and kept: the run goes on. Returns the deleted folders."""
    older = [d for d in checkpoint_dirs(run_dir) if _step_of(d) < _step_of(newest)]
    deleted = []
    for folder in older[: max(0, len(older) - (keep - 1))]:
        try:
            doomed = f"{folder}.deleting"
            os.replace(folder, doomed)
            shutil.rmtree(doomed)
            deleted.append(folder)
        except OSError as e:
            print(f"--keep-checkpoints {keep}: {rc_run.io_fault(e, 'deleting', folder)}; kept", file=sys.stderr)
    return deleted


def remove_leftovers(run_dir: str) -> list[str]:
    """Remove what a kill during a pruning (step_N.deleting) or a replacement (step_N.replaced<pid>, _replace_folder)
    left under checkpoints/: folders already renamed out of the checkpoints, never loaded. Called by the main process
    at each save and once a resume has loaded its checkpoint (commit_resume), under the run's lock; said on the
    console. A step_N.tmp (a save cut short) is left alone: the next save of its step replaces it. Returns them."""
    root = os.path.join(run_dir, "checkpoints")
    try:
        names = sorted(n for n in os.listdir(root) if LEFTOVER.fullmatch(n))
    except OSError:
        return []
    removed = []
    for name in names:
        path = os.path.join(root, name)
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            print(f"removed {path}: left by a deletion of an old checkpoint cut short", flush=True)
            removed.append(path)
    return removed


# ---------------------------------------------------------------------------------------------
# Checking a start or a resume before anything is loaded or written: the files, the settings, the run folder
# ---------------------------------------------------------------------------------------------
def _manifest(path: str) -> tuple[dict, int]:
    """The checksums.json of the checkpoint `path`: ({file: SHA-256}, its version), checked for form."""
    file = os.path.join(path, CHECKSUMS)
    sums = _read_json(file)
    version = sums.get("version", 1) if isinstance(sums, dict) else None
    listed = sums.get("sha256") if isinstance(sums, dict) else None
    if version not in (1, MANIFEST_VERSION) or not isinstance(listed, dict):
        raise rc_run.RunError(f"{file} holds no checksums this rc_train.py can read")
    return listed, version


def _check_sum(file: str, digest) -> None:
    try:
        actual = file_sha256(file)
    except OSError as e:
        raise rc_run.io_fault(e, "reading", file) from e
    if actual != digest:
        raise rc_run.RunError(
            f"{file} does not match its checksum (SHA-256 {actual[:12]}..., written {str(digest)[:12]}...)"
        )


def verify_checkpoint(path: str, state: dict) -> str | None:
    """Check the checkpoint `path` against its checksums.json (state: its trainer_state.json): the files it lists are
    exactly the files there (one present but not listed, or listed but missing, is named), then every SHA-256, before
    anything is loaded. Raises RunError naming the first file at fault; returns a note for an older checkpoint, else
    None. The checksums guard against damage (a torn copy, a flipped bit, a file lost, added or edited by hand), not
    against forgery: whoever rewrites the manifest too is believed.
    Older checkpoints still load: one written before checkpoints carried checksums (no checksums.json, none named in
    trainer_state.json) loads unchecked, said; one whose manifest has no "version" (written before the manifest
    covered trainer_state.json) has every other file checked exactly as above and trainer_state.json unchecked, said.
    A checksums.json present is always checked, whatever trainer_state.json says."""
    if "checksums" not in state and not os.path.lexists(os.path.join(path, CHECKSUMS)):
        return f"{path} carries no checksums (written before checkpoints had them): loaded unchecked"
    manifest = os.path.join(path, CHECKSUMS)
    if not os.path.isfile(manifest):
        raise rc_run.RunError(f"{manifest} is {'not a file' if os.path.lexists(manifest) else 'missing'}")
    listed, version = _manifest(path)
    present = set(files_under(path)) - {CHECKSUMS}
    unchecked = {"trainer_state.json"} - set(listed) if version == 1 else set()
    unlisted, missing = sorted(present - set(listed) - unchecked), sorted(set(listed) - present)
    if unlisted:
        raise rc_run.RunError(
            f"{os.path.join(path, unlisted[0])} is not listed in {manifest} (a file the checkpoint did not write, or "
            f"one whose entry was removed)"
        )
    if missing:
        file = os.path.join(path, missing[0])
        raise rc_run.RunError(f"{file} is {'not a file' if os.path.lexists(file) else 'missing'}")
    for rel, digest in sorted(listed.items()):
        _check_sum(os.path.join(path, rel), digest)
    if unchecked:
        return (
            f"{os.path.join(path, 'trainer_state.json')} carries no checksum (the checkpoint was written before "
            f"checksums.json covered it): its other files checked"
        )
    return None


def _damaged(run_dir: str, ckpt: str, why: str) -> rc_run.RunError:
    earlier = [d for d in checkpoint_dirs(run_dir) if _step_of(d) < _step_of(ckpt)]
    if earlier:
        how = (
            f"to resume from {os.path.basename(earlier[-1])}, the checkpoint before it, move the damaged one aside "
            f"(mv {ckpt} {ckpt}.damaged) and resume again"
        )
    else:
        how = "there is no earlier complete checkpoint to resume from: start the run again (--overwrite)"
    return rc_run.RunError(f"--resume: the newest checkpoint {ckpt} is damaged: {why}; {how}")


def check_resume(run_dir: str, args) -> str:
    """The newest checkpoint can be continued, checked before anything is loaded or written: it is complete
    (trainer_state.json), every file matches its checksum (a damaged one is refused naming the file and how to
    resume from the previous checkpoint, never skipped silently), the settings that decide what a step computes are
    the checkpoint's (check_settings; those in RESOLVED_LATE once the start has resolved them, agree_settings), and
    --num-steps does not end before it. Returns its path."""
    ckpt = step_folders(run_dir)[-1]
    state_file = os.path.join(ckpt, "trainer_state.json")
    try:
        if not os.path.isfile(state_file):
            raise rc_run.RunError("it has no trainer_state.json (a complete checkpoint writes it last)")
        state = _read_json(state_file)
        note = verify_checkpoint(ckpt, state)
    except rc_run.RunError as e:
        raise _damaged(run_dir, ckpt, str(e)) from None
    if note:
        print(note, flush=True)
    check_settings(run_dir, ckpt, state, args, skip=RESOLVED_LATE)
    if state["step"] + 1 > args.num_steps:
        raise rc_run.RunError(
            f"--resume: the checkpoint {ckpt} is past --num-steps {args.num_steps} (it holds step {state['step']}): "
            f"give --num-steps {state['step'] + 1} or more"
        )
    return ckpt


def _same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


# Settings whose default (None) the start resolves only once the model's config is read (rc_moe.check_model):
# compared by agree_settings, after that, instead of by check_resume.
RESOLVED_LATE = frozenset({"routing_metrics"})


def check_settings(run_dir: str, ckpt: str, state: dict, args, skip=frozenset()) -> None:
    """Refuse a resume whose settings (run_settings, but those in `skip`) differ from the checkpoint's: one line
    naming each setting that differs and both values. A checkpoint written before checkpoints stored them is compared
    with the run's config.yaml (which only a start or a successful resume writes)."""
    saved, source = state.get("settings"), os.path.join(ckpt, "trainer_state.json")
    if saved is None:
        source = os.path.join(run_dir, "config.yaml")
        try:
            with open(source) as f:
                config = yaml.safe_load(f)
            saved = {k: v for k, v in _flat(config["args"]).items() if k not in RESUME_MAY_CHANGE}
        except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError):
            print(f"{ckpt} stores no settings and {source} is unreadable: settings not compared", flush=True)
            return
    now = {k: v for k, v in run_settings(args).items() if k not in skip}
    differ = [(k, saved[k], now[k]) for k in sorted(saved) if k in now and not _same(saved[k], now[k])]
    if differ:
        said = "; ".join(f"--{k.replace('_', '-')} is {a!r} in the checkpoint, {b!r} now" for k, a, b in differ)
        raise rc_run.RunError(
            f"--resume: {said} ({source}): a resumed step must compute what the uninterrupted run would, so these "
            f"settings must be the checkpoint's (docs/running.md, 'Checkpoints and resume'); drop the changed flags, "
            f"or start a new run"
        )


def agree_settings(run_dir: str, args, host: rc_run.HostGroup, main: bool) -> None:
    """On --resume, once the start has resolved every setting (the last checks before the model is loaded;
    RESOLVED_LATE): the main process compares them all with the newest checkpoint's (check_settings), and every rank
    learns a refusal (RunError on each)."""
    error = None
    if main and args.resume:
        try:
            ckpt = checkpoint_dirs(run_dir)[-1]
            check_settings(run_dir, ckpt, _read_json(os.path.join(ckpt, "trainer_state.json")), args)
        except ValueError as e:
            error = str(e)
    errors = [e for e in host.gather(error) if e]
    if errors:
        raise rc_run.RunError(errors[0])


def check_run_dir(run_dir: str, resume: bool, overwrite: bool, world: int = 1, max_staleness: int = 0) -> bool:
    """Refuse to touch an existing run unless --resume or --overwrite (before anything is written), and a resume
    with another number of processes than its checkpoint's (each rank's RNG state and data shard are in it) or another
    --max-staleness (its batches in flight were sampled for that schedule); True when the folder must be emptied first
    (--overwrite of an existing run)."""
    exists = rc_run.run_dir_in_use(run_dir)
    state = newest_checkpoint_state(run_dir) if resume else None
    if resume and state is None:
        raise FileNotFoundError(f"--resume: no complete checkpoint under {run_dir!r}")
    if resume:
        written_by, k = state.get("world_size", 1), state.get("max_staleness", 0)
        if written_by != world:
            raise ValueError(
                f"--resume: the checkpoint under {run_dir!r} was written by {written_by} process(es), "
                f"this run has {world}: resume with as many"
            )
        if k != max_staleness:
            raise ValueError(
                f"--resume: the checkpoint under {run_dir!r} was written with --max-staleness {k}, this "
                f"run has --max-staleness {max_staleness}: resume with the same bound"
            )
    if exists and not (resume or overwrite):
        if ended_before_training(run_dir):
            return True  # a run that never trained: emptied and started again, once claim_run_dir holds its lock
        raise FileExistsError(f"run folder {run_dir!r} exists; pass --overwrite to replace it or --resume")
    return exists and overwrite and not resume


BEFORE_TRAINING = re.compile(r"config\.yaml(\.tmp)?|engine\d*\.log|metrics\.jsonl|eval_samples\.jsonl")


def ended_before_training(run_dir: str) -> bool:
    """The folder of a run that ended (killed, crashed) before its first training step: made by a run (its lock file
    is there) and holding only what a run writes before that step (config.yaml, the engines' logs, at most the
    evaluation before training: metrics.jsonl lines of step -1 and their eval_samples.jsonl), so no step, no
    checkpoint, no final model. A next run of its name starts it again instead of refusing it. Whether its run is
    still alive is for the lock to say: only claim_run_dir, holding it, acts on this."""
    try:
        names = os.listdir(run_dir)
        if rc_run.LOCK_FILE not in names or not all(
            n == rc_run.LOCK_FILE or BEFORE_TRAINING.fullmatch(n) for n in names
        ):
            return False
        if "metrics.jsonl" in names:
            with open(os.path.join(run_dir, "metrics.jsonl")) as f:
                for line in f:
                    if line.strip() and json.loads(line).get("step", 0) >= 0:
                        return False
    except (OSError, ValueError, AttributeError, TypeError):  # unreadable, a torn line, not a step record
        return False
    return True


ABANDONED_AFTER_S = 60.0  # a lock-only run folder this old whose lock is free was left by a killed start
LOCK_TEXT = re.compile(r"(\d+ \S+\n)?")  # what rc_run.RunLock writes in its file: "PID HOST", or nothing yet


def remove_abandoned_claims(output_dir: str, keep: str) -> list[str]:
    """Remove the run folders under `output_dir` that hold nothing but a free lock file at least ABANDONED_AFTER_S old
    (besides `keep`, the caller's own), and return them. Such a folder is a start that was killed before it wrote
    anything, typically during the base-model build (rc_run.RunLock removes its own at a normal exit; a SIGKILL
    skips that). A lock that some process holds, one that RunLock did not write, or any other file: the folder stays."""
    removed = []
    try:
        entries = sorted(os.listdir(output_dir))
    except OSError:
        return removed
    for entry in entries:
        folder = os.path.join(output_dir, entry)
        lock_path = os.path.join(folder, rc_run.LOCK_FILE)
        try:
            if (
                os.path.samefile(folder, keep)
                or os.path.islink(folder)
                or os.listdir(folder) != [rc_run.LOCK_FILE]
                or time.time() - os.lstat(lock_path).st_mtime < ABANDONED_AFTER_S
            ):
                continue
            fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: a live process holds it
                holder = os.pread(fd, 300, 0).decode(errors="replace")
                if LOCK_TEXT.fullmatch(holder) and os.listdir(folder) == [rc_run.LOCK_FILE]:
                    os.unlink(lock_path)
                    os.rmdir(folder)
                    removed.append(folder)
            finally:
                os.close(fd)
        except OSError:  # not a folder, gone meanwhile, held, not ours to remove
            continue
    return removed


def claim_run_dir(run_dir: str, args, host: rc_run.HostGroup, main: bool) -> tuple[rc_run.RunLock | None, bool]:
    """Before any rank writes to the run folder: the main process checks it (check_run_dir: an existing run that
    must not be touched is refused before it gets a lock file), takes its lock (rc_run.RunLock), checks it again now
    that no other process can change it (two fresh starts of one name cannot both pass), and on --resume checks the
    newest checkpoint (check_resume: complete and intact; its settings later, agree_settings). A folder whose run ended
    before its first step (ended_before_training) is taken over and emptied, as --overwrite would, and the folders of
    starts killed before they wrote anything are removed beside it (remove_abandoned_claims). Every rank learns the
    outcome: a refusal raises RunError on each. Returns (the lock, held by the main process, None on the others;
    whether the folder must be emptied). Here rather than in rc_run because a resume's claim needs the checkpoint."""
    lock, replace, error = None, False, None
    if main:
        try:
            check_run_dir(run_dir, args.resume, args.overwrite, host.world, args.max_staleness)
            lock = rc_run.RunLock(run_dir)
            replace = check_run_dir(run_dir, args.resume, args.overwrite, host.world, args.max_staleness)
            if args.resume:
                check_resume(run_dir, args)
            elif replace and not args.overwrite:
                print(f"run folder {run_dir!r}: its last run ended before its first step; starting afresh", flush=True)
            for folder in remove_abandoned_claims(os.path.dirname(run_dir) or ".", run_dir):
                print(f"removed {folder!r}: a run killed before it wrote anything (only its lock file)", flush=True)
        except (ValueError, FileNotFoundError, FileExistsError) as e:
            error = str(e)
        except OSError as e:
            error = str(rc_run.io_fault(e, "claiming the run folder", run_dir))
    errors = [e for e in host.gather(error) if e]
    if errors:
        raise rc_run.RunError(errors[0])
    return lock, replace


# ---------------------------------------------------------------------------------------------
# Loading a resume, then taking the run folder over
# ---------------------------------------------------------------------------------------------
def _describe(e: BaseException) -> str:
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:  # a CheckpointException: the first rank's own exception
        first = next(iter(failures.values()))
        e = first[0] if isinstance(first, tuple) else first
    if isinstance(e, OSError) and e.errno in rc_run.FILE_FAULTS:
        return rc_run.FILE_FAULTS[e.errno]
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def _loaded(path: str, load):
    """load(), which reads `path`: any failure (missing, unreadable, not what was written) becomes a RunError naming
    it."""
    try:
        return load()
    except (KeyboardInterrupt, SystemExit, rc_run.RunError):
        raise
    except BaseException as e:  # torch's CheckpointException is a BaseException
        raise rc_run.RunError(f"{path} cannot be loaded ({_describe(e)})") from e


@dataclasses.dataclass
class Resumed:
    """What a resume loaded and checked: the checkpoint, the first step to run, the counters, this rank's batches in
    flight ({step: Result}) and RNG states (for set_rng)."""

    path: str
    start_step: int
    counters: dict
    in_flight: dict
    rng: dict
    replay: list
    kept_versions: dict | None = None
    carried: list | None = None  # --partial-rollout: the unfinished responses (rc_rollout.PartialRollouts.state)


def load_resume(
    run_dir: str, model, optimizer, scheduler, accelerator, *, host: rc_run.HostGroup, counters: dict, args
) -> Resumed:
    """Load and check everything a resume needs from the newest checkpoint (the main process checked its files and
    settings: check_resume), writing nothing: the model and optimizer (DCP, resharded onto this run's ranks; every
    weight finite), the scheduler, this rank's batches in flight (one for each of the next k steps the run will take,
    so a continued run samples nothing with another version than the uninterrupted one), its RNG states. A fault on
    any rank raises RunError on every rank. commit_resume then truncates the logs and rewrites config.yaml."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.tensor import DTensor

    rank, error, resumed = accelerator.process_index, None, None
    try:
        ckpt = checkpoint_dirs(run_dir)[-1]
        state = _read_json(os.path.join(ckpt, "trainer_state.json"))
        model_state, optim_state = get_state_dict(model, optimizer)  # the layout to load into (creates Adam's state)
        both = {"model": model_state, "optim": optim_state}
        _loaded(os.path.join(ckpt, "state"), lambda: dcp.load(both, checkpoint_id=os.path.join(ckpt, "state")))
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
        for name, t in model.state_dict().items():
            t = t.to_local() if isinstance(t, DTensor) else t
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise rc_run.RunError(
                    f"{os.path.join(ckpt, 'state')}: the weight {name} is not finite (NaN or inf): the run had "
                    f"diverged when it was written, or it is damaged; resume from an earlier checkpoint"
                )
        file = os.path.join(ckpt, "scheduler.pt")
        _loaded(file, lambda: scheduler.load_state_dict(torch.load(file, weights_only=False)))
        in_flight, rng = load_in_flight(ckpt, rank), load_rng(ckpt, rank)
        replay = load_replay(ckpt, rank) if args.replay_window else []
        kept = load_kept_versions(ckpt) if args.mismatch_split or args.prox_logp == "sampling" else None
        carried = load_carried(ckpt, rank) if args.partial_rollout else None
        start = state["step"] + 1
        missing = [t for t in range(start, min(start + args.max_staleness, args.num_steps)) if t not in in_flight]
        if missing:
            t = missing[0]
            raise rc_run.RunError(
                f"--resume: {ckpt} holds no batch in flight for step {t}, which the uninterrupted run samples with "
                f"version {t - args.max_staleness}: it ended a run, written by an rc_train.py that kept no batch past "
                f"a run's end (checkpoints with checksums keep them), so the run cannot be continued exactly past "
                f"step {start - 1}; start a new one"
            )
        lacking = [k for k in counters if k not in state]
        if lacking:
            raise rc_run.RunError(f"{os.path.join(ckpt, 'trainer_state.json')} lacks {lacking[0]}")
        resumed = Resumed(ckpt, start, {k: state[k] for k in counters}, in_flight, rng, replay, kept, carried)
    except rc_run.RunError as e:
        error = str(e)
    errors = [e for e in host.gather(error) if e]
    if errors:
        raise rc_run.RunError(errors[0])
    return resumed


def load_in_flight(path: str, rank: int) -> dict:
    """The batches this rank had in flight when the checkpoint was written ({step: Result}; empty at k = 0, and for
    a checkpoint written before asynchronous rollout existed, which has no such file)."""
    file = os.path.join(path, f"in_flight_rank{rank}.pt")
    if not os.path.isfile(file):
        return {}
    batches = _loaded(file, lambda: torch.load(file, weights_only=False))
    ok = isinstance(batches, dict) and all(
        isinstance(t, int) and isinstance(r, (tuple, list)) and len(r) >= 4 and isinstance(r[0], int)
        for t, r in batches.items()
    )
    if not ok:
        raise rc_run.RunError(f"{file} cannot be loaded (not the batches in flight a checkpoint writes)")
    return batches


def load_kept_versions(path: str) -> dict:
    """The weights kept by version when the checkpoint was written (rc_rollout.KeptVersions.weights), checked."""
    file = os.path.join(path, "kept_versions.pt")
    if not os.path.isfile(file):
        raise rc_run.RunError(f"{path} holds no kept versions ({os.path.basename(file)}) for this --mismatch-split run")
    kept = _loaded(file, lambda: torch.load(file, weights_only=True))
    ok = isinstance(kept, dict) and all(isinstance(v, int) and isinstance(w, dict) for v, w in kept.items())
    if not ok:
        raise rc_run.RunError(f"{file} cannot be loaded (not the kept versions a checkpoint writes)")
    return kept


def load_replay(path: str, rank: int) -> list:
    """This rank's replay buffer when the checkpoint was written (rc_rollout.ReplayBuffer.state): [(step, version,
    train rows, groups of response tuples)], checked."""
    file = os.path.join(path, f"replay_rank{rank}.pt")
    if not os.path.isfile(file):
        raise rc_run.RunError(f"{path} holds no replay buffer ({os.path.basename(file)}) for this --replay-window run")
    entries = _loaded(file, lambda: torch.load(file, weights_only=False))
    ok = isinstance(entries, list) and all(
        isinstance(e, tuple) and len(e) == 4 and isinstance(e[0], int) and len(e[2]) == len(e[3]) for e in entries
    )
    if not ok:
        raise rc_run.RunError(f"{file} cannot be loaded (not the replay buffer a checkpoint writes)")
    return entries


def load_carried(path: str, rank: int) -> list:
    """This rank's unfinished responses when the checkpoint was written (rc_rollout.PartialRollouts.state): [[row,
    prompt, seed keys, [[token ids, log mu, versions, finished], ...]], ...], checked."""
    file = os.path.join(path, f"partial_rank{rank}.pt")
    if not os.path.isfile(file):
        name = os.path.basename(file)
        raise rc_run.RunError(f"{path} holds no unfinished responses ({name}) for this --partial-rollout run")
    groups = _loaded(file, lambda: torch.load(file, weights_only=False))
    ok = isinstance(groups, list) and all(
        isinstance(g, list) and len(g) == 4 and all(len(r) == 4 and len(r[0]) == len(r[1]) == len(r[2]) for r in g[3])
        for g in groups
    )
    if not ok:
        raise rc_run.RunError(f"{file} cannot be loaded (not the unfinished responses a checkpoint writes)")
    return groups


def load_rng(path: str, rank: int) -> dict:
    """This rank's RNG states from the checkpoint (python, numpy, torch), checked and not yet set (set_rng)."""
    file = os.path.join(path, f"rng_rank{rank}.pt")
    rng = _loaded(file, lambda: torch.load(file, weights_only=False))
    if not (isinstance(rng, dict) and {"python", "numpy", "torch"} <= set(rng)):
        raise rc_run.RunError(f"{file} cannot be loaded (not the RNG states a checkpoint writes)")
    return rng


def set_rng(rng: dict) -> None:
    """Set the global generators (rc_rollout.start_engine keeps them as they were when the engine starts)."""
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])


def restore_rng(path: str, rank: int) -> None:
    set_rng(load_rng(path, rank))


def truncate_metrics(path: str, start_step: int, say=None) -> None:
    """On resume, drop the lines of the steps that will be run again (rewritten atomically). A torn line (cut
    mid-write by the kill that stopped the run: not JSON) is dropped, and a complete last line that lost its newline
    gets it back, so the next record starts a line of its own; `say` (the console) is told of each."""
    if not os.path.isfile(path):
        return
    say = say or (lambda _: None)
    with open(path, "rb") as f:
        lines = f.read().splitlines(keepends=True)
    keep = []
    for n, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            step = record["step"]
        except (ValueError, KeyError, TypeError):
            say(f"{path}: line {n} is torn ({len(line)} bytes, not a JSON record): dropped")
            continue
        if step < start_step:
            if not line.endswith(b"\n"):
                say(f"{path}: line {n} (step {step}) had no newline at its end: added")
                line += b"\n"
            keep.append(line)
    with rc_run.writing(path), open(path + ".tmp", "wb") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)


def commit_resume(run_dir: str, resumed: Resumed, accelerator, args, correction, **facts) -> None:
    """A resume that has loaded everything (load_resume) and started its engine takes the run folder over: the logs
    are cut back to the checkpoint (truncate_metrics: metrics.jsonl and eval_samples.jsonl by the main process, each
    rank its ranks/rank{r}.jsonl), config.yaml is rewritten (rc_run.write_config) and the leftovers of a pruning cut
    short are removed (remove_leftovers)."""
    main, rank = accelerator.is_main_process, accelerator.process_index
    say = (lambda m: print(m, flush=True)) if main else None
    if main:
        remove_leftovers(run_dir)
        for name in ("metrics.jsonl", "eval_samples.jsonl"):
            truncate_metrics(os.path.join(run_dir, name), resumed.start_step, say)
    truncate_metrics(os.path.join(run_dir, "ranks", f"rank{rank}.jsonl"), resumed.start_step, say)
    rc_run.write_config(run_dir, accelerator, args, correction, **facts)
    if main:
        print(f"resumed from {resumed.path} at step {resumed.start_step}")
