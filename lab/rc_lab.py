# Mismatch lab: sweep presets x one mismatch dial x seeds of rc_train.py, then tabulate and plot.
"""Does uncorrected ("naive") PPO degrade under training-inference mismatch while corrected presets do not?

    python -m lab.rc_lab sweep --out runs/lab --presets naive,decoupled_token_is,bypass_ppo_clip \\
        --dial rollout_weight_noise --levels 0,0.1,0.3 --seeds 1,2,3 --jobs 2 --steps 40 -- --eval-every 10
    python -m lab.rc_lab report runs/lab --reward-level 0.5      # summary.md/.csv, reward/k3/alpha/is_hist PNGs
    python -m lab.rc_lab export runs/lab lab/my_sweep             # the compact form (below) + report: committable

`--dial mismatch` sweeps several dials at once: each level is `none` or FIELD=VALUE[+FIELD=VALUE] of rc_train.py
(`--levels none,rollout_dtype=bfloat16,rollout_weight_quant=int4`); a preset entry may add correction fields
(`naive+rollout_token_veto_threshold=1e-4`) or other Args fields (`bypass_ppo_clip+kl_coef=0.05`). An MoE sweep
(`-- --model tiny-moe`, levels of rollout_dtype and moe_router_scale) reads each level against the float32-engine level
of the same router scale (MOE_RULE, reference_level) and each `P+routing_replay=r3` arm against `P`. A split sweep
(`-- --mismatch-split`, arms `P+prox_logp=sampling|loglinear` beside `P`) reads the staleness share of alpha_1 at each
level and each cheaper pi_old against `P` (SPLIT_RULE, split_verdicts). A --max-staleness sweep started with
`--rule paired` (kept in sweep.json; without it, `standard`: STALENESS_RULE) reads each hold and repair by the margin
and the paired interval over seeds together (PAIRED_STALENESS_RULE, paired_staleness_verdicts). Runs trained with
--dump-log-ratio-every also get the length lab: length.md/.csv, length_law.png (chi2_seq against (1 + chi2_token)^T -
1, ESS of token vs sequence weights) and
length_trap.png (rejection rate of a sequence-sum gate vs Geo-RS), per response-length bin.

Each run is `rc_train.py --output-dir OUT --run-name PRESET__DIAL=LEVEL__sSEED --rc.preset PRESET --seed SEED
--DIAL LEVEL --num-steps STEPS EXTRA...` (OMP_NUM_THREADS=1), its output in OUT/RUN_NAME.log. A run whose
metrics.jsonl already holds steps 0..STEPS-1 is skipped, so an interrupted sweep resumes; an incomplete run
folder is re-run with --overwrite. A cell rc_train.py refuses to start (its own checks, asked before anything
starts: refused_cells) is not launched: sweep.json and the report list it with the trainer's reason. sweep.json lists
every invocation of the sweep in its folder (`invocations`: start, end, command line, load average at start, runs
done; run_sweep). The alpha plot shows the estimates of the
three-policy TRPO bound (docs/corrections.md §12.6): alpha_0 = D_TV(pi_old, pi_theta) ~ `actor/tv_update`,
alpha_1 = D_TV(mu, pi_old) ~ `rollout_corr/tv_mismatch` (in bypass presets the latter estimates beta = D_TV(mu,
pi_theta) instead and tv_update is not logged; see rc_core.compute_rollout_correction_and_rejection_mask).

`report` reads a sweep folder in either of two forms (load_sweep):
* as `sweep` writes it: sweep.json, RUN.log and each run's rc_train.py folder (RUN/config.yaml, RUN/metrics.jsonl,
  RUN/log_ratio/step_N.npy and RUN/log_ratio/lengths/step_N.npy when dumped);
* the compact form `export` writes, a few files that regenerate every table and plot: sweep.json; runs.jsonl.gz, one
  JSON line per run {"name", "config": config.yaml text, "metrics": the metrics.jsonl records cut down to
  EXPORT_KEYS}; log_ratio.npz, every dump exactly as dumped (dtype and values), keyed RUN/step_N and
  RUN/lengths/step_N (N zero-padded to 6 digits); and the report's own files. No absolute path of the machine is
  kept: in sweep.json and the configs, paths are relative to the repository root (`portable`).
"""

from __future__ import annotations

import argparse
import csv
import functools
import glob
import gzip
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor, as_completed

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from tqdm import tqdm

from rc_plot import load_metrics, run_series

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
# The trainer each run executes; RC_LAB_TRAIN points it elsewhere (tests use a tiny fake trainer).
RC_TRAIN = os.environ.get("RC_LAB_TRAIN", os.path.join(ROOT, "rc_train.py"))
SWEEP_FILE = "sweep.json"
LAST_N = 10  # final reward = mean reward/mean over the last LAST_N steps
DASH = "–"  # shown for anything that could not be computed
# Flags the runner sets itself; passing them again after `--` would silently change the sweep.
RESERVED = ("--output-dir", "--run-name", "--rc.preset", "--seed", "--num-steps", "--overwrite", "--resume")


class LabError(Exception):
    """Bad user input: printed as `rc_lab: error: ...`, exit code 2."""


# ---------------------------------------------------------------------------------------------
# Sweep
# ---------------------------------------------------------------------------------------------
MISMATCH = "mismatch"  # pseudo-dial whose levels name their own flags: `none` or FIELD=VALUE[+FIELD=VALUE...]


def run_name(preset: str, dial: str, level: str, seed: int) -> str:
    return f"{preset}__{level if dial == MISMATCH else dial + '=' + level}__s{seed}"


def _field_flags(text: str, what: str, spaces: list[tuple[str, set | None, set]]) -> list[str]:
    """`FIELD=VALUE[+FIELD=VALUE...]` -> rc_train.py flags. Each FIELD is looked up in `spaces`, a list of (flag
    prefix, known field names or None = anything, boolean field names), first match wins: `--PREFIXfield-name VALUE`,
    or for a boolean field tyro's `--PREFIXfield-name` / `--PREFIXno-field-name` (VALUE true/false)."""
    flags = []
    for part in text.split("+"):
        field, sep, value = part.partition("=")
        if not sep or not field.isidentifier() or not value:
            raise LabError(f"{what}: {part!r} in {text!r} is not FIELD=VALUE")
        space = next(((p, b) for p, known, b in spaces if known is None or field in known), None)
        if space is None:
            raise LabError(f"{what}: {field!r} in {text!r} is not an rc_train.py field")
        prefix, bools = space
        name = field.replace("_", "-")
        if field in bools:
            if value.lower() not in ("true", "false"):
                raise LabError(f"{what}: {field!r} is a switch: true or false, got {value!r}")
            flags.append("--" + prefix + ("" if value.lower() == "true" else "no-") + name)
        else:
            flags += ["--" + prefix + name, value]
    return flags


def _trainer_fields() -> tuple[set, set, set] | tuple[None, None, set]:
    """(Args fields, CorrectionArgs fields, their boolean fields) of the real trainer, or (None, None, set()) when
    RC_LAB_TRAIN points elsewhere."""
    if os.path.abspath(RC_TRAIN) != os.path.join(ROOT, "rc_train.py"):
        return None, None, set()
    import dataclasses

    import rc_config
    import rc_train

    args, rc = dataclasses.fields(rc_train.Args), dataclasses.fields(rc_config.CorrectionArgs)
    bools = {f.name for f in (*args, *rc) if f.type in (bool, "bool")}
    return {f.name for f in args}, {f.name for f in rc}, bools


def preset_flags(preset: str, rc_fields: set | None = None, fields: set | None = None, bools=frozenset()) -> list[str]:
    """A preset entry `NAME` or `NAME+FIELD=VALUE...` -> its rc_train.py flags. A FIELD is a correction field on top
    of the preset (`naive+rollout_token_veto_threshold=1e-4` -> --rc.rollout-token-veto-threshold) or, when it is
    not one, an Args field (`bypass_ppo_clip+kl_coef=0.05+kl_is_corrected=true` -> --kl-coef 0.05
    --kl-is-corrected): one row of the table may be an objective, a mask or a loss term."""
    name, _, rest = preset.partition("+")
    if not rest:
        return ["--rc.preset", name]
    spaces = [("rc.", rc_fields, bools)] if rc_fields is None else [("rc.", rc_fields, bools), ("", fields, bools)]
    return ["--rc.preset", name] + _field_flags(rest, "--presets", spaces)


def level_flags(dial: str, level: str, fields: set | None = None, bools=frozenset()) -> list[str]:
    """The rc_train.py flags of one dial level: `--DIAL LEVEL`, or for the mismatch pseudo-dial the level's own
    FIELD=VALUE pairs (`none`: no flag, the zero-mismatch level)."""
    if dial != MISMATCH:
        return ["--" + dial.replace("_", "-"), level]
    return [] if level == "none" else _field_flags(level, "--levels", [("", fields, bools)])


def _split(text: str, what: str) -> list[str]:
    items = [s.strip() for s in text.split(",")]
    if not text.strip() or any(not s for s in items):
        raise LabError(f"--{what}: empty list or empty item in {text!r}")
    dup = sorted({s for s in items if items.count(s) > 1})
    if dup:
        raise LabError(f"--{what}: duplicate value(s) {', '.join(dup)} in {text!r}")
    return items


def _plants(flags: list[str]) -> bool:
    """The flags set --rollout-corrupt-prob above 0 (a value the trainer would refuse counts as not)."""
    flag = "--rollout-corrupt-prob"
    try:
        return flag in flags and float(flags[flags.index(flag) + 1]) > 0
    except (IndexError, ValueError):
        return False


def build_spec(args: argparse.Namespace, extra: list[str]) -> dict:
    """Validate the sweep arguments (nothing is started or created) and return the sweep spec."""
    import rc_core  # imports torch: only needed here

    presets = _split(args.presets, "presets")
    bad = [p for p in presets if p.partition("+")[0] not in rc_core.PRESET_NAMES]
    if bad:
        raise LabError(f"unknown preset(s) {', '.join(bad)}; known: {', '.join(rc_core.PRESET_NAMES)}")
    fields, rc_fields, bools = _trainer_fields()
    dial_flag = "--" + args.dial.replace("_", "-")
    if (
        not args.dial.isidentifier()
        or dial_flag in RESERVED
        or (fields is not None and args.dial != MISMATCH and args.dial not in fields)
    ):
        raise LabError(
            f"--dial must be an rc_train.py Args field name like rollout_weight_noise (not one the "
            f"sweep sets itself) or `{MISMATCH}`, got {args.dial!r}"
        )
    levels = _split(args.levels, "levels")
    level_flags_of = {lv: level_flags(args.dial, lv, fields, bools) for lv in levels}
    preset_flags_of = {p: preset_flags(p, rc_fields, fields, bools) for p in presets}
    swept = {f for fl in [*level_flags_of.values(), *preset_flags_of.values()] for f in fl if f.startswith("--")}
    clash = sorted(f for f in swept if f in RESERVED and f != "--rc.preset")
    if clash:
        raise LabError(f"--levels/--presets set {', '.join(clash)}, which the sweep sets itself")
    bad = [v for v in levels if "/" in v or os.sep in v or any(c.isspace() for c in v)]
    if bad:
        raise LabError(f"--levels: value(s) {', '.join(bad)} cannot be part of a run folder name")
    try:
        seeds = [int(s) for s in _split(args.seeds, "seeds")]
    except ValueError as e:
        raise LabError(f"--seeds must be integers: {e}") from None
    if args.jobs < 1:
        raise LabError(f"--jobs must be >= 1, got {args.jobs}")
    if args.steps < 1:
        raise LabError(f"--steps must be >= 1, got {args.steps}")
    if args.rule != "standard" and args.dial != STALENESS_DIAL:
        raise LabError(f"--rule {args.rule} reads a --dial {STALENESS_DIAL} sweep only (PAIRED_STALENESS_RULE)")
    clash = [f for f in extra if f.split("=")[0] in RESERVED + tuple(swept)]
    if clash:
        raise LabError(f"extra flag(s) {', '.join(clash)} are set by the sweep itself")
    # The real trainer's default --max-staleness is 1 on a CPU; a sweep measures against the synchronous loop unless
    # its dial, a level or an extra flag sets the bound.
    set_k = "--max-staleness" in swept or any(f.split("=")[0] == "--max-staleness" for f in extra)
    synchronous = [] if fields is None or set_k else ["--max-staleness", "0"]
    # On a GPU, --rollout-corrupt-prob > 0 runs vLLM's V1 model runner (rc_rollout.start_engine), whose sampler is not
    # the default V2's: when some cell plants tokens, every cell runs V1, so the levels differ by the dial alone.
    planted = any(map(_plants, [*level_flags_of.values(), *preset_flags_of.values()]))
    v1_runner = ["--vllm-v1-runner"] if fields is not None and planted and "--vllm-v1-runner" not in extra else []
    out, runs = os.path.abspath(args.out), []
    for preset in presets:
        for level in levels:
            for seed in seeds:
                name = run_name(preset, args.dial, level, seed)
                cmd = [
                    sys.executable,
                    RC_TRAIN,
                    "--output-dir",
                    out,
                    "--run-name",
                    name,
                    *preset_flags_of[preset],
                    "--seed",
                    str(seed),
                    *level_flags_of[level],
                    "--num-steps",
                    str(args.steps),
                    *synchronous,
                    *v1_runner,
                    *extra,
                ]
                runs.append({"name": name, "preset": preset, "level": level, "seed": seed, "cmd": cmd})
    refused = refused_cells(runs, presets, levels) if fields is not None else []
    skip = {(c["preset"], c["level"]) for c in refused}
    runs = [r for r in runs if (r["preset"], r["level"]) not in skip]
    return {
        "presets": presets,
        "dial": args.dial,
        "levels": levels,
        "seeds": seeds,
        "steps": args.steps,
        "extra": list(extra),
        "rule": args.rule,
        "jobs": args.jobs,
        "trainer": RC_TRAIN,
        "refused": refused,
        "runs": runs,
    }


# rc_train.py's defaults on a GPU when neither --config nor --model is given (the path its __main__ passes parse_cli).
TRAINER_GPU_CONFIG = os.path.join(ROOT, "configs", "gsm8k_qwen0.5b_bypass.yaml")


def trainer_refusal(flags: list[str]) -> str | None:
    """The one line with which rc_train.py would refuse to start with `flags`, or None when it would start: its own
    parse (rc_config.parse_cli, --config defaults included) and the checks it runs before the run folder exists
    (resolve_max_staleness, validate_args, build_correction_config, check_prox_logp; one process). Nothing starts:
    no engine, no model. The checks that need the model (the kept versions' memory) or the launcher are not run.
    Flags rc_train.py cannot parse are bad input (LabError), not a refusal."""
    import unittest.mock

    import torch

    import rc_config
    import rc_run
    import rc_train

    try:
        with unittest.mock.patch.object(sys, "argv", [RC_TRAIN, *flags]):
            args = rc_config.parse_cli(rc_train.Args, rc_train.load_yaml_defaults, TRAINER_GPU_CONFIG)
    except SystemExit as e:  # tyro printed its message above
        said = f": {e.code}" if isinstance(e.code, str) else " (its message above)"
        raise LabError(f"rc_train.py cannot parse the flags {' '.join(flags)}{said}") from None
    try:
        run_dir = os.path.join(args.output_dir, args.run_name or "")
        args.max_staleness = rc_config.resolve_max_staleness(args, torch.cuda.is_available(), run_dir)
        rc_config.validate_args(args, 1)
        rc_config.check_prox_logp(args, rc_config.build_correction_config(args.rc))
    except rc_run.REFUSALS as e:
        return str(e)
    return None


def refused_cells(runs: list[dict], presets: list[str], levels: list[str]) -> list[dict]:
    """The cells (preset, level) rc_train.py refuses to start (trainer_refusal of each cell's first run), in sweep
    order: [{preset, level, reason}]. A sweep skips them, records them in sweep.json and lists them in its report:
    a design may hold a cell the trainer cannot run (`--prox-logp sampling` at k = 0 without replay). A preset or a
    level the trainer refuses everywhere is bad input (LabError with the trainer's reason): nothing of it would run."""
    refused, seen = [], set()
    for run in runs:
        if (run["preset"], run["level"]) not in seen:
            seen.add((run["preset"], run["level"]))
            reason = trainer_refusal(run["cmd"][2:])
            if reason is not None:
                refused.append({"preset": run["preset"], "level": run["level"], "reason": reason})
    for key, names, width in (("preset", presets, len(levels)), ("level", levels, len(presets))):
        for name in names:
            cells = [c for c in refused if c[key] == name]
            if len(cells) == width:
                raise LabError(f"rc_train.py refuses every cell of {key} {name!r}: {cells[0]['reason']}")
    return refused


