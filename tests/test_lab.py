"""Tests for lab/rc_lab.py: the report numbers, summary files, plots, input checks, and the sweep runner
end to end against a tiny fake trainer (no vLLM, no torch training).

    .venv/bin/python -m pytest tests/test_lab.py -q
"""

import csv
import gzip
import itertools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from lab import rc_lab

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
RC_LAB = [sys.executable, "-m", "lab.rc_lab"]  # as a user runs it (from the root; from elsewhere with LAB_ENV)
LAB_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DIAL = "rollout_weight_noise"
PRESETS = ["naive", "decoupled_token_is", "bypass_ppo_clip"]
LEVELS = ["0", "0.3"]
SEEDS = [1, 2]
N_STEPS = 20
REWARD_LEVEL = 0.71

# Per (preset, level): reward bases of seeds 1, 2 (reward/mean = base + 0.02 * step) and their final
# eval accuracies.
#   naive:              eval 0.80,0.82 -> 0.60,0.62: delta -0.20, pooled std 0.0141 -> flagged (0.05 rule)
#   decoupled_token_is: eval 0.80,0.80 -> 0.78,0.76: delta -0.03 > 2 * pooled std 0.01 but < 0.05 -> not flagged
#   bypass_ppo_clip:    eval 0.70,0.90 -> 0.60,0.80: delta -0.10 < 2 * pooled std 0.1414 -> not flagged
BASES = {
    ("naive", "0"): (0.5, 0.6),
    ("naive", "0.3"): (0.1, 0.3),
    ("decoupled_token_is", "0"): (0.4, 0.4),
    ("decoupled_token_is", "0.3"): (0.4, 0.2),
    ("bypass_ppo_clip", "0"): (0.4, 0.4),
    ("bypass_ppo_clip", "0.3"): (0.4, 0.4),
}
EVALS = {
    ("naive", "0"): (0.80, 0.82),
    ("naive", "0.3"): (0.60, 0.62),
    ("decoupled_token_is", "0"): (0.80, 0.80),
    ("decoupled_token_is", "0.3"): (0.78, 0.76),
    ("bypass_ppo_clip", "0"): (0.70, 0.90),
    ("bypass_ppo_clip", "0.3"): (0.60, 0.80),
}


def fake_records(preset, level, seed):
    """20 steps. k3 only for non-bypass presets (bypass: the key is missing); RS masked fraction only for
    decoupled_token_is, 0.1 on even steps and absent on odd ones; veto only for decoupled_token_is seed 1."""
    base = BASES[(preset, level)][seed - 1]
    out = []
    for s in range(N_STEPS):
        r = {
            "step": s,
            "reward/mean": base + 0.02 * s,
            "actor/grad_norm": s + 100.0 * seed,
            "rollout_corr/tv_mismatch": 0.01 * float(level) + 0.001 * s,
            "timing/step_s": 1.0,
        }
        if not preset.startswith("bypass"):
            r["rollout_corr/k3_kl"] = 1e-3 * (s + 1) * seed * (1 + float(level))
            r["actor/tv_update"] = 0.002 * s
        if preset == "decoupled_token_is" and s % 2 == 0:
            r["rollout_corr/rollout_rs_masked_fraction"] = 0.1
        if preset == "decoupled_token_is" and seed == 1:
            r["rollout_corr/rollout_is_veto_fraction"] = 0.02
        if s == 9:
            r["eval/accuracy"] = 0.0  # an earlier eval: the report must use the last one
        if s == N_STEPS - 1:
            r["eval/accuracy"] = EVALS[(preset, level)][seed - 1]
        out.append(r)
    return out


def write_sweep(out, presets=PRESETS, levels=LEVELS, seeds=SEEDS, records=fake_records, steps=N_STEPS):
    """A sweep folder as `lab/rc_lab.py sweep` leaves it: sweep.json plus one run folder per run."""
    runs = []
    for p in presets:
        for lv in levels:
            for sd in seeds:
                name = rc_lab.run_name(p, DIAL, lv, sd)
                recs = records(p, lv, sd)
                if recs is not None:
                    os.makedirs(out / name, exist_ok=True)
                    with open(out / name / "metrics.jsonl", "w") as f:
                        f.writelines(json.dumps(r) + "\n" for r in recs)
                runs.append({"name": name, "preset": p, "level": lv, "seed": sd, "cmd": []})
    with open(out / "sweep.json", "w") as f:
        json.dump(
            {
                "presets": list(presets),
                "dial": DIAL,
                "levels": list(levels),
                "seeds": list(seeds),
                "steps": steps,
                "extra": [],
                "jobs": 1,
                "runs": runs,
            },
            f,
        )
    return out


def row_of(rows, preset, level):
    (row,) = [r for r in rows if r["preset"] == preset and r["level"] == level]
    return row


# ---------------------------------------------------------------------------------------------
# Numbers
# ---------------------------------------------------------------------------------------------
def test_final_reward_and_steps_to_reach():
    recs = fake_records("naive", "0", 1)  # reward 0.5 + 0.02 s, s = 0..19
    assert rc_lab.final_reward(recs) == pytest.approx(0.5 + 0.02 * 14.5)  # mean of steps 10..19
    assert rc_lab.final_reward(recs, last=1) == pytest.approx(0.88)
    assert rc_lab.steps_to_reach(recs, 0.71) == 11
    assert rc_lab.steps_to_reach(recs, 0.5) == 0
    assert rc_lab.steps_to_reach(recs, 0.9) is None
    assert rc_lab.final_reward([{"step": 0}]) is None
    assert rc_lab.steps_to_reach([{"step": 0}], 0.1) is None


def test_summarise_exact_values(tmp_path):
    sweep = rc_lab.load_sweep(str(write_sweep(tmp_path)))
    rows = rc_lab.summarise(sweep, REWARD_LEVEL)
    assert [(r["preset"], r["level"]) for r in rows] == [(p, lv) for p in PRESETS for lv in LEVELS]
    r = row_of(rows, "naive", "0")
    assert r["n_seeds"] == 2
    assert r["final_reward"] == pytest.approx(0.84)  # seeds 0.79, 0.89
    assert r["final_reward_std"] == pytest.approx(0.1 / np.sqrt(2))  # sample std (ddof=1)
    assert r["eval_acc"] == pytest.approx(0.81) and r["eval_acc_std"] == pytest.approx(0.02 / np.sqrt(2))
    assert r["steps_to_reach"] == pytest.approx(8.5) and r["reached"] == "2/2"  # steps 11 and 6
    assert r["max_grad_norm"] == pytest.approx(219.0)
    assert r["max_k3_kl"] == pytest.approx(0.04)
    assert r["masked_fraction"] == 0.0 and r["veto_fraction"] == 0.0
    assert r["delta_eval_acc"] == 0.0 and r["flag"] == "ref"
    r = row_of(rows, "naive", "0.3")
    assert r["final_reward"] == pytest.approx(0.49) and r["final_reward_std"] == pytest.approx(0.2 / np.sqrt(2))
    assert r["steps_to_reach"] is None and r["reached"] == "0/2"
    assert r["max_k3_kl"] == pytest.approx(0.04 * 1.3)
    assert r["delta_eval_acc"] == pytest.approx(-0.20) and r["flag"] == "below"
    r = row_of(rows, "decoupled_token_is", "0.3")
    assert r["steps_to_reach"] == pytest.approx(16.0) and r["reached"] == "1/2"
    assert r["masked_fraction"] == pytest.approx(0.05)  # 0.1 on even steps, missing (0) on odd ones
    assert r["veto_fraction"] == pytest.approx(0.01)  # seed 1: 0.02, seed 2: not logged (0)
    assert r["eval_acc"] == pytest.approx(0.77) and r["eval_acc_std"] == pytest.approx(0.02 / np.sqrt(2))
    assert r["delta_eval_acc"] == pytest.approx(-0.03) and r["flag"] == ""  # 0.03 < 0.05
    r = row_of(rows, "bypass_ppo_clip", "0.3")
    assert r["max_k3_kl"] is None  # never logged
    assert r["delta_eval_acc"] == pytest.approx(-0.10) and r["flag"] == ""  # 0.10 < 2 * 0.1414


