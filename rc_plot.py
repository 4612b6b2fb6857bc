"""Rollout-correction dashboard: plot the `metrics.jsonl` of one or more `rc_train.py` runs.

    python rc_plot.py runs/A                      # -> runs/A/dashboard.png
    python rc_plot.py runs/A runs/B --labels naive tis --smooth 5 --out cmp.png
    python rc_train.py plot runs/A runs/B         # same thing, through the trainer's entry point

One PNG with a grid of panels (the mismatch diagnostics of docs/corrections.md §6 and the collapse signatures the
lab reads, lab/README.md): reward, eval accuracy, IS-weight mean and std, effective sample size,
k1 / k3 mismatch KL, PPL ratio, chi-squared (token, sequence), masked fractions (RS, veto),
TV estimates (alpha_1 = `rollout_corr/tv_mismatch`, alpha_0 = `actor/tv_update` of the
three-policy bound), grad norm, staleness, response length, and the steps on which each health check
fired (`health/*`). Runs are overlaid, one colour per run in every panel; within a panel, several metrics
are told apart by line style. A panel whose metrics no run logged says "not logged" (e.g. IS panels
of a run without IS) instead of showing empty axes. The optional panels, which only some runs can fill (the replay
buffer of --replay-window, the routing of an MoE model), are drawn only when one of the plotted runs logged one of
their metrics; the figure's last line and the console name the ones left out, e.g. "optional panels not drawn (no
data in this run): Replay buffer (--replay-window), MoE routing (an MoE model)".

Reference lines are those of verl's usage guide ("Debugging: Visualizing Metrics"): the ideal IS mean
and PPL ratio 1.0, ESS 0.5 (good) and, wherever a panel shows a metric of `rc_core.HEALTH_CHECKS`,
the thresholds of that check (IS mean 0.5 and 2, IS std 1, ESS 0.3, |k1| 0.1, chi-squared 1), read
from `rc_core.HEALTH_CHECKS` when the panel is drawn (docs/corrections.md §6.7, docs/metrics.md
`health/`), so that the lines and the run-time alarms cannot disagree.

Rendering uses matplotlib's Agg canvas on a bare `Figure` (no pyplot global state), so it works
headless and inside the trainer process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

import rc_core

METRICS_FILE = "metrics.jsonl"
DEFAULT_OUT = "dashboard.png"


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------
def load_metrics(run_dir: str) -> list[dict]:
    """Read `run_dir/metrics.jsonl` into a list of per-step dicts (file order).

    * A missing run folder or metrics file raises FileNotFoundError naming the path.
    * Blank lines are ignored.
    * A line that is not a JSON object with a `step` key raises ValueError naming the file and
      its 1-based line number.
    * Exception: a last line that does not parse and has no trailing newline is what a run
      killed mid-write (or still writing) leaves behind; it is skipped with a warning.
    """
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"run folder not found: {run_dir}")
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"metrics file not found: {path}")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    lines = text.split("\n")  # the element after a final "\n" is ""; otherwise it is a partial line
    records: list[dict] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        lineno = i + 1
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:  # last line, no newline after it: truncated write
                warnings.warn(f"{path}:{lineno}: skipping truncated last line ({e.msg})", stacklevel=2)
                continue
            raise ValueError(f"{path}:{lineno}: malformed JSON line ({e.msg})") from e
        if not isinstance(rec, dict) or "step" not in rec:
            raise ValueError(f"{path}:{lineno}: expected a JSON object with a 'step' key")
        records.append(rec)
    return records


def describe_run(run_dir: str) -> str:
    """One-line summary of a run's rollout-correction settings from its `config.yaml` ('' if unavailable)."""
    path = os.path.join(run_dir, "config.yaml")
    # Optional decoration only: a missing or odd config must never break plotting.
    try:
        import yaml
    except ImportError:
        return ""
    try:
        with open(path, encoding="utf-8") as f:
            cfg = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return ""
    if not isinstance(cfg, dict):
        return ""
    args = cfg.get("args") or {}
    rc = cfg.get("rollout_correction") or {}
    parts = []
    preset = (args.get("rc") or {}).get("preset")
    if preset:
        parts.append(f"preset={preset}")
    if rc:
        parts.append("bypass" if rc.get("bypass_mode") else "decoupled")
        parts.append(f"IS={rc.get('rollout_is')}")
        if rc.get("rollout_is"):
            parts[-1] += f"(C={rc.get('rollout_is_threshold')})"
        parts.append(f"RS={rc.get('rollout_rs')}")
        if rc.get("rollout_token_veto_threshold"):
            parts.append(f"veto={rc.get('rollout_token_veto_threshold')}")
    for k in ("task", "model"):
        if args.get(k):
            parts.append(f"{k}={args[k]}")
    return ", ".join(str(p) for p in parts)