def refused_keys(sweep: dict) -> set[tuple[str, str]]:
    """(preset, level) of the cells the sweep did not launch because rc_train.py refuses them (refused_cells)."""
    return {(c["preset"], c["level"]) for c in sweep.get("refused", [])}


def eval_key(records: list[dict]) -> str:
    """The evaluation metric of a run: eval/accuracy_strict (every task now), or eval/accuracy in runs written
    before the addition task reported strict/flexible accuracy (the committed one-token sweeps)."""
    return "eval/accuracy" if any("eval/accuracy" in r for r in records) else "eval/accuracy_strict"


def is_complete(run_dir: str, steps: int) -> bool:
    """True if run_dir/metrics.jsonl holds exactly the steps 0..steps-1 (a finished run of this length)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            records = load_metrics(run_dir)
    except (FileNotFoundError, ValueError):
        return False
    return {int(r["step"]) for r in records} - {-1} == set(range(steps))  # -1: the evaluation before training


def launch(cmd: list[str], log_path: str) -> int:
    """Run one trainer command with OMP_NUM_THREADS=1, stdout+stderr to log_path; return its exit code."""
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        with _LIVE_LOCK:
            if _STOP.is_set():  # Ctrl-C arrived while this run was queued
                return -2
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
            )
            _LIVE.add(proc)
        try:
            return proc.wait()
        finally:
            with _LIVE_LOCK:
                _LIVE.discard(proc)


_LIVE: set = set()  # running trainer processes, terminated on Ctrl-C
_LIVE_LOCK = threading.Lock()
_STOP = threading.Event()


def tail(path: str, n: int = 15) -> str:
    """The last n lines of a log file."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


def _load_average() -> list[float] | None:
    """The machine's 1-, 5- and 15-minute load averages (os.getloadavg; None where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def invocations(spec: dict) -> list[dict]:
    """The invocation records of a sweep.json (run_sweep appends one per `sweep` command). A sweep.json written
    before they were kept holds only its last invocation's `started` / `wall_time_s`: returned as one record marked
    `legacy` (earlier invocations of a resumed sweep are unknown); none at all: []."""
    if "invocations" in spec:
        return spec["invocations"]
    if "started" not in spec:
        return []
    return [
        {
            "started": spec["started"],
            "wall_time_s": spec.get("wall_time_s"),
            "legacy": "the last invocation only, from a sweep.json written before every invocation was recorded",
        }
    ]


def run_sweep(spec: dict, out: str, overwrite: bool = False, command: list[str] | None = None) -> int:
    """Run every run of `spec` under `out` with spec['jobs'] workers; return the number of failed runs. sweep.json
    keeps the spec, each run's status, and `invocations`: the records of the earlier invocations in `out` (a resumed
    sweep) plus one for this one: started and ended (local time with UTC offset), wall_time_s, the command line
    (`command`), the machine's load average at start (1, 5, 15 min) and its CPU count, and the runs skipped
    (complete), launched, done (ok), failed and left unfinished (interrupted) in it. `started` / `wall_time_s` at the
    top level are this invocation's, as before."""
    if os.path.isfile(os.path.join(out, RUNS_FILE)):  # report would read the exported runs, not the new folders
        raise LabError(f"{out!r} holds an exported sweep ({RUNS_FILE}); sweep into another folder")
    os.makedirs(out, exist_ok=True)
    _STOP.clear()
    sweep_path = os.path.join(out, SWEEP_FILE)
    earlier = []
    if os.path.isfile(sweep_path):
        with open(sweep_path) as f:
            old = json.load(f)
        earlier = list(invocations(old))
        if sweep_rule(old) != sweep_rule(spec):  # the reading rule is fixed before the runs
            raise LabError(f"{out!r} was swept under --rule {sweep_rule(old)}: resume it with the same --rule")
        if old.get("extra") != spec["extra"] and not overwrite:
            print(
                f"rc_lab: note: previous sweep used extra flags {old.get('extra')}; completed runs are kept "
                "(pass --overwrite to re-run them)",
                file=sys.stderr,
            )
    todo = []
    for run in spec["runs"]:
        run_dir = os.path.join(out, run["name"])
        if not overwrite and is_complete(run_dir, spec["steps"]):
            run["status"] = "skipped"
            continue
        if os.path.isdir(run_dir):  # incomplete (or --overwrite): rc_train replaces the folder
            run["cmd"] = run["cmd"] + ["--overwrite"]
        run["status"] = "pending"
        todo.append(run)
    t0 = time.time()
    spec["started"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    invocation = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "ended": None,  # until this invocation ends (a sweep.json with None here: killed, or still running)
        "wall_time_s": None,
        "command": command,
        "load_average_at_start": _load_average(),
        "cpus": os.cpu_count(),
        "runs_skipped": len(spec["runs"]) - len(todo),
        "runs_launched": len(todo),
        "runs_done": 0,
        "runs_failed": 0,
        "runs_unfinished": len(todo),
    }
    spec["invocations"] = [*earlier, invocation]
    _write_json(sweep_path, spec)

    def work(run):
        start = time.time()
        code = launch(run["cmd"], os.path.join(out, run["name"] + ".log"))
        if code == 0 and not is_complete(os.path.join(out, run["name"]), spec["steps"]):
            code = -1  # the trainer exited cleanly but its metrics.jsonl is not a full run
        run.update(returncode=code, seconds=round(time.time() - start, 1), status="ok" if code == 0 else "failed")
        return run

    n_skip = len(spec["runs"]) - len(todo)
    bar = tqdm(total=len(spec["runs"]), initial=n_skip, desc="rc_lab sweep", dynamic_ncols=True)
    bar.set_postfix(skipped=n_skip, failed=0)
    failed = []
    pool = ThreadPoolExecutor(max_workers=spec["jobs"])
    try:
        for fut in as_completed([pool.submit(work, r) for r in todo]):
            run = fut.result()
            if run["status"] == "failed":
                failed.append(run)
                bar.write(f"rc_lab: FAILED {run['name']} (exit {run['returncode']})")
            bar.update(1)
            bar.set_postfix(skipped=n_skip, failed=len(failed))
    except KeyboardInterrupt:  # stop queued runs, terminate the running ones (only the processes we started)
        with _LIVE_LOCK:
            _STOP.set()
            for proc in _LIVE:
                proc.terminate()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
        spec["wall_time_s"] = round(time.time() - t0, 1)
        statuses = [r["status"] for r in todo]
        invocation.update(
            ended=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            wall_time_s=spec["wall_time_s"],
            runs_done=statuses.count("ok"),
            runs_failed=statuses.count("failed"),
            runs_unfinished=statuses.count("pending"),
        )
        _write_json(sweep_path, spec)
    for run in failed:
        log = os.path.join(out, run["name"] + ".log")
        print(
            f"\nrc_lab: run {run['name']} failed (exit {run['returncode']}); last lines of {log}:\n{tail(log)}",
            file=sys.stderr,
        )
    print(
        f"rc_lab: {len(todo) - len(failed)} ran, {n_skip} skipped, {len(failed)} failed in {spec['wall_time_s']:.0f}s"
    )
    return len(failed)


def _write_json(path: str, obj) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


# ---------------------------------------------------------------------------------------------
# Sweep data: the run folders of a sweep, or the compact form of `export`
# ---------------------------------------------------------------------------------------------
RUNS_FILE = "runs.jsonl.gz"  # compact form: one JSON line per run, {"name", "config", "metrics"}
DUMPS_FILE = "log_ratio.npz"  # compact form: every log-ratio dump, keyed RUN/step_N and RUN/lengths/step_N
# The metrics `report` reads, plus the chi2 diagnostics and the step time: all that `export` keeps of metrics.jsonl.
EXPORT_KEYS = (
    "step",
    "reward/mean",
    "eval/accuracy",
    "eval/accuracy_strict",
    "eval/accuracy_flexible",
    "response_length/mean",
    "actor/grad_norm",
    "actor/tv_update",
    "rollout_corr/tv_mismatch",
    "rollout_corr/k3_kl",
    "rollout_corr/chi2_token",
    "rollout_corr/chi2_seq",
    "rollout_corr/rollout_rs_masked_fraction",
    "rollout_corr/rollout_is_veto_fraction",
    "rollout_corr/rollout_is_catastrophic_token_fraction",
    "timing/step_s",
    "rollout/staleness_mean",
    "rollout/dropped_samples",
    "rollout_corr/training_ppl",
    "rollout_corr/routing_agreement",
    "rollout_corr/routing_flip_token_fraction",
    "rollout_corr/unreplayed_k3_kl",
    "rollout_corr/unreplayed_tv_mismatch",
    "rollout_corr/numerics_tv",
    "rollout_corr/staleness_tv",
    "rollout_corr/numerics_k3_kl",
    "rollout_corr/staleness_k3_kl",
    "actor/opsm_seq_masked_fraction",
    "actor/opsm_neg_adv_seq_masked_fraction",
    "rollout_corr/rollout_m2_masked_fraction",
    "rollout/token_staleness_mean",
    "rollout/spanning_responses",
    "rollout/masked_stale_tokens",
    "timing/rollout_s",
    "rollout/replayed_fraction",
)


def read_spec(out: str) -> dict:
    """The sweep.json of `out` (LabError if it has none)."""
    path = os.path.join(out, SWEEP_FILE)
    if not os.path.isfile(path):
        raise LabError(f"no {SWEEP_FILE} in {out!r} (not a sweep folder)")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise LabError(f"{path}: not valid JSON ({e})") from None


def _npy_steps(folder: str) -> dict[int, np.ndarray]:
    """{N: array} of the folder's step_N.npy files, in step order."""
    paths = sorted(glob.glob(os.path.join(folder, "step_*.npy")))  # N is zero-padded: file order is step order
    return {int(os.path.basename(p)[5:-4]): np.load(p) for p in paths}


def read_run_folder(run_dir: str) -> dict:
    """What the lab keeps of one rc_train.py run folder: name, records (metrics.jsonl; None, with a note, if it has
    none), config (config.yaml text or None), log_ratio and lengths ({step: array as dumped} of log_ratio/ and
    log_ratio/lengths/)."""
    name = os.path.basename(os.path.normpath(run_dir))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            records = load_metrics(run_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"rc_lab: note: {name} left out ({e})", file=sys.stderr)
        records = None
    config = None
    if os.path.isfile(os.path.join(run_dir, "config.yaml")):
        with open(os.path.join(run_dir, "config.yaml")) as f:
            config = f.read()
    dumps = os.path.join(run_dir, "log_ratio")
    return {
        "name": name,
        "records": records,
        "config": config,
        "log_ratio": _npy_steps(dumps),
        "lengths": _npy_steps(os.path.join(dumps, "lengths")),
    }


def read_compact(out: str) -> dict[str, dict]:
    """{run name: read_run_folder's dict} of a sweep in the compact form (RUNS_FILE, DUMPS_FILE if any run dumped)."""
    runs = {}
    with gzip.open(os.path.join(out, RUNS_FILE), "rt", encoding="utf-8") as f:
        for line in f:
            run = json.loads(line)
            if run["metrics"] is None:
                print(f"rc_lab: note: {run['name']} left out (no metrics.jsonl when exported)", file=sys.stderr)
            runs[run["name"]] = {
                "name": run["name"],
                "records": run["metrics"],
                "config": run["config"],
                "log_ratio": {},
                "lengths": {},
            }
    if os.path.isfile(os.path.join(out, DUMPS_FILE)):
        with np.load(os.path.join(out, DUMPS_FILE)) as npz:
            for key in npz.files:
                name, *lengths, step = key.split("/")  # RUN/step_N or RUN/lengths/step_N
                runs[name]["lengths" if lengths else "log_ratio"][int(step[5:])] = npz[key]
    return runs


def load_sweep(out: str) -> dict:
    """sweep.json of `out`, each run with read_run_folder's keys (records, config, log_ratio, lengths) read from its
    run folder, or from the compact form when `out` holds RUNS_FILE: the report reads both alike."""
    sweep = read_spec(out)
    compact = read_compact(out) if os.path.isfile(os.path.join(out, RUNS_FILE)) else None
    for run in sweep["runs"]:
        run.update(compact[run["name"]] if compact is not None else read_run_folder(os.path.join(out, run["name"])))
    return sweep


# An absolute path in a command line, a JSON text or a YAML text: at the start, after a space, `=` or a quote.
ABS_PATH = re.compile(r"""(?<![^\s="'])/[^\s="']+""")


def portable(text: str) -> str:
    """`text` with each absolute path made independent of the machine: relative to the repository root when inside it
    (`rc_train.py`, `runs/lab`, `.venv/bin/python`), else only its last component (a cache or scratch folder)."""

    def fix(match: re.Match) -> str:
        rel = os.path.relpath(match.group(), ROOT)
        return os.path.basename(match.group()) if rel.split(os.sep)[0] == os.pardir else rel

    return ABS_PATH.sub(fix, text)


def export(out: str, dest: str) -> list[str]:
    """Write the compact form (see the top) of the sweep in `out` into `dest`, then report there: a few files, small
    enough to commit, that regenerate their own tables and plots (`python -m lab.rc_lab report DEST`). Absolute paths in
    sweep.json and the configs become `portable`; metrics keep EXPORT_KEYS; dumps keep their dtype and values."""
    if os.path.abspath(dest) == os.path.abspath(out):
        raise LabError("export: DEST must differ from the sweep folder")
    spec, runs = read_spec(out), load_sweep(out)["runs"]
    os.makedirs(dest, exist_ok=True)
    _write_json(os.path.join(dest, SWEEP_FILE), json.loads(portable(json.dumps(spec))))
    with gzip.GzipFile(os.path.join(dest, RUNS_FILE), "wb", mtime=0) as f:  # mtime=0: same runs, same bytes
        for run in runs:
            metrics = (
                None if run["records"] is None else [{k: r[k] for k in EXPORT_KEYS if k in r} for r in run["records"]]
            )
            config = None if run["config"] is None else portable(run["config"])
            f.write((json.dumps({"name": run["name"], "config": config, "metrics": metrics}) + "\n").encode())
    dumps = {
        f"{run['name']}/{prefix}step_{step:06d}": array
        for run in runs
        for prefix, key in (("", "log_ratio"), ("lengths/", "lengths"))
        for step, array in run[key].items()
    }
    if dumps:
        np.savez_compressed(os.path.join(dest, DUMPS_FILE), **dumps)
    elif os.path.isfile(os.path.join(dest, DUMPS_FILE)):  # an earlier export's: not of this sweep
        os.remove(os.path.join(dest, DUMPS_FILE))
    return report(dest)


# ---------------------------------------------------------------------------------------------
# Report: numbers
# ---------------------------------------------------------------------------------------------
def final_reward(records: list[dict], last: int = LAST_N) -> float | None:
    """Mean `reward/mean` over the last `last` logged steps of one run (None if never logged)."""
    _, values = run_series(records, "reward/mean")
    return float(values[-last:].mean()) if values.size else None


def steps_to_reach(records: list[dict], level: float) -> int | None:
    """First step whose `reward/mean` >= level (None if never reached)."""
    steps, values = run_series(records, "reward/mean")
    hit = np.nonzero(values >= level)[0]
    return int(steps[hit[0]]) if hit.size else None


def reward_drop(records: list[dict], window: int = 3) -> float | None:
    """Collapse signature: peak of the `window`-step moving average of `reward/mean` minus its last value
    (0 for a run that ends at its best; large when reward falls after rising)."""
    smooth = _moving_average(records, "reward/mean", window)
    return None if smooth is None else float(smooth.max() - smooth[-1])


def ppl_rise(records: list[dict], window: int = 3) -> float | None:
    """Collapse signature: the largest rise of the `window`-step moving average of `rollout_corr/training_ppl` (the
    trainer's perplexity on the sampled responses) over its running minimum, as a ratio minus 1 (0 for a run whose
    perplexity never climbs back; a spike comes with collapse, docs/metrics.md)."""
    smooth = _moving_average(records, "rollout_corr/training_ppl", window)
    return None if smooth is None else float(np.max(smooth / np.minimum.accumulate(smooth)) - 1.0)


