"""Tests for rc_plot.py: loading metrics.jsonl, the dashboard's panel data, the PNG, and the CLI.

.venv/bin/python -m pytest tests/test_plot.py -q
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from matplotlib.colors import to_rgba
from matplotlib.image import imread

import rc_core
import rc_plot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------
# Synthetic runs
# ---------------------------------------------------------------------------------------------
def write_run(root, name, records, tail=""):
    """Create root/name/metrics.jsonl (one JSON line per record, then `tail` verbatim)."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
        f.write(tail)
    return d


def records_is(n=10):
    """Run with IS, RS and veto on; eval (synthetic task) only on steps 0, 4, 9; k1 KL changes sign."""
    out = []
    for s in range(n):
        r = {
            "step": s,
            "reward/mean": 0.1 * s,
            "reward/correct": 0.05 * s,
            "rollout_corr/kl": (-1) ** s * 10.0 ** (-s % 4 - 2),
            "rollout_corr/k3_kl": 1e-4 * (s + 1),
            "rollout_corr/chi2_token": 0.01 * s,
            "rollout_corr/chi2_seq": 0.1 * s,
            "rollout_corr/ppl_ratio": 1.0 + 0.001 * s,
            "rollout_corr/tv_mismatch": 0.002 * s,
            "actor/tv_update": 0.001 * s,
            "rollout_corr/rollout_is_mean": 1.0 - 0.01 * s,
            "rollout_corr/rollout_is_eff_sample_size": 0.9 - 0.02 * s,
            "rollout_corr/rollout_rs_masked_fraction": 0.001 * s,
            "rollout_corr/rollout_is_veto_fraction": 0.0005 * s,
            "actor/grad_norm": 1.0 + s,
            "rollout_corr/rollout_is_std": 0.3 + 0.1 * s,
            # rc_run.HealthWatch's records: 1.0 where a check fires (IS std above 1 from step 8), 0.0 where it passes.
            "health/is_mean": 0.0,
            "health/is_ess": 0.0,
            "health/is_std": float(s >= 8),
            "health/kl": float(s in (1, 5)),
            "health/chi2_token": 0.0,
        }
        if s in (0, 4, 9):
            r["eval/accuracy"] = 0.2 + 0.05 * s
        out.append(r)
    return out


def records_plain(n=6):
    """Run without IS/RS (no IS/ESS/masked keys); GSM8K-style eval only on step 5."""
    out = []
    for s in range(n):
        r = {
            "step": s,
            "reward/mean": 0.2 + 0.01 * s,
            "reward/correct": 0.2,
            "rollout_corr/kl": 1e-3,
            "rollout_corr/k3_kl": 0.0 if s == 0 else 2e-3,
            "rollout_corr/chi2_token": 0.02,
            "rollout_corr/chi2_seq": 0.3,
            "rollout_corr/ppl_ratio": 1.01,
            "rollout_corr/tv_mismatch": 0.01,
            "actor/grad_norm": 2.0,
        }
        if s == 5:
            r["eval/accuracy_strict"] = 0.4
            r["eval/accuracy_flexible"] = 0.5
        out.append(r)
    return out


def records_dense(n=10):
    """Like the dense default run (the first run of docs/running.md): every panel but the optional ones has data."""
    return [
        {
            **r,
            "rollout/staleness_mean": float(s > 0),
            "rollout/staleness_max": float(s > 0),
            "response_length/mean": 40.0 + s,
        }
        for s, r in enumerate(records_is(n))
    ]


def records_replay(n=10):
    """A dense run with --replay-window: the replayed share of the batch is logged (0 at step 0)."""
    return [{**r, "rollout/replayed_fraction": 0.0 if r["step"] == 0 else 0.5} for r in records_dense(n)]


def records_split(n=10):
    """A dense run with --mismatch-split: the numerics and staleness parts of alpha_1 (corrections.md §6.9)."""
    return [{**r, "rollout_corr/numerics_tv": 1e-3, "rollout_corr/staleness_tv": 0.02} for r in records_dense(n)]