def test_summary_files(tmp_path):
    out = write_sweep(tmp_path)
    sweep = rc_lab.load_sweep(str(out))
    rows = rc_lab.summarise(sweep, REWARD_LEVEL)
    csv_path, md_path = rc_lab.write_summary(rows, sweep, str(out), REWARD_LEVEL)
    with open(csv_path) as f:
        table = list(csv.DictReader(f))
    assert [(t["preset"], t["level"]) for t in table] == [(p, lv) for p in PRESETS for lv in LEVELS]
    naive3 = table[1]
    assert float(naive3["final_reward_mean"]) == pytest.approx(0.49)
    assert float(naive3["delta_eval_acc_vs_level0"]) == pytest.approx(-0.2)
    assert naive3["flag"] == "below" and naive3["steps_to_reach_mean"] == "–" and naive3["reached"] == "0/2"
    assert table[5]["max_k3_kl"] == "–"
    assert [t["flag"] for t in table] == ["ref", "below", "ref", "", "ref", ""]
    md = Path(md_path).read_text()
    assert "| naive | 0.3 | 2 | 0.490 ± 0.141 | 0.610 ± 0.014 | – | 0/2 |" in md
    assert "| bypass_ppo_clip | 0.3 | 2 | 0.690 ± 0.000 | 0.700 ± 0.141 | 16.0 | 2/2 | – | 219 |" in md
    assert sum(line.endswith("| below |") for line in md.splitlines()) == 1
    assert "max(2 × pooled std, 0.05)" in md and "`rollout_weight_noise=0`" in md


def test_t_quantiles_match_the_t_density():
    """rc_lab.T_975 (NIST/SEMATECH's table, 3 decimals) is the 0.975 quantile of Student's t: the t density integrated
    from 0 to each tabled value gives 0.475 to within the table's rounding."""
    for df, t in enumerate(rc_lab.T_975, start=1):
        x = np.linspace(0.0, t, 400_001)
        c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
        density = c * (1 + x * x / df) ** (-(df + 1) / 2)
        mass = float(np.sum((density[1:] + density[:-1]) / 2) * (x[1] - x[0]))
        assert abs(mass - 0.475) < 0.5e-3 * density[-1] + 1e-9, (df, t, mass)  # 0.0005 in t: the last decimal
    assert rc_lab.t_975(2) == 4.303 and rc_lab.t_975(4) == 2.776 and rc_lab.t_975(100) == rc_lab.T_975[-1]


def test_paired_view(tmp_path):
    """Each comparison of the table (each row against its reference level) as a paired difference over seeds: mean
    of the per-seed differences, a Student t 95 % interval and its half-width, beside the rule's margin, in
    summary.md and summary.csv; verdicts and flags unchanged."""
    sweep = rc_lab.load_sweep(str(write_sweep(tmp_path)))
    rows = rc_lab.summarise(sweep, REWARD_LEVEL)
    comps = {(c["kind"], c["preset"], c["level"]): c for c in rc_lab.paired_comparisons(rows, sweep)}
    assert set(comps) == {("ref", p, "0.3") for p in PRESETS}  # a mismatch sweep reads each row against level 0
    naive = comps[("ref", "naive", "0.3")]  # seeds: 0.60 - 0.80, 0.62 - 0.82
    assert naive["n_pairs"] == 2 and naive["unpaired"] == 0 and naive["against_level"] == "0"
    assert naive["delta"] == pytest.approx(-0.20) and naive["half_width"] == pytest.approx(0.0, abs=1e-15)
    dtis = comps[("ref", "decoupled_token_is", "0.3")]  # seeds: 0.78 - 0.80, 0.76 - 0.80
    assert dtis["delta"] == pytest.approx(-0.03) and dtis["sd"] == pytest.approx(0.02 / math.sqrt(2))
    assert dtis["half_width"] == pytest.approx(12.706 * 0.01)  # t(0.975, 1 df) * sd / sqrt(2)
    assert (dtis["ci_low"], dtis["ci_high"]) == pytest.approx((-0.03 - 0.12706, -0.03 + 0.12706))
    assert dtis["rule_margin"] == pytest.approx(0.05)
    bypass = comps[("ref", "bypass_ppo_clip", "0.3")]  # seeds 0.70, 0.90 widen the rule's margin; each seed -0.10
    assert bypass["rule_margin"] == pytest.approx(2 * 0.1414, abs=1e-3) and bypass["half_width"] < 1e-12
    csv_path, md_path = rc_lab.write_summary(rows, sweep, str(tmp_path), REWARD_LEVEL)
    with open(csv_path) as f:
        table = list(csv.DictReader(f))
    assert [t["flag"] for t in table] == ["ref", "below", "ref", "", "ref", ""]  # the rule's flags, as before
    assert [t["paired_vs_ref_n"] for t in table] == ["–", "2", "–", "2", "–", "2"]
    assert float(table[3]["paired_vs_ref_delta"]) == pytest.approx(-0.03)
    assert float(table[3]["paired_vs_ref_half_width"]) == pytest.approx(0.12706)
    assert "paired_vs_naive_n" not in table[0]  # read across presets only in staleness, replay and MoE sweeps
    md = Path(md_path).read_text()
    assert md.index("Verdicts") < md.index("**Paired view") < md.index("final reward: mean")
    assert (
        "| decoupled_token_is | 0.3 | same preset at `rollout_weight_noise=0` | 2 | -0.030 | [-0.157, +0.097] | "
        "0.127 | 0.050 | covers 0 |" in md
    )
    assert "| naive | 0.3 | same preset at `rollout_weight_noise=0` | 2 | -0.200 | [-0.200, -0.200] | 0.000 |" in md
    assert "(12.706 at n = 2; NIST/SEMATECH" in md and "run from 0.000 to 0.127 (median 0.000)" in md
    assert "Not every comparison is paired" not in md

    def records(p, lv, sd):  # naive at 0.3 lost its seed 2: paired on seed 1 alone, no interval
        return None if (p, lv, sd) == ("naive", "0.3", 2) else fake_records(p, lv, sd)

    sweep = rc_lab.load_sweep(str(write_sweep(tmp_path / "gap", records=records)))
    rows = rc_lab.summarise(sweep, REWARD_LEVEL)
    (gap,) = [c for c in rc_lab.paired_comparisons(rows, sweep) if c["preset"] == "naive"]
    assert gap["n_pairs"] == 1 and gap["unpaired"] == 1 and gap["delta"] == pytest.approx(-0.20)
    assert gap["ci_low"] is None and gap["half_width"] is None
    _, md_path = rc_lab.write_summary(rows, sweep, str(tmp_path / "gap"), REWARD_LEVEL)
    md = Path(md_path).read_text()
    assert "| naive | 0.3 | same preset at `rollout_weight_noise=0` | 1 (1 unpaired) | -0.200 | – | – |" in md
    assert "Not every comparison is paired by seed" in md


def test_csv_cells_keep_fixed_digits():
    """Every float of a lab CSV: CSV_DIGITS significant digits, written as Python writes the rounded float; with
    `decimals` (length.csv) no digit below that, a noise-sized value (either sign) is 0.0; the rest as it is."""
    assert rc_lab.CSV_DIGITS == 10
    cell = rc_lab.csv_cell
    assert [cell(v) for v in (1 / 3, np.float64(2 / 3), np.float32(0.1), 3.0, 1e-5, 6573232631234.5)] == [
        "0.3333333333",
        "0.6666666667",
        "0.1000000015",
        "3.0",
        "1e-05",
        "6573232631000.0",
    ]
    assert [cell(v) for v in (float("nan"), float("inf"), -float("inf"), -0.0)] == ["nan", "inf", "-inf", "0.0"]
    assert [cell(v) for v in (None, 3, np.int64(7), True, "1/3")] == [rc_lab.DASH, 3, np.int64(7), True, "1/3"]
    # the same value to the last digits of a float64 writes the same cell
    assert cell(1 / 3 * (1 + 2**-52)) == cell(1 / 3) and cell(-1.289603690501906e-08, 12) == "-1.2896e-08"
    assert cell(8.845022185312978e-14, 12) == cell(8.840432742e-14, 12) == cell(-1e-14, 12) == "0.0"


