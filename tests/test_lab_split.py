"""Tests for the mismatch-split sweep of lab/rc_lab.py (lab/README.md, "Planned ... the mismatch split"; issue 50
item 4): the staleness share of alpha_1 and its reading, each cheaper pi_old arm against the recompute arm (holds,
fails, undecided), and the cells rc_train.py refuses, skipped before anything starts and listed by the report. On
synthetic run records and with rc_train.py's own checks (no engine, no training).

    .venv/bin/python -m pytest tests/test_lab_split.py -q
"""

import json
import math
import os

import pytest

from lab import rc_lab

P = "decoupled_token_is"  # the recompute arm
S = P + "+prox_logp=sampling"
L = P + "+prox_logp=loglinear"
K0, K2, K8 = "max_staleness=0", "max_staleness=2", "max_staleness=8"
REPLAY = "max_staleness=0+replay_window=8+replay_fraction=0.75"
LEVELS = [K0, K2, K8, REPLAY]
SEEDS = (1, 2, 3)
REFUSED = [
    {"preset": S, "level": K0, "reason": "--prox-logp sampling needs samples older than the trainer's weights"},
    {"preset": L, "level": K0, "reason": "--prox-logp loglinear needs samples older than the trainer's weights"},
]
# The staleness share of each seed of the recompute arm, per level (the cheaper arms': 0.5 everywhere).
SHARES = {K0: (0.0, 0.0, 0.0), K2: (0.2, 0.3, 0.4), K8: (0.6, 0.7, 0.8), REPLAY: (0.4, 0.5, 0.6)}
# Final eval acc of seeds 1, 2, 3 per (preset, level); any other cell 0.80 in every seed.
EVALS = {
    (P, K2): (0.80, 0.82, 0.84),
    (S, K2): (0.79, 0.83, 0.83),  # Δ -0.003, paired [-0.03, +0.02]: holds
    (L, K2): (0.70, 0.71, 0.73),  # Δ -0.107 (margin 0.05), paired wholly below 0: fails
    (P, K8): (0.80, 0.90, 0.85),
    (S, K8): (0.75, 0.65, 0.70),  # Δ -0.15 below the margin 0.10, but paired [-0.398, +0.098] covers 0: undecided
    (L, K8): (0.77, 0.87, 0.82),  # every seed -0.03: interval below 0, mean not below the margin 0.10: undecided
}


def split_records(share: float, acc: float, steps: int = 5) -> list[dict]:
    """Steps 0..steps-1: the first steps - 1 log alpha_1's parts with per-step staleness shares share - d, share + d,
    then share (d = 0.1 inside [0.1, 0.9], else 0: their mean is `share`); the last logs both parts 0 (left out of
    the share) and the final eval acc `acc`."""
    d = 0.1 if 0.1 <= share <= 0.9 else 0.0
    records = []
    for s in range(steps):
        x = share - d if s == 0 else share + d if s == 1 else share
        last = s == steps - 1
        records.append(
            {
                "step": s,
                "reward/mean": 0.5,
                "rollout_corr/tv_mismatch": 1e-3,
                "rollout_corr/numerics_tv": 0.0 if last else 1e-3 * (1 - x),
                "rollout_corr/staleness_tv": 0.0 if last else 1e-3 * x,
                **({"eval/accuracy_strict": acc} if last else {}),
            }
        )
    return records