def records_moe(n=10):
    """A dense run of an MoE model: the routing metrics (and the unreplayed k3 / alpha_1 beside the replayed ones)."""
    return [
        {
            **r,
            "rollout_corr/routing_agreement": 0.99,
            "rollout_corr/routing_flip_token_fraction": 0.3,
            "rollout_corr/unreplayed_k3_kl": 2e-4,
            "rollout_corr/unreplayed_tv_mismatch": 0.01,
        }
        for r in records_dense(n)
    ]


@pytest.fixture
def two_runs(tmp_path):
    return write_run(tmp_path, "run_is", records_is()), write_run(tmp_path, "run_plain", records_plain())


def panel_axes(fig):
    """Dashboard axes keyed by panel title (visible ones, in PANELS order)."""
    axes = [ax for ax in fig.axes if ax.get_visible() and ax.get_title()]
    return {ax.get_title(): ax for ax in axes}


def lines_of(ax, color):
    return [ln for ln in ax.get_lines() if to_rgba(ln.get_color()) == to_rgba(color)]


def empty_panels(fig):
    """Titles of the drawn panels that show no data: "not logged", or no line at all."""
    return [
        title
        for title, ax in panel_axes(fig).items()
        if "not logged" in [t.get_text() for t in ax.texts] or not ax.get_lines()
    ]


CORE = [p.title for p in rc_plot.PANELS if not p.needs]  # the panels every dashboard draws
REPLAY = "Replay buffer"
MOE = "MoE routing (trainer vs engine)"
SPLIT = "Mismatch split (α₁ = numerics + staleness)"
SPLIT_NOTE = "Mismatch split (--mismatch-split)"
DENSE_NOTE = (
    "optional panels not drawn (no data in this run): Replay buffer (--replay-window), MoE routing (an MoE model), "
    + SPLIT_NOTE
)


# ---------------------------------------------------------------------------------------------
# Panel data
# ---------------------------------------------------------------------------------------------
def test_smooth_values_trailing_moving_average():
    v = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    np.testing.assert_allclose(rc_plot.smooth_values(v, 1), v)
    np.testing.assert_allclose(rc_plot.smooth_values(v, 2), [1.0, 1.5, 2.5, 3.5, 4.5])
    np.testing.assert_allclose(rc_plot.smooth_values(v, 3), [1.0, 1.5, 2.0, 3.0, 4.0])
    np.testing.assert_allclose(rc_plot.smooth_values(v, 10), [1.0, 1.5, 2.0, 2.5, 3.0])
    assert rc_plot.smooth_values(np.array([]), 3).size == 0


def test_dashboard_series_skips_absent_and_smooths():
    run_a = [
        {"step": 0, "m": 1.0},
        {"step": 1},  # key absent
        {"step": 2, "m": 3.0},
        {"step": 3, "m": None},  # null
        {"step": 4, "m": float("nan")},  # not finite
        {"step": 5, "m": 5.0},
        {"step": 6, "m": 9.0},
    ]
    run_b = [{"step": s, "other": 1.0} for s in range(3)]  # never logs "m"
    raw = rc_plot.dashboard_series([run_a, run_b], "m", 1)
    assert len(raw) == 2
    np.testing.assert_array_equal(raw[0][0], [0, 2, 5, 6])
    np.testing.assert_allclose(raw[0][1], [1.0, 3.0, 5.0, 9.0])
    assert raw[1][0].size == 0 and raw[1][1].size == 0

    (steps, values), _ = rc_plot.dashboard_series([run_a, run_b], "m", 2)
    np.testing.assert_array_equal(steps, [0, 2, 5, 6])
    np.testing.assert_allclose(values, [1.0, 2.0, 4.0, 7.0])  # window over kept points only


def test_dashboard_series_sorts_steps_last_duplicate_wins():
    run = [{"step": 2, "m": 20.0}, {"step": 0, "m": 0.0}, {"step": 1, "m": 10.0}, {"step": 2, "m": 22.0}]
    [(steps, values)] = rc_plot.dashboard_series([run], "m", 1)
    np.testing.assert_array_equal(steps, [0, 1, 2])
    np.testing.assert_allclose(values, [0.0, 10.0, 22.0])


# ---------------------------------------------------------------------------------------------
# load_metrics
# ---------------------------------------------------------------------------------------------
def test_load_metrics_roundtrip(tmp_path):
    d = write_run(tmp_path, "r", records_plain(), tail="\n")  # a blank line is ignored
    assert rc_plot.load_metrics(str(d)) == records_plain()