def _moving_average(records: list[dict], key: str, window: int) -> np.ndarray | None:
    """The `window`-step moving average of `key` over the logged steps (None with fewer than `window` of them)."""
    _, values = run_series(records, key)
    return np.convolve(values, np.ones(window) / window, mode="valid") if values.size >= window else None


def level_value(dial: str, level: str, field: str) -> str | None:
    """The value one dial level sets for the rc_train.py field `field` (None when it does not set it)."""
    flags, flag = level_flags(dial, level), "--" + field.replace("_", "-")
    return flags[flags.index(flag) + 1] if flag in flags else None


def planted_prob(dial: str, level: str) -> float | None:
    """The --rollout-corrupt-prob of a dial level (None when the sweep does not set it; 0 at the mismatch `none`)."""
    p = level_value(dial, level, "rollout_corrupt_prob")
    if p is not None:
        return float(p)
    return 0.0 if dial == MISMATCH and level == "none" else None


def expected_planted_rows(records: list[dict], p: float) -> float | None:
    """Mean over steps of 1 - (1 - p)^T, T = that step's `response_length/mean`: the share of responses holding at
    least one planted token, the veto's target. 1-(1-p)^T is concave in T, so with the mean length this is an
    upper bound of the exact share (Jensen)."""
    _, lengths = run_series(records, "response_length/mean")
    return float(np.mean(1.0 - (1.0 - p) ** lengths)) if lengths.size else None