def test_missing_keys_and_missing_runs(tmp_path):
    """A run with only step + reward, and a run with no metrics at all: no crash, '–' where unknown."""

    def records(p, lv, sd):
        if sd == 2:
            return None
        return [{"step": s, "reward/mean": 0.25} for s in range(3)]

    out = write_sweep(tmp_path, presets=["naive"], records=records)
    written = rc_lab.report(str(out), 0.2)
    assert {os.path.basename(p) for p in written} == {"summary.csv", "summary.md", "reward.png", "k3.png", "alpha.png"}
    with open(out / "summary.csv") as f:
        table = list(csv.DictReader(f))
    assert table[0]["n_seeds"] == "1" and float(table[0]["final_reward_mean"]) == 0.25
    assert table[0]["final_reward_std"] == "–" and table[0]["eval_acc_mean"] == "–"
    assert table[0]["max_k3_kl"] == "–" and table[0]["max_grad_norm"] == "–"
    assert table[0]["rs_masked_fraction"] == "0.0" and "veto_fraction" not in table[0]
    assert table[1]["delta_eval_acc_vs_level0"] == "–" and table[1]["flag"] == "–"


# ---------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------
def check_png(path, n_panels):
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    assert os.path.getsize(path) > 5000
    assert imread(path).shape[1] == round(4.6 * 90 * n_panels)  # one panel per dial level


def test_report_writes_all_pngs_and_histogram(tmp_path, capsys):
    out = write_sweep(tmp_path)
    rng = np.random.default_rng(0)
    for i, run in enumerate(json.loads((out / "sweep.json").read_text())["runs"]):
        d = out / run["name"] / "log_ratio"
        d.mkdir()
        for step in (0, 10) if i else (0, 10, 15):  # step 15 exists for one run only
            np.save(d / f"step_{step:06d}.npy", (0.05 * rng.standard_normal(200)).astype(np.float32))
    written = rc_lab.report(str(out), REWARD_LEVEL)
    assert "rc_lab: IS histogram at step 10" in capsys.readouterr().out  # largest step that all runs have
    for name in ("reward.png", "k3.png", "alpha.png", "is_hist.png"):
        assert str(out / name) in written
        check_png(out / name, len(LEVELS))
    os.remove(out / "is_hist.png")
    rc_lab.plot_is_hist(rc_lab.load_sweep(str(out)), str(out / "is_hist.png"), step=15)
    assert "at step 15" in capsys.readouterr().out
    check_png(out / "is_hist.png", len(LEVELS))


def test_histogram_skipped_without_npy(tmp_path, capsys):
    out = write_sweep(tmp_path)
    written = rc_lab.report(str(out), REWARD_LEVEL)
    assert "is_hist.png skipped" in capsys.readouterr().out
    assert not (out / "is_hist.png").exists() and str(out / "is_hist.png") not in written
    assert rc_lab.plot_is_hist(rc_lab.load_sweep(str(out)), str(out / "h.png"), step=5) is None


# ---------------------------------------------------------------------------------------------
# Bad input: exit 2, the bad value named, nothing created
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "flags, bad",
    [
        (["--presets", "naive,not_a_preset"], "not_a_preset"),
        (["--levels", "0,0.1,0.1"], "0.1"),
        (["--jobs", "0"], "0"),
        (["--levels", ""], "--levels"),
        (["--seeds", "1,x"], "x"),
        (["--dial", "rollout-weight-noise"], "rollout-weight-noise"),
        (["--dial", "seed"], "seed"),
        (["--steps", "0"], "0"),
    ],
)
def test_bad_sweep_input(tmp_path, capsys, monkeypatch, flags, bad):
    monkeypatch.setattr(rc_lab, "launch", lambda *a: pytest.fail("nothing may start"))
    base = {
        "--out": str(tmp_path / "lab"),
        "--presets": "naive",
        "--dial": DIAL,
        "--levels": "0,0.1",
        "--seeds": "1",
        "--jobs": "1",
    }
    base.update(dict(zip(flags[::2], flags[1::2])))
    code = rc_lab.main(["sweep", *[x for kv in base.items() for x in kv]])
    err = capsys.readouterr().err
    assert code == 2 and bad in err and "rc_lab: error" in err
    assert not (tmp_path / "lab").exists()


def test_extra_flag_clash(tmp_path, capsys):
    code = rc_lab.main(
        [
            "sweep",
            "--out",
            str(tmp_path / "lab"),
            "--presets",
            "naive",
            "--dial",
            DIAL,
            "--levels",
            "0",
            "--",
            "--seed",
            "3",
        ]
    )
    assert code == 2 and "--seed" in capsys.readouterr().err and not (tmp_path / "lab").exists()