def test_load_metrics_missing_folder_and_file(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        rc_plot.load_metrics(str(missing))
    (tmp_path / "empty_run").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty_run.*metrics\.jsonl"):
        rc_plot.load_metrics(str(tmp_path / "empty_run"))


def test_load_metrics_malformed_middle_line_names_file_and_line(tmp_path):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "metrics.jsonl").write_text('{"step": 0, "a": 1}\n{"step": 1, "a": \n{"step": 2, "a": 3}\n')
    with pytest.raises(ValueError, match=r"bad[/\\]metrics\.jsonl:2\b"):
        rc_plot.load_metrics(str(d))


def test_load_metrics_line_without_step_is_an_error(tmp_path):
    d = tmp_path / "nostep"
    d.mkdir()
    (d / "metrics.jsonl").write_text('{"step": 0}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2\b"):
        rc_plot.load_metrics(str(d))


def test_load_metrics_truncated_last_line_is_skipped_with_warning(tmp_path):
    d = write_run(tmp_path, "killed", records_plain(3), tail='{"step": 3, "reward/mean": 0.')
    with pytest.warns(UserWarning, match=r"metrics\.jsonl:4.*truncated"):
        recs = rc_plot.load_metrics(str(d))
    assert recs == records_plain(3)


def test_load_metrics_bad_complete_last_line_is_an_error(tmp_path):
    """A garbled line that was written in full (newline present) is corruption, not truncation."""
    d = write_run(tmp_path, "garbled", records_plain(2), tail="{oops}\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl:3\b"):
        rc_plot.load_metrics(str(d))


# ---------------------------------------------------------------------------------------------
# Dashboard figure
# ---------------------------------------------------------------------------------------------
def test_dashboard_panels_hold_the_expected_data(two_runs):
    runs = [rc_plot.load_metrics(str(d)) for d in two_runs]
    fig = rc_plot.build_dashboard(runs, ["A", "B"], smooth=3)
    axes = panel_axes(fig)
    assert list(axes) == CORE  # neither run logged the optional panels' metrics
    a, b = "C0", "C1"

    # Reward: both runs, mean (solid) and correct (dashed), smoothed over 3 points.
    reward = axes["Reward"]
    for color, recs in ((a, runs[0]), (b, runs[1])):
        by_style = {ln.get_linestyle(): ln for ln in lines_of(reward, color)}
        assert set(by_style) == {"-", "--"}
        for style, key in (("-", "reward/mean"), ("--", "reward/correct")):
            [(steps, values)] = rc_plot.dashboard_series([recs], key, 3)
            np.testing.assert_array_equal(by_style[style].get_xdata(), steps)
            np.testing.assert_allclose(by_style[style].get_ydata(), values)
    [mean_a] = [ln for ln in lines_of(reward, a) if ln.get_linestyle() == "-"]
    np.testing.assert_allclose(mean_a.get_ydata()[:4], [0.0, 0.05, 0.1, 0.2])  # (0), (0+.1)/2, ...

    # Eval: markers on eval steps only, never smoothed.
    ev = axes["Eval accuracy"]
    [ev_a] = lines_of(ev, a)
    np.testing.assert_array_equal(ev_a.get_xdata(), [0, 4, 9])
    np.testing.assert_allclose(ev_a.get_ydata(), [0.2, 0.4, 0.65])
    assert ev_a.get_marker() == "o"
    ev_b = {ln.get_linestyle(): ln for ln in lines_of(ev, b)}
    np.testing.assert_array_equal(ev_b["-"].get_xdata(), [5])  # strict
    np.testing.assert_allclose(ev_b["--"].get_ydata(), [0.5])  # flexible

    # IS / ESS / masked fractions: only the run that logs them.
    for title in ("IS weight mean", "IS weight std", "Effective sample size"):
        assert len(lines_of(axes[title], a)) == 1 and lines_of(axes[title], b) == []
    masked = axes["Masked fractions"]
    assert {ln.get_linestyle() for ln in lines_of(masked, a)} == {"-", "--"} and lines_of(masked, b) == []
    # TV: alpha_1 for both runs, alpha_0 (tv_update) only for run A.
    assert len(lines_of(axes["TV estimates (three-policy bound)"], a)) == 2
    assert len(lines_of(axes["TV estimates (three-policy bound)"], b)) == 1

    # Scales: k1 can be negative -> symlog; k3 positive -> log; others linear.
    assert axes["Mismatch KL k1 (rollout vs train)"].get_yscale() == "symlog"
    assert axes["Mismatch KL k3"].get_yscale() == "log"
    assert axes["Chi-squared divergence"].get_yscale() == "symlog"
    assert axes["Grad norm"].get_yscale() == "linear"

    # Response length is in neither run: "not logged" text instead of an empty axis.
    resp = axes["Response length"]
    assert resp.get_lines() == []
    assert "not logged" in [t.get_text() for t in resp.texts]
    assert not any(t.get_text() == "not logged" for t in axes["Reward"].texts)

    # One figure legend entry per run, same colour as its lines.
    [legend] = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["A", "B"]
    assert [to_rgba(h.get_color()) for h in legend.legend_handles] == [to_rgba(a), to_rgba(b)]


def test_dashboard_not_logged_for_a_run_without_is(tmp_path):
    d = write_run(tmp_path, "plain", records_plain())
    fig = rc_plot.build_dashboard([rc_plot.load_metrics(str(d))], ["plain"])
    axes = panel_axes(fig)
    for title in (
        "IS weight mean",
        "IS weight std",
        "Effective sample size",
        "Masked fractions",
        "Response length",
        "Health checks fired",
    ):
        assert [t.get_text() for t in axes[title].texts] == ["not logged"], title
        assert axes[title].get_lines() == []
    assert axes["Mismatch KL k3"].get_yscale() == "log"  # zero at step 0, positive later


# ---------------------------------------------------------------------------------------------
# Optional panels: drawn only when a plotted run logged them
# ---------------------------------------------------------------------------------------------
def test_optional_panels_name_what_fills_them():
    optional = [p for p in rc_plot.PANELS if p.needs]
    assert [p.title for p in optional] == [REPLAY, MOE, SPLIT]
    assert all(p.needs in rc_plot.NEEDS for p in optional)
    assert rc_plot.left_out_note(optional, 1) == DENSE_NOTE
    two = rc_plot.left_out_note(optional[1:], 2)
    assert two == f"optional panels not drawn (no data in these runs): MoE routing (an MoE model), {SPLIT_NOTE}"
    assert rc_plot.left_out_note([], 1) == ""


def test_dense_run_draws_no_empty_panel_and_names_the_optional_ones():
    """The first hour: the dense default run's dashboard is all live panels (no "not logged" axis), on a grid sized
    for them, and one line at its foot names the optional panels and what fills them."""
    fig = rc_plot.build_dashboard([records_dense()], ["dense"])
    axes = panel_axes(fig)
    assert list(axes) == CORE and len(CORE) == 15
    assert empty_panels(fig) == []
    assert not any("not logged" in t.get_text() for ax in fig.axes for t in ax.texts)
    # 15 panels: 4 rows of 4, one cell left blank (17 panels took 5 rows).
    assert len(fig.axes) == 16 and sum(not ax.get_visible() for ax in fig.axes) == 1
    visible = [ax for ax in fig.axes if ax.get_visible()]
    bottoms = {}
    for ax in visible:
        col = ax.get_subplotspec().colspan.start
        bottoms[col] = max(bottoms.get(col, ax), ax, key=lambda a: a.get_subplotspec().rowspan.start)
    assert sorted(bottoms) == [0, 1, 2, 3]
    assert all(ax.get_xlabel() == "step" for ax in bottoms.values())
    assert fig.get_supxlabel() == DENSE_NOTE


def test_dense_run_console_names_the_optional_panels(tmp_path, capsys):
    """`rc_train.py plot runs/A` (rc_plot.main) says the figure's note in one line after the path."""
    d = write_run(tmp_path, "dense", records_dense())
    assert rc_plot.main([str(d)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"rc_plot: wrote {d / 'dashboard.png'}",
        f"rc_plot: {DENSE_NOTE}",
    ]
    assert imread(str(d / "dashboard.png"))[..., :3].std() > 0.05


def test_empty_panel_check_catches_a_not_logged_panel():
    """empty_panels (the check above) does see an empty panel: a run without IS has them, and they stay drawn."""
    fig = rc_plot.build_dashboard([records_plain()], ["plain"])
    assert {"IS weight mean", "Response length", "Health checks fired"} <= set(empty_panels(fig))
    assert REPLAY not in empty_panels(fig) and MOE not in empty_panels(fig)


def test_replay_run_draws_the_replay_panel():
    fig = rc_plot.build_dashboard([records_replay()], ["replay"])
    axes = panel_axes(fig)
    assert list(axes) == CORE[: CORE.index("Response length")] + [REPLAY] + CORE[CORE.index("Response length") :]
    assert empty_panels(fig) == []
    [line] = axes[REPLAY].get_lines()
    assert list(line.get_ydata()) == [0.0] + [0.5] * 9
    assert (
        fig.get_supxlabel()
        == f"optional panels not drawn (no data in this run): MoE routing (an MoE model), {SPLIT_NOTE}"
    )
    assert sum(ax.get_visible() for ax in fig.axes) == 16 and len(fig.axes) == 16  # 16 panels fill 4 rows


def test_moe_run_draws_the_routing_panel():
    fig = rc_plot.build_dashboard([records_moe()], ["moe"])
    axes = panel_axes(fig)
    assert list(axes) == CORE + [MOE]
    assert empty_panels(fig) == []
    assert len(axes[MOE].get_lines()) == 2
    assert len(axes["Mismatch KL k3"].get_lines()) == 2  # k3 and k3 without MoE replay
    assert fig.get_supxlabel() == (
        f"optional panels not drawn (no data in this run): Replay buffer (--replay-window), {SPLIT_NOTE}"
    )


def test_compared_runs_draw_an_optional_panel_any_of_them_filled(tmp_path, capsys):
    """Several runs: a panel one run filled is drawn, the others show nothing there; with both optional panels
    filled (by different runs) every panel is drawn, on 5 rows, and nothing is named as left out."""
    fig = rc_plot.build_dashboard([records_dense(), records_replay()], ["dense", "replay"])
    ax = panel_axes(fig)[REPLAY]
    assert lines_of(ax, "C0") == [] and len(lines_of(ax, "C1")) == 1
    assert fig.get_supxlabel() == (
        f"optional panels not drawn (no data in these runs): MoE routing (an MoE model), {SPLIT_NOTE}"
    )

    fig = rc_plot.build_dashboard([records_replay(), records_moe(), records_split()], ["replay", "moe", "split"])
    assert list(panel_axes(fig)) == [p.title for p in rc_plot.PANELS]
    assert empty_panels(fig) == []
    assert len(fig.axes) == 20 and fig.get_supxlabel() == ""
    runs = (("r", records_replay()), ("m", records_moe()), ("s", records_split()))
    dirs = [str(write_run(tmp_path, n, recs)) for n, recs in runs]
    assert rc_plot.main(dirs + ["--out", str(tmp_path / "both.png")]) == 0
    assert capsys.readouterr().out.splitlines() == [f"rc_plot: wrote {tmp_path / 'both.png'}"]


def test_a_metric_logged_only_as_null_does_not_draw_its_optional_panel():
    recs = [{**r, "rollout/replayed_fraction": None} for r in records_dense()]
    assert REPLAY not in panel_axes(rc_plot.build_dashboard([recs], ["nulls"]))


def reference_lines(ax) -> set[tuple[str, float]]:
    """(gid, y) of the horizontal reference lines of a panel: gid "ref" for a fixed line, the check's name for a
    threshold of rc_core.HEALTH_CHECKS (rc_plot._draw_reference_lines)."""
    out = set()
    for ln in ax.get_lines():
        if ln.get_gid():
            y0, y1 = ln.get_ydata()
            assert y0 == y1, ln.get_gid()  # an axhline
            out.add((ln.get_gid(), float(y0)))
    return out


def test_reference_lines_are_the_usage_guides(two_runs):
    """verl's usage guide ("Debugging: Visualizing Metrics"; check_rollout_correction_health): ESS 0.5 good and 0.3
    warning, chi-squared 1.0, IS mean ideal 1.0 and alarms outside [0.5, 2], IS std 1, |KL| 0.1."""
    runs = [rc_plot.load_metrics(str(d)) for d in two_runs]
    axes = panel_axes(rc_plot.build_dashboard(runs, ["A", "B"]))
    assert reference_lines(axes["Effective sample size"]) == {("ref", 0.5), ("health/is_ess", 0.3)}
    assert reference_lines(axes["Chi-squared divergence"]) == {("ref", 0.0), ("health/chi2_token", 1.0)}
    assert reference_lines(axes["IS weight mean"]) == {("ref", 1.0), ("health/is_mean", 0.5), ("health/is_mean", 2.0)}
    assert reference_lines(axes["IS weight std"]) == {("health/is_std", 1.0)}
    kl = reference_lines(axes["Mismatch KL k1 (rollout vs train)"])
    assert kl == {("ref", 0.0), ("health/kl", 0.1), ("health/kl", -0.1)}
    assert reference_lines(axes["PPL ratio (train / rollout)"]) == {("ref", 1.0)}
    # A threshold line is included in the y-range even where the data stay far from it.
    lo, hi = axes["IS weight mean"].get_ylim()
    assert lo < 0.5 and hi > 2.0
    # The key names the thresholds.
    labels = [t.get_text() for t in axes["IS weight mean"].get_legend().get_texts()]
    assert labels == ["ideal 1.0", "warn < 0.5 or > 2"]
    assert "token warn > 1" in [t.get_text() for t in axes["Chi-squared divergence"].get_legend().get_texts()]


def test_threshold_lines_are_read_from_health_checks(two_runs, monkeypatch):
    """The lines follow rc_core.HEALTH_CHECKS (a changed threshold moves its line): no second copy of the numbers."""
    runs = [rc_plot.load_metrics(str(d)) for d in two_runs]
    checks = dict(rc_core.HEALTH_CHECKS)
    checks["health/is_ess"] = rc_core.HealthCheck("rollout_corr/rollout_is_eff_sample_size", 0.25, None)
    checks["health/is_mean"] = rc_core.HealthCheck("rollout_corr/rollout_is_mean", None, 3.0)
    checks["health/kl"] = rc_core.HealthCheck("rollout_corr/kl", None, 0.2, absolute=True)
    monkeypatch.setattr(rc_core, "HEALTH_CHECKS", checks)
    axes = panel_axes(rc_plot.build_dashboard(runs, ["A", "B"]))
    assert ("health/is_ess", 0.25) in reference_lines(axes["Effective sample size"])
    assert ("health/is_ess", 0.3) not in reference_lines(axes["Effective sample size"])
    assert reference_lines(axes["IS weight mean"]) == {("ref", 1.0), ("health/is_mean", 3.0)}
    assert {("health/kl", 0.2), ("health/kl", -0.2)} <= reference_lines(axes["Mismatch KL k1 (rollout vs train)"])


def test_every_health_check_is_drawn_on_a_panel_of_its_metric():
    for name, check in rc_core.HEALTH_CHECKS.items():
        panels = [p for p in rc_plot.PANELS if name in p.health]
        assert len(panels) == 1, name
        assert check.metric in [s.key for s in panels[0].series], (name, panels[0].title)
    assert all(n in rc_core.HEALTH_CHECKS for p in rc_plot.PANELS for n in p.health)
    [events] = [p for p in rc_plot.PANELS if p.kind == "health"]
    assert [s.key for s in events.series] == list(rc_core.HEALTH_CHECKS)  # one row per check


def test_health_panel_marks_the_steps_each_check_fired_on(tmp_path):
    """One row per check (HEALTH_CHECKS order, top to bottom), a mark per firing step in the run's colour; a run
    without health/* records adds nothing; a logged run where nothing fired says so."""
    quiet = [{**r, "health/kl": 0.0, "health/is_std": 0.0} for r in records_is()]
    runs = [records_is(), records_plain(), quiet]
    axes = panel_axes(rc_plot.build_dashboard(runs, ["A", "B", "C"]))
    ax = axes["Health checks fired"]
    names = list(rc_core.HEALTH_CHECKS)
    rows = {len(names) - 1 - i: n for i, n in enumerate(names)}
    marks = {}
    for ln in lines_of(ax, "C0"):
        [row] = {round(y) for y in ln.get_ydata()}
        marks[rows[row]] = list(ln.get_xdata())
    assert marks == {"health/is_std": [8, 9], "health/kl": [1, 5]}
    assert lines_of(ax, "C1") == [] and lines_of(ax, "C2") == []
    assert [t.get_text() for t in ax.get_yticklabels()] == [n.removeprefix("health/") for n in names][::-1]
    assert "none fired" not in [t.get_text() for t in ax.texts]

    axes = panel_axes(rc_plot.build_dashboard([quiet], ["C"]))
    assert [t.get_text() for t in axes["Health checks fired"].texts] == ["none fired"]
    partial = [{k: v for k, v in r.items() if k != "health/is_mean"} for r in quiet]
    ticks = panel_axes(rc_plot.build_dashboard([partial], ["P"]))["Health checks fired"].get_yticklabels()
    assert "is_mean (not logged)" in [t.get_text() for t in ticks]


def test_build_dashboard_rejects_bad_arguments(two_runs):
    runs = [rc_plot.load_metrics(str(d)) for d in two_runs]
    with pytest.raises(ValueError, match="labels"):
        rc_plot.build_dashboard(runs, ["only one"])
    with pytest.raises(ValueError, match="smooth"):
        rc_plot.build_dashboard(runs, ["A", "B"], smooth=0)


def test_plot_dashboard_writes_png(two_runs, tmp_path):
    out = tmp_path / "figs" / "cmp.png"  # parent folder is created
    ret = rc_plot.plot_dashboard([str(d) for d in two_runs], str(out), smooth=2)
    assert ret == str(out)
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 30_000
    img = imread(str(out))
    assert img.shape[0] >= 800 and img.shape[1] >= 1200
    assert img[..., :3].std() > 0.05  # not a blank canvas


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def test_main_single_run_default_out(two_runs, capsys):
    """One run -> RUN_DIR/dashboard.png (rendered for real)."""
    _, run_plain = two_runs
    assert rc_plot.main([str(run_plain)]) == 0
    out = run_plain / "dashboard.png"
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert str(out) in capsys.readouterr().out


def test_main_argument_handling(two_runs, tmp_path, monkeypatch):
    """Several runs -> ./dashboard.png; --out/--labels/--smooth reach plot_dashboard unchanged."""
    calls = []

    def fake_plot(run_dirs, out_path, labels=None, smooth=1, echo=None):
        calls.append((list(run_dirs), out_path, labels, smooth))
        return out_path

    monkeypatch.setattr(rc_plot, "plot_dashboard", fake_plot)
    runs = [str(d) for d in two_runs]
    assert rc_plot.main(runs) == 0
    assert rc_plot.main(runs + ["--labels", "is", "plain", "--smooth", "3", "--out", "x/y.png"]) == 0
    assert rc_plot.main([runs[1], "--smooth", "5"]) == 0
    assert calls == [
        (runs, "dashboard.png", None, 1),
        (runs, "x/y.png", ["is", "plain"], 3),
        ([runs[1]], os.path.join(runs[1], "dashboard.png"), None, 5),
    ]


def test_main_missing_run_folder_returns_2(tmp_path, capsys):
    missing = tmp_path / "no_such_run"
    assert rc_plot.main([str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no_such_run" in err and "error" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("extra", [["--labels", "a", "b"], ["--smooth", "0"]])
def test_main_bad_options_return_2(two_runs, tmp_path, capsys, extra):
    assert rc_plot.main([str(two_runs[0]), "--out", str(tmp_path / "o.png")] + extra) == 2
    assert "error" in capsys.readouterr().err
    assert not (tmp_path / "o.png").exists()


def test_main_usage_error_returns_2(capsys):
    assert rc_plot.main([]) == 2
    assert "usage" in capsys.readouterr().err


def test_script_entry_point(tmp_path):
    """`python rc_plot.py ...` runs main() and exits with its status (error paths: the main() tests)."""
    script = os.path.join(ROOT, "rc_plot.py")
    killed = write_run(tmp_path, "killed", records_is(4), tail='{"step": 4, "rew')
    out = tmp_path / "cli.png"
    ok = subprocess.run(
        [sys.executable, script, str(killed), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert "rc_plot: warning:" in ok.stderr and "truncated" in ok.stderr
    assert not (killed / "dashboard.png").exists()