# ---------------------------------------------------------------------------------------------
# Panel data
# ---------------------------------------------------------------------------------------------
def smooth_values(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average: out[i] = mean(values[max(0, i-window+1) : i+1]).

    The first window-1 points average over what is available, so the output has the input's
    length and no edge NaNs. window <= 1 returns the values unchanged (as float).
    """
    v = np.asarray(values, dtype=float)
    if window <= 1 or v.size == 0:
        return v
    csum = np.concatenate([[0.0], np.cumsum(v)])
    idx = np.arange(1, v.size + 1)
    lo = np.maximum(idx - window, 0)
    return (csum[idx] - csum[lo]) / (idx - lo)


def _as_number(x) -> float | None:
    """x as a finite float, or None for absent / null / non-numeric / NaN / inf values."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def run_series(records: Sequence[dict], key: str, smooth: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of one metric in one run, sorted by step.

    Steps where `key` is absent, null, or not a finite number are skipped (eval metrics exist only
    on eval steps; IS/RS metrics only when those corrections are on). If a step occurs more than
    once (e.g. a resumed run), its last record wins. Smoothing (trailing moving average over
    `smooth` points) is applied to the kept points.
    """
    by_step: dict[int, float] = {}
    for rec in records:
        v = _as_number(rec.get(key))
        if v is not None:
            by_step[int(rec["step"])] = v
    steps = np.array(sorted(by_step), dtype=int)
    values = np.array([by_step[s] for s in steps], dtype=float)
    return steps, smooth_values(values, smooth)


def dashboard_series(runs: Sequence[Sequence[dict]], key: str, smooth: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    """`run_series` for each run: the exact (steps, values) the dashboard draws for `key`."""
    return [run_series(records, key, smooth) for records in runs]


# ---------------------------------------------------------------------------------------------
# Dashboard layout
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Series:
    """One metric drawn in a panel; `style` tells it apart from the panel's other metrics."""

    key: str
    name: str
    style: str = "-"
    marker: str | None = None


class RefLine(NamedTuple):
    """A fixed reference line of a panel: its y, its name in the panel's key, its colour."""

    y: float
    label: str
    color: str = "0.45"


REF_COLOR = "0.45"  # ideal values (IS mean 1.0, PPL ratio 1.0, KL 0)
GOOD_COLOR = "#2e7d32"  # the guide's "good" line (ESS 0.5)
WARN_COLOR = "#b71c1c"  # a health check's threshold
REF_STYLE = ":"  # every reference line is dotted: runs are drawn solid or dashed


@dataclass(frozen=True)
class Panel:
    """One axis of the dashboard.

    scale: "linear", "log" (used only if some value is positive; non-positive points are hidden),
    or "symlog" (for signed quantities spanning decades, e.g. the k1 KL estimate).
    smooth: whether the --smooth moving average applies (not for sparse eval points).
    hlines: fixed reference lines, e.g. the ideal IS mean 1.0 or the ESS the guide calls good, 0.5.
    health: names of rc_core.HEALTH_CHECKS whose thresholds are drawn (warning colour); they are
    read from HEALTH_CHECKS when the panel is drawn, never copied here. The check's metric must be
    one of the panel's series (tests/test_plot.py checks it).
    kind: "lines" (metrics against steps) or "health" (the steps on which each series, a health/*
    record, is 1.0: the check fired).
    min_span: y-range always shown (widened to fit the data), e.g. (0, 1) for accuracies, so that a
    few equal points do not produce a meaningless +-0.05 axis around them.
    needs: the feature a run must use for the panel to have data (a key of NEEDS), or "" for every run: "moe" (the
    routing metrics of an MoE run, docs/moe.md), "replay" (--replay-window, docs/async.md §8), "split"
    (--mismatch-split, docs/corrections.md §6.9). Such an optional panel
    is drawn only if a plotted run logged one of its metrics (`drawn_panels`); the others always are.
    """

    title: str
    ylabel: str
    series: tuple[Series, ...]
    scale: str = "linear"
    smooth: bool = True
    hlines: tuple[RefLine, ...] = ()
    health: tuple[str, ...] = ()
    kind: str = "lines"
    min_span: tuple[float, float] | None = None
    needs: str = ""


PANELS: tuple[Panel, ...] = (
    Panel("Reward", "reward", (Series("reward/mean", "mean"), Series("reward/correct", "correct", "--"))),
    Panel(
        "Eval accuracy",
        "accuracy",
        (
            Series("eval/accuracy", "accuracy", "-", "o"),
            Series("eval/accuracy_strict", "strict", "-", "o"),
            Series("eval/accuracy_flexible", "flexible", "--", "s"),
        ),
        smooth=False,
        min_span=(0.0, 1.0),
    ),
    Panel(
        "IS weight mean",
        "mean IS weight",
        (Series("rollout_corr/rollout_is_mean", "IS mean"),),
        hlines=(RefLine(1.0, "ideal 1.0"),),
        health=("health/is_mean",),
    ),
    Panel(
        "IS weight std",
        "std of IS weights",
        (Series("rollout_corr/rollout_is_std", "IS std"),),
        health=("health/is_std",),
    ),
    Panel(
        "Effective sample size",
        "ESS (fraction of batch)",
        (Series("rollout_corr/rollout_is_eff_sample_size", "ESS"),),
        hlines=(RefLine(0.5, "good ≥ 0.5", GOOD_COLOR),),
        health=("health/is_ess",),
    ),
    Panel(
        "Mismatch KL k1 (rollout vs train)",
        "k1 KL",
        (Series("rollout_corr/kl", "k1"),),
        scale="symlog",
        hlines=(RefLine(0.0, ""),),
        health=("health/kl",),
    ),
    Panel(
        "Mismatch KL k3",
        "k3 KL",
        (Series("rollout_corr/k3_kl", "k3"), Series("rollout_corr/unreplayed_k3_kl", "k3 without MoE replay", "--")),
        scale="log",
    ),
    Panel(
        "PPL ratio (train / rollout)",
        "ppl ratio",
        (Series("rollout_corr/ppl_ratio", "ppl ratio"),),
        hlines=(RefLine(1.0, "ideal 1.0"),),
    ),
    Panel(
        "Chi-squared divergence",
        "χ²",
        (Series("rollout_corr/chi2_token", "token"), Series("rollout_corr/chi2_seq", "seq", "--")),
        scale="symlog",
        hlines=(RefLine(0.0, ""),),
        health=("health/chi2_token",),
    ),
    Panel(
        "Masked fractions",
        "fraction",
        (
            Series("rollout_corr/rollout_rs_masked_fraction", "RS masked"),
            Series("rollout_corr/rollout_is_veto_fraction", "veto", "--"),
        ),
        min_span=(0.0, 0.05),
    ),
    Panel(
        "TV estimates (three-policy bound)",
        "total variation",
        (
            Series("rollout_corr/tv_mismatch", "α₁ tv_mismatch"),
            Series("actor/tv_update", "α₀ tv_update", "--"),
            Series("rollout_corr/unreplayed_tv_mismatch", "α₁ without MoE replay", ":"),
        ),
    ),
    Panel("Grad norm", "grad norm", (Series("actor/grad_norm", "grad norm"),)),
    Panel(
        "Staleness (versions behind the trainer)",
        "versions",
        (
            Series("rollout/staleness_mean", "mean"),
            Series("rollout/staleness_max", "max", "--"),
            Series("rollout/token_staleness_mean", "token mean", ":"),  # --partial-rollout's (docs/async.md §9)
            Series("rollout/token_staleness_max", "token max", "-."),
            Series("rollout/versions_per_response", "versions/resp.", ":", "."),
            Series("rollout/spanning_responses", "spanning share", ":", "x"),
        ),
        min_span=(0.0, 1.0),
    ),
    Panel(
        "Replay buffer",
        "share of the batch",
        (Series("rollout/replayed_fraction", "replayed"),),
        min_span=(0.0, 1.0),
        needs="replay",
    ),
    Panel("Response length", "tokens (mean)", (Series("response_length/mean", "mean length"),)),
    Panel(
        "Health checks fired",
        "",
        tuple(Series(name, name.removeprefix("health/")) for name in rc_core.HEALTH_CHECKS),
        smooth=False,
        kind="health",
    ),
    Panel(
        "MoE routing (trainer vs engine)",
        "share",
        (
            Series("rollout_corr/routing_agreement", "routing agreement"),
            Series("rollout_corr/routing_flip_token_fraction", "tokens whose position flipped", "--"),
        ),
        min_span=(0.0, 1.0),
        needs="moe",
    ),
    Panel(
        "Mismatch split (α₁ = numerics + staleness)",
        "total variation",
        (
            Series("rollout_corr/numerics_tv", "numerics TV(π_v, μ)"),
            Series("rollout_corr/staleness_tv", "staleness TV(π_t, π_v)", "--"),
        ),
        needs="split",
    ),
)
NEEDS = {
    "replay": "--replay-window",
    "moe": "an MoE model",
    "split": "--mismatch-split",
}  # Panel.needs -> what fills it, for the note
NCOLS = 4
TITLE_PAD = 16  # points between axes and title: room for the per-panel style key


def _symlog_linthresh(values: np.ndarray) -> float:
    """Linear range of a symlog axis: a power of ten near the small end of the nonzero |values|."""
    nz = np.abs(values[values != 0])
    if nz.size == 0:
        return 1.0
    return float(10.0 ** math.floor(math.log10(np.percentile(nz, 10))))


def health_thresholds(name: str) -> tuple[list[float], str]:
    """The y values of the thresholds of check `name` of rc_core.HEALTH_CHECKS, read now, and their
    key text: IS mean -> [0.5, 2.0], "warn < 0.5 or > 2"; |k1| -> [0.1, -0.1], "warn |x| > 0.1"."""
    check = rc_core.HEALTH_CHECKS[name]
    ys, parts = [], []
    for bound, sign in ((check.low, "<"), (check.high, ">")):
        if bound is None:
            continue
        ys += [bound, -bound] if check.absolute and bound != 0 else [bound]
        parts.append(f"{sign} {bound:g}")
    return ys, "warn " + ("|x| " if check.absolute else "") + " or ".join(parts)


def _not_logged(ax) -> None:
    ax.text(
        0.5,
        0.5,
        "not logged",
        transform=ax.transAxes,
        ha="center",
        va="center",
        fontsize=11,
        color="0.5",
        style="italic",
    )
    ax.set_yticks([])


def _style_key(ax, handles: list) -> None:
    """The panel's key, in the strip between title and axes so that it never covers data."""
    if handles:
        ax.legend(
            handles=handles,
            fontsize=7.5,
            loc="lower center",
            bbox_to_anchor=(0.5, 1.0),
            ncol=len(handles),
            frameon=False,
            handlelength=2.4,
            borderaxespad=0.1,
            columnspacing=1.2,
        )


def _draw_reference_lines(ax, panel: Panel, used_series: list) -> list:
    """The panel's fixed lines (gid "ref") and its health thresholds (gid = the check's name), each
    axhline dotted and included in the y-range; returns their key handles."""
    handles = []
    for line in panel.hlines:
        ax.axhline(line.y, color=line.color, linestyle=REF_STYLE, linewidth=1.0, zorder=0, gid="ref")
        if line.label:
            handles.append(Line2D([], [], color=line.color, linestyle=REF_STYLE, label=line.label))
    for name in panel.health:
        ys, label = health_thresholds(name)
        for y in ys:
            ax.axhline(y, color=WARN_COLOR, linestyle=REF_STYLE, linewidth=1.2, zorder=0, gid=name)
        metric = rc_core.HEALTH_CHECKS[name].metric
        named = [s.name for s in used_series if s.key == metric and len(panel.series) > 1]
        label = " ".join(named + [label])
        handles.append(Line2D([], [], color=WARN_COLOR, linestyle=REF_STYLE, linewidth=1.2, label=label))
    return handles


def health_events(records: Sequence[dict], name: str) -> tuple[np.ndarray, bool]:
    """(steps on which health check `name` fired, whether the run logged the check at all).
    rc_run.HealthWatch logs 1.0 on a firing step, 0.0 where the metric passed, nothing where the
    correction has no such metric."""
    steps, values = run_series(records, name)
    return steps[values > 0.5], steps.size > 0


def _draw_health_panel(ax, panel: Panel, runs: Sequence[Sequence[dict]], colors: list) -> bool:
    """One row per series of the panel (the checks of rc_core.HEALTH_CHECKS, top to bottom in its
    order), a mark on each step where it fired, one colour per run (runs a little apart vertically);
    a check no run logged is labelled "(not logged)". "not logged" if no run has any health/* key
    (a run from before the check, or one whose correction logs none of its metrics)."""
    names = [s.key for s in panel.series]
    ax.set_title(panel.title, fontsize=10, pad=TITLE_PAD)
    ax.tick_params(labelsize=8)
    events = {name: [health_events(records, name) for records in runs] for name in names}
    if not any(logged for per_run in events.values() for _, logged in per_run):
        _not_logged(ax)
        return False
    fired_any = False
    spread = 0.5 / max(len(runs), 1)
    for row, name in enumerate(names):
        y = len(names) - 1 - row
        for r, ((steps, _), color) in enumerate(zip(events[name], colors)):
            if steps.size:
                fired_any = True
                offset = (r - (len(runs) - 1) / 2) * spread
                ax.plot(steps, np.full(steps.size, y + offset), linestyle="none", marker="|", markersize=9, color=color)
    labels = [s.name + ("" if any(logged for _, logged in events[s.key]) else " (not logged)") for s in panel.series]
    ax.set_yticks(range(len(names)), labels[::-1])
    ax.set_ylim(-0.7, len(names) - 0.3)
    if not fired_any:
        ax.text(0.5, 0.5, "none fired", transform=ax.transAxes, ha="center", va="center", fontsize=10, color="0.4")
    ax.grid(True, axis="x", alpha=0.3, linewidth=0.6)
    return True


def _draw_panel(ax, panel: Panel, runs: Sequence[Sequence[dict]], colors: list, smooth: int) -> bool:
    """Draw one panel; returns False (and writes "not logged") if no run has any of its metrics."""
    window = smooth if panel.smooth else 1
    drawn_values = []
    used_series = []
    for s in panel.series:
        per_run = dashboard_series(runs, s.key, window)
        if not any(len(steps) for steps, _ in per_run):
            continue
        used_series.append(s)
        for (steps, values), color in zip(per_run, colors):
            if len(steps) == 0:
                continue
            ax.plot(
                steps,
                values,
                color=color,
                linestyle=s.style,
                marker=s.marker,
                markersize=4 if s.marker else None,
                linewidth=1.4 if s.style == "-" else 1.2,
            )
            drawn_values.append(values)
    ax.set_title(panel.title, fontsize=10, pad=TITLE_PAD)
    ax.tick_params(labelsize=8)
    if not used_series:
        _not_logged(ax)
        return False
    reference_handles = _draw_reference_lines(ax, panel, used_series)
    values = np.concatenate(drawn_values)
    ylabel = panel.ylabel
    if panel.scale == "log" and np.any(values > 0):
        ax.set_yscale("log", nonpositive="mask")
        ylabel += " (log)"
    elif panel.scale == "symlog" and np.any(values != 0):
        ax.set_yscale("symlog", linthresh=_symlog_linthresh(values))
        ylabel += " (symlog)"
    else:  # linear: absolute tick labels (an offset like "1e-8+1" reads badly and collides with the title)
        ax.ticklabel_format(axis="y", useOffset=False)
        if panel.min_span is not None:
            lo, hi = panel.min_span
            pad = 0.04 * (max(hi, values.max()) - min(lo, values.min()))
            ax.set_ylim(min(lo, values.min()) - pad, max(hi, values.max()) + pad)
    ax.set_ylabel(ylabel, fontsize=9)
    # Style key (for panels defined with several metrics: the logged ones; plus named reference
    # lines and health thresholds), drawn in the strip between title and axes.
    handles = (
        [
            Line2D([], [], color="0.25", linestyle=s.style, marker=s.marker, markersize=4, label=s.name)
            for s in used_series
        ]
        if len(panel.series) > 1
        else []
    )
    _style_key(ax, handles + reference_handles)
    ax.grid(True, alpha=0.3, linewidth=0.6)
    return True


def panel_logged(panel: Panel, runs: Sequence[Sequence[dict]]) -> bool:
    """Whether any run logged any metric of the panel (a finite number on some step)."""
    return any(run_series(records, s.key)[0].size for s in panel.series for records in runs)


def drawn_panels(runs: Sequence[Sequence[dict]]) -> tuple[list[Panel], list[Panel]]:
    """(the panels the dashboard draws, in PANELS order; the optional ones it leaves out). A panel with `needs` is
    drawn only if a run logged one of its metrics; a panel without is always drawn ("not logged" if empty)."""
    drawn, left_out = [], []
    for panel in PANELS:
        (drawn if not panel.needs or panel_logged(panel, runs) else left_out).append(panel)
    return drawn, left_out


def left_out_note(left_out: Sequence[Panel], n_runs: int) -> str:
    """One line naming the optional panels not drawn and what fills each ('' if none):
    "optional panels not drawn (no data in this run): Replay buffer (--replay-window), MoE routing (an MoE model)"."""
    if not left_out:
        return ""
    where = "this run" if n_runs == 1 else "these runs"
    names = ", ".join(f"{p.title.split(' (')[0]} ({NEEDS[p.needs]})" for p in left_out)
    return f"optional panels not drawn (no data in {where}): {names}"


def build_dashboard(
    runs: Sequence[Sequence[dict]],
    labels: Sequence[str],
    smooth: int = 1,
    descriptions: Sequence[str] | None = None,
) -> Figure:
    """Lay out the panels of `drawn_panels` for already-loaded runs and return the (unsaved) Figure.

    Axes come in PANELS order, on a grid of NCOLS columns and as many rows as the drawn panels need;
    each run gets one colour (tab10 cycle) in every panel and one entry in the figure-level legend.
    `descriptions` (optional, per run) are appended to legend labels. The optional panels left out
    are named in one line at the bottom of the figure (`fig.get_supxlabel()`, `left_out_note`).
    """
    if len(labels) != len(runs):
        raise ValueError(f"got {len(labels)} labels for {len(runs)} runs")
    if smooth < 1:
        raise ValueError(f"smooth must be >= 1, got {smooth}")
    panels, left_out = drawn_panels(runs)
    note = left_out_note(left_out, len(runs))
    nrows = math.ceil(len(panels) / NCOLS)
    height = 3.3 * nrows + 0.6 + 0.25 * math.ceil(len(runs) / 3) + (0.3 if note else 0.0)
    fig = Figure(figsize=(4.4 * NCOLS, height), layout="constrained")
    FigureCanvasAgg(fig)
    cycle = [f"C{i % 10}" for i in range(len(runs))]
    axes = fig.subplots(nrows, NCOLS, sharex=True, squeeze=False).ravel()
    for ax, panel in zip(axes, panels):
        if panel.kind == "health":
            _draw_health_panel(ax, panel, runs, cycle)
        else:
            _draw_panel(ax, panel, runs, cycle, smooth)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    for ax in axes[len(panels) - NCOLS : len(panels)]:  # the lowest visible panel of each column
        ax.set_xlabel("step", fontsize=9)
        ax.tick_params(labelbottom=True)
    title = "Rollout-correction dashboard" + (f" (moving average over {smooth} steps)" if smooth > 1 else "")
    legend_labels = [
        f"{lab} [{desc}]" if descriptions and desc else lab
        for lab, desc in zip(labels, descriptions or [""] * len(labels))
    ]
    handles = [Line2D([], [], color=c, linewidth=2.5) for c in cycle]
    # The figure title doubles as the run legend's title (a separate suptitle would collide with an
    # "outside" legend under constrained layout).
    fig.legend(
        handles,
        legend_labels,
        loc="outside upper center",
        ncol=min(len(runs), 3),
        fontsize=9,
        frameon=False,
        title=title,
        title_fontsize=13,
    )
    if note:  # below the panels; constrained layout makes room for it
        fig.supxlabel(note, fontsize=9, color="0.35", style="italic")
    return fig


def plot_dashboard(
    run_dirs: Sequence[str],
    out_path: str,
    labels: Sequence[str] | None = None,
    smooth: int = 1,
    echo: Callable[[str], None] | None = None,
) -> str:
    """Load each run's metrics.jsonl, draw the dashboard, save it as PNG at `out_path`; return the path.

    labels default to the run folder names. `echo`, if given, is called with the figure's note on the
    optional panels left out (`left_out_note`), when there are any. Raises FileNotFoundError / ValueError from
    `load_metrics`, or ValueError for a label count that does not match the runs or smooth < 1.
    """
    run_dirs = list(run_dirs)
    if not run_dirs:
        raise ValueError("no run folders given")
    if labels is None:
        labels = [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    runs = [load_metrics(d) for d in run_dirs]
    fig = build_dashboard(runs, list(labels), smooth, [describe_run(d) for d in run_dirs])
    parent = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(parent, exist_ok=True)
    fig.savefig(out_path, dpi=100, format="png")
    note = fig.get_supxlabel()
    if echo is not None and note:
        echo(note)
    return str(out_path)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rc_plot.py",
        description="Rollout-correction dashboard from runs/<name>/metrics.jsonl (several runs are overlaid).",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folder(s) holding metrics.jsonl")
    p.add_argument(
        "--out",
        default=None,
        help=f"output PNG (default: RUN_DIR/{DEFAULT_OUT} for one run, ./{DEFAULT_OUT} for several)",
    )
    p.add_argument("--labels", nargs="+", default=None, help="legend label per run (default: folder names)")
    p.add_argument("--smooth", type=int, default=1, help="moving-average window in steps (default 1: raw)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point (also `rc_train.py plot ...`). Returns 0 on success, 2 on a usage/input error."""
    try:
        args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # argparse already printed usage/help
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    if args.out is None:
        args.out = os.path.join(args.run_dirs[0], DEFAULT_OUT) if len(args.run_dirs) == 1 else DEFAULT_OUT
    try:
        notes: list[str] = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = plot_dashboard(args.run_dirs, args.out, labels=args.labels, smooth=args.smooth, echo=notes.append)
        for w in caught:
            print(f"rc_plot: warning: {w.message}", file=sys.stderr)
    except (FileNotFoundError, ValueError) as e:
        print(f"rc_plot: error: {e}", file=sys.stderr)
        return 2
    print(f"rc_plot: wrote {out}")
    for note in notes:
        print(f"rc_plot: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