def test_cli_errors_subprocess(tmp_path):
    """The real command line: exit code 2 and the bad value on stderr."""
    missing = tmp_path / "nope"
    p = subprocess.run(
        [*RC_LAB, "report", str(missing)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=LAB_ENV,
        check=False,
    )
    assert p.returncode == 2 and str(missing) in p.stderr and not missing.exists()
    p = subprocess.run(
        [
            *RC_LAB,
            "sweep",
            "--out",
            "lab",
            "--presets",
            "naive,bogus",
            "--dial",
            DIAL,
            "--levels",
            "0",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=LAB_ENV,
        check=False,
    )
    assert p.returncode == 2 and "bogus" in p.stderr and not (tmp_path / "lab").exists()


# ---------------------------------------------------------------------------------------------
# Sweep end to end with a fake trainer
# ---------------------------------------------------------------------------------------------
FAKE_TRAIN = r"""
import argparse, json, os, sys, time
p = argparse.ArgumentParser()
for flag in ("--output-dir", "--run-name", "--rollout-weight-noise"):
    p.add_argument(flag)
p.add_argument("--rc.preset", dest="preset")
p.add_argument("--seed", type=int)
p.add_argument("--num-steps", type=int)
p.add_argument("--overwrite", action="store_true")
a, rest = p.parse_known_args()
start = time.time()
time.sleep(0.4)
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "calls.jsonl"), "a") as f:
    f.write(json.dumps({"argv": sys.argv[1:], "omp": os.environ.get("OMP_NUM_THREADS"), "start": start,
                        "end": time.time()}) + "\n")
run_dir = os.path.join(a.output_dir, a.run_name)
if os.path.isdir(run_dir) and os.listdir(run_dir) and not a.overwrite:
    sys.exit("fake: run folder exists")
if a.preset == "decoupled_seq_is" and a.rollout_weight_noise == "0.3":
    print("fake: boom at step 2")
    sys.exit(3)
os.makedirs(run_dir, exist_ok=True)
with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
    for s in range(a.num_steps):
        f.write(json.dumps({"step": s, "reward/mean": 0.1 * s + 0.01 * a.seed}) + "\n")
print("fake: done", rest)
"""


def read_calls(tmp_path):
    """The fake trainer's call records, one per launch."""
    return [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]


def write_metrics(run_dir, steps, reward):
    run_dir.mkdir(parents=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps({"step": s, "reward/mean": reward}) + "\n" for s in range(steps))


def test_sweep_end_to_end(tmp_path, monkeypatch, capsys):
    fake = tmp_path / "fake_train.py"
    fake.write_text(FAKE_TRAIN)
    monkeypatch.setattr(rc_lab, "RC_TRAIN", str(fake))
    out = tmp_path / "lab"
    write_metrics(out / f"naive__{DIAL}=0__s1", 5, 9.0)  # complete: skipped
    write_metrics(out / f"naive__{DIAL}=0.3__s2", 2, 9.0)  # incomplete: re-run with --overwrite
    argv = [
        "sweep",
        "--out",
        str(out),
        "--presets",
        "naive,decoupled_seq_is",
        "--dial",
        DIAL,
        "--levels",
        "0,0.3",
        "--seeds",
        "1,2",
        "--jobs",
        "2",
        "--steps",
        "5",
        "--",
        "--eval-every",
        "2",
    ]
    assert rc_lab.main(argv) == 1  # two runs fail
    cap = capsys.readouterr()

    calls = read_calls(tmp_path)
    names = sorted(c["argv"][c["argv"].index("--run-name") + 1] for c in calls)
    assert len(calls) == 7 and f"naive__{DIAL}=0__s1" not in names
    assert all(c["omp"] == "1" for c in calls)
    spans = sorted((c["start"], c["end"]) for c in calls)
    assert any(b[0] < a[1] for a, b in itertools.pairwise(spans))  # --jobs 2: some runs overlapped
    by_name = {c["argv"][c["argv"].index("--run-name") + 1]: c["argv"] for c in calls}
    assert by_name[f"naive__{DIAL}=0.3__s2"][-1] == "--overwrite"
    assert by_name[f"naive__{DIAL}=0.3__s1"] == [
        "--output-dir",
        str(out),
        "--run-name",
        f"naive__{DIAL}=0.3__s1",
        "--rc.preset",
        "naive",
        "--seed",
        "1",
        "--rollout-weight-noise",
        "0.3",
        "--num-steps",
        "5",
        "--eval-every",
        "2",
    ]

    # the skipped run is untouched, the incomplete one was replaced, logs exist for every launched run
    assert rc_lab.load_metrics(str(out / f"naive__{DIAL}=0__s1"))[0]["reward/mean"] == 9.0
    assert rc_lab.load_metrics(str(out / f"naive__{DIAL}=0.3__s2"))[4]["reward/mean"] == pytest.approx(0.42)
    assert sorted(p.name for p in out.glob("*.log")) == sorted(n + ".log" for n in names)
    assert "fake: done ['--eval-every', '2']" in (out / f"naive__{DIAL}=0.3__s1.log").read_text()

    # failures: reported with the log tail, the sweep went on
    for sd in (1, 2):
        name = f"decoupled_seq_is__{DIAL}=0.3__s{sd}"
        assert f"run {name} failed (exit 3)" in cap.err
    assert "fake: boom at step 2" in cap.err
    spec = json.loads((out / "sweep.json").read_text())
    assert spec["presets"] == ["naive", "decoupled_seq_is"] and spec["levels"] == ["0", "0.3"]
    assert spec["seeds"] == [1, 2] and spec["steps"] == 5 and spec["extra"] == ["--eval-every", "2"]
    assert spec["wall_time_s"] >= 0
    status = {r["name"]: r["status"] for r in spec["runs"]}
    assert list(status.values()).count("failed") == 2 and list(status.values()).count("skipped") == 1
    assert list(status.values()).count("ok") == 5

    # the report ran: failed cell has no seeds
    with open(out / "summary.csv") as f:
        table = {(t["preset"], t["level"]): t for t in csv.DictReader(f)}
    assert table[("decoupled_seq_is", "0.3")]["n_seeds"] == "0"
    assert float(table[("decoupled_seq_is", "0")]["final_reward_mean"]) == pytest.approx(0.215)
    assert (out / "reward.png").stat().st_size > 0

    # resume: only the failed runs are launched again
    (tmp_path / "calls.jsonl").unlink()
    assert rc_lab.main(argv) == 1
    again = read_calls(tmp_path)
    assert sorted(c["argv"][c["argv"].index("--run-name") + 1] for c in again) == [
        f"decoupled_seq_is__{DIAL}=0.3__s1",
        f"decoupled_seq_is__{DIAL}=0.3__s2",
    ]


def test_sweep_all_ok_exit_zero(tmp_path, monkeypatch):
    fake = tmp_path / "fake_train.py"
    fake.write_text(FAKE_TRAIN)
    monkeypatch.setattr(rc_lab, "RC_TRAIN", str(fake))
    out = tmp_path / "lab"
    assert (
        rc_lab.main(
            [
                "sweep",
                "--out",
                str(out),
                "--presets",
                "naive",
                "--dial",
                DIAL,
                "--levels",
                "0",
                "--seeds",
                "1",
                "--steps",
                "3",
            ]
        )
        == 0
    )
    assert (out / "summary.md").exists()
    # a trainer that exits 0 without a complete metrics.jsonl counts as failed
    monkeypatch.setattr(rc_lab, "launch", lambda cmd, log: 0)
    assert (
        rc_lab.main(
            [
                "sweep",
                "--out",
                str(out),
                "--presets",
                "naive",
                "--dial",
                DIAL,
                "--levels",
                "0",
                "--seeds",
                "1",
                "--steps",
                "4",
            ]
        )
        == 1
    )


def test_sweep_json_records_every_invocation(tmp_path, monkeypatch):
    """Each `sweep` command appends one record to sweep.json's `invocations` (start, end, command line, load average
    at start, runs skipped / launched / done / failed), so a resumed sweep keeps its history; a sweep.json written
    before the list existed still loads, its last invocation kept as a `legacy` record. The runs are stubbed."""
    launched = []

    def fake_launch(cmd, log_path):  # writes a complete metrics.jsonl, except for seed 3 (fails)
        flag = {f: cmd[cmd.index(f) + 1] for f in ("--output-dir", "--run-name", "--num-steps", "--seed")}
        launched.append(flag["--run-name"])
        if flag["--seed"] == "3":
            return 5
        write_metrics(Path(flag["--output-dir"]) / flag["--run-name"], int(flag["--num-steps"]), 0.5)
        return 0

    monkeypatch.setattr(rc_lab, "launch", fake_launch)
    monkeypatch.setattr(rc_lab.os, "getloadavg", lambda: (1.234, 0.5, 0.25))
    out = tmp_path / "lab"
    argv = ["sweep", "--out", str(out), "--presets", "naive", "--dial", DIAL, "--levels", "0", "--steps", "2"]
    (out / "sweep.json").parent.mkdir()
    (out / "sweep.json").write_text(json.dumps({"runs": [], "extra": [], "started": "2025-01-01T00:00:00"}))
    assert rc_lab.main([*argv, "--seeds", "1"]) == 0
    assert rc_lab.main([*argv, "--seeds", "1,2,3"]) == 1  # resumed: seed 1 skipped, 2 done, 3 failed
    spec = json.loads((out / "sweep.json").read_text())
    legacy, first, second = rc_lab.invocations(spec)
    assert legacy["started"] == "2025-01-01T00:00:00" and "legacy" in legacy
    assert first["command"] == ["python", "-m", "lab.rc_lab", *argv, "--seeds", "1"]
    assert second["command"][-1] == "1,2,3" and second["load_average_at_start"] == [1.23, 0.5, 0.25]
    assert (first["runs_skipped"], first["runs_launched"], first["runs_done"], first["runs_failed"]) == (0, 1, 1, 0)
    assert (second["runs_skipped"], second["runs_launched"], second["runs_done"], second["runs_failed"]) == (1, 2, 1, 1)
    assert first["runs_unfinished"] == second["runs_unfinished"] == 0 and first["cpus"] == os.cpu_count()
    for inv in (first, second):
        assert inv["started"] <= inv["ended"] and inv["wall_time_s"] >= 0
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4}", inv["ended"])
    assert spec["wall_time_s"] == second["wall_time_s"] and spec["started"]  # the top-level fields, as before
    assert launched == [rc_lab.run_name("naive", DIAL, "0", s) for s in (1, 2, 3)]
    # a committed sweep.json (written before the list) loads, its one known invocation marked legacy
    old = rc_lab.read_spec(str(LAB / "catalogue"))
    assert "invocations" not in old and rc_lab.invocations(old)[0]["started"] == old["started"]
    assert rc_lab.invocations({"runs": []}) == []


def test_cli_sweep_subprocess(tmp_path):
    """`python -m lab.rc_lab sweep` as a user runs it, the trainer swapped through RC_LAB_TRAIN."""
    fake = tmp_path / "fake_train.py"
    fake.write_text(FAKE_TRAIN)
    env = {**LAB_ENV, "RC_LAB_TRAIN": str(fake)}
    p = subprocess.run(
        [
            *RC_LAB,
            "sweep",
            "--out",
            "lab",
            "--presets",
            "naive",
            "--dial",
            DIAL,
            "--levels",
            "0,0.1",
            "--seeds",
            "7",
            "--steps",
            "3",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    assert "rc_lab: 2 ran, 0 skipped, 0 failed" in p.stdout and "| naive | 0.1 | 1 |" in p.stdout
    spec = json.loads((tmp_path / "lab" / "sweep.json").read_text())
    assert [r["cmd"][1] for r in spec["runs"]] == [str(fake)] * 2
    assert [r["status"] for r in spec["runs"]] == ["ok", "ok"]
    assert rc_lab.load_metrics(str(tmp_path / "lab" / f"naive__{DIAL}=0.1__s7"))[2]["reward/mean"] == pytest.approx(
        0.27
    )


# ---------------------------------------------------------------------------------------------
# The mismatch pseudo-dial, preset fields, the length lab
# ---------------------------------------------------------------------------------------------
ARGS_FIELDS, RC_FIELDS, BOOL_FIELDS = rc_lab._trainer_fields()


def test_mismatch_levels_and_preset_fields_become_flags(tmp_path, monkeypatch, capsys):
    import torch  # build_spec asks rc_train.py's own checks, which refuse --max-staleness >= 1 on a GPU

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = rc_lab._parser().parse_args(
        [
            "sweep",
            "--out",
            str(tmp_path / "lab"),
            "--presets",
            "naive,naive+rollout_token_veto_threshold=1e-4",
            "--dial",
            "mismatch",
            "--levels",
            "none,rollout_dtype=bfloat16+rollout_weight_noise=0.5",
            "--seeds",
            "3",
        ]
    )
    spec = rc_lab.build_spec(args, ["--eval-every", "5"])
    cmds = {r["name"]: r["cmd"][2:] for r in spec["runs"]}
    name = "naive+rollout_token_veto_threshold=1e-4__rollout_dtype=bfloat16+rollout_weight_noise=0.5__s3"
    assert cmds[name] == [
        "--output-dir",
        str(tmp_path / "lab"),
        "--run-name",
        name,
        "--rc.preset",
        "naive",
        "--rc.rollout-token-veto-threshold",
        "1e-4",
        "--seed",
        "3",
        "--rollout-dtype",
        "bfloat16",
        "--rollout-weight-noise",
        "0.5",
        "--num-steps",
        "40",
        "--max-staleness",  # the synchronous loop, pinned: rc_train.py's own default on a CPU is 1
        "0",
        "--eval-every",
        "5",
    ]
    assert "--rollout-dtype" not in cmds["naive__none__s3"]
    # a preset entry may set Args fields too (objective, mask or loss term in one row); booleans are tyro switches
    flags = rc_lab.preset_flags(
        "bypass_ppo_clip+loss_mode=cispo+kl_coef=0.05+kl_is_corrected=true", RC_FIELDS, ARGS_FIELDS, BOOL_FIELDS
    )
    assert flags == [
        "--rc.preset",
        "bypass_ppo_clip",
        "--rc.loss-mode",
        "cispo",
        "--kl-coef",
        "0.05",
        "--kl-is-corrected",
    ]
    assert rc_lab.preset_flags("naive+eval_before=False", RC_FIELDS, ARGS_FIELDS, BOOL_FIELDS)[2:] == [
        "--no-eval-before"
    ]
    with pytest.raises(rc_lab.LabError, match="is a switch"):
        rc_lab.preset_flags("naive+kl_is_corrected=1", RC_FIELDS, ARGS_FIELDS, BOOL_FIELDS)
    # a sweep of the bound itself, or an extra flag that sets it, is not pinned
    args.dial, args.levels = "max_staleness", "0,4"
    assert rc_lab.build_spec(args, [])["runs"][1]["cmd"][-4:] == ["--max-staleness", "4", "--num-steps", "40"]
    args.dial, args.levels = "mismatch", "none"
    assert rc_lab.build_spec(args, ["--max-staleness=2"])["runs"][0]["cmd"][-3:] == [
        "--num-steps",
        "40",
        "--max-staleness=2",
    ]
    for flags, needle in (
        (["--levels", "none,rollout_dtyp=bfloat16"], "'rollout_dtyp'"),
        (["--levels", "none,seed=4"], "--seed"),
        (["--levels", "none,rollout_dtype"], "is not FIELD=VALUE"),
        (["--presets", "naive+veto=1"], "'veto'"),
        (["--presets", "naive+seed=4"], "--seed"),
    ):
        argv = [
            "sweep",
            "--out",
            str(tmp_path / "bad"),
            "--presets",
            "naive",
            "--dial",
            "mismatch",
            "--levels",
            "none",
            *flags,
        ]
        assert rc_lab.main(argv) == 2
        assert needle in capsys.readouterr().err
        assert not (tmp_path / "bad").exists()
    # the clash with a flag after `--` is caught too
    assert (
        rc_lab.main(
            [
                "sweep",
                "--out",
                str(tmp_path / "bad"),
                "--presets",
                "naive",
                "--dial",
                "mismatch",
                "--levels",
                "none,rollout_dtype=bfloat16",
                "--",
                "--rollout-dtype",
                "float16",
            ]
        )
        == 2
    )
    assert "--rollout-dtype" in capsys.readouterr().err


def test_a_sweep_that_plants_tokens_runs_every_cell_on_one_vllm_runner(tmp_path):
    """--rollout-corrupt-prob > 0 runs vLLM's V1 model runner on a GPU (vLLM's default is V2, another sampler): a sweep
    with such a cell pins V1 in every cell, level 0 included (--vllm-v1-runner), and a sweep without one does not."""

    def cmds(dial, levels, presets="naive", extra=()):
        argv = ["sweep", "--out", str(tmp_path / "lab"), "--presets", presets, "--dial", dial, "--levels", levels]
        argv += ["--seeds", "1"]
        return [r["cmd"] for r in rc_lab.build_spec(rc_lab._parser().parse_args(argv), list(extra))["runs"]]

    for pinned in (cmds("rollout_corrupt_prob", "0,0.01"), cmds("mismatch", "none,rollout_corrupt_prob=0.02")):
        assert len(pinned) == 2 and all(c.count("--vllm-v1-runner") == 1 for c in pinned), pinned
    for free in (cmds("rollout_weight_noise", "0,0.5"), cmds("rollout_corrupt_prob", "0")):
        assert not any("--vllm-v1-runner" in c for c in free), free
    given = cmds("rollout_corrupt_prob", "0,0.1", extra=["--vllm-v1-runner"])  # not twice
    assert all(c.count("--vllm-v1-runner") == 1 for c in given)


def write_length_dumps(run_dir, sigma, rng, steps=3, rows=400):
    """Dumps of i.i.d. token log-ratios N(-sigma^2/2, sigma^2) (so E_mu rho = 1), response lengths 4..59."""
    (run_dir / "log_ratio" / "lengths").mkdir(parents=True)
    for s in range(steps):
        lengths = rng.integers(4, 60, size=rows)
        flat = rng.normal(-(sigma**2) / 2, sigma, size=lengths.sum())
        np.save(run_dir / "log_ratio" / f"step_{s:06d}.npy", flat.astype(np.float32))
        np.save(run_dir / "log_ratio" / "lengths" / f"step_{s:06d}.npy", lengths.astype(np.int32))


def test_length_law_and_trap_on_independent_tokens(tmp_path):
    # Independent lognormal token ratios obey the law exactly: chi2_seq = (1 + chi2_token)^T - 1 with
    # chi2_token = e^{sigma^2} - 1, so the fitted slope is sigma^2; the sum gate's |s| grows like sqrt(T) sigma and
    # rejects more long answers, while Geo-RS (mean in a +-0.001 band) rejects nearly all of them at every length.
    rng = np.random.default_rng(0)
    sigma = 0.1
    runs = []
    for lv, sg in (("none", 0.0), ("rollout_weight_noise=0.5", sigma)):
        for sd in (1, 2, 3):
            name = rc_lab.run_name("naive", "mismatch", lv, sd)
            write_length_dumps(tmp_path / name, sg, rng)
            runs.append({"preset": "naive", "level": lv, "seed": sd, **rc_lab.read_run_folder(str(tmp_path / name))})
    sweep = {
        "presets": ["naive"],
        "dial": "mismatch",
        "levels": ["none", "rollout_weight_noise=0.5"],
        "seeds": [1, 2, 3],
        "runs": runs,
    }
    rows = rc_lab.length_rows(sweep)
    fits = {f["level"]: f for f in rc_lab.length_fits(rows)}
    noisy = [r for r in rows if r["level"] != "none"]
    assert [r["bin"] for r in noisy] == ["0–7", "8–15", "16–23", "24–31", "32–39", "40–47", "48–55", "56–63"]
    assert all(r["n_seeds"] == 3 for r in noisy)
    assert all(abs(r["chi2_token"] - math.expm1(sigma**2)) < 0.5 * sigma**2 for r in noisy)
    assert fits["rollout_weight_noise=0.5"]["slope"] == pytest.approx(sigma**2, rel=0.25)
    assert 0.75 < fits["rollout_weight_noise=0.5"]["slope_ratio"] < 1.33
    assert noisy[-1]["ess_seq"] < noisy[0]["ess_seq"] - 0.2 and min(r["ess_token"] for r in noisy) > 0.98
    assert fits["rollout_weight_noise=0.5"]["reject_seq_sum_k1_change"] > 0.2
    assert abs(fits["rollout_weight_noise=0.5"]["reject_seq_mean_k1_change"]) < 0.1
    clean = [r for r in rows if r["level"] == "none"]
    assert all(r["chi2_seq"] == 0 and r["reject_seq_sum_k1"] == 0 and r["ess_seq"] == 1 for r in clean)
    assert fits["none"]["slope_ratio"] is None
    csv_path, md_path = rc_lab.write_length_summary(rows, list(fits.values()), sweep, str(tmp_path))
    md = Path(md_path).read_text()
    assert md.index("Reading rule") < md.index("| preset | level | T bin")  # the rule comes before the table
    assert "| holds | " in md and "(rises) | " in md
    with open(csv_path) as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    for path in rc_lab.plot_length(rows, str(tmp_path)):
        with open(path, "rb") as f:
            assert f.read(8) == PNG_MAGIC


def test_length_dump_whose_lengths_disagree_is_refused(tmp_path):
    d = tmp_path / "run" / "log_ratio"
    (d / "lengths").mkdir(parents=True)
    np.save(d / "step_000000.npy", np.zeros(10, np.float32))
    np.save(d / "lengths" / "step_000000.npy", np.array([3, 4], np.int32))
    with pytest.raises(rc_lab.LabError, match="add up to 7"):
        rc_lab.load_dumps(rc_lab.read_run_folder(str(tmp_path / "run")))


# ---------------------------------------------------------------------------------------------
# Export (the compact form) and the committed sweeps in lab/
# ---------------------------------------------------------------------------------------------
LAB = Path(ROOT) / "lab"
COMMITTED = sorted(p.parent.name for p in LAB.glob("*/sweep.json"))
REPORT = {"summary.md", "summary.csv", "reward.png", "k3.png", "alpha.png", "is_hist.png"}
COMPACT = {"sweep.json", rc_lab.RUNS_FILE, rc_lab.DUMPS_FILE} | REPORT
MACHINE_PATHS = re.compile("/(work|root|home|tmp)/")


def test_export_round_trip(tmp_path, monkeypatch):
    """Run folders (one without metrics, one metric export leaves out, a config with machine paths) -> the compact
    form: a few files, no machine path, the same tables and plots byte for byte; exporting it again gives the same
    runs file; export refuses to write onto its source and a sweep into an exported folder is refused."""

    def records(p, lv, sd):
        return None if (lv, sd) == ("0.3", 2) else [{**r, "perf/not_exported": 1.0} for r in fake_records(p, lv, sd)]

    src, dest, again = tmp_path / "src", tmp_path / "dest", tmp_path / "again"
    write_sweep(src, presets=["naive"], records=records)
    spec = json.loads((src / "sweep.json").read_text())
    spec["trainer"] = os.path.join(ROOT, "rc_train.py")
    spec["runs"][0]["cmd"] = [
        sys.executable,
        spec["trainer"],
        "--output-dir",
        str(src),
        "--config=" + os.path.join(ROOT, "configs", "cpu_add.yaml"),
    ]
    (src / "sweep.json").write_text(json.dumps(spec))
    rng = np.random.default_rng(0)
    for i, run in enumerate(spec["runs"]):
        write_length_dumps(src / run["name"], 0.1 * i, rng, steps=2, rows=200)
    (src / spec["runs"][0]["name"] / "config.yaml").write_text(f"output_dir: {src}\nmodel_path: /tmp/cache/base-1\n")

    written = {os.path.basename(p) for p in rc_lab.report(str(src))}
    assert rc_lab.main(["export", str(src), str(dest)]) == 0
    assert (
        {p.name for p in dest.iterdir()}
        == COMPACT | {"length.md", "length.csv", "length_law.png", "length_trap.png"}
        == written | COMPACT
    )
    for name in written:
        assert (dest / name).read_bytes() == (src / name).read_bytes(), name

    exported = json.loads((dest / "sweep.json").read_text())
    assert exported["trainer"] == "rc_train.py" and exported["runs"][0]["cmd"][1:] == [
        "rc_train.py",
        "--output-dir",
        "src",
        "--config=" + os.path.join("configs", "cpu_add.yaml"),
    ]
    runs = rc_lab.read_compact(str(dest))
    assert runs[spec["runs"][0]["name"]]["config"] == "output_dir: src\nmodel_path: base-1\n"
    assert runs[rc_lab.run_name("naive", DIAL, "0.3", 2)]["records"] is None
    assert not any("perf/not_exported" in r for run in runs.values() for r in run["records"] or [])
    text = (dest / "sweep.json").read_text() + gzip.decompress((dest / rc_lab.RUNS_FILE).read_bytes()).decode()
    assert str(tmp_path) not in text and not MACHINE_PATHS.search(text)
    folder = rc_lab.read_run_folder(str(src / spec["runs"][1]["name"]))
    for key in ("log_ratio", "lengths"):  # every dump as dumped: dtype and values
        stored = runs[spec["runs"][1]["name"]][key]
        assert stored.keys() == folder[key].keys() == {0, 1}
        assert all(
            stored[s].dtype == folder[key][s].dtype and np.array_equal(stored[s], folder[key][s]) for s in stored
        )

    assert rc_lab.main(["export", str(dest), str(again)]) == 0  # the compact form exports to itself, byte for byte
    assert (again / rc_lab.RUNS_FILE).read_bytes() == (dest / rc_lab.RUNS_FILE).read_bytes()
    assert rc_lab.main(["export", str(dest), str(dest)]) == 2
    monkeypatch.setattr(rc_lab, "launch", lambda *a: pytest.fail("nothing may start"))
    assert rc_lab.main(["sweep", "--out", str(dest), "--presets", "naive", "--dial", DIAL, "--levels", "0"]) == 2


def test_lab_holds_a_few_files_per_sweep():
    """The lab stays a few files per sweep: the compact form and its report (sweep.json, runs.jsonl.gz, the summaries,
    the plots: 7; with dumped log-ratios, the length lab's report and the dumps too: 13 at most), and beside the sweeps
    only the code and its README.
    A bound per sweep, not a total, so that a new sweep never needs the bound raised (it was a total: 100, then 120
    at 103 files; 124 files for 14 sweeps in session 23)."""
    for name in COMMITTED:
        assert len(os.listdir(LAB / name)) <= 13, name
    assert sorted(p.name for p in LAB.iterdir() if p.is_file()) == ["README.md", "__init__.py", "rc_lab.py"]


def test_committed_sweeps_hold_no_machine_path():
    """sweep.json, the configs in the runs file and every text file of lab/ name no absolute path."""
    assert COMMITTED == [
        "catalogue",
        "catalogue_published",
        "collapse",
        "length",
        "length_long",
        "moe",
        "moe_gspo",
        "noise_sweep",
        "partial",
        "replay",
        "replay_staleness",
        "split",
        "staleness",
        "veto",
    ]
    for name in COMMITTED:
        spec = json.loads((LAB / name / "sweep.json").read_text())
        strings = [spec["trainer"], *(s for run in spec["runs"] for s in run["cmd"]), *spec["extra"]]
        assert not [s for s in strings if os.path.isabs(s.partition("=")[2] or s)], name
        configs = [run["config"] or "" for run in rc_lab.read_compact(str(LAB / name)).values()]
        assert not [c for c in configs if MACHINE_PATHS.search(c)], name
    for path in LAB.rglob("*"):
        if path.suffix in (".md", ".csv", ".json"):
            assert not MACHINE_PATHS.search(path.read_text()), path


@pytest.mark.parametrize("name", COMMITTED)
def test_committed_sweep_regenerates_its_summary(tmp_path, name):
    """The compact form in lab/NAME gives its committed summary.md/.csv and length.md/.csv byte for byte, on any
    CPU: the CSVs keep rc_lab.CSV_DIGITS significant digits (length.csv no digit below 1e-12), far above the last
    digits of float64 in which numpy's exp and power differ from CPU to CPU."""
    sweep = rc_lab.load_sweep(str(LAB / name))
    assert {p.name for p in (LAB / name).iterdir()} <= COMPACT | {
        "length.md",
        "length.csv",
        "length_law.png",
        "length_trap.png",
        "staleness.png",
    }
    written = rc_lab.write_summary(rc_lab.summarise(sweep, 0.5), sweep, str(tmp_path), 0.5)
    if (LAB / name / "length.md").exists():
        rows = rc_lab.length_rows(sweep)
        written += rc_lab.write_length_summary(rows, rc_lab.length_fits(rows), sweep, str(tmp_path))
    for path in written:
        assert Path(path).read_bytes() == (LAB / name / os.path.basename(path)).read_bytes(), path


def real_two_cell_sweep(tmp_path, sweep_flags: list[str], trainer_flags: list[str]):
    """`python -m lab.rc_lab sweep` with rc_train.py itself on the one-token fixture (configs/cpu_add.yaml, 8 prompts
    x 8 samples, 6-token answers, 10 eval problems): two runs, seconds each. Returns the sweep folder; the sweep must
    succeed with both runs done."""
    out = tmp_path / "lab"
    env = {**LAB_ENV, "OMP_NUM_THREADS": "1", "RC_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("RC_LAB_TRAIN", None)
    trainer = ["--config", os.path.join(ROOT, "configs", "cpu_add.yaml"), "--num-prompts-per-step", "8"]
    trainer += ["--num-samples-per-prompt", "8", "--max-response-length", "6", "--eval-limit", "10", "--no-save-final"]
    p = subprocess.run(
        [*RC_LAB, "sweep", "--out", str(out), *sweep_flags, "--", *trainer, *trainer_flags],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
        check=False,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "rc_lab: 2 ran, 0 skipped, 0 failed" in p.stdout
    return out


def test_two_cell_sweep_with_the_real_trainer(tmp_path):
    """`lab/rc_lab.py sweep` end to end with rc_train.py itself: naive at no mismatch and at a weight-noise level,
    one seed, 2 steps of the tiny one-token-fixture model with 6-token answers (seconds per run)."""
    levels = ["--levels", "none,rollout_weight_noise=1.0", "--seeds", "1", "--steps", "2"]
    out = real_two_cell_sweep(
        tmp_path, ["--presets", "naive", "--dial", "mismatch", *levels], ["--dump-log-ratio-every", "1"]
    )
    md = (out / "summary.md").read_text()
    assert md.index("Reading rule") < md.index("| preset | level |")
    assert "| naive | none | 1 |" in md and "| naive | rollout_weight_noise=1.0 | 1 |" in md
    with open(out / "summary.csv") as f:
        table = {t["level"]: t for t in csv.DictReader(f)}
    assert table["none"]["flag"] == "ref" and float(table["rollout_weight_noise=1.0"]["alpha1_mean"]) > 1e-3
    assert float(table["none"]["alpha1_mean"]) < 1e-4
    # the length lab recomputes, from the dumps, exactly the chi2 the trainer logged for the whole batch
    run = out / "naive__rollout_weight_noise=1.0__s1"
    records = {r["step"]: r for r in rc_lab.load_metrics(str(run))}
    for step, (flat, lengths) in enumerate(rc_lab.load_dumps(rc_lab.read_run_folder(str(run)))):
        stats = rc_lab.length_stats(flat, lengths)
        assert stats["chi2_token"] == pytest.approx(records[step]["rollout_corr/chi2_token"], rel=1e-4)
        assert stats["chi2_seq"] == pytest.approx(records[step]["rollout_corr/chi2_seq"], rel=1e-4)
        assert stats["n_rows"] == 64
    assert (out / "length.md").exists() and (out / "length_law.png").exists() and (out / "length_trap.png").exists()
    # export: the compact form (no engine logs, no eval samples) regenerates the same tables by itself
    dest = tmp_path / "committed"
    assert rc_lab.main(["export", str(out), str(dest)]) == 0
    assert (dest / "summary.md").read_text() == md and (dest / "length.md").read_text() == (
        out / "length.md"
    ).read_text()
    assert {p.name for p in dest.iterdir()} == COMPACT | {
        "length.md",
        "length.csv",
        "length_law.png",
        "length_trap.png",
    }
    config = rc_lab.read_compact(str(dest))["naive__none__s1"]["config"]
    assert "run_name: naive__none__s1" in config and str(tmp_path) not in config
    assert rc_lab.main(["export", str(out), str(out)]) == 2


def test_two_cell_staleness_sweep_with_the_real_trainer(tmp_path):
    """The staleness lab's sweep end to end with rc_train.py itself (the lab/staleness commands at a toy size): naive
    at --max-staleness 0 and 2, one seed, 3 steps of the one-token fixture. The summary carries the asynchronous
    mode's columns (staleness min(step, k) averaged over steps 0..2, nothing dropped) and staleness.png is drawn;
    the exported compact form regenerates the same table."""
    flags = ["--presets", "naive", "--dial", "max_staleness", "--levels", "0,2", "--seeds", "1", "--steps", "3"]
    out = real_two_cell_sweep(tmp_path, flags, [])
    md = (out / "summary.md").read_text()
    assert md.index("Reading rule") < md.index("| preset | level |")
    header = md[md.index("| preset | level |") :].splitlines()[0]
    assert "| staleness | dropped |" in header and "ppl rise" in header
    with open(out / "summary.csv") as f:
        table = {t["level"]: t for t in csv.DictReader(f)}
    assert table["0"]["flag"] == "ref" and float(table["0"]["staleness_mean"]) == 0.0
    assert float(table["2"]["staleness_mean"]) == pytest.approx((0 + 1 + 2) / 3)
    assert float(table["0"]["dropped_samples"]) == 0.0 == float(table["2"]["dropped_samples"])
    records = rc_lab.load_metrics(str(out / "naive__max_staleness=2__s1"))
    assert [r["rollout/policy_version"] for r in records if r["step"] >= 0] == [0, 0, 0]
    assert float(table["2"]["alpha1_mean"]) > 1e-4 > float(table["0"]["alpha1_mean"])  # pi_old != mu only when stale
    assert imread(out / "staleness.png").shape[1] > 0
    dest = tmp_path / "committed"
    assert rc_lab.main(["export", str(out), str(dest)]) == 0
    assert (dest / "summary.md").read_text() == md and (dest / "staleness.png").exists()


def test_replay_verdicts_read_the_documents_pick():
    """A replay sweep reads each level across presets (REPLAY_RULE) and says whether the documents' pick holds."""

    def row(preset, level, acc, std=0.01):
        return {"preset": preset, "level": level, "eval_acc": acc, "eval_acc_std": std, "n_eval": 3, "flag": ""}

    sweep = {"dial": "replay_fraction", "levels": ["0", "0.75"], "presets": ["naive", rc_lab.REPLAY_PICK, "x", "y"]}
    rows = [row(p, "0", 0.85) for p in sweep["presets"]]
    at = [
        row("naive", "0.75", 0.6),
        row(rc_lab.REPLAY_PICK, "0.75", 0.8),
        row("x", "0.75", 0.82),
        row("y", "0.75", 0.7),
    ]
    at[0].update(flag="below", delta_eval_acc=-0.25)
    at[3]["flag"] = "below"  # repairs (above naive) but does not hold
    lines = rc_lab.verdicts(rows + at, sweep)
    assert "repair): decoupled_seq_is_rs, x, y;" in lines[1] and "(hold): decoupled_seq_is_rs, x →" in lines[1]
    assert "**reproduced**" in lines[1]
    assert lines[2].endswith("clearly above it: none → **the recommendation holds**")
    at[2]["eval_acc"] = 0.95  # another preset clearly better than the pick
    assert rc_lab.verdicts(rows + at, sweep)[2].endswith("clearly above it: x → **the recommendation does not hold**")


def test_committed_replay_sweep_pairs_every_comparison_of_its_verdicts():
    """lab/replay's paired view holds each comparison its verdicts make (each row against f = 0, each corrected
    preset against naive, each other corrected preset against the documents' pick), all over the 3 shared seeds;
    with every seed present the paired Δ is the table's Δ."""
    sweep = rc_lab.load_sweep(str(LAB / "replay"))
    rows = rc_lab.summarise(sweep)
    comps = rc_lab.paired_comparisons(rows, sweep)
    corrected = [p for p in sweep["presets"] if not rc_lab.is_naive(p)]
    assert [c["kind"] for c in comps] == ["ref"] * 5 + ["naive"] * 4 + ["pick"] * 3 and len(corrected) == 4
    assert {c["against_preset"] for c in comps if c["kind"] == "pick"} == {rc_lab.REPLAY_PICK}
    assert all(c["n_pairs"] == 3 and c["unpaired"] == 0 and c["half_width"] is not None for c in comps)
    for c in comps:
        if c["kind"] == "ref":
            assert c["delta"] == pytest.approx(row_of(rows, c["preset"], c["level"])["delta_eval_acc"], abs=1e-12)


def test_moe_sweep_reads_each_router_scale_against_its_fp32_engine(tmp_path):
    """An MoE sweep (MOE_RULE): each level is compared with the float32-engine level of the same router scale, the
    routing columns are summarised, and each R3 arm is read against its unreplayed twin."""
    levels = [
        "rollout_dtype=float32",
        "rollout_dtype=bfloat16",
        "rollout_dtype=float32+moe_router_scale=0.3",
        "rollout_dtype=bfloat16+moe_router_scale=0.3",
    ]
    presets = ["naive", "naive" + rc_lab.REPLAY_ROUTING, "decoupled_token_is"]
    acc = {  # (preset, level index) -> eval acc of seeds 1, 2, 3
        ("naive", 0): (0.80, 0.81, 0.82),
        ("naive", 1): (0.79, 0.80, 0.81),
        ("naive", 2): (0.70, 0.71, 0.72),
        ("naive", 3): (0.50, 0.51, 0.52),  # below its own fp32 row (0.71), though above level 0's...
        ("naive+routing_replay=r3", 3): (0.30, 0.31, 0.32),  # replay costs against naive at the same level
        ("decoupled_token_is", 3): (0.69, 0.70, 0.71),  # repairs and holds
    }
    runs = []
    for p in presets:
        for i, lv in enumerate(levels):
            for seed in (1, 2, 3):
                name = rc_lab.run_name(p, rc_lab.MISMATCH, lv, seed)
                records = [
                    {
                        "step": s,
                        "reward/mean": 0.5,
                        "rollout_corr/routing_agreement": 1.0 if "float32" in lv else 0.99 - 0.01 * s,
                        "rollout_corr/routing_flip_token_fraction": 0.0 if "float32" in lv else 0.02,
                        "rollout_corr/unreplayed_tv_mismatch": 1e-3 * (i + 1),
                        **({"eval/accuracy_strict": acc.get((p, i), (0.77, 0.77, 0.77))[seed - 1]} if s == 1 else {}),
                    }
                    for s in range(2)
                ]
                os.makedirs(tmp_path / name)
                (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
                runs.append({"name": name, "preset": p, "level": lv, "seed": seed, "cmd": []})
    spec = {"presets": presets, "dial": rc_lab.MISMATCH, "levels": levels, "seeds": [1, 2, 3], "steps": 2}
    (tmp_path / "sweep.json").write_text(json.dumps({**spec, "extra": [], "jobs": 1, "runs": runs}))
    sweep = rc_lab.load_sweep(str(tmp_path))
    assert [rc_lab.reference_level(sweep, lv) for lv in levels] == [levels[0], levels[0], levels[2], levels[2]]
    assert rc_lab.compared_levels(sweep) == [levels[1], levels[3]]
    rows = rc_lab.summarise(sweep)
    naive = row_of(rows, "naive", levels[3])
    assert naive["delta_eval_acc"] == pytest.approx(-0.20) and naive["flag"] == "below"
    assert row_of(rows, "naive", levels[2])["flag"] == "ref"  # the sharper router's own fp32 engine
    assert naive["routing_agreement"] == pytest.approx(0.985) and naive["flip_fraction"] == pytest.approx(0.02)
    assert naive["alpha1_unreplayed"] == pytest.approx(4e-3)
    assert row_of(rows, "naive", levels[0])["routing_agreement"] == 1.0
    lines = rc_lab.verdicts(rows, sweep)
    assert lines[1].startswith(f"- `{levels[1]}`: naive Δ -0.010 (not below)") and "naive holds" in lines[1]
    assert (
        f"- `{levels[3]}`: naive Δ -0.200 (below); above naive at this level (repair): decoupled_token_is;"
        in (lines[2])
    )
    assert "fewer than two presets repair" in lines[2]
    assert lines[3] == (f"- replay at `{levels[1]}`: `naive+routing_replay=r3` against `naive` Δ -0.030 → **neither**")
    assert lines[4].endswith("`naive+routing_replay=r3` against `naive` Δ -0.200 → **costs**")
    _, md = rc_lab.write_summary(rows, sweep, str(tmp_path), 0.5)
    text = open(md).read()
    assert rc_lab.MOE_RULE in text and "| Δ vs ref |" in text and "| routing agreement | flipped tokens |" in text
    assert "delta_eval_acc_vs_ref" in open(tmp_path / "summary.csv").read()
    # the paired view reads the same comparisons: each row against its ref, corrected arms against naive, R3 twins
    comps = {(c["kind"], c["preset"], c["level"]): c for c in rc_lab.paired_comparisons(rows, sweep)}
    assert {k for k, *_ in comps} == {"ref", "naive", "twin"} and len(comps) == 3 * 2 + 2 * 2 + 2
    ref = comps[("ref", "naive", levels[3])]
    assert ref["against_level"] == levels[2] and ref["delta"] == pytest.approx(-0.20) and ref["n_pairs"] == 3
    repair = comps[("naive", "decoupled_token_is", levels[3])]  # 0.69 - 0.50, 0.70 - 0.51, 0.71 - 0.52
    assert repair["against_preset"] == "naive" and repair["delta"] == pytest.approx(0.19)
    assert repair["half_width"] == pytest.approx(0.0, abs=1e-12) and repair["rule_margin"] == pytest.approx(0.05)
    twin = comps[("twin", "naive+routing_replay=r3", levels[3])]
    assert twin["against_preset"] == "naive" and twin["delta"] == pytest.approx(-0.20)
    assert "| naive+routing_replay=r3 | " + levels[3] + " | `naive` (no R3) at this level | 3 | -0.200 |" in text
    with open(tmp_path / "summary.csv") as f:
        header = next(csv.reader(f))
    assert header[-18:] == [
        f"paired_vs_{k}_{f}"
        for k in ("ref", "naive", "twin")
        for f in ("n", "delta", "ci_low", "ci_high", "half_width", "rule_margin")
    ]