def _mean_std(xs: list) -> tuple[float | None, float | None, int]:
    """(mean, sample std (ddof=1; None for one value), n) of the non-None values."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None, 0
    return float(np.mean(xs)), float(np.std(xs, ddof=1)) if len(xs) > 1 else None, len(xs)


def _series_stat(records: list[dict], key: str, fn) -> float | None:
    _, values = run_series(records, key)
    return float(fn(values)) if values.size else None


def _fraction(records: list[dict], key: str) -> float:
    """Mean over steps of `key`, a missing value counting as 0 (nothing masked)."""
    vals = [rec.get(key) for rec in records if rec.get("step", 0) >= 0]  # not the evaluation before training
    return float(np.mean([v if isinstance(v, (int, float)) and math.isfinite(v) else 0.0 for v in vals]))


def reference_level(sweep: dict, level: str) -> str:
    """The level a row is compared with: the first level; in a sweep whose levels set `moe_router_scale` (the MoE
    lab), the first level of the same router scale, so that a bf16 engine is read against the fp32 engine of the
    same model."""
    if sweep["dial"] != MISMATCH:
        return sweep["levels"][0]
    scale = level_value(MISMATCH, level, "moe_router_scale")
    return next(lv for lv in sweep["levels"] if level_value(MISMATCH, lv, "moe_router_scale") == scale)


def compared_levels(sweep: dict) -> list[str]:
    """The levels that are not their own reference, in sweep order: the ones the verdicts read."""
    return [lv for lv in sweep["levels"] if reference_level(sweep, lv) != lv]


PARTIAL_COLUMNS = (  # (summary column, metric): a run's mean over steps, then the mean over seeds (_seed_means)
    ("token_staleness", "rollout/token_staleness_mean"),
    ("spanning", "rollout/spanning_responses"),
    ("step_s", "timing/step_s"),
)
ROUTING_COLUMNS = (
    ("routing_agreement", "rollout_corr/routing_agreement"),
    ("flip_fraction", "rollout_corr/routing_flip_token_fraction"),
    ("alpha1_unreplayed", "rollout_corr/unreplayed_tv_mismatch"),
)


def _seed_means(recs: list, columns) -> dict:
    """{column: mean over seeds of each run's mean of the metric over its steps} for (column, metric) pairs."""
    return {name: _mean_std([_series_stat(x, key, np.mean) for x in recs])[0] for name, key in columns}


def summarise(sweep: dict, reward_level: float = 0.5) -> list[dict]:
    """One row per (preset, level) in sweep order with the summary statistics over seeds (None = missing)."""
    rows = []
    has_veto = any(
        r["records"] and any("rollout_corr/rollout_is_veto_fraction" in x for x in r["records"]) for r in sweep["runs"]
    )
    has_staleness = any(
        r["records"] and any("rollout/staleness_mean" in x for x in r["records"]) for r in sweep["runs"]
    )
    has_routing = any(
        r["records"] and any("rollout_corr/routing_agreement" in x for x in r["records"]) for r in sweep["runs"]
    )
    has_split = any(r["records"] and any(SPLIT_KEYS[1] in x for x in r["records"]) for r in sweep["runs"])
    partial = is_partial(sweep)
    refused = refused_keys(sweep)
    for preset in sweep["presets"]:
        for level in sweep["levels"]:
            if (preset, level) in refused:  # never launched: listed under the table (write_summary)
                continue
            recs = [
                r["records"] for r in sweep["runs"] if r["preset"] == preset and r["level"] == level and r["records"]
            ]
            rew, rew_std, _ = _mean_std([final_reward(x) for x in recs])
            evals = [_series_stat(x, eval_key(x), lambda v: v[-1]) for x in recs]
            acc, acc_std, n_acc = _mean_std(evals)
            reach = [s for s in (steps_to_reach(x, reward_level) for x in recs) if s is not None]
            maxes = {
                k: [m for m in (_series_stat(x, k, np.max) for x in recs) if m is not None]
                for k in ("rollout_corr/k3_kl", "actor/grad_norm")
            }
            rows.append(
                {
                    "preset": preset,
                    "level": level,
                    "n_seeds": len(recs),
                    "final_reward": rew,
                    "final_reward_std": rew_std,
                    "eval_acc": acc,
                    "eval_acc_std": acc_std,
                    "n_eval": n_acc,
                    "steps_to_reach": float(np.mean(reach)) if reach else None,
                    "reached": f"{len(reach)}/{len(recs)}",
                    "max_k3_kl": max(maxes["rollout_corr/k3_kl"], default=None),
                    "max_grad_norm": max(maxes["actor/grad_norm"], default=None),
                    "masked_fraction": float(
                        np.mean([_fraction(x, "rollout_corr/rollout_rs_masked_fraction") for x in recs])
                    )
                    if recs
                    else None,
                }
            )
            alphas = {
                k: _mean_std([_series_stat(x, k, np.mean) for x in recs])[0]
                for k in ("actor/tv_update", "rollout_corr/tv_mismatch")
            }
            rows[-1].update(
                alpha0=alphas["actor/tv_update"],
                alpha1=alphas["rollout_corr/tv_mismatch"],
                reward_drop=_mean_std([reward_drop(x) for x in recs])[0],
            )
            if has_staleness:  # the asynchronous mode's own columns (sweeps of --max-staleness)
                rows[-1].update(
                    staleness=_mean_std([_series_stat(x, "rollout/staleness_mean", np.mean) for x in recs])[0],
                    dropped=_mean_std([_series_stat(x, "rollout/dropped_samples", np.sum) for x in recs])[0],
                    ppl_rise=_mean_std([ppl_rise(x) for x in recs])[0],
                )
            if partial:  # partial-rollout sweeps (PARTIAL_RULE): each token's staleness, the mixture, the step time
                rows[-1].update(_seed_means(recs, PARTIAL_COLUMNS))
            if has_routing:  # MoE runs (docs/moe.md): the trainer's own routing against the engine's, unreplayed
                rows[-1].update(_seed_means(recs, ROUTING_COLUMNS))
            if has_split:  # --mismatch-split runs: the staleness share of alpha_1 (SPLIT_RULE)
                shares = [s for s in map(staleness_share, recs) if s is not None]
                rows[-1].update(
                    staleness_share=_mean_std(shares)[0],
                    staleness_share_min=min(shares, default=None),
                    staleness_share_max=max(shares, default=None),
                )
            if has_veto:
                rows[-1]["veto_fraction"] = (
                    float(np.mean([_fraction(x, "rollout_corr/rollout_is_veto_fraction") for x in recs]))
                    if recs
                    else None
                )
                rows[-1]["catastrophic_fraction"] = (
                    float(np.mean([_fraction(x, "rollout_corr/rollout_is_catastrophic_token_fraction") for x in recs]))
                    if recs
                    else None
                )
                p = planted_prob(sweep["dial"], level)
                if p is not None:
                    rows[-1]["expected_veto"] = _mean_std([expected_planted_rows(x, p) for x in recs])[0]
    for row in rows:  # compare with the same preset at its reference (zero-mismatch) level
        level = reference_level(sweep, row["level"])
        ref = next((r for r in rows if r["preset"] == row["preset"] and r["level"] == level), None)  # None: refused
        row["delta_eval_acc"], row["flag"] = None, DASH
        if row is ref:
            row["delta_eval_acc"], row["flag"] = (0.0, "ref") if ref["eval_acc"] is not None else (None, "ref")
        elif ref is not None and row["eval_acc"] is not None and ref["eval_acc"] is not None:
            row["delta_eval_acc"] = row["eval_acc"] - ref["eval_acc"]
            row["flag"] = "below" if clearly_below(row, ref) else ""
    return rows


def clearly_below(row: dict, ref: dict) -> bool:
    """The reading rule's test: `row`'s mean eval acc is more than max(2 x pooled std, 0.05) below `ref`'s, pooled std
    = sqrt(((n1-1)s1^2 + (n2-1)s2^2) / (n1+n2-2)) over the two rows' seeds (0 when n1+n2 <= 2)."""
    margin = rule_margin(row, ref)
    return margin is not None and ref["eval_acc"] - row["eval_acc"] > margin


def rule_margin(row: dict, ref: dict) -> float | None:
    """The reading rule's margin between two rows, max(2 x pooled std, 0.05) (clearly_below); None when either row
    has no eval acc."""
    if row["eval_acc"] is None or ref["eval_acc"] is None:
        return None
    dof = row["n_eval"] + ref["n_eval"] - 2
    pooled = (
        math.sqrt(
            (
                (row["n_eval"] - 1) * (row["eval_acc_std"] or 0) ** 2
                + (ref["n_eval"] - 1) * (ref["eval_acc_std"] or 0) ** 2
            )
            / dof
        )
        if dof > 0
        else 0.0
    )
    return max(2 * pooled, 0.05)


# ---------------------------------------------------------------------------------------------
# Report: the paired view (beside the reading rules, which it does not change)
# ---------------------------------------------------------------------------------------------
# The 0.975 quantile of Student's t with df = 1..30 degrees of freedom, the two-sided 95 % critical value, as tabled in
# the NIST/SEMATECH e-Handbook of Statistical Methods, section 1.3.6.7.2 "Critical Values of the Student's t
# Distribution" (column 0.975). scipy is not a dependency; tests/test_lab.py checks each value against a numerical
# integration of the t density.
T_975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
# what a paired comparison reads a row against (paired_comparisons)
PAIRED_KINDS = ("ref", "naive", "pick", "twin", "recompute")


def t_975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` >= 1 degrees of freedom (T_975); beyond 30, the value at 30, which
    is larger than the exact one (by under 4 %: the interval is then conservative)."""
    return T_975[min(df, len(T_975)) - 1]


def seed_evals(sweep: dict, preset: str, level: str) -> dict[int, float]:
    """{seed: final eval acc} of one cell of a loaded sweep (the value summarise averages; runs without it left out)."""
    out = {}
    for run in sweep["runs"]:
        if run["preset"] == preset and run["level"] == level and run["records"]:
            value = _series_stat(run["records"], eval_key(run["records"]), lambda v: v[-1])
            if value is not None:
                out[int(run["seed"])] = value
    return out


def paired_difference(a: dict[int, float], b: dict[int, float]) -> dict:
    """a - b paired by seed, over the seeds both hold: n_pairs, unpaired (seeds only one of them holds), delta (mean of
    the per-seed differences), sd (their sample std), half_width = t_975(n - 1) * sd / sqrt(n) and the 95 % interval
    delta -+ half_width (Student t; no interval below 2 pairs). Pure-Python float arithmetic (math.fsum), so the same
    bits on every CPU."""
    seeds = sorted(a.keys() & b.keys())
    out = dict(n_pairs=len(seeds), unpaired=len(a.keys() ^ b.keys()), delta=None, sd=None, half_width=None)
    out.update(ci_low=None, ci_high=None)
    if not seeds:
        return out
    d = [a[s] - b[s] for s in seeds]
    n = len(d)
    out["delta"] = mean = math.fsum(d) / n
    if n >= 2:
        sd = 0.0 if len(set(d)) == 1 else math.sqrt(math.fsum((x - mean) ** 2 for x in d) / (n - 1))
        half = t_975(n - 1) * sd / math.sqrt(n)
        out.update(sd=sd, half_width=half, ci_low=mean - half, ci_high=mean + half)
    return out


def paired_comparisons(rows: list[dict], sweep: dict) -> list[dict]:
    """Every comparison the report's table and verdicts make, as a paired difference over seeds (paired_difference of
    the row's eval acc minus the other's) with the rule's margin beside it. Kinds (PAIRED_KINDS): `ref`, each row
    against the same preset at its reference level (the Δ column and flag); in sweeps read across presets (staleness,
    replay, MoE; with a naive arm) `naive`, each corrected preset against naive at the same compared level (repair);
    in a replay sweep `pick`, each other corrected preset against REPLAY_PICK (clearly above it); in an MoE sweep
    `twin`, each R3 arm against its unreplayed twin (replay costs / pays); in a split sweep `recompute`, each cheaper
    pi_old arm against its recompute arm at the same level (SPLIT_RULE (2)). A cell the sweep did not launch (refused)
    is in no comparison."""
    by = {(r["preset"], r["level"]): r for r in rows}
    pairs = []  # (kind, row key, other key)
    for r in rows:
        ref = reference_level(sweep, r["level"])
        if ref != r["level"]:
            pairs.append(("ref", (r["preset"], r["level"]), (r["preset"], ref)))
    naive = next((p for p in sweep["presets"] if is_naive(p)), None)
    moe = is_moe(rows)
    if naive is not None and (sweep["dial"] == STALENESS_DIAL or sweep["dial"] in REPLAY_DIALS or moe):
        corrected = [p for p in sweep["presets"] if not is_naive(p)]
        for level in compared_levels(sweep):
            pairs += [("naive", (p, level), (naive, level)) for p in corrected]
            if sweep["dial"] in REPLAY_DIALS and REPLAY_PICK in corrected:
                pairs += [("pick", (p, level), (REPLAY_PICK, level)) for p in corrected if p != REPLAY_PICK]
            if moe:
                pairs += [
                    ("twin", (p, level), (p.removesuffix(REPLAY_ROUTING), level))
                    for p in sweep["presets"]
                    if p.endswith(REPLAY_ROUTING) and p.removesuffix(REPLAY_ROUTING) in sweep["presets"]
                ]
    if is_split(rows, sweep):
        pairs += [("recompute", (p, lv), (base, lv)) for p, base in cheaper_arms(sweep) for lv in sweep["levels"]]
    pairs = [x for x in pairs if x[1] in by and x[2] in by]
    pairs.sort(key=lambda x: PAIRED_KINDS.index(x[0]))  # stable: within a kind, sweep order
    evals = functools.lru_cache(maxsize=None)(lambda key: seed_evals(sweep, *key))
    return [
        {
            "kind": kind,
            "preset": key[0],
            "level": key[1],
            "against_preset": other[0],
            "against_level": other[1],
            **paired_difference(evals(key), evals(other)),
            "rule_margin": rule_margin(by[key], by[other]),
        }
        for kind, key, other in pairs
    ]


def _zero_side(c: dict) -> str:
    """Where 0 lies against a comparison's 95 % interval: `below 0` / `above 0` (the interval excludes 0) or
    `covers 0`."""
    if c["ci_low"] is None:
        return DASH
    return "below 0" if c["ci_high"] < 0 else "above 0" if c["ci_low"] > 0 else "covers 0"


def paired_lines(comparisons: list[dict], sweep: dict) -> list[str]:
    """The paired view of summary.md: its definition, one table row per comparison, and the sweep's minimum
    detectable effect (the range of the half-widths)."""
    if not comparisons:
        return ["Paired view: no comparison in this sweep (each row is its own reference)."]
    n = max(c["n_pairs"] for c in comparisons)
    uses = "no verdict uses it"
    if any(c["kind"] == "recompute" for c in comparisons):  # SPLIT_RULE (2) reads the intervals of these rows
        uses = "the verdicts of the cheaper π_old read its rows against the recompute arm, the others none"
    if is_gspo_moe(sweep):  # GSPO_MOE_RULE reads every verdict by the margin and the paired interval
        uses = "the GSPO rule's verdicts read its rows against the float32 engine (its one-factor pairs: the verdicts)"
    if is_replay_vs_staleness(sweep):  # REPLAY_VS_STALENESS_RULE reads its rows by both tests
        uses = "the replay-against-staleness rule's verdicts read its rows against k = 0 and replay against staleness"
    if is_partial(sweep):  # PARTIAL_RULE reads every row against whole responses
        uses = "the partial-rollout rule's verdicts read its rows against whole responses"
    if sweep["dial"] == STALENESS_DIAL and sweep_rule(sweep) == "paired":  # PAIRED_STALENESS_RULE reads them all
        uses = "the amended rule's verdicts read its rows against k = 0 and against naive"
    lines = [
        f"**Paired view (beside the rule above; {uses}).** The arms of a sweep share seeds, so each "
        "comparison the table and the verdicts make is also read seed by seed. Paired Δ: mean over the seeds both "
        "rows ran of (row's eval acc − the other row's); with every seed present it equals the difference of the "
        "means. 95 % interval: paired Δ ± t·s_d/√n, s_d the sample std of the n per-seed differences and t the "
        "0.975 quantile of Student's t with n − 1 degrees of freedom ("
        + (f"{t_975(n - 1):.3f} at n = {n}; " if n >= 2 else "")
        + "NIST/SEMATECH e-Handbook §1.3.6.7.2). Half-width t·s_d/√n: the minimum effect the comparison can "
        "detect, the smallest paired Δ whose interval excludes 0 at the spread observed (detected half the time; "
        "at 80 % power the effect must be about (t + t₀.₈₀)/t times larger). Rule margin: max(2 × pooled std, 0.05), "
        "the threshold the verdicts use. 0 vs interval: whether the interval lies below 0, above 0 or covers it.",
        "",
        "| preset | level | against | n | paired Δ | 95 % interval | half-width | rule margin | 0 vs interval |",
        "|" + "---|" * 9,
    ]
    against = {
        "ref": lambda c: f"same preset at `{level_title(sweep, c['against_level'])}`",
        "naive": lambda c: f"`{c['against_preset']}` at this level",
        "pick": lambda c: f"the pick `{c['against_preset']}` at this level",
        "twin": lambda c: f"`{c['against_preset']}` (no R3) at this level",
        "recompute": lambda c: f"`{c['against_preset']}` (π_old recomputed) at this level",
    }
    for c in comparisons:
        n_cell = str(c["n_pairs"]) + (f" ({c['unpaired']} unpaired)" if c["unpaired"] else "")
        interval = DASH if c["ci_low"] is None else f"[{c['ci_low']:+.3f}, {c['ci_high']:+.3f}]"
        lines.append(
            f"| {c['preset']} | {c['level']} | {against[c['kind']](c)} | {n_cell} | {_fmt(c['delta'], '{:+.3f}')} | "
            f"{interval} | {_fmt(c['half_width'], '{:.3f}')} | {_fmt(c['rule_margin'], '{:.3f}')} | {_zero_side(c)} |"
        )
    halves = sorted(c["half_width"] for c in comparisons if c["half_width"] is not None)
    lines.append("")
    if halves:
        lines.append(
            f"Minimum detectable effect of this sweep: the half-widths of its {len(halves)} paired interval(s) run "
            f"from {halves[0]:.3f} to {halves[-1]:.3f} (median {float(np.median(halves)):.3f}) in eval acc."
        )
    if any(c["unpaired"] or c["n_pairs"] < 2 for c in comparisons):
        lines.append(
            "Not every comparison is paired by seed: a comparison is paired over the seeds both rows ran (n; "
            "unpaired: seeds only one of them ran, left out); below 2 shared seeds it has no interval (–)."
        )
    return lines


def paired_columns(rows: list[dict], comparisons: list[dict]) -> tuple[list[str], list[list]]:
    """The paired view as summary.csv columns: per kind present, paired_vs_KIND_{n, delta, ci_low, ci_high,
    half_width, rule_margin} on the compared row (DASH on the others). Returns (headers, one list of cells per row)."""
    fields = ("n_pairs", "delta", "ci_low", "ci_high", "half_width", "rule_margin")
    kinds = [k for k in PAIRED_KINDS if any(c["kind"] == k for c in comparisons)]
    headers = [f"paired_vs_{k}_{f.removesuffix('_pairs')}" for k in kinds for f in fields]
    at = {(c["kind"], c["preset"], c["level"]): c for c in comparisons}
    cells = [
        [csv_cell((at.get((k, r["preset"], r["level"])) or {}).get(f)) for k in kinds for f in fields] for r in rows
    ]
    return headers, cells


# ---------------------------------------------------------------------------------------------
# Report: files
# ---------------------------------------------------------------------------------------------
COLUMNS = (  # (row key, csv header, markdown header, format)
    ("preset", "preset", "preset", "{}"),
    ("level", "level", "level", "{}"),
    ("n_seeds", "n_seeds", "n", "{}"),
    ("final_reward", "final_reward_mean", "final reward", "{:.3f}"),
    ("final_reward_std", "final_reward_std", None, "{:.3f}"),
    ("eval_acc", "eval_acc_mean", "eval acc", "{:.3f}"),
    ("eval_acc_std", "eval_acc_std", None, "{:.3f}"),
    ("steps_to_reach", "steps_to_reach_mean", "steps to reward ≥ {lvl}", "{:.1f}"),
    ("reached", "reached", "reached", "{}"),
    ("max_k3_kl", "max_k3_kl", "max k3 KL", "{:.2e}"),
    ("max_grad_norm", "max_grad_norm", "max grad norm", "{:.3g}"),
    ("masked_fraction", "rs_masked_fraction", "RS masked", "{:.4f}"),
    ("veto_fraction", "veto_fraction", "veto", "{:.4f}"),
    ("expected_veto", "expected_veto", "planted rows", "{:.4f}"),
    ("catastrophic_fraction", "catastrophic_token_fraction", "catastrophic tokens", "{:.5f}"),
    ("reward_drop", "reward_drop", "reward drop", "{:.3f}"),
    ("ppl_rise", "training_ppl_rise", "ppl rise", "{:.3f}"),
    ("staleness", "staleness_mean", "staleness", "{:.2f}"),
    ("dropped", "dropped_samples", "dropped", "{:.0f}"),
    ("token_staleness", "token_staleness_mean", "token staleness", "{:.2f}"),
    ("spanning", "spanning_responses_mean", "spanning", "{:.3f}"),
    ("step_s", "step_s_mean", "step s", "{:.2f}"),
    ("alpha0", "alpha0_mean", "α₀", "{:.2e}"),
    ("alpha1", "alpha1_mean", "α₁", "{:.2e}"),
    ("staleness_share", "staleness_share_mean", "staleness share of α₁ (seeds)", "{:.3f}"),
    ("staleness_share_min", "staleness_share_min", None, "{:.3f}"),
    ("staleness_share_max", "staleness_share_max", None, "{:.3f}"),
    ("routing_agreement", "routing_agreement_mean", "routing agreement", "{:.4f}"),
    ("flip_fraction", "routing_flip_token_fraction", "flipped tokens", "{:.4f}"),
    ("alpha1_unreplayed", "alpha1_unreplayed_mean", "α₁ unreplayed", "{:.2e}"),
    ("delta_eval_acc", "delta_eval_acc_vs_level0", "Δ vs level 0", "{:+.3f}"),
    ("flag", "flag", "flag", "{}"),
)


def level_title(sweep: dict, level: str) -> str:
    """`dial=level`, or the level alone for the mismatch pseudo-dial (it names its own fields)."""
    return level if sweep["dial"] == MISMATCH else f"{sweep['dial']}={level}"


def is_naive(preset: str) -> bool:
    """The uncorrected arm: `naive`/`disabled` with no correction field on top."""
    return preset in ("naive", "disabled")


def verdicts(rows: list[dict], sweep: dict) -> list[str]:
    """One line per non-reference level, the reading rule applied: naive below, corrected presets held? A split sweep
    (is_split) is read by SPLIT_RULE instead, a staleness sweep swept with `--rule paired` by PAIRED_STALENESS_RULE."""
    if is_split(rows, sweep):
        return split_verdicts(rows, sweep)
    if is_partial(sweep):
        return partial_verdicts(rows, sweep)
    if is_replay_vs_staleness(sweep):
        return replay_vs_staleness_verdicts(rows, sweep)
    if not any(is_naive(p) for p in sweep["presets"]):
        return []
    if sweep["dial"] == STALENESS_DIAL:
        paired = sweep_rule(sweep) == "paired"  # `sweep --rule paired`: PAIRED_STALENESS_RULE
        return paired_staleness_verdicts(rows, sweep) if paired else staleness_verdicts(rows, sweep)
    if sweep["dial"] in REPLAY_DIALS:
        return staleness_verdicts(rows, sweep, at_level="this level", reference="f = 0", pick=REPLAY_PICK)
    if is_moe(rows) and is_gspo_moe(sweep):
        return gspo_moe_verdicts(rows, sweep)
    if is_moe(rows):
        return staleness_verdicts(rows, sweep, at_level="this level", reference="`ref`") + replay_costs(rows, sweep)
    lines = ["Verdicts (the rule above, applied):"]
    for level in compared_levels(sweep):
        at = [r for r in rows if r["level"] == level]
        naive = [r for r in at if is_naive(r["preset"])]
        held = [r["preset"] for r in at if not is_naive(r["preset"]) and r["flag"] == ""]
        broke = any(r["flag"] == "below" for r in naive)
        delta = ", ".join(_fmt(r["delta_eval_acc"], "{:+.3f}") for r in naive)
        verdict = (
            "reproduced"
            if broke and len(held) >= 2
            else (
                "not reproduced: naive holds" if not broke else "not reproduced: fewer than two corrected presets hold"
            )
        )
        lines.append(
            f"- `{level}`: naive Δ {delta} ({'below' if broke else 'not below'}); corrected presets "
            f"holding: {', '.join(held) or 'none'} → **{verdict}**"
        )
    return lines


def staleness_verdicts(
    rows: list[dict], sweep: dict, at_level="this k", reference="k = 0", pick: str | None = None
) -> list[str]:
    """The staleness rule (STALENESS_RULE; REPLAY_RULE for a replay sweep) applied at each level after the first:
    naive below its first-level row? which corrected presets are clearly above naive at the same level (repair), which
    are not below their own first-level row (hold)? With `pick` (a preset the design documents recommend for the
    case), whether it repairs and holds and no corrected preset is clearly above it."""
    lines = ["Verdicts (the rule above, applied):"]
    for level in compared_levels(sweep):
        at = [r for r in rows if r["level"] == level]
        naive = next(r for r in at if is_naive(r["preset"]))
        corrected = [r for r in at if not is_naive(r["preset"])]
        repair = [r["preset"] for r in corrected if clearly_below(naive, r)]
        held = [r["preset"] for r in corrected if r["flag"] == ""]
        broke = naive["flag"] == "below"
        verdict = (
            "reproduced"
            if broke and len(repair) >= 2
            else ("not reproduced: naive holds" if not broke else "not reproduced: fewer than two presets repair")
        )
        lines.append(
            f"- `{level_title(sweep, level)}`: naive Δ {_fmt(naive['delta_eval_acc'], '{:+.3f}')} "
            f"({'below' if broke else 'not below'}); above naive at {at_level} (repair): "
            f"{', '.join(repair) or 'none'}; not below their own {reference} (hold): {', '.join(held) or 'none'} → "
            f"**{verdict}**"
        )
        chosen = next((r for r in corrected if r["preset"] == pick), None)
        if chosen is not None:
            better = [r["preset"] for r in corrected if clearly_below(chosen, r)]
            holds = chosen["preset"] in repair and chosen["preset"] in held and not better
            lines.append(
                f"  - the documents' pick `{pick}`: {'repairs' if pick in repair else 'does not repair'}, "
                f"{'holds' if pick in held else 'does not hold'}; clearly above it: {', '.join(better) or 'none'} → "
                f"**{'the recommendation holds' if holds else 'the recommendation does not hold'}**"
            )
    return lines


def _fmt(value, fmt: str) -> str:
    return DASH if value is None else fmt.format(value)


# Significant digits of every float in a lab CSV. 10 is far more than any figure the markdown shows (a few
# significant digits) and far above the noise between CPUs, which sits in the last digits of a float64's 17
# (numpy's exp/power kernels differ, e.g. with AVX-512), so a regenerated CSV is the same bytes on any machine.
CSV_DIGITS = 10
# ... except where that noise is absolute, not relative: the length lab's numbers are differences of quantities
# near 1 (chi2 = E[rho^2] - 1, (1 + chi2)^T - 1, ESS ~ 1 and its std over seeds), so at no mismatch they are tiny
# values whose every digit can be noise (ess_token_std 8.845e-14 on one CPU, 8.840e-14 on another). Their
# cross-CPU difference is at most ~5e-15 absolute (measured on lab/collapse, length, length_long), so length.csv
# also keeps no digit below 1e-12: 200x that noise (1e-12 is itself only ~4500 float64 ulps of the 1 those
# numbers are computed against).
LENGTH_CSV_DECIMALS = 12


def csv_cell(value, decimals: int | None = None):
    """One cell of a lab CSV: None -> DASH; a float (Python or numpy) rounded to `decimals` decimal places when
    given, then to CSV_DIGITS significant digits, and written as Python writes that float (0.1, 3.0, 1e-05, nan,
    inf: the shortest form that reads back to it, so never more than CSV_DIGITS digits; -0.0 as 0.0); ints, bools
    and text as they are."""
    if value is None:
        return DASH
    if isinstance(value, (float, np.floating)):
        x = float(value) if decimals is None else round(float(value), decimals)
        return repr(float(f"{x:.{CSV_DIGITS}g}") + 0.0)  # + 0.0: a noise value rounded to -0.0 is written 0.0
    return value


def write_summary(rows: list[dict], sweep: dict, out: str, reward_level: float) -> tuple[str, str]:
    """Write out/summary.csv (floats to CSV_DIGITS significant digits, csv_cell) and out/summary.md (rounded,
    mean ± std); return both paths."""
    cols = [c for c in COLUMNS if c[0] in rows[0]] if rows else list(COLUMNS)
    if len({reference_level(sweep, lv) for lv in sweep["levels"]}) > 1:  # several reference levels (MOE_RULE)
        cols = [
            ("delta_eval_acc", "delta_eval_acc_vs_ref", "Δ vs ref", c[3]) if c[0] == "delta_eval_acc" else c
            for c in cols
        ]
    csv_path, md_path = os.path.join(out, "summary.csv"), os.path.join(out, "summary.md")
    comparisons = paired_comparisons(rows, sweep)
    paired_headers, paired_cells = paired_columns(rows, comparisons)
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([c[1] for c in cols] + paired_headers)
        w.writerows([[csv_cell(r.get(k)) for k, *_ in cols] + p for r, p in zip(rows, paired_cells)])
    md_cols = [c for c in cols if c[2] is not None]
    below = (
        "A row is marked `below` when its mean eval acc is more than max(2 × pooled std, 0.05) below the reference "
        "row's; pooled std = sqrt(((n₁−1)s₁² + (n₂−1)s₂²) / (n₁+n₂−2)) over the two rows' seeds (0 when n₁+n₂ ≤ 2)."
    )
    first = (
        f"Δ vs level 0: eval acc minus that of the same preset at the first level "
        f"(`{level_title(sweep, sweep['levels'][0])}`, `ref`). {below}"
    )
    if is_split(rows, sweep):
        rule = f"{first} {SPLIT_RULE}"
    elif is_partial(sweep):
        rule = f"{first} {PARTIAL_RULE}"
    elif is_replay_vs_staleness(sweep):
        rule = f"{first} {REPLAY_VS_STALENESS_RULE}"
    elif sweep["dial"] == STALENESS_DIAL:
        rule = f"{first} {PAIRED_STALENESS_RULE if sweep_rule(sweep) == 'paired' else STALENESS_RULE}"
    elif sweep["dial"] in REPLAY_DIALS:
        rule = f"{first} {REPLAY_RULE}"
    elif is_moe(rows) and is_gspo_moe(sweep):
        rule = f"Δ vs ref: eval acc minus that of the same preset at its `ref` level. {below} {GSPO_MOE_RULE}"
    elif is_moe(rows):
        rule = f"Δ vs ref: eval acc minus that of the same preset at its `ref` level. {below} {MOE_RULE}"
    else:
        rule = (
            f'{first} A level reproduces "mismatch breaks naive, correction repairs it" when the naive row is `below` '
            "and at least two corrected presets are not."
        )
    rule = "**Reading rule (fixed before the runs).** " + rule
    lines = [
        f"# Mismatch lab: dial `{sweep['dial']}`, {len(sweep['seeds'])} seed(s), {sweep['steps']} steps",
        "",
        rule,
        "",
        "| " + " | ".join(c[2].format(lvl=reward_level) for c in md_cols) + " |",
        "|" + "---|" * len(md_cols),
    ]
    for r in rows:
        cells = []
        for key, _, _, fmt in md_cols:
            cell = _fmt(r.get(key), fmt)
            if key in ("final_reward", "eval_acc") and r.get(key + "_std") is not None:
                cell += " ± " + fmt.format(r[key + "_std"])
            if key == "staleness_share" and r.get(key) is not None:  # the seed range SPLIT_RULE reads
                cell += f" ({fmt.format(r[key + '_min'])}{DASH}{fmt.format(r[key + '_max'])})"
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    columns = (
        f"final reward: mean `reward/mean` over the last {LAST_N} steps of each seed; eval acc: last "
        "`eval/accuracy` of each seed; both mean ± sample std over seeds. Steps to reward: first step with "
        f"`reward/mean` ≥ {reward_level}, mean over the seeds that reached it (reached: seeds that did). "
        "max k3 KL, max grad norm: max over steps and seeds. RS masked / veto: mean over steps of the "
        f"logged fraction (0 when not logged), mean over seeds. {DASH}: not logged / not computable."
    )
    columns += (
        " Reward drop: peak of the 3-step moving average of `reward/mean` minus its last value (collapse "
        "signature), mean over seeds. α₀, α₁: mean over steps of `actor/tv_update` and "
        "`rollout_corr/tv_mismatch` (defined in docs/corrections.md §12.6, estimated as in §12.7), mean over seeds."
    )
    if any("staleness" in r for r in rows):
        columns += (
            " Ppl rise: largest rise of the 3-step moving average of `rollout_corr/training_ppl` over its running "
            "minimum, as a ratio minus 1 (collapse signature), mean over seeds. Staleness: mean over steps of "
            "`rollout/staleness_mean` (trainer version − sample version), mean over seeds; dropped: "
            "`rollout/dropped_samples` summed over steps, mean over seeds."
        )
    if any("token_staleness" in r for r in rows):
        columns += (
            " Token staleness: mean over steps of `rollout/token_staleness_mean` (trainer version − the version that "
            "sampled each response token; partial rows only), spanning: mean over steps of "
            "`rollout/spanning_responses` (share of responses sampled by more than one version), step s: mean over "
            "steps of `timing/step_s`; each mean over seeds."
        )
    if any("staleness_share" in r for r in rows):
        columns += (
            " Staleness share of α₁: per seed, the mean over steps of `rollout_corr/staleness_tv` / "
            "(`numerics_tv` + `staleness_tv`) (steps where both are 0 left out), mean over seeds, the seeds' range "
            "in brackets."
        )
    if any("expected_veto" in r for r in rows):
        columns += (
            " Planted rows: mean over steps of 1 − (1 − p)^T̄ (T̄ = mean response length, p = "
            "--rollout-corrupt-prob), the share of responses holding a planted token (an upper bound, "
            "Jensen); catastrophic tokens: `rollout_is_catastrophic_token_fraction`, to set against p."
        )
    lines += [*refused_lines(sweep), "", *verdicts(rows, sweep), "", *paired_lines(comparisons, sweep), "", columns, ""]
    with open(md_path, "w") as f:
        f.write("\n".join(lines))
    return csv_path, md_path


def _new_figure(n_panels: int, sharey: bool = True):
    fig = Figure(figsize=(4.6 * n_panels, 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(1, n_panels, sharey=sharey, squeeze=False).ravel()


def _seed_band(runs: list[dict], key: str):
    """(steps, mean, min, max) of `key` over the runs' seeds, per step (steps where any seed logged it)."""
    by_step: dict[int, list[float]] = {}
    for run in runs:
        for s, v in zip(*run_series(run["records"], key)):
            by_step.setdefault(int(s), []).append(float(v))
    steps = np.array(sorted(by_step), dtype=int)
    vals = [by_step[s] for s in steps]
    return (
        steps,
        np.array([np.mean(v) for v in vals]),
        np.array([min(v) for v in vals]),
        np.array([max(v) for v in vals]),
    )


def _legend(axes, fontsize: int) -> None:
    """Legend in the first panel that has lines; 'not logged' in the empty panels."""
    with_lines = [ax for ax in axes if ax.get_legend_handles_labels()[0]]
    if with_lines:
        with_lines[0].legend(fontsize=fontsize)
    for ax in axes:
        if ax not in with_lines:
            ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", color="0.5", style="italic")


def _groups(sweep: dict, level: str):
    """(preset, colour, runs with metrics) for one dial level."""
    for i, preset in enumerate(sweep["presets"]):
        runs = [r for r in sweep["runs"] if r["preset"] == preset and r["level"] == level and r["records"]]
        yield preset, f"C{i % 10}", runs


def plot_curves(sweep: dict, key: str, path: str, ylabel: str, log: bool = False) -> str:
    """One panel per dial level: per preset, the mean of `key` over seeds vs step, min–max shaded; shared y."""
    fig, axes = _new_figure(len(sweep["levels"]))
    positive = False
    for ax, level in zip(axes, sweep["levels"]):
        panel_positive = False
        for preset, color, runs in _groups(sweep, level):
            steps, mean, lo, hi = _seed_band(runs, key)
            if steps.size:
                ax.plot(steps, mean, color=color, label=preset, linewidth=1.4)
                ax.fill_between(steps, lo, hi, color=color, alpha=0.2, linewidth=0)
                panel_positive |= bool(np.any(hi > 0))
        if log and not panel_positive:  # a log axis cannot show it: say so instead of an empty panel
            ax.text(0.5, 0.5, f"{key} = 0 at every step", transform=ax.transAxes, ha="center", fontsize=9)
        positive |= panel_positive
        ax.set_title(level_title(sweep, level), fontsize=10)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
    if log and positive:
        axes[0].set_yscale("log", nonpositive="mask")
    axes[0].set_ylabel(ylabel + (" (log)" if log and positive else ""))
    _legend(axes, 8)
    fig.suptitle(f"{key}: mean over seeds, min–max shaded")
    fig.savefig(path, dpi=90)
    return path


def plot_alpha(sweep: dict, path: str) -> str:
    """Per dial level: alpha_0 (`actor/tv_update`, solid) and alpha_1 (`rollout_corr/tv_mismatch`, dashed) vs step."""
    fig, axes = _new_figure(len(sweep["levels"]))
    for ax, level in zip(axes, sweep["levels"]):
        for preset, color, runs in _groups(sweep, level):
            for key, style, sym in (("actor/tv_update", "-", "α₀"), ("rollout_corr/tv_mismatch", "--", "α₁")):
                steps, mean, _, _ = _seed_band(runs, key)
                if steps.size:
                    ax.plot(steps, mean, color=color, linestyle=style, label=f"{preset} {sym}", linewidth=1.3)
        ax.set_title(level_title(sweep, level), fontsize=10)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("total variation (mean over seeds)")
    _legend(axes, 7)
    fig.suptitle("three-policy TRPO: α₀ = tv_update (solid), α₁ = tv_mismatch (dashed; β in bypass presets)")
    fig.savefig(path, dpi=90)
    return path


STALENESS_DIAL = "max_staleness"  # a sweep of this dial also gets staleness.png: the summary against k
STALENESS_RULE = (  # the reading rule of a --max-staleness sweep, fixed before lab/staleness ran
    "Under staleness every preset learns from older samples, so a correction can remove the bias of stale samples "
    "but not their lag: each k is also read across presets. A corrected preset *repairs* at k when its mean eval acc "
    "is above naive's at the same k by more than the same margin, max(2 × pooled std, 0.05); it *holds* when it is not "
    '`below` its own k = 0 row. A level reproduces "staleness breaks naive, correction repairs it" when the naive '
    "row is `below` and at least two corrected presets repair."
)
RULES = ("standard", "paired")  # `sweep --rule`, kept in sweep.json: how a --max-staleness sweep is read (sweep_rule)
PAIRED_STALENESS_RULE = (  # `--rule paired`: the amended staleness rule (issue 48 item 7), fixed in lab/README.md
    "Amended rule (`--rule paired`, issue 48), fixed before any run of it. Under staleness every preset learns from "
    "older samples, so a correction can remove the bias of stale samples but not their lag: each k is also read "
    "across presets. Every comparison is read twice: by the margin of the means, max(2 × pooled std, 0.05), and by "
    "the paired 95 % interval of the per-seed differences over the seeds both rows ran (paired Δ ± t·s_d/√n, t with "
    "n − 1 degrees of freedom; the paired view below). A preset *holds* at k when its mean final eval acc is not below "
    "its own k = 0 row by more than the margin **and** the paired interval of its (k − k = 0) difference does not lie "
    "wholly below 0; it is *below* when both say below; otherwise *undecided*. A corrected preset *repairs* at k when "
    "its mean is above naive's at the same k by more than the margin **and** the paired interval of (preset − naive) "
    "lies wholly above 0; it *does not repair* when neither says above; otherwise *undecided*. Naive *breaks* at k "
    'when it is *below* by both tests. A level reproduces "staleness breaks naive, correction repairs it" when naive '
    "breaks and at least two corrected presets repair; it does *not* when naive holds or fewer than two corrected "
    "presets repair or are undecided (no undecided comparison could change it); otherwise the level is *undecided*. "
    "A comparison without an interval (fewer than 2 shared seeds) is undecided. Each undecided comparison states the "
    "half-width five seeds would give at the spread observed, t₄ · s_d / √5 (t₄ = 2.776), and the Δ the mean test "
    "needs, which more seeds do not narrow. The table's `below` flag is the margin test alone."
)


REPLAY_DIALS = ("replay_fraction", "replay_window")  # sweeps of a replay buffer (docs/async.md §8)
REPLAY_PICK = "decoupled_seq_is_rs"  # the documents' pick for replay buffers (math document §5.2, "severe")
REPLAY_RULE = (  # the reading rule of a replay sweep, fixed before lab/replay ran
    "Replay trains every preset on samples up to W + k versions old, a mixture of behaviour policies, so a "
    "correction can remove their bias but not their lag: each level is also read across presets. A corrected preset "
    "*repairs* at a level when its mean eval acc is above naive's at the same level by more than the same margin, "
    'max(2 × pooled std, 0.05); it *holds* when it is not `below` its own f = 0 row. A level reproduces "a mixture '
    'of versions breaks naive, correction repairs it" when the naive row is `below` and at least two corrected '
    f"presets repair. The documents' recommendation for this case, `{REPLAY_PICK}`, holds at a level when it repairs, "
    "holds, and no corrected preset is above it by the same margin."
)


REPLAY_ROUTING = "+routing_replay=r3"  # a preset entry adding rollout routing replay (R3) to a preset (docs/moe.md)
MOE_RULE = (  # the reading rule of an MoE sweep (levels of rollout_dtype, moe_router_scale), fixed before lab/moe ran
    "An MoE sweep reads each level against the level of the same router scale with a float32 engine (`ref`): there "
    "the engine routes as the trainer does, so Δ is what the engine's routing and precision mismatch costs. A "
    "corrected preset *repairs* at a level when its mean eval acc is above naive's at the same level by more than the "
    "same margin, max(2 × pooled std, 0.05); it *holds* when it is not `below` its own `ref` row. A level reproduces "
    '"routing mismatch breaks naive, correction repairs it" when the naive row is `below` and at least two corrected '
    f"presets repair. Replay's cost: an R3 arm (`P{REPLAY_ROUTING}`) is read against `P` at the same level; replay "
    "*costs* when the R3 arm is below `P` by the margin and *pays* when it is above. Eval acc is always greedy "
    "decoding on the engine, which never replays: the model as the engine serves it."
)


GSPO_CLIP = "+clip_ratio_low=0.0003+clip_ratio_high=0.0004"  # GSPO's ranges (arXiv 2507.18071, §5.1)
GSPO = "naive+loss_mode=gspo" + GSPO_CLIP  # against the recomputed pi_old, mu ignored: the paper's setting
GSPO_FACTORS = (  # (arm, the arm it is read against, the one factor between them): lab/README.md section 12
    (GSPO, "naive", "the objective: GSPO's sequence ratio and clip against token PPO"),
    ("naive+loss_mode=gspo_token" + GSPO_CLIP, GSPO, "GSPO-token's per-token gradient against GSPO's"),
    (GSPO + REPLAY_ROUTING, GSPO, "routing replay (R3) under GSPO"),
    ("bypass_ppo_clip+loss_mode=gspo" + GSPO_CLIP, GSPO, "pi_old := mu (bypass) against pi_old recomputed"),
)
GSPO_MOE_RULE = (  # fixed in lab/README.md section 12 before the sweep ran (issue 48 items 2 and 7)
    "GSPO in the MoE lab (issue 48), fixed before the sweep ran. Every comparison is read by the paired rule's two "
    "tests (section 10): the margin of the means, max(2 × pooled std, 0.05), and the paired 95 % interval over seeds. "
    "(1) *Hold*: each arm at the bf16 engine against its own row with the float32 engine at the same router scale "
    "(`ref`): it *holds* when neither test says below, is *below* when both do, else *undecided*. (2) *One factor at "
    "a time*: at each level each arm of GSPO_FACTORS is read against the arm it differs from in one factor (the "
    "objective; GSPO-token against GSPO; R3 under GSPO; bypass against π_old recomputed): *above* when both tests say "
    "above, *below* when both say below, *no difference found* when neither says either, else *undecided*. (3) The "
    "three-policy note's claim, GSPO needs no routing replay under routing mismatch, is *supported* when GSPO holds at "
    "the bf16 level and GSPO + R3 is not above GSPO there, *contradicted* when GSPO is below at the bf16 level and "
    "GSPO + R3 holds, else *undecided*. Eval acc is greedy decoding on the engine, which never replays."
)


def is_gspo_moe(sweep: dict) -> bool:
    """The MoE GSPO sweep (GSPO_MOE_RULE): its arms include GSPO as GSPO_FACTORS names it."""
    return GSPO in sweep["presets"]


def paired_side(row: dict, other: dict, paired: dict) -> str:
    """GSPO_MOE_RULE (2): `above` / `below` when the margin and the paired interval both say so, `no difference found`
    when neither says either, else `undecided` (also without an interval)."""
    if row["eval_acc"] is None or other["eval_acc"] is None or paired["ci_low"] is None:
        return "undecided"
    below = (clearly_below(row, other), paired["ci_high"] < 0)
    above = (clearly_below(other, row), paired["ci_low"] > 0)
    if all(below) or all(above):
        return "below" if all(below) else "above"
    return "undecided" if any(below) or any(above) else "no difference found"


def _read_sides(by: dict, key: tuple, other: tuple, sweep: dict) -> tuple[str | None, str]:
    """_read by paired_side, a two-sided test: its text says the side the difference of the means is on."""
    a, b = by.get(key), by.get(other)
    up = a is not None and b is not None and (_delta(a, b) or 0) > 0
    return _read(by, key, other, sweep, paired_side, up)


def gspo_moe_verdicts(rows: list[dict], sweep: dict) -> list[str]:
    """GSPO_MOE_RULE: (1) every arm against its float32 row, (2) each one-factor pair at every level, (3) the claim."""
    by, lines = {(r["preset"], r["level"]): r for r in rows}, ["Verdicts (the rule above, applied):"]
    held = {}
    for level in compared_levels(sweep):
        lines.append(f"- `{level_title(sweep, level)}` against `{level_title(sweep, reference_level(sweep, level))}`:")
        for p in sweep["presets"]:
            held[p, level], text = _read(by, (p, level), (p, reference_level(sweep, level)), sweep, paired_hold)
            lines.append(f"  - `{p}` (hold): {text}")
    sides = {}
    for level in sweep["levels"]:
        lines.append(f"- one factor at a time at `{level_title(sweep, level)}`:")
        for arm, against, factor in GSPO_FACTORS:
            if arm in sweep["presets"] and against in sweep["presets"]:
                sides[arm, level], text = _read_sides(by, (arm, level), (against, level), sweep)
                lines.append(f"  - `{arm}` against `{against}` ({factor}): {text}")
    for level in compared_levels(sweep):
        gspo, r3 = held.get((GSPO, level)), sides.get((GSPO + REPLAY_ROUTING, level), "not run")
        r3_holds = held.get((GSPO + REPLAY_ROUTING, level))
        claim = (
            "supported"
            if gspo == "holds" and r3 not in ("above", "not run")
            else "contradicted"
            if gspo == "below" and r3_holds == "holds"
            else "undecided"
        )
        lines.append(
            f"- at `{level_title(sweep, level)}`: GSPO {gspo}; GSPO + R3 against GSPO: {r3} → the claim that GSPO "
            f"needs no routing replay: **{claim}**"
        )
    return lines


def is_moe(rows: list[dict]) -> bool:
    """A sweep of MoE runs (its rows carry the routing columns)."""
    return any(r.get("routing_agreement") is not None for r in rows)


def _delta(row: dict, other: dict) -> float | None:
    """row's mean eval acc minus other's (None when either is missing)."""
    return None if None in (row["eval_acc"], other["eval_acc"]) else row["eval_acc"] - other["eval_acc"]


def replay_costs(rows: list[dict], sweep: dict) -> list[str]:
    """MOE_RULE's last part: each R3 arm against its unreplayed twin, at every compared level."""
    lines = []
    for level in compared_levels(sweep):
        at = {r["preset"]: r for r in rows if r["level"] == level}
        cells = []
        for preset, r3 in at.items():
            twin = at.get(preset.removesuffix(REPLAY_ROUTING)) if preset.endswith(REPLAY_ROUTING) else None
            if twin is not None:
                verdict = "costs" if clearly_below(r3, twin) else "pays" if clearly_below(twin, r3) else "neither"
                delta = _fmt(_delta(r3, twin), "{:+.3f}")
                cells.append(f"`{preset}` against `{twin['preset']}` Δ {delta} → **{verdict}**")
        if cells:
            lines.append(f"- replay at `{level_title(sweep, level)}`: " + "; ".join(cells))
    return lines


SPLIT_KEYS = ("rollout_corr/numerics_tv", "rollout_corr/staleness_tv")  # alpha_1's parts (--mismatch-split, §6.9)
PROX_ARM = re.compile(r"\+prox_logp=([^+]*)")  # a preset entry's cheaper pi_old: `P+prox_logp=sampling|loglinear`
SPLIT_RULE = (  # the reading rule of the mismatch split (lab/split), fixed in lab/README.md before any run
    "(1) *How α₁ splits*: at each level, the share of α₁ that is staleness is the mean over seeds of "
    "`staleness_tv / (numerics_tv + staleness_tv)` over the run's steps; the split is *staleness-dominated* at a "
    "level when that share's seed range lies above 0.5, *numerics-dominated* when below, otherwise mixed. At k = 0 "
    "without replay the share must be 0 (a check of the tooling, not a finding). (2) *Whether the cheaper π_old "
    "holds*: an arm *holds* at a level when its mean final eval accuracy is not below the recompute arm's at the "
    "same level by more than max(2 × pooled std, 0.05) **and** the paired 95 % interval of its per-seed difference "
    "from the recompute arm does not lie wholly below 0; it *fails* when both say below. Anything else is "
    "*undecided* (say so, and what five seeds would need). The rule does not rank `sampling` against `loglinear` "
    "unless one holds and the other fails at the same level. As applied: a level's split is read on the arm that "
    "recomputes π_old, whose α₁ = TV(π_old, μ) is the total split (under `--prox-logp sampling` π_old is the "
    "sampling version's π, so that arm's α₁ is the numerics part alone); a step's share counts once, a step "
    "where both parts are 0 not at all; a cheaper arm `P+prox_logp=M` is read against `P`, with the paired "
    "interval of the paired view below (n − 1 degrees of freedom)."
)


def staleness_share(records: list[dict]) -> float | None:
    """SPLIT_RULE (1) for one run: the mean over its steps of staleness_tv / (numerics_tv + staleness_tv) (steps
    where both are 0 or either is missing left out; None when no step is left). math.fsum: the same bits on every
    CPU."""
    numerics, staleness = SPLIT_KEYS
    shares = [
        r[staleness] / (r[numerics] + r[staleness])
        for r in records
        if r.get("step", 0) >= 0
        and all(isinstance(r.get(k), (int, float)) and math.isfinite(r[k]) for k in SPLIT_KEYS)
        and r[numerics] + r[staleness] > 0
    ]
    return math.fsum(shares) / len(shares) if shares else None


def cheaper_arms(sweep: dict) -> list[tuple[str, str]]:
    """(arm, its recompute arm) for each preset entry `P+prox_logp=M` (M not recompute) whose `P`, the entry without
    that field, is in the sweep too; in sweep order."""
    arms = []
    for preset in sweep["presets"]:
        found, base = PROX_ARM.search(preset), PROX_ARM.sub("", preset)
        if found and found.group(1) != "recompute" and base in sweep["presets"]:
            arms.append((preset, base))
    return arms


def is_split(rows: list[dict], sweep: dict) -> bool:
    """A split sweep (SPLIT_RULE): its runs log alpha_1's two parts and it has a cheaper pi_old arm to read."""
    return any(r.get("staleness_share") is not None for r in rows) and bool(cheaper_arms(sweep))


def _setting(sweep: dict, level: str, field: str) -> str | None:
    """The value the flags of a cell at `level` give rc_train.py's field `field`: the level's, else the sweep's extra
    flags' (`--flag VALUE` or `--flag=VALUE`); None when neither sets it."""
    value = level_value(sweep["dial"], level, field)
    flags, flag = sweep.get("extra", []), "--" + field.replace("_", "-")
    for i, f in enumerate(flags):
        if value is None and f == flag and i + 1 < len(flags):
            value = flags[i + 1]
        elif value is None and f.startswith(flag + "="):
            value = f.partition("=")[2]
    return value


def no_stale_samples(sweep: dict, level: str) -> bool:
    """The level runs at k = 0 without replay (unset: the sweep pins k = 0 and replays nothing), so every sample is
    current and the staleness part of alpha_1 must be 0."""
    k, f = _setting(sweep, level, "max_staleness"), _setting(sweep, level, "replay_fraction")
    return float(k or 0) == 0 and float(f or 0) == 0


def split_reading(row: dict, no_stale: bool) -> str:
    """SPLIT_RULE (1) on one row: the tooling check where no sample is stale (share 0 in every seed), else the split
    by the seeds' range of the share against 0.5."""
    if row.get("staleness_share") is None:
        return "not logged"
    if no_stale:
        return f"tooling check {'passes' if row['staleness_share_max'] == 0 else 'fails'} (not a finding)"
    if row["staleness_share_min"] > 0.5:
        return "staleness-dominated"
    return "numerics-dominated" if row["staleness_share_max"] < 0.5 else "mixed"


def pi_old_verdict(arm: dict, recompute: dict, paired: dict) -> str:
    """SPLIT_RULE (2) for one cheaper pi_old arm against the recompute arm at the same level: `holds` when neither the
    mean (clearly_below) nor the paired 95 % interval (wholly below 0) says below, `fails` when both do, else
    `undecided` (also without eval acc or without an interval: fewer than 2 shared seeds)."""
    if arm["eval_acc"] is None or recompute["eval_acc"] is None or paired["ci_high"] is None:
        return "undecided"
    by_mean, by_pairs = clearly_below(arm, recompute), paired["ci_high"] < 0
    return "fails" if by_mean and by_pairs else "undecided" if by_mean or by_pairs else "holds"


def five_seeds(paired: dict, margin: float, above: bool = False) -> str:
    """What five seeds would need, for an undecided comparison: the paired interval's half-width at n = 5 at the
    spread observed (t with 4 degrees of freedom), and the mean test's margin, which more seeds do not narrow (below
    −margin; `above`, for a test of being above the other row, a repair: above +margin)."""
    bound = f"above +{margin:.3f}" if above else f"below −{margin:.3f}"
    need = f"the mean test needs Δ {bound} at any number of seeds (the margin is a spread, not an error)"
    if paired["sd"] is None:
        return f"five seeds would give the paired interval its first estimate; {need}"
    half = t_975(4) * paired["sd"] / math.sqrt(5)
    d = paired["delta"]
    side = "lie below 0" if d + half < 0 else "lie above 0" if d - half > 0 else "still cover 0"
    return f"five seeds at this spread (s_d {paired['sd']:.3f}): half-width {half:.3f}, Δ {d:+.3f} would {side}; {need}"


def split_verdicts(rows: list[dict], sweep: dict) -> list[str]:
    """SPLIT_RULE applied at each level: (1) the staleness share of alpha_1 on each recompute arm, (2) each cheaper
    pi_old arm against its recompute arm (pi_old_verdict, paired by seed), and the ranking the rule allows."""
    by, arms = {(r["preset"], r["level"]): r for r in rows}, cheaper_arms(sweep)
    lines = ["Verdicts (the rule above, applied):"]
    for level in sweep["levels"]:
        no_stale = no_stale_samples(sweep, level)
        for base in dict.fromkeys(b for _, b in arms):
            row = by.get((base, level))
            if row is None:
                continue
            where = "; k = 0 without replay: must be 0" if no_stale else ""
            lines.append(
                f"- `{level_title(sweep, level)}`: staleness share of α₁ (`{base}`) {_share_text(row)}{where} → "
                f"**{split_reading(row, no_stale)}**"
            )
            lines += _pi_old_lines([(a, by.get((a, level))) for a, b in arms if b == base], row, sweep)
    return lines


def _share_text(row: dict) -> str:
    """A row's staleness share of alpha_1 with its seeds' range: `0.620 (seeds 0.550–0.700)`, or DASH."""
    if row.get("staleness_share") is None:
        return DASH
    low, high = row["staleness_share_min"], row["staleness_share_max"]
    return f"{row['staleness_share']:.3f} (seeds {low:.3f}{DASH}{high:.3f})"


def _pi_old_lines(arms: list[tuple[str, dict | None]], recompute: dict, sweep: dict) -> list[str]:
    """SPLIT_RULE (2)'s lines at one level: each cheaper arm that ran there against `recompute`, then the ranking."""
    lines, verdict_of = [], {}
    for name, arm in arms:
        if arm is not None:  # None: refused at this level (listed under the table)
            verdict_of[name], line = _pi_old_line(arm, recompute, sweep)
            lines.append(line)
    held = [a for a, v in verdict_of.items() if v == "holds"]
    failed = [a for a, v in verdict_of.items() if v == "fails"]
    if held and failed:
        ranked = " above ".join(", ".join(f"`{a}`" for a in group) for group in (held, failed))
        lines.append(f"  - ranked: {ranked} (holds where the other fails)")
    elif len(verdict_of) >= 2:
        lines.append("  - not ranked: no cheaper arm holds here where another fails")
    return lines


def _pi_old_line(arm: dict, recompute: dict, sweep: dict) -> tuple[str, str]:
    """(pi_old_verdict, its line) of one cheaper arm against the recompute arm at the same level (_two_tests: the
    mean's Δ against the rule's margin, the paired interval, and for an undecided one what five seeds would need)."""
    verdict, text = _two_tests(arm, recompute, sweep, pi_old_verdict)
    return verdict, f"  - `{arm['preset']}` against `{recompute['preset']}`: {text}"


# ---------------------------------------------------------------------------------------------
# Report: the amended staleness rule (`sweep --rule paired`, PAIRED_STALENESS_RULE; issue 48 item 7)
# ---------------------------------------------------------------------------------------------
def sweep_rule(sweep: dict) -> str:
    """The reading rule the sweep asked for (`sweep --rule`, one of RULES); a sweep.json written before the option
    (every committed one) reads as `standard`."""
    return sweep.get("rule", "standard")


def paired_hold(row: dict, ref: dict, paired: dict) -> str:
    """PAIRED_STALENESS_RULE's hold of `row` against its own k = 0 row `ref` (`paired`: row − ref by seed), by
    SPLIT_RULE (2)'s two tests (pi_old_verdict): `holds` when neither the margin nor the interval says below, `below`
    when both do, else `undecided`. Naive *breaks* when it is `below`."""
    verdict = pi_old_verdict(row, ref, paired)
    return "below" if verdict == "fails" else verdict


def paired_repair(arm: dict, naive: dict, paired: dict) -> str:
    """PAIRED_STALENESS_RULE's repair of a corrected `arm` against naive at the same k (`paired`: arm − naive by
    seed): `repairs` when its mean is above naive's by more than the margin (clearly_below(naive, arm)) and the paired
    interval lies wholly above 0, `does not repair` when neither, else `undecided` (also without an eval acc or an
    interval: fewer than 2 shared seeds)."""
    if arm["eval_acc"] is None or naive["eval_acc"] is None or paired["ci_low"] is None:
        return "undecided"
    by_mean, by_pairs = clearly_below(naive, arm), paired["ci_low"] > 0
    return "repairs" if by_mean and by_pairs else "undecided" if by_mean or by_pairs else "does not repair"


def paired_reproduction(naive: str | None, repairs: list[str]) -> str:
    """A level's verdict under PAIRED_STALENESS_RULE from naive's paired_hold (None: naive not run there) and the
    corrected presets' paired_repair: `reproduced` when naive is below and at least two repair; `not reproduced` when
    naive holds or fewer than two repair or are undecided (no undecided comparison could change it); else
    `undecided`."""
    done, open_ = repairs.count("repairs"), repairs.count("undecided")
    if naive == "below" and done >= 2:
        return "reproduced"
    return "not reproduced" if naive == "holds" or done + open_ < 2 else "undecided"


def _two_tests(row: dict, other: dict, sweep: dict, verdict_of, above: bool = False) -> tuple[str, str]:
    """(verdict, text) of `row` read against `other` by the margin and the paired interval (row − other by seed),
    verdict_of(row, other, paired) giving the verdict: the mean's Δ against the margin, the interval, the verdict,
    and for an undecided one what five seeds would give (five_seeds; `above`: a test of row above other)."""
    paired = paired_difference(*(seed_evals(sweep, r["preset"], r["level"]) for r in (row, other)))
    margin, verdict = rule_margin(row, other), verdict_of(row, other, paired)
    mean = DASH
    if margin is not None:
        says = clearly_below(other, row) if above else clearly_below(row, other)
        side = ("" if says else "not ") + ("above" if above else "below")
        mean = f"{_delta(row, other):+.3f} (margin {margin:.3f}: {side})"
    interval = DASH
    if paired["ci_low"] is not None:
        interval = f"[{paired['ci_low']:+.3f}, {paired['ci_high']:+.3f}] ({_zero_side(paired)})"
    text = f"Δ {mean}; paired 95 % interval {interval} → **{verdict}**"
    if verdict == "undecided" and margin is not None:
        text += f"; {five_seeds(paired, margin, above)}"
    return verdict, text


def _read(by: dict, key: tuple, other: tuple, sweep: dict, verdict_of, above: bool = False) -> tuple[str | None, str]:
    """_two_tests of the rows `key` and `other` of `by`; (None, a note) when either did not run (refused)."""
    if key not in by or other not in by:
        return None, "not run (refused; listed under the table)"
    return _two_tests(by[key], by[other], sweep, verdict_of, above)


BREAKS = {"below": "breaks", "holds": "does not break", "undecided": "undecided", None: "not run"}

# The partial-rollout lab (issue 52; lab/README.md section 11): which arms correct per token, which per sequence
PARTIAL_TOKEN_ARMS = ("decoupled_token_is", "bypass_ppo_clip")
PARTIAL_SEQUENCE_ARMS = ("decoupled_seq_mis", "decoupled_geo_rs")
PARTIAL_RULE = (  # fixed in lab/README.md section 11 before the sweep ran
    "Partial-rollout rule (issue 52), fixed before the sweep ran. The first level trains on whole responses, the "
    "other on partial ones (--partial-rollout) at the same --max-staleness, so a response's tokens come from two "
    "versions or more. Each preset is read against itself on whole responses by the two tests of the paired rule: it "
    "*holds* when its mean final eval acc is not below its whole-response row by more than max(2 × pooled std, 0.05) "
    "**and** the paired 95 % interval of its (partial − whole) difference does not lie wholly below 0; it *loses* "
    "when both say below; otherwise *undecided*. The question, do sequence-level corrections lose what token-level "
    f"ones keep when a sequence mixes versions, is answered *yes* when at least one token-level arm "
    f"({', '.join(PARTIAL_TOKEN_ARMS)}) holds and every sequence-level arm ({', '.join(PARTIAL_SEQUENCE_ARMS)}) "
    "loses; *no* when every sequence-level arm holds; otherwise *undecided*. Naive is read the same way and reported, "
    "not counted. Partial rollouts also carry some tokens one version further (their staleness is logged: "
    "`rollout/token_staleness_mean`), so a loss that every arm shares is the extra lag, not the mixture."
)


REPLAY_VS_STALENESS_RULE = (  # fixed in lab/README.md section 13 before the sweep ran (issue 48 item 4)
    "Replay against staleness on one base (issue 48), fixed before the sweep ran. Three levels: the synchronous loop "
    "(k = 0, the reference), staleness alone (every sample k versions old) and a replay buffer at k = 0 (a mixture of "
    "versions whose mean age is close to k; each fresh group trained on about 1/(1 − f) times, the reuse staleness "
    "does not have: reported, not held equal). Every comparison by the paired rule's two tests (section 10). (1) "
    "Each preset at each of the two off-policy levels against its own k = 0 row: *holds* when neither the margin nor "
    "the paired interval says below, *below* when both do, else *undecided*. (2) Each preset's replay row against its "
    "staleness row: replay *costs more* when both tests say below, *costs less* when both say above, *no difference "
    "found* when neither says either, else *undecided*. (3) The sweep says *replay costs more than staleness of the "
    "same mean age* when naive and at least two corrected presets cost more, *not* when no preset does and at least "
    "three find no difference, otherwise *undecided*."
)


def _replays(sweep: dict, level: str) -> bool:
    return float(level_value(MISMATCH, level, "replay_fraction") or 0) > 0


def is_replay_vs_staleness(sweep: dict) -> bool:
    """A mismatch sweep of three levels, the synchronous loop first, then a staleness level and a replay level in
    either order (REPLAY_VS_STALENESS_RULE; lab/split's four levels are the split rule's)."""
    if sweep["dial"] != MISMATCH or len(sweep["levels"]) != 3:
        return False
    stale = [lv for lv in sweep["levels"] if int(level_value(MISMATCH, lv, "max_staleness") or 0) > 0]
    return any(_replays(sweep, lv) for lv in sweep["levels"]) and any(not _replays(sweep, lv) for lv in stale)


def replay_vs_staleness_verdicts(rows: list[dict], sweep: dict) -> list[str]:
    """REPLAY_VS_STALENESS_RULE: (1) each preset's holds at both off-policy levels, (2) replay against staleness per
    preset, (3) the sweep's answer."""
    by, lines = {(r["preset"], r["level"]): r for r in rows}, ["Verdicts (the rule above, applied):"]
    ref = sweep["levels"][0]
    replay = next(lv for lv in sweep["levels"] if _replays(sweep, lv))
    stale = next(lv for lv in sweep["levels"] if lv != ref and not _replays(sweep, lv))
    sides = {}
    for p in sweep["presets"]:
        lines.append(f"- `{p}`:")
        for level in (stale, replay):
            _, text = _read(by, (p, level), (p, ref), sweep, paired_hold)
            lines.append(f"  - `{level_title(sweep, level)}` against k = 0 (hold): {text}")
        sides[p], text = _read_sides(by, (p, replay), (p, stale), sweep)
        lines.append(f"  - replay against staleness: {text}")
    naive = [sides[p] for p in sweep["presets"] if is_naive(p)]
    corrected = [sides[p] for p in sweep["presets"] if not is_naive(p)]
    answer = (
        "yes"
        if naive and all(v == "below" for v in naive) and corrected.count("below") >= 2
        else "no"
        if "below" not in sides.values() and list(sides.values()).count("no difference found") >= 3
        else "undecided"
    )
    lines.append(f"- replay costs more than staleness of the same mean age: **{answer}**")
    return lines


def is_partial(sweep: dict) -> bool:
    """A partial-rollout sweep (PARTIAL_RULE): a mismatch sweep one of whose levels sets partial_rollout=true."""
    return sweep["dial"] == MISMATCH and any(
        (level_value(MISMATCH, lv, "partial_rollout") or "").lower() == "true" for lv in sweep["levels"]
    )


def partial_verdicts(rows: list[dict], sweep: dict) -> list[str]:
    """PARTIAL_RULE at each partial level: every preset against itself on whole responses (the first level, by
    paired_hold's two tests), then the answer from the token-level and sequence-level arms."""
    by, lines = {(r["preset"], r["level"]): r for r in rows}, ["Verdicts (the rule above, applied):"]
    name = {"holds": "holds", "below": "loses", "undecided": "undecided", None: "not run"}
    for level in compared_levels(sweep):
        ref, read = reference_level(sweep, level), {}
        lines.append(f"- `{level_title(sweep, level)}` against `{level_title(sweep, ref)}`:")
        for p in sweep["presets"]:
            read[p], text = _read(by, (p, level), (p, ref), sweep, paired_hold)
            lines.append(f"  - `{p}`: {text}")
        tokens = [name[read.get(p)] for p in PARTIAL_TOKEN_ARMS]
        sequences = [name[read.get(p)] for p in PARTIAL_SEQUENCE_ARMS]
        answer = (
            "yes"
            if "holds" in tokens and all(v == "loses" for v in sequences)
            else "no"
            if all(v == "holds" for v in sequences)
            else "undecided"
        )
        lines.append(
            f"  - token-level arms: {', '.join(tokens)}; sequence-level arms: {', '.join(sequences)} → sequence-level "
            f"corrections lose what token-level ones keep: **{answer}**"
        )
    return lines


def paired_staleness_verdicts(rows: list[dict], sweep: dict) -> list[str]:
    """PAIRED_STALENESS_RULE applied at each level after the first (sweep_rule `paired`): naive against its own k = 0
    row (breaks?), each corrected preset against its own k = 0 row (hold) and against naive at the same k (repair),
    then the level's verdict (paired_reproduction)."""
    by = {(r["preset"], r["level"]): r for r in rows}
    naive = next(p for p in sweep["presets"] if is_naive(p))
    lines = ["Verdicts (the rule above, applied):"]
    for level in compared_levels(sweep):
        ref = reference_level(sweep, level)
        broke, text = _read(by, (naive, level), (naive, ref), sweep, paired_hold)
        lines.append(f"- `{level_title(sweep, level)}`: `{naive}` against its own k = 0: {text}")
        held, repaired = {}, {}
        for p in (p for p in sweep["presets"] if not is_naive(p)):
            held[p], text = _read(by, (p, level), (p, ref), sweep, paired_hold)
            lines.append(f"  - `{p}` against its own k = 0 (hold): {text}")
            repaired[p], text = _read(by, (p, level), (naive, level), sweep, paired_repair, above=True)
            lines.append(f"  - `{p}` against `{naive}` at this k (repair): {text}")
        lines.append(_paired_level_line(broke, held, repaired))
    return lines


def _paired_level_line(broke: str | None, held: dict, repaired: dict) -> str:
    """The last line of a level under PAIRED_STALENESS_RULE from naive's paired_hold (`broke`) and each corrected
    preset's hold and repair: naive's break, who repairs and holds (and who is undecided), the level's verdict."""

    def names(verdicts: dict, verdict: str) -> str:
        return ", ".join(f"`{p}`" for p, v in verdicts.items() if v == verdict) or "none"

    verdict = paired_reproduction(broke, list(repaired.values()))
    return (
        f"  - naive {BREAKS[broke]}; repair: {names(repaired, 'repairs')} (undecided: {names(repaired, 'undecided')}); "
        f"hold: {names(held, 'holds')} (undecided: {names(held, 'undecided')}) → **{verdict}**"
    )


def refused_lines(sweep: dict) -> list[str]:
    """The cells the sweep did not launch because rc_train.py refuses them (refused_cells), each with its reason;
    nothing when there are none."""
    cells = sweep.get("refused", [])
    if not cells:
        return []
    head = "Not launched, so not in the table: rc_train.py refuses these cells before anything starts (its own checks):"
    lines = ["", head]
    return lines + [f"- `{c['preset']}` at `{level_title(sweep, c['level'])}`: refused: {c['reason']}" for c in cells]


def _column(rows: list[dict], key: str) -> np.ndarray:
    """`key` of each row as floats (NaN where missing)."""
    return np.array([np.nan if r.get(key) is None else r[key] for r in rows], dtype=float)


def plot_against_staleness(rows: list[dict], sweep: dict, path: str) -> str:
    """The summary against k = --max-staleness, one line per preset: final eval acc (mean ± std over seeds), final
    reward, and alpha_0 (solid) / alpha_1 (dashed) on a log axis. k is placed evenly (0, 1, 2, 4, 8 read as a
    doubling)."""
    fig, axes = _new_figure(3, sharey=False)
    levels = sweep["levels"]
    x = np.arange(len(levels))
    by = {(r["preset"], r["level"]): r for r in rows}
    for i, preset in enumerate(sweep["presets"]):
        color, at = f"C{i % 10}", [by.get((preset, lv), {}) for lv in levels]  # {}: a refused cell, no point
        series = functools.partial(_column, at)
        std = np.nan_to_num(series("eval_acc_std"))
        axes[0].errorbar(x, series("eval_acc"), yerr=std, color=color, label=preset, marker="o", capsize=3, lw=1.3)
        axes[1].errorbar(
            x, series("final_reward"), yerr=np.nan_to_num(series("final_reward_std")), color=color, marker="o",
            capsize=3, lw=1.3,
        )  # fmt: skip
        for key, style in (("alpha0", "-"), ("alpha1", "--")):
            vals = series(key)
            if np.any(vals > 0):
                axes[2].plot(x, vals, color=color, linestyle=style, marker="o", lw=1.3)
    if any(line.get_ydata().size for line in axes[2].get_lines()):
        axes[2].set_yscale("log", nonpositive="mask")
    for ax, ylabel in zip(axes, ("final eval acc (mean ± std)", "final reward (mean ± std)", "α₀ solid, α₁ dashed")):
        ax.set_xticks(x, [str(lv) for lv in levels])
        ax.set_xlabel("k = --max-staleness")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("staleness: results against the bound k (each point 3 seeds unless the table says otherwise)")
    fig.savefig(path, dpi=90)
    return path


def plot_is_hist(sweep: dict, path: str, step: int | None = None) -> str | None:
    """Histogram of the token IS ratio exp(log ratio) at `step` (default: the largest step all runs dumped),
    one panel per dial level, presets overlaid (seeds pooled). Returns None (with a note) if nothing to plot."""
    runs = [r for r in sweep["runs"] if r["records"]]
    if step is None:
        common = set.intersection(*[set(r["log_ratio"]) for r in runs]) if runs else set()
        if not common:
            print(
                "rc_lab: note: no log_ratio/step_N.npy shared by all runs (train with --dump-log-ratio-every K); "
                "is_hist.png skipped"
            )
            return None
        step = max(common)
    fig, axes = _new_figure(len(sweep["levels"]), sharey=False)
    drawn = False
    for ax, level in zip(axes, sweep["levels"]):
        ratios = {}
        for preset, color, group in _groups(sweep, level):
            arrays = [r["log_ratio"][step].astype(np.float64).ravel() for r in group if step in r["log_ratio"]]
            ratio = np.exp(np.clip(np.concatenate(arrays), -20, 20)) if arrays else np.zeros(0)
            if ratio.size:
                ratios[preset] = (color, ratio)
        if ratios:  # common bins over the bulk (0.1%-99.9% quantiles) so one outlier cannot squash the rest
            lo, hi = np.quantile(np.concatenate([r for _, r in ratios.values()]), [0.001, 0.999])
            bins = np.linspace(lo, hi if hi > lo else lo + 1e-6, 61)
            for preset, (color, ratio) in ratios.items():
                ax.hist(
                    np.clip(ratio, lo, hi), bins=bins, histtype="step", color=color, label=f"{preset} (n={ratio.size})"
                )
            drawn = True
        ax.set_yscale("log")
        ax.set_title(level_title(sweep, level), fontsize=10)
        ax.set_xlabel("token IS ratio π_trainer / π_rollout")
        if ratios:
            ax.legend(fontsize=7)
    if not drawn:
        print(f"rc_lab: note: no non-empty log_ratio/step_{step:06d}.npy; is_hist.png skipped")
        return None
    print(f"rc_lab: IS histogram at step {step}")
    axes[0].set_ylabel("tokens (log)")
    fig.suptitle(f"token IS ratio at step {step} (seeds pooled)")
    fig.savefig(path, dpi=90)
    return path


def report(out: str, reward_level: float = 0.5, hist_step: int | None = None) -> list[str]:
    """Write summary.md/.csv and the PNGs of a sweep folder; return the written paths."""
    sweep = load_sweep(out)
    rows = summarise(sweep, reward_level)
    written = list(write_summary(rows, sweep, out, reward_level))
    written.append(plot_curves(sweep, "reward/mean", os.path.join(out, "reward.png"), "reward/mean"))
    written.append(plot_curves(sweep, "rollout_corr/k3_kl", os.path.join(out, "k3.png"), "k3 KL", log=True))
    written.append(plot_alpha(sweep, os.path.join(out, "alpha.png")))
    if sweep["dial"] == STALENESS_DIAL:
        written.append(plot_against_staleness(rows, sweep, os.path.join(out, "staleness.png")))
    hist = plot_is_hist(sweep, os.path.join(out, "is_hist.png"), hist_step)
    written += [hist] if hist else []
    lengths = length_rows(sweep)
    if any(r["T"] > 1 for r in lengths):  # one-token answers have no length law to show
        fits = length_fits(lengths)
        written += [*write_length_summary(lengths, fits, sweep, out), *plot_length(lengths, out, fits)]
    with open(written[1]) as f:
        print(f.read())
    print("rc_lab: wrote " + ", ".join(written))
    return written


# ---------------------------------------------------------------------------------------------
# Report: length (from the log-ratio dumps of runs trained with --dump-log-ratio-every)
# ---------------------------------------------------------------------------------------------
# The two sequence gates of the length trap (docs/corrections.md §12.8), at their presets' thresholds (§9.2): the
# sequence-sum k1 gate of decoupled_seq_is_rs (rho_seq in [0.5, 2]) and Geo-RS of decoupled_geo_rs (geometric-mean
# ratio in [0.999, 1.001]).
GATES = {"seq_sum_k1": "0.5_2.0", "seq_mean_k1": "0.999_1.001"}
LENGTH_BIN = 8  # response lengths are grouped in bins of this many tokens
MIN_BIN_ROWS = 30  # a (run, bin) with fewer responses over its dumped steps is left out


def load_dumps(run: dict) -> list[tuple[np.ndarray, np.ndarray]]:
    """(flat token log-ratios float64, row lengths int64) of every step of a load_sweep run (or read_run_folder's
    dict) with both dumps (log_ratio/ and log_ratio/lengths/), in step order."""
    out = []
    for step in sorted(run["lengths"]):
        if step in run["log_ratio"]:
            flat, lengths = run["log_ratio"][step].astype(np.float64), run["lengths"][step].astype(np.int64)
            if lengths.sum() != flat.size:
                raise LabError(
                    f"{run['name']}: the lengths of step {step} add up to {lengths.sum()}, but its "
                    f"log_ratio dump has {flat.size} tokens"
                )
            out.append((flat, lengths))
    return out


def padded(flat: np.ndarray, lengths: np.ndarray):
    """(log-ratio (n, T_max) float64, mask (n, T_max) bool) of rows laid one after another in `flat`."""
    import torch

    n, width = len(lengths), max(1, int(lengths.max(initial=0)))
    mask = torch.arange(width)[None, :] < torch.as_tensor(lengths)[:, None]
    ell = torch.zeros((n, width), dtype=torch.float64)
    ell[mask] = torch.as_tensor(flat)
    return ell, mask


def length_stats(flat: np.ndarray, lengths: np.ndarray) -> dict:
    """The length-lab numbers of one set of responses, through rc_core's own formulas (docs/corrections.md §6.4,
    §12.10; the law and its conditions: §12.11): chi2 per token and per sequence, the law's (1 + chi2_token)^T - 1
    averaged over the rows, the Kish ESS (fraction of n) of token- and of sequence-level weights, and the row
    rejection rates of GATES."""
    import rc_core

    ell, mask = padded(flat, lengths)
    rows = mask.any(dim=-1)
    chi2_token = float(rc_core.chi2_divergence(ell, mask))
    seq = rc_core.sequence_log_ratio(ell, mask)
    out = {
        "n_rows": int(rows.sum()),
        "T": float(lengths[lengths > 0].mean()),
        "chi2_token": chi2_token,
        "chi2_seq": float(rc_core.chi2_divergence(seq, rows)),
        "law": float(np.mean((1.0 + chi2_token) ** lengths[lengths > 0]) - 1.0),
        "ess_seq": kish_ess(seq[rows]),
        "ess_token": kish_ess(ell[mask]),
    }
    for name, threshold in GATES.items():
        keep, _ = rc_core.compute_rejection_mask(ell, mask, rc_core.parse_rs_options(name, threshold))
        out["reject_" + name] = float((mask & ~keep).any(dim=-1)[rows].double().mean())
    return out


def kish_ess(log_weight) -> float:
    """Kish ESS as a fraction of n, (sum w)^2 / (n sum w^2), of the weights w = exp(clip_S(log_weight)) (§12.10)."""
    import rc_core

    w = np.exp(rc_core.safety_clip(log_weight).numpy())
    return float(w.sum() ** 2 / (len(w) * (w**2).sum()))


def length_rows(sweep: dict, bin_width: int = LENGTH_BIN) -> list[dict]:
    """Per (preset, level, length bin): length_stats per seed (its dumped steps pooled), then mean and sample std
    over seeds; plus per (preset, level) the pooled chi2_token. Empty if no run has dumps with lengths."""
    result = []
    for preset in sweep["presets"]:
        for level in sweep["levels"]:
            per_seed = {}
            for run in sweep["runs"]:
                if run["preset"] != preset or run["level"] != level:
                    continue
                dumps = load_dumps(run)
                if not dumps:
                    continue
                flat = np.concatenate([d[0] for d in dumps])
                lengths = np.concatenate([d[1] for d in dumps])
                starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
                for b in sorted(set((lengths[lengths > 0] // bin_width).tolist())):
                    sel = np.nonzero((lengths // bin_width == b) & (lengths > 0))[0]
                    if len(sel) < MIN_BIN_ROWS:
                        continue
                    tokens = np.concatenate([flat[starts[i] : starts[i] + lengths[i]] for i in sel])
                    per_seed.setdefault(b, []).append(length_stats(tokens, lengths[sel]))
            for b, stats in sorted(per_seed.items()):
                row = {
                    "preset": preset,
                    "level": level,
                    "bin": f"{b * bin_width}–{(b + 1) * bin_width - 1}",
                    "n_seeds": len(stats),
                    "n_rows": sum(x["n_rows"] for x in stats),
                }
                for key in (
                    "T",
                    "chi2_token",
                    "chi2_seq",
                    "law",
                    "ess_seq",
                    "ess_token",
                    *("reject_" + g for g in GATES),
                ):
                    row[key], row[key + "_std"], _ = _mean_std([x[key] for x in stats])
                result.append(row)
    return result


def length_fits(rows: list[dict]) -> list[dict]:
    """Per (preset, level): least-squares slope b of log(1 + chi2_seq) = b T through the origin over the bins, the
    law's slope b0 = log(1 + chi2_token) (chi2_token averaged over the bins, weighted by rows), their ratio, and the
    change of each gate's rejection rate from the shortest to the longest bin with its noise (2 x pooled std)."""
    fits = []
    for key in dict.fromkeys((r["preset"], r["level"]) for r in rows):
        cell = [r for r in rows if (r["preset"], r["level"]) == key]
        T = np.array([r["T"] for r in cell])
        y = np.log1p(np.maximum(np.array([r["chi2_seq"] for r in cell]), -1 + 1e-12))
        n = np.array([r["n_rows"] for r in cell], dtype=float)
        b = float((T * y).sum() / (T * T).sum())
        b0 = float(np.log1p(np.average([r["chi2_token"] for r in cell], weights=n)))
        fit = {
            "preset": key[0],
            "level": key[1],
            "bins": len(cell),
            "T_min": float(T.min()),
            "T_max": float(T.max()),
            "slope": b,
            "law_slope": b0,
            "slope_ratio": b / b0 if b0 > 0 else None,
        }
        first, last = cell[0], cell[-1]
        for g in GATES:
            k = "reject_" + g
            noise = 2 * math.sqrt(((first[k + "_std"] or 0) ** 2 + (last[k + "_std"] or 0) ** 2) / 2)
            fit[k + "_change"], fit[k + "_noise"] = last[k] - first[k], noise
        fits.append(fit)
    return fits


LENGTH_COLUMNS = (  # (key, csv header, markdown header, format); `key_std` is shown as ± when present
    ("preset", "preset", "preset", "{}"),
    ("level", "level", "level", "{}"),
    ("bin", "length_bin", "T bin", "{}"),
    ("n_rows", "n_rows", "responses", "{}"),
    ("T", "T_mean", "T̄", "{:.1f}"),
    ("chi2_token", "chi2_token", "χ²_token", "{:.2e}"),
    ("chi2_seq", "chi2_seq", "χ²_seq", "{:.3g}"),
    ("law", "law_(1+chi2_token)^T-1", "(1+χ²_tok)^T−1", "{:.3g}"),
    ("ess_token", "ess_token", "ESS token", "{:.3f}"),
    ("ess_seq", "ess_seq", "ESS seq", "{:.3f}"),
    ("reject_seq_sum_k1", "reject_seq_sum_k1", "rejected: seq_sum_k1", "{:.3f}"),
    ("reject_seq_mean_k1", "reject_seq_mean_k1", "rejected: seq_mean_k1 (Geo-RS)", "{:.3f}"),
)


def write_length_summary(rows: list[dict], fits: list[dict], sweep: dict, out: str) -> tuple[str, str]:
    """out/length.csv (every bin, with the stds; floats to CSV_DIGITS significant digits and LENGTH_CSV_DECIMALS
    decimal places, csv_cell) and out/length.md (rule, table, fits)."""
    csv_path, md_path = os.path.join(out, "length.csv"), os.path.join(out, "length.md")
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        keys = [c[0] for c in LENGTH_COLUMNS] + [c[0] + "_std" for c in LENGTH_COLUMNS if c[0] + "_std" in rows[0]]
        w.writerow([c[1] for c in LENGTH_COLUMNS] + [k for k in keys[len(LENGTH_COLUMNS) :]])
        w.writerows([[csv_cell(r.get(k), LENGTH_CSV_DECIMALS) for k in keys] for r in rows])
    gates = ", ".join(f"`{g}` at {t}" for g, t in GATES.items())
    rule = (
        "**Reading rule (fixed before the runs).** *Length law*: if token ratios were independent, "
        "χ²_seq = (1 + χ²_token)^T − 1, i.e. log(1 + χ²_seq) = b·T with b = log(1 + χ²_token). The law holds "
        "for a cell when the least-squares slope b (through the origin, over the length bins) is within a factor "
        "2 of b₀ = log(1 + χ²_token). *Length trap*: a gate's rejection rate rises with length when the change "
        "from the shortest to the longest bin exceeds max(2 × pooled std over seeds, 0.05); it is flat when "
        f"the change is within that. Gates: {gates} (ρ_seq resp. geometric-mean ratio bounds)."
    )
    cols = LENGTH_COLUMNS
    lines = [
        f"# Length lab: dial `{sweep['dial']}`, {len(sweep['seeds'])} seed(s)",
        "",
        rule,
        "",
        "| " + " | ".join(c[2] for c in cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in rows:
        cells = []
        for key, _, _, fmt in cols:
            cell = _fmt(r.get(key), fmt)
            if r.get(key + "_std") is not None and key not in ("T",):
                cell += " ± " + fmt.format(r[key + "_std"])
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        (
            "| preset | level | bins | T range | slope b | law b₀ | b/b₀ | law | Δ reject seq_sum_k1 | "
            "Δ reject seq_mean_k1 |"
        ),
        "|" + "---|" * 10,
    ]
    for f in fits:
        law = DASH if f["slope_ratio"] is None else ("holds" if 0.5 <= f["slope_ratio"] <= 2 else "fails")
        trap = []
        for g in GATES:
            c, nz = f[f"reject_{g}_change"], f[f"reject_{g}_noise"]
            trap.append(f"{c:+.3f} ({'rises' if c > max(nz, 0.05) else 'falls' if c < -max(nz, 0.05) else 'flat'})")
        lines.append(
            f"| {f['preset']} | {f['level']} | {f['bins']} | {f['T_min']:.0f}–{f['T_max']:.0f} | "
            f"{f['slope']:.3e} | {f['law_slope']:.3e} | {_fmt(f['slope_ratio'], '{:.2f}')} | {law} | "
            + " | ".join(trap)
            + " |"
        )
    lines += [
        "",
        (
            f"Rows: responses of every dumped step (`log_ratio/step_N.npy` with `log_ratio/lengths/`), grouped by "
            f"length T in bins of {LENGTH_BIN} tokens; a (run, bin) with fewer than {MIN_BIN_ROWS} responses is left "
            "out. Each number is computed per seed with rc_core's formulas (χ² with the ±20 safety clip, "
            "docs/corrections.md §6.4) and shown as mean ± sample std over seeds; the law column averages "
            "(1 + χ²_token)^{T_i} − 1 over the bin's responses. ESS: Kish effective sample size as a fraction of n "
            "(§12.10) of the token weights ρ_t and of the sequence weights ∏ρ_t. Rejected: share of the bin's "
            "responses the gate would mask (computed offline, whatever the run's own preset)."
        ),
        "",
    ]
    with open(md_path, "w") as f:
        f.write("\n".join(lines))
    return csv_path, md_path


def plot_length(rows: list[dict], out: str, fits: list[dict] | None = None) -> list[str]:
    """length_law.png (chi2_seq measured, the law (1 + chi2_token)^T - 1 with the cell's chi2_token and the fitted
    e^(bT) - 1 from length_fits; ESS of token vs sequence weights) and length_trap.png (rejection rate of each
    gate), against the mean length of each bin, one colour per (preset, level)."""
    cells = list(dict.fromkeys((r["preset"], r["level"]) for r in rows))
    law_fig, axes = _new_figure(2, sharey=False)
    ax_chi, ax_ess = axes
    trap_fig, trap_axes = _new_figure(1)
    for i, cell in enumerate(cells):
        c, label = f"C{i % 10}", cell[1] if len({p for p, _ in cells}) == 1 else f"{cell[0]} {cell[1]}"
        sel = [r for r in rows if (r["preset"], r["level"]) == cell]
        T = [r["T"] for r in sel]
        ax_chi.errorbar(
            T,
            [r["chi2_seq"] for r in sel],
            yerr=[r["chi2_seq_std"] or 0 for r in sel],
            fmt="o",
            color=c,
            label=f"{label}: measured",
            capsize=2,
        )
        fit = next((f for f in fits or [] if (f["preset"], f["level"]) == cell), None)
        if fit is not None and fit["law_slope"] > 0:  # smooth curves over the cell's length range
            grid = np.linspace(min(T), max(T), 50)
            ax_chi.plot(grid, np.expm1(fit["law_slope"] * grid), "--", color=c, label=f"{label}: (1+χ²_tok)^T−1")
            ax_chi.plot(grid, np.expm1(fit["slope"] * grid), ":", color=c, label=f"{label}: fit e^(bT)−1")
        ax_ess.plot(T, [r["ess_seq"] for r in sel], "o-", color=c, label=f"{label}: sequence")
        ax_ess.plot(T, [r["ess_token"] for r in sel], "s--", color=c, label=f"{label}: token")
        for g, style in (("seq_sum_k1", "o-"), ("seq_mean_k1", "s--")):
            trap_axes[0].errorbar(
                T,
                [r["reject_" + g] for r in sel],
                yerr=[r["reject_" + g + "_std"] or 0 for r in sel],
                fmt=style,
                color=c,
                capsize=2,
                label=f"{label}: {g} {GATES[g]}",
            )
    ax_chi.set_yscale("log", nonpositive="mask")
    ax_chi.set(xlabel="response length T (bin mean)", ylabel="χ²_seq (log)", title="length law")
    ax_ess.set(xlabel="response length T (bin mean)", ylabel="ESS / n", title="effective sample size")
    trap_axes[0].set(
        xlabel="response length T (bin mean)",
        ylabel="rejected share of responses",
        title="length trap: sequence-sum gate vs Geo-RS",
    )
    for ax in (ax_chi, ax_ess, trap_axes[0]):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    law_fig.suptitle("mean over seeds (error bars: sample std)")
    paths = [os.path.join(out, "length_law.png"), os.path.join(out, "length_trap.png")]
    law_fig.savefig(paths[0], dpi=90)
    trap_fig.savefig(paths[1], dpi=90)
    return paths


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lab.rc_lab", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser(
        "sweep",
        help="run presets x dial levels x seeds, then report",
        epilog="flags after `--` are passed verbatim to rc_train.py",
    )
    s.add_argument("--out", required=True, help="sweep folder (runs, logs, sweep.json, summary)")
    s.add_argument(
        "--presets",
        required=True,
        help="comma-separated rc_core.PRESET_NAMES, e.g. naive,decoupled_token_is; "
        "NAME+FIELD=VALUE adds a correction field, e.g. naive+rollout_token_veto_threshold=1e-4",
    )
    s.add_argument(
        "--dial",
        required=True,
        help="rc_train.py Args field, e.g. rollout_weight_noise, sync_every; or `mismatch`: "
        "each level is `none` or FIELD=VALUE[+FIELD=VALUE], e.g. rollout_dtype=bfloat16",
    )
    s.add_argument("--levels", required=True, help="comma-separated dial values, the zero-mismatch one first")
    s.add_argument("--seeds", default="1,2,3", help="comma-separated integer seeds (default 1,2,3)")
    s.add_argument("--jobs", type=int, default=1, help="runs in parallel (default 1)")
    s.add_argument("--steps", type=int, default=40, help="--num-steps of each run (default 40)")
    s.add_argument("--overwrite", action="store_true", help="re-run runs that are already complete")
    s.add_argument("--reward-level", type=float, default=0.5, help="reward level of the report (default 0.5)")
    s.add_argument(
        "--rule",
        choices=RULES,
        default="standard",
        help="reading rule of a --dial max_staleness sweep, kept in sweep.json: standard (STALENESS_RULE, default) or "
        "paired (PAIRED_STALENESS_RULE: the margin and the paired 95 %% interval over seeds must agree)",
    )
    r = sub.add_parser("report", help="summary table and plots of a sweep folder")
    r.add_argument("out", metavar="SWEEP_DIR")
    r.add_argument("--reward-level", type=float, default=0.5, help="'steps to reach' level (default 0.5)")
    r.add_argument("--hist-step", type=int, default=None, help="step of the IS histogram (default: largest common)")
    e = sub.add_parser(
        "export",
        help="write a sweep's metrics, configs and dumps to DEST in the compact form and "
        "report there (a few committable files that regenerate its tables and plots)",
    )
    e.add_argument("out", metavar="SWEEP_DIR")
    e.add_argument("dest", metavar="DEST")
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: 0 = success, 1 = some run failed, 2 = bad input (nothing started)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = ["python", "-m", "lab.rc_lab", *argv]  # as invoked (sweep.json's invocation record)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    try:
        if args.command in ("report", "export") and extra:
            raise LabError(f"extra flags {extra} are only for `sweep`")
        if args.command == "report":
            report(args.out, args.reward_level, args.hist_step)
            return 0
        if args.command == "export":
            export(args.out, args.dest)
            return 0
        spec = build_spec(args, extra)
        for cell in spec["refused"]:
            note = f"not launched, rc_train.py refuses {cell['preset']} at {cell['level']}: {cell['reason']}"
            print(f"rc_lab: note: {note}", file=sys.stderr)
        failed = run_sweep(spec, args.out, args.overwrite, command)
        report(args.out, args.reward_level)
        return 1 if failed else 0
    except LabError as e:
        print(f"rc_lab: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