def write_split_sweep(out, refused=REFUSED, shares=SHARES, evals=EVALS):
    """A split sweep folder as `sweep` leaves it: the refused cells in sweep.json, no run of theirs."""
    runs, skip = [], {(c["preset"], c["level"]) for c in refused}
    for p in (P, S, L):
        for lv in LEVELS:
            for seed in SEEDS if (p, lv) not in skip else ():
                name = rc_lab.run_name(p, rc_lab.MISMATCH, lv, seed)
                share = shares[lv][seed - 1] if p == P else 0.5
                records = split_records(share, evals.get((p, lv), (0.80,) * 3)[seed - 1])
                os.makedirs(out / name)
                (out / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
                runs.append({"name": name, "preset": p, "level": lv, "seed": seed, "cmd": []})
    spec = {"presets": [P, S, L], "dial": rc_lab.MISMATCH, "levels": LEVELS, "seeds": list(SEEDS), "steps": 5}
    spec.update(extra=["--rollout-dtype", "bfloat16", "--mismatch-split"], jobs=1, refused=refused, runs=runs)
    (out / "sweep.json").write_text(json.dumps(spec))
    return out


@pytest.fixture(autouse=True)
def cpu_trainer(monkeypatch):
    """rc_train.py's checks as on the CPU the lab runs on (on a GPU they refuse --max-staleness >= 1 everywhere)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def row_of(rows, preset, level):
    (row,) = [r for r in rows if r["preset"] == preset and r["level"] == level]
    return row


# ---------------------------------------------------------------------------------------------
# (1) How alpha_1 splits
# ---------------------------------------------------------------------------------------------
def test_staleness_share_is_the_mean_of_each_steps_share():
    """Per step staleness_tv / (numerics_tv + staleness_tv), averaged over the steps (not the ratio of the sums);
    a step with both parts 0, one without the keys and the evaluation before training are left out."""
    records = [
        {"step": -1, "rollout_corr/numerics_tv": 0.0, "rollout_corr/staleness_tv": 1.0},  # eval before training
        {"step": 0, "rollout_corr/numerics_tv": 3.0, "rollout_corr/staleness_tv": 1.0},  # 0.25
        {"step": 1, "rollout_corr/numerics_tv": 1.0, "rollout_corr/staleness_tv": 9.0},  # 0.9
        {"step": 2, "rollout_corr/numerics_tv": 0.0, "rollout_corr/staleness_tv": 0.0},  # no alpha_1: left out
        {"step": 3, "reward/mean": 0.1},
    ]
    assert rc_lab.staleness_share(records) == pytest.approx((0.25 + 0.9) / 2)  # the ratio of sums: 10/14
    assert rc_lab.staleness_share(records[3:]) is None


def test_split_rows_carry_the_share_and_its_seed_range(tmp_path):
    sweep = rc_lab.load_sweep(str(write_split_sweep(tmp_path)))
    rows = rc_lab.summarise(sweep)
    assert [(r["preset"], r["level"]) for r in rows] == [(P, lv) for lv in LEVELS] + [
        (a, lv) for a in (S, L) for lv in LEVELS[1:]
    ]  # the refused cells have no row
    k8 = row_of(rows, P, K8)
    assert k8["staleness_share"] == pytest.approx(0.7)
    assert (k8["staleness_share_min"], k8["staleness_share_max"]) == pytest.approx((0.6, 0.8))
    assert row_of(rows, P, K0)["staleness_share_max"] == 0.0
    assert row_of(rows, S, K2)["delta_eval_acc"] is None  # its level-0 reference was refused: no Δ, no flag
    assert rc_lab.is_split(rows, sweep)
    assert not rc_lab.is_split(rows, {**sweep, "presets": [P]})  # the share alone: no cheaper arm to read


@pytest.mark.parametrize(
    "low, high, no_stale, reading",
    [
        (0.51, 0.9, False, "staleness-dominated"),
        (0.1, 0.49, False, "numerics-dominated"),
        (0.4, 0.6, False, "mixed"),
        (0.5, 0.7, False, "mixed"),  # a seed at 0.5 is not above it
        (0.0, 0.0, True, "tooling check passes (not a finding)"),
        (0.0, 1e-9, True, "tooling check fails (not a finding)"),
    ],
)
def test_split_reading_by_the_seed_range(low, high, no_stale, reading):
    row = {"staleness_share": (low + high) / 2, "staleness_share_min": low, "staleness_share_max": high}
    assert rc_lab.split_reading(row, no_stale) == reading


def test_no_stale_samples_reads_the_level_then_the_extra_flags():
    sweep = {"dial": rc_lab.MISMATCH, "extra": []}
    assert rc_lab.no_stale_samples(sweep, K0) and rc_lab.no_stale_samples(sweep, "none")
    assert not rc_lab.no_stale_samples(sweep, K2) and not rc_lab.no_stale_samples(sweep, REPLAY)
    assert not rc_lab.no_stale_samples({**sweep, "extra": ["--replay-fraction=0.5"]}, K0)
    assert not rc_lab.no_stale_samples({**sweep, "extra": ["--max-staleness", "4"]}, "none")
    assert rc_lab.no_stale_samples({"dial": "max_staleness", "extra": []}, "0")


# ---------------------------------------------------------------------------------------------
# (2) Whether the cheaper pi_old holds
# ---------------------------------------------------------------------------------------------
def test_cheaper_arms_are_read_against_their_recompute_arm():
    sweep = {"presets": [P, S, L, P + "+prox_logp=recompute", "naive+prox_logp=loglinear"]}
    assert rc_lab.cheaper_arms(sweep) == [(S, P), (L, P)]  # recompute is not cheaper; naive is not in the sweep


def verdict_lines(tmp_path):
    sweep = rc_lab.load_sweep(str(write_split_sweep(tmp_path)))
    rows = rc_lab.summarise(sweep)
    return rc_lab.verdicts(rows, sweep), rows, sweep


def test_split_verdicts_at_each_level(tmp_path):
    lines, _, _ = verdict_lines(tmp_path)
    text = "\n".join(lines)
    assert lines[0] == "Verdicts (the rule above, applied):"
    assert lines[1] == (
        f"- `{K0}`: staleness share of α₁ (`{P}`) 0.000 (seeds 0.000–0.000); k = 0 without replay: must be 0 → "
        "**tooling check passes (not a finding)**"
    )
    assert f"- `{K2}`: staleness share of α₁ (`{P}`) 0.300 (seeds 0.200–0.400) → **numerics-dominated**" in lines
    assert f"- `{K8}`: staleness share of α₁ (`{P}`) 0.700 (seeds 0.600–0.800) → **staleness-dominated**" in lines
    assert f"- `{REPLAY}`: staleness share of α₁ (`{P}`) 0.500 (seeds 0.400–0.600) → **mixed**" in lines
    k2 = lines[
        lines.index(f"- `{K2}`: staleness share of α₁ (`{P}`) 0.300 (seeds 0.200–0.400) → **numerics-dominated**") :
    ]
    assert k2[1].startswith(f"  - `{S}` against `{P}`: Δ -0.003 (margin 0.050: not below); paired 95 % interval [")
    assert k2[1].endswith("(covers 0) → **holds**")
    assert k2[2].startswith(f"  - `{L}` against `{P}`: Δ -0.107 (margin 0.050: below)")
    assert k2[2].endswith("(below 0) → **fails**")
    assert k2[3] == f"  - ranked: `{S}` above `{L}` (holds where the other fails)"
    assert text.count("**holds**") == 1 + 2  # k = 2, and both arms at the replay level (0.80 everywhere)
    assert text.count("not ranked") == 2  # k = 8 (both undecided) and the replay level (both hold)


def test_undecided_when_the_mean_says_below_but_the_paired_interval_does_not(tmp_path):
    """At k = 8 the sampling arm is 0.15 below the recompute arm's mean, beyond the margin max(2 x 0.05, 0.05),
    but its seeds move against the recompute arm's, so the paired interval covers 0: undecided, with what five seeds
    at this spread would give. The loglinear arm is the other way round: each seed exactly 0.03 below (an interval
    wholly below 0), a mean within the margin."""
    lines, rows, sweep = verdict_lines(tmp_path)
    arm, ref = row_of(rows, S, K8), row_of(rows, P, K8)
    assert rc_lab.clearly_below(arm, ref) and rc_lab.rule_margin(arm, ref) == pytest.approx(0.10)
    paired = rc_lab.paired_difference(rc_lab.seed_evals(sweep, S, K8), rc_lab.seed_evals(sweep, P, K8))
    assert paired["delta"] == pytest.approx(-0.15) and paired["sd"] == pytest.approx(0.1)
    assert (paired["ci_low"], paired["ci_high"]) == pytest.approx((-0.15 - 0.24844, -0.15 + 0.24844), abs=1e-4)
    assert rc_lab.pi_old_verdict(arm, ref, paired) == "undecided"
    (line,) = [x for x in lines if x.startswith(f"  - `{S}` against `{P}`: Δ -0.150")]
    half5 = 2.776 * 0.1 / math.sqrt(5)  # t(0.975, 4) s_d / sqrt(5) = 0.124: -0.150 would then lie below 0
    assert "(margin 0.100: below)" in line and "(covers 0) → **undecided**" in line
    assert f"five seeds at this spread (s_d 0.100): half-width {half5:.3f}, Δ -0.150 would lie below 0" in line
    assert "the mean test needs Δ below −0.100 at any number of seeds" in line
    (line,) = [x for x in lines if x.startswith(f"  - `{L}` against `{P}`: Δ -0.030")]
    assert "(margin 0.100: not below)" in line and "(below 0) → **undecided**" in line


def test_pi_old_verdict_holds_fails_undecided():
    def row(acc, std=0.01):
        return {"eval_acc": acc, "eval_acc_std": std, "n_eval": 3}

    def paired(low, high):
        return {"ci_low": low, "ci_high": high}

    ref = row(0.80)
    assert rc_lab.pi_old_verdict(row(0.78), ref, paired(-0.05, 0.01)) == "holds"
    assert rc_lab.pi_old_verdict(row(0.70), ref, paired(-0.12, -0.08)) == "fails"
    assert rc_lab.pi_old_verdict(row(0.70), ref, paired(-0.25, 0.05)) == "undecided"  # the mean alone says below
    assert rc_lab.pi_old_verdict(row(0.78), ref, paired(-0.03, -0.01)) == "undecided"  # the interval alone
    assert rc_lab.pi_old_verdict(row(0.80), ref, paired(None, None)) == "undecided"  # no interval (n < 2)


def test_split_summary_states_the_rule_the_column_and_the_refused_cells(tmp_path):
    lines, rows, sweep = verdict_lines(tmp_path)
    csv_path, md_path = rc_lab.write_summary(rows, sweep, str(tmp_path), 0.5)
    md = open(md_path).read()
    assert rc_lab.SPLIT_RULE in md and md.index("Reading rule") < md.index("| preset | level |")
    header = md[md.index("| preset | level |") :].splitlines()[0]
    assert "| α₁ | staleness share of α₁ (seeds) |" in header
    assert f"| {P} | {K8} | 3 |" in md and "| 0.700 (0.600–0.800) |" in md
    assert f"| {S} | {K0} |" not in md  # refused: no row
    refused = f"- `{S}` at `{K0}`: refused: --prox-logp sampling needs samples older than the trainer's weights"
    assert refused in md and md.index("| preset | level |") < md.index(refused) < md.index("Verdicts")
    assert "\n".join(lines) in md
    # the paired view reads each cheaper arm against its recompute arm; a refused cell is in no comparison
    comps = rc_lab.paired_comparisons(rows, sweep)
    assert {(c["preset"], c["level"]) for c in comps if c["kind"] == "recompute"} == {
        (a, lv) for a in (S, L) for lv in LEVELS[1:]
    }
    assert {c["preset"] for c in comps if c["kind"] == "ref"} == {P}  # S and L have no level-0 row to read against
    assert f"| {S} | {K8} | `{P}` (π_old recomputed) at this level | 3 | -0.150 | [-0.398, +0.098] |" in md
    assert "paired_vs_recompute_delta" in open(csv_path).read().splitlines()[0]
    assert "**Paired view (beside the rule above; the verdicts of the cheaper π_old read its rows" in md


# ---------------------------------------------------------------------------------------------
# Refused cells: asked of rc_train.py's own checks before anything starts
# ---------------------------------------------------------------------------------------------
DESIGN = ["--presets", f"{P},{S},{L}", "--dial", "mismatch", "--levels", ",".join(LEVELS), "--seeds", "1,2,3"]
DESIGN_EXTRA = ["--rollout-dtype", "bfloat16", "--mismatch-split", "--num-prompts-per-step", "12"]


def test_the_designed_sweep_skips_what_the_trainer_refuses(tmp_path):
    """The sweep of lab/README.md's design: the sampling and loglinear arms at k = 0 without replay are refused by
    rc_train.py's own check (rc_config.check_prox_logp), with its one line; every other cell runs."""
    args = rc_lab._parser().parse_args(["sweep", "--out", str(tmp_path / "split"), *DESIGN, "--steps", "30"])
    spec = rc_lab.build_spec(args, DESIGN_EXTRA)
    assert [(c["preset"], c["level"]) for c in spec["refused"]] == [(S, K0), (L, K0)]
    assert spec["refused"][0]["reason"].startswith("--prox-logp sampling needs samples older than the trainer's")
    assert "--prox-logp loglinear" in spec["refused"][1]["reason"]
    assert len(spec["runs"]) == 3 * 4 * 3 - 2 * 3
    assert not [r for r in spec["runs"] if r["preset"] != P and r["level"] == K0]
    replay = [r["cmd"] for r in spec["runs"] if r["preset"] == L and r["level"] == REPLAY]
    assert replay and "--prox-logp" in replay[0] and replay[0][replay[0].index("--replay-fraction") + 1] == "0.75"
    assert not (tmp_path / "split").exists()
    assert rc_lab.trainer_refusal(spec["runs"][0]["cmd"][2:]) is None


def test_a_level_or_preset_refused_everywhere_is_bad_input(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(rc_lab, "launch", lambda *a: pytest.fail("nothing may start"))
    out = str(tmp_path / "split")
    argv = [
        "sweep",
        "--out",
        out,
        "--presets",
        S,
        "--dial",
        "mismatch",
        "--levels",
        f"{K0},{K2}",
        "--",
        "--mismatch-split",
    ]
    assert rc_lab.main(argv) == 2
    err = capsys.readouterr().err
    assert f"rc_train.py refuses every cell of level '{K0}': --prox-logp sampling needs samples older" in err
    argv = ["sweep", "--out", out, "--presets", P, "--dial", "mismatch", "--levels", K0, "--", "--bogus-flag", "1"]
    assert rc_lab.main(argv) == 2
    assert "rc_train.py cannot parse the flags" in capsys.readouterr().err
    assert not os.path.exists(out)


def test_a_sweep_launches_no_refused_cell_and_its_report_lists_it(tmp_path, capsys, monkeypatch):
    """`sweep` end to end with rc_train.py's checks and a stand-in for the launch (no engine): the refused cell is
    never launched, said on stderr, kept in sweep.json, and listed under the summary's table."""
    launched = []

    def launch(cmd, log_path):
        name = cmd[cmd.index("--run-name") + 1]
        launched.append(name)
        run_dir = os.path.join(cmd[cmd.index("--output-dir") + 1], name)
        os.makedirs(run_dir)
        with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in split_records(0.4, 0.8, steps=2))
        return 0

    monkeypatch.setattr(rc_lab, "launch", launch)
    monkeypatch.setattr(rc_lab, "report", lambda *a, **k: [])  # the report is read below, from the folder
    out = tmp_path / "split"
    argv = ["sweep", "--out", str(out), "--presets", f"{P},{S}", "--dial", "mismatch", "--levels", f"{K0},{K2}"]
    assert rc_lab.main([*argv, "--seeds", "1,2", "--steps", "2", "--", "--mismatch-split"]) == 0
    assert sorted(launched) == sorted(
        rc_lab.run_name(p, "mismatch", lv, s) for p, lv in [(P, K0), (P, K2), (S, K2)] for s in (1, 2)
    )
    assert (
        f"rc_lab: note: not launched, rc_train.py refuses {S} at {K0}: --prox-logp sampling" in capsys.readouterr().err
    )
    spec = json.loads((out / "sweep.json").read_text())
    assert [(c["preset"], c["level"]) for c in spec["refused"]] == [(S, K0)]
    sweep = rc_lab.load_sweep(str(out))
    rows = rc_lab.summarise(sweep)
    _, md = rc_lab.write_summary(rows, sweep, str(out), 0.5)
    assert f"- `{S}` at `{K0}`: refused: --prox-logp sampling needs samples older" in open(md).read()
