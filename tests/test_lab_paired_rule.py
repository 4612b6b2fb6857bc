"""Tests for the amended staleness reading rule of lab/rc_lab.py (`sweep --rule paired`, PAIRED_STALENESS_RULE;
lab/README.md, "Planned ... the catalogue's arms as published"; issue 48 item 7): hold / below / undecided and
repairs / does not repair / undecided, each read by the margin and by the paired interval over seeds; the level's
verdict; `standard` (every committed sweep) unchanged; the rule kept in sweep.json. On synthetic run records and with
rc_train.py's own checks (no engine, no training).

    .venv/bin/python -m pytest tests/test_lab_paired_rule.py -q
"""

import json
import math
import os
import re
import shlex
from pathlib import Path

import pytest

from lab import rc_lab

ROOT = Path(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
LAB = ROOT / "lab"
DIAL, K0, K8 = rc_lab.STALENESS_DIAL, "0", "8"
A, B, C, D, E = (
    "bypass_ppo_clip",
    "bypass_ppo_clip+loss_mode=cispo",
    "decoupled_opsm",
    "decoupled_m2po",
    "decoupled_token_is",
)
PRESETS = ["naive", A, B, C, D, E]
X0 = (0.80, 0.82, 0.84)
W0 = (0.80, 0.90, 0.85)  # a wide k = 0 row: std 0.05, so the margin against it is 0.10
NAIVE8 = (0.60, 0.61, 0.63)
# Final eval acc of seeds 1, 2, 3 per (preset, k); the reading each gives at k = 8 (margins computed in the tests).
EVALS = {
    ("naive", K0): X0,
    ("naive", K8): NAIVE8,  # -0.207, every seed below: below by both -> breaks
    (A, K0): X0,
    (A, K8): (0.79, 0.83, 0.83),  # hold: -0.003, interval covers 0 -> holds; vs naive +0.203, above 0 -> repairs
    (B, K0): W0,
    (B, K8): (0.75, 0.65, 0.70),  # hold: -0.150 past the margin 0.10, interval covers 0 -> undecided;
    #                               vs naive +0.087 past the margin 0.074, interval covers 0 -> undecided
    (C, K0): W0,
    (C, K8): (0.77, 0.87, 0.82),  # hold: every seed -0.03, interval below 0, margin 0.10 not -> undecided; repairs
    (D, K0): X0,
    (D, K8): (0.63, 0.64, 0.66),  # below; vs naive every seed +0.03: interval above 0, margin 0.05 not -> undecided
    (E, K0): X0,
    (E, K8): (0.62, 0.60, 0.62),  # below; vs naive +0.000, interval covers 0 -> does not repair
}


def records(acc: float, steps: int = 3) -> list[dict]:
    return [
        {"step": s, "reward/mean": 0.5, **({"eval/accuracy_strict": acc} if s == steps - 1 else {})}
        for s in range(steps)
    ]


def write_staleness_sweep(out: Path, rule: str | None = "paired", evals=EVALS) -> Path:
    """A --max-staleness sweep folder as `sweep` leaves it; `rule` None: a sweep.json written before `--rule`."""
    runs = []
    for p in PRESETS:
        for level in (K0, K8):
            for seed in (1, 2, 3):
                name = rc_lab.run_name(p, DIAL, level, seed)
                os.makedirs(out / name)
                text = "".join(json.dumps(r) + "\n" for r in records(evals[(p, level)][seed - 1]))
                (out / name / "metrics.jsonl").write_text(text)
                runs.append({"name": name, "preset": p, "level": level, "seed": seed, "cmd": []})
    spec = {"presets": PRESETS, "dial": DIAL, "levels": [K0, K8], "seeds": [1, 2, 3], "steps": 3, "extra": []}
    spec.update({"rule": rule} if rule is not None else {}, jobs=1, runs=runs)
    (out / "sweep.json").write_text(json.dumps(spec))
    return out


def loaded(tmp_path, rule="paired"):
    sweep = rc_lab.load_sweep(str(write_staleness_sweep(tmp_path, rule)))
    return rc_lab.summarise(sweep), sweep


def row(acc, std=0.01):
    return {"eval_acc": acc, "eval_acc_std": std, "n_eval": 3}


def paired(low, high):
    return {"ci_low": low, "ci_high": high}


# ---------------------------------------------------------------------------------------------
# The two tests of each comparison
# ---------------------------------------------------------------------------------------------
def test_hold_needs_both_tests_to_say_below():
    ref = row(0.80)  # margin against it 0.05
    assert rc_lab.paired_hold(row(0.78), ref, paired(-0.05, 0.01)) == "holds"
    assert rc_lab.paired_hold(row(0.70), ref, paired(-0.12, -0.08)) == "below"
    assert rc_lab.paired_hold(row(0.70), ref, paired(-0.25, 0.05)) == "undecided"  # margin below, interval covers 0
    assert rc_lab.paired_hold(row(0.78), ref, paired(-0.03, -0.01)) == "undecided"  # interval below, margin not
    assert rc_lab.paired_hold(row(0.80), ref, paired(None, None)) == "undecided"  # no interval (n < 2)


def test_repair_needs_both_tests_to_say_above():
    naive = row(0.60)  # margin against it 0.05
    assert rc_lab.paired_repair(row(0.75), naive, paired(0.10, 0.20)) == "repairs"
    assert rc_lab.paired_repair(row(0.62), naive, paired(-0.03, 0.07)) == "does not repair"
    assert rc_lab.paired_repair(row(0.70), naive, paired(-0.05, 0.25)) == "undecided"  # margin above, interval covers
    assert rc_lab.paired_repair(row(0.63), naive, paired(0.01, 0.05)) == "undecided"  # interval above, margin not
    assert rc_lab.paired_repair(row(0.75), naive, paired(None, None)) == "undecided"  # no interval
    assert rc_lab.paired_repair(row(0.45), naive, paired(-0.20, -0.10)) == "does not repair"  # below naive


@pytest.mark.parametrize(
    "naive, repairs, verdict",
    [
        ("below", ["repairs", "repairs", "does not repair"], "reproduced"),
        ("below", ["repairs", "undecided", "does not repair"], "undecided"),  # the undecided one could make it
        ("below", ["repairs", "does not repair", "does not repair"], "not reproduced"),
        ("holds", ["repairs", "repairs", "repairs"], "not reproduced"),
        ("undecided", ["repairs", "repairs"], "undecided"),
        ("undecided", ["undecided", "does not repair"], "not reproduced"),
        (None, ["repairs", "repairs"], "undecided"),  # naive not run at this level
    ],
)
def test_level_verdict(naive, repairs, verdict):
    assert rc_lab.paired_reproduction(naive, repairs) == verdict


# ---------------------------------------------------------------------------------------------
# The rule applied to a sweep
# ---------------------------------------------------------------------------------------------
def lines_of(lines: list[str], preset: str) -> tuple[str, str]:
    (hold,) = [x for x in lines if x.startswith(f"  - `{preset}` against its own k = 0 (hold): ")]
    (repair,) = [x for x in lines if x.startswith(f"  - `{preset}` against `naive` at this k (repair): ")]
    return hold, repair


def test_paired_verdicts_on_a_staleness_sweep(tmp_path):
    rows, sweep = loaded(tmp_path)
    lines = rc_lab.verdicts(rows, sweep)
    assert lines[0] == "Verdicts (the rule above, applied):"
    assert lines[1].startswith(f"- `{DIAL}=8`: `naive` against its own k = 0: Δ -0.207 (margin 0.050: below);")
    assert lines[1].endswith("(below 0) → **below**")
    verdicts = {p: tuple(re.findall(r"→ \*\*([^*]+)\*\*", " ".join(lines_of(lines, p)))) for p in PRESETS[1:]}
    assert verdicts == {
        A: ("holds", "repairs"),
        B: ("undecided", "undecided"),
        C: ("undecided", "repairs"),
        D: ("below", "undecided"),
        E: ("below", "does not repair"),
    }
    assert lines[-1] == (
        f"  - naive breaks; repair: `{A}`, `{C}` (undecided: `{B}`, `{D}`); hold: `{A}` (undecided: `{B}`, `{C}`) → "
        "**reproduced**"
    )
    assert len(lines) == 2 + 2 * 5 + 1


def test_undecided_when_the_margin_says_below_but_the_interval_covers_0_and_the_reverse(tmp_path):
    """B's k = 8 row is 0.15 below its k = 0 row, past the margin max(2 x 0.05, 0.05), but its seeds move against
    its k = 0 seeds, so the interval covers 0; C's every seed is 0.03 below (an interval wholly below 0) within the
    margin 0.10. Both undecided, each with the half-width five seeds would give at its spread."""
    rows, sweep = loaded(tmp_path)
    lines = rc_lab.verdicts(rows, sweep)
    hold_b, repair_b = lines_of(lines, B)
    half5 = 2.776 * 0.1 / math.sqrt(5)  # t(0.975, 4) s_d / sqrt(5): -0.150 would then lie below 0
    assert hold_b.startswith(f"  - `{B}` against its own k = 0 (hold): Δ -0.150 (margin 0.100: below); ")
    assert "paired 95 % interval [-0.398, +0.098] (covers 0) → **undecided**" in hold_b
    assert f"five seeds at this spread (s_d 0.100): half-width {half5:.3f}, Δ -0.150 would lie below 0" in hold_b
    assert "the mean test needs Δ below −0.100 at any number of seeds" in hold_b
    hold_c, _ = lines_of(lines, C)
    assert "Δ -0.030 (margin 0.100: not below)" in hold_c and "(below 0) → **undecided**" in hold_c
    assert "five seeds at this spread (s_d 0.000): half-width 0.000, Δ -0.030 would lie below 0" in hold_c
    # the same two cases for a repair: above naive by the margin with an interval covering 0 (B), and the reverse (D)
    assert "Δ +0.087 (margin 0.074: above)" in repair_b and "(covers 0) → **undecided**" in repair_b
    diffs = [b - n for b, n in zip(EVALS[(B, K8)], NAIVE8)]
    sd = math.sqrt(sum((x - sum(diffs) / 3) ** 2 for x in diffs) / 2)
    assert f"(s_d {sd:.3f}): half-width {2.776 * sd / math.sqrt(5):.3f}, Δ +0.087 would lie above 0" in repair_b
    assert "the mean test needs Δ above +0.074 at any number of seeds" in repair_b
    _, repair_d = lines_of(lines, D)
    assert "Δ +0.030 (margin 0.050: not above)" in repair_d and "(above 0) → **undecided**" in repair_d
    assert "the mean test needs Δ above +0.050" in repair_d
    # decided comparisons carry no five-seed note
    assert "five seeds" not in " ".join(lines_of(lines, A)) and "five seeds" not in lines[1]


def test_a_refused_cell_is_in_no_comparison(tmp_path):
    rows, sweep = loaded(tmp_path)
    rows = [r for r in rows if (r["preset"], r["level"]) != (D, K0)]  # as summarise leaves a refused cell
    hold, repair = lines_of(rc_lab.verdicts(rows, sweep), D)
    assert hold.endswith("(hold): not run (refused; listed under the table)") and "**undecided**" in repair


def test_the_summary_states_the_amended_rule_and_the_paired_view_says_it_is_read(tmp_path):
    rows, sweep = loaded(tmp_path)
    _, md_path = rc_lab.write_summary(rows, sweep, str(tmp_path), 0.5)
    md = Path(md_path).read_text()
    assert rc_lab.PAIRED_STALENESS_RULE in md and rc_lab.STALENESS_RULE not in md
    assert md.index("Reading rule") < md.index("| preset |") < md.index("Verdicts") < md.index("**Paired view")
    assert "\n".join(rc_lab.verdicts(rows, sweep)) in md
    assert "**Paired view (beside the rule above; the amended rule's verdicts read its rows against k = 0" in md
    # the table's flag stays the margin test alone: B is flagged `below`, its verdict undecided
    (b8,) = [r for r in rows if (r["preset"], r["level"]) == (B, K8)]
    assert b8["flag"] == "below"


@pytest.mark.parametrize("rule", [None, "standard"])
def test_standard_reads_as_before(tmp_path, rule):
    """A sweep.json without `rule` (every committed one) or with `standard`: STALENESS_RULE and its verdicts, the
    same bytes either way."""
    rows, sweep = loaded(tmp_path / "x", rule)
    assert rc_lab.sweep_rule(sweep) == "standard"
    assert rc_lab.verdicts(rows, sweep) == rc_lab.staleness_verdicts(rows, sweep)
    _, md_path = rc_lab.write_summary(rows, sweep, str(tmp_path / "x"), 0.5)
    md = Path(md_path).read_text()
    assert rc_lab.STALENESS_RULE in md and rc_lab.PAIRED_STALENESS_RULE not in md and "→ **undecided**" not in md
    assert "**Paired view (beside the rule above; no verdict uses it)" in md
    rows, sweep = loaded(tmp_path / "y", None if rule else "standard")
    other = rc_lab.write_summary(rows, sweep, str(tmp_path / "y"), 0.5)[1]
    assert Path(other).read_bytes() == Path(md_path).read_bytes()


def test_committed_sweeps_read_as_standard():
    """Every committed sweep but catalogue_published (the first run under --rule paired) reads as standard; those
    before it were written before the option, those run or resumed after it say `standard` (moe_gspo, partial,
    replay_staleness, and split, resumed with five seeds: their own rules, read from their arms and levels)."""
    names = sorted(p.parent.name for p in LAB.glob("*/sweep.json"))
    newer = ["catalogue_published", "moe_gspo", "partial", "replay_staleness", "split"]
    older = [n for n in names if n not in newer]
    assert len(older) == len(names) - len(newer) and all(
        rc_lab.sweep_rule(rc_lab.read_spec(str(LAB / n))) == "standard" for n in older
    )
    assert all("rule" not in rc_lab.read_spec(str(LAB / n)) for n in older)  # written before the option
    assert all(rc_lab.read_spec(str(LAB / n))["rule"] == "standard" for n in newer[1:])
    assert rc_lab.sweep_rule(rc_lab.read_spec(str(LAB / "catalogue_published"))) == "paired"


# ---------------------------------------------------------------------------------------------
# `sweep --rule`: kept in sweep.json
# ---------------------------------------------------------------------------------------------
def sweep_argv(out, *more):
    return ["sweep", "--out", str(out), "--presets", "naive,bypass_ppo_clip", "--dial", DIAL, "--levels", "0,8",
            "--seeds", "1", "--steps", "2", *more]  # fmt: skip


@pytest.fixture
def stub_trainer(monkeypatch, tmp_path):
    """No trainer: `launch` writes a complete metrics.jsonl for each run and records its name."""
    launched = []

    def launch(cmd, log_path):
        flag = {f: cmd[cmd.index(f) + 1] for f in ("--output-dir", "--run-name", "--num-steps")}
        launched.append(flag["--run-name"])
        run_dir = Path(flag["--output-dir"]) / flag["--run-name"]
        run_dir.mkdir(parents=True)
        text = "".join(json.dumps(r) + "\n" for r in records(0.5, int(flag["--num-steps"])))
        (run_dir / "metrics.jsonl").write_text(text)
        return 0

    monkeypatch.setattr(rc_lab, "RC_TRAIN", str(tmp_path / "fake_train.py"))  # not rc_train.py: no field checks
    monkeypatch.setattr(rc_lab, "launch", launch)
    return launched


def test_sweep_keeps_its_rule_in_sweep_json(tmp_path, stub_trainer, capsys):
    assert rc_lab.main(sweep_argv(tmp_path / "p", "--rule", "paired")) == 0
    spec = rc_lab.read_spec(str(tmp_path / "p"))
    assert spec["rule"] == "paired" and rc_lab.sweep_rule(spec) == "paired"
    assert rc_lab.PAIRED_STALENESS_RULE in (tmp_path / "p" / "summary.md").read_text()
    assert rc_lab.main(sweep_argv(tmp_path / "s")) == 0  # the default
    assert rc_lab.read_spec(str(tmp_path / "s"))["rule"] == "standard"
    assert rc_lab.STALENESS_RULE in (tmp_path / "s" / "summary.md").read_text()
    assert len(stub_trainer) == 2 * 2 * 2  # presets x levels x the two sweeps


def test_a_resume_under_another_rule_is_refused(tmp_path, stub_trainer, capsys):
    """The rule is fixed before the runs: a sweep folder resumed with another --rule starts nothing. A sweep.json
    written before the option reads as standard."""
    out = tmp_path / "lab"
    assert rc_lab.main(sweep_argv(out, "--rule", "paired")) == 0
    stub_trainer.clear()
    assert rc_lab.main([*sweep_argv(out, "--rule", "standard"), "--seeds", "1,2"]) == 2
    assert "was swept under --rule paired: resume it with the same --rule" in capsys.readouterr().err
    assert stub_trainer == [] and rc_lab.read_spec(str(out))["rule"] == "paired"
    old = tmp_path / "old"
    out.rename(old)
    spec = rc_lab.read_spec(str(old))
    del spec["rule"]  # as written before --rule existed
    (old / "sweep.json").write_text(json.dumps(spec))
    assert rc_lab.main([*sweep_argv(old, "--rule", "paired"), "--seeds", "1,2"]) == 2
    assert "was swept under --rule standard" in capsys.readouterr().err
    assert rc_lab.main([*sweep_argv(old), "--seeds", "1,2"]) == 0 and len(stub_trainer) == 2 * 2  # seed 2 only


def test_rule_paired_is_for_a_staleness_sweep_only(tmp_path, stub_trainer, capsys):
    argv = sweep_argv(tmp_path / "x", "--rule", "paired")
    argv[argv.index(DIAL)] = "rollout_weight_noise"
    assert rc_lab.main(argv) == 2
    assert "--rule paired reads a --dial max_staleness sweep only" in capsys.readouterr().err
    assert rc_lab.main(sweep_argv(tmp_path / "y", "--rule", "bogus")) == 2  # argparse: not one of RULES
    assert stub_trainer == [] and not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------------------------
# The designed sweep (lab/README.md), through rc_train.py's own checks
# ---------------------------------------------------------------------------------------------
def readme_command() -> list[str]:
    """The `sweep` command of lab/README.md's section on lab/catalogue_published, as argv after `python -m
    lab.rc_lab`."""
    text = (ROOT / "lab" / "README.md").read_text()
    section = text[text.index("(`lab/catalogue_published/`, issue 48 item 7") :]
    block = section[section.index("```bash\n") + 8 : section.index("\n```", section.index("```bash"))]
    (line,) = [x for x in block.replace("\\\n", "").splitlines() if " sweep " in x]
    argv = shlex.split(line)
    assert argv[:3] == ["python", "-m", "lab.rc_lab"]
    return argv[3:]


def test_the_designed_sweep_runs_every_cell_under_the_paired_rule(tmp_path, monkeypatch):
    import torch  # rc_train.py's checks as on the CPU the lab runs on (a GPU refuses --max-staleness >= 1)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = readme_command()
    cut = argv.index("--")
    args = rc_lab._parser().parse_args(argv[:cut])
    assert args.presets.split(",") == ["naive", A, B, C, D] and args.levels == "0,8" and args.seeds == "1,2,3"
    assert (args.steps, args.jobs, args.rule, args.out) == (30, 2, "paired", "runs/lab_catalogue_published")
    spec = rc_lab.build_spec(args, argv[cut + 1 :])
    assert spec["rule"] == "paired" and spec["refused"] == [] and len(spec["runs"]) == 5 * 2 * 3
    assert spec["extra"] == "--num-prompts-per-step 12 --eval-every 10 --no-eval-before --no-save-final".split()
    cispo = next(r["cmd"] for r in spec["runs"] if r["preset"] == B)
    assert cispo[cispo.index("--rc.preset") + 1 : cispo.index("--rc.preset") + 4] == [A, "--rc.loss-mode", "cispo"]
