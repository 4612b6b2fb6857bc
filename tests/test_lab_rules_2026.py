"""Tests for the two reading rules lab/rc_lab.py gained for the 2026 sweeps, each applied in code and fixed before its
sweep ran: PARTIAL_RULE (lab/README.md section 11, issue 52: do sequence-level corrections lose what token-level
ones keep when a response mixes policy versions?) and GSPO_MOE_RULE (section 12, issue 48 items 2 and 7: GSPO in
the MoE lab, one factor at a time, and the claim that GSPO needs no routing replay). On synthetic sweeps written as
`sweep` leaves them (no engine, no training); every verdict is also shown to move when one seed's number moves.

    .venv/bin/python -m pytest tests/test_lab_rules_2026.py -q
"""

import json
import os
import re
import shlex
from pathlib import Path

import pytest

from lab import rc_lab

ROOT = Path(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
SEEDS = (1, 2, 3)

# Final eval acc of seeds 1, 2, 3. Against REF (std 0.02, so every margin below is max(2 x pooled std, 0.05) = 0.05):
REF = (0.80, 0.82, 0.84)
HOLDS = (0.79, 0.83, 0.83)  # Δ -0.003, paired interval covers 0: neither test says below -> holds
LOSES = (0.60, 0.61, 0.63)  # Δ -0.207, every seed ~0.21 below: both tests say below -> below / loses
EDGE = (0.77, 0.79, 0.81)  # every seed 0.03 below: the interval lies below 0, the margin 0.05 does not -> undecided
ABOVE = (0.95, 0.97, 0.99)  # Δ +0.150 against REF or HOLDS, every seed above: both tests say above


def write_sweep(out: Path, presets, dial, levels, evals, extra=lambda preset, level, seed, step: {}) -> Path:
    """A sweep folder as `sweep` leaves it: three steps per run, the last one with the final eval acc
    evals[(preset, level)][seed - 1]; extra(...) adds metrics to each step's record."""
    runs = []
    for p in presets:
        for level in levels:
            for seed in SEEDS:
                name = rc_lab.run_name(p, dial, level, seed)
                records = [
                    {
                        "step": s,
                        "reward/mean": 0.5,
                        **extra(p, level, seed, s),
                        **({"eval/accuracy_strict": evals[(p, level)][seed - 1]} if s == 2 else {}),
                    }
                    for s in range(3)
                ]
                os.makedirs(out / name)
                (out / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
                runs.append({"name": name, "preset": p, "level": level, "seed": seed, "cmd": []})
    spec = {"presets": list(presets), "dial": dial, "levels": list(levels), "seeds": list(SEEDS), "steps": 3}
    spec.update(extra=[], jobs=1, runs=runs)
    (out / "sweep.json").write_text(json.dumps(spec))
    return out


def load(out: Path):
    sweep = rc_lab.load_sweep(str(out))
    return rc_lab.summarise(sweep), sweep


def verdict_of(line: str) -> str:
    (verdict,) = re.findall(r"\*\*([^*]+)\*\*", line)  # the one bold word of a verdict line
    return verdict


def readme_sweep(section: str) -> list[str]:
    """The `sweep` command of lab/README.md's section whose heading holds `section`, as argv after
    `python -m lab.rc_lab`."""
    text = (ROOT / "lab" / "README.md").read_text()
    part = text[text.index(section) :]
    block = part[part.index("```bash\n") + 8 : part.index("\n```", part.index("```bash"))]
    (line,) = [x for x in block.replace("\\\n", "").splitlines() if " sweep " in x]
    argv = shlex.split(line)
    assert argv[:3] == ["python", "-m", "lab.rc_lab"]
    return argv[3:]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def row(acc, std=0.01):
    return {"eval_acc": acc, "eval_acc_std": std, "n_eval": 3}


def paired(low, high):
    return {"ci_low": low, "ci_high": high}


# =============================================================================================
# PARTIAL_RULE (lab/README.md section 11)
# =============================================================================================
WHOLE = "max_staleness=8"
PART = "max_staleness=8+partial_rollout=true+partial_rollout_tokens=8"
TOKEN_IS, BYPASS = rc_lab.PARTIAL_TOKEN_ARMS
SEQ_MIS, GEO_RS = rc_lab.PARTIAL_SEQUENCE_ARMS
ARMS = ["naive", TOKEN_IS, BYPASS, SEQ_MIS, GEO_RS]


def partial_metrics(preset, level, seed, step):
    """Token staleness and the spanning share on partial rows only (steps 0, 1, 2: per seed a mean of 0.5 s + 1 and
    0.2 s, so 2.0 and 0.4 over seeds 1, 2, 3); the step time on both levels (10 + s whole, 7 + s partial: 12.0 and
    9.0 over seeds)."""
    if level != PART:
        return {"timing/step_s": 10.0 + seed}
    return {
        "rollout/token_staleness_mean": 0.5 * seed + step,
        "rollout/spanning_responses": 0.1 * seed * (step + 1),
        "timing/step_s": 7.0 + seed,
    }


def write_partial(out: Path, partial: dict, levels=(WHOLE, PART)) -> Path:
    """A partial-rollout sweep: every arm at REF on whole responses, at partial[arm] on partial ones."""
    evals = {(p, WHOLE): REF for p in ARMS} | {(p, lv): partial[p] for p in ARMS for lv in levels if lv != WHOLE}
    return write_sweep(out, ARMS, rc_lab.MISMATCH, levels, evals, partial_metrics)


def partial_read(tmp_path, partial: dict) -> tuple[dict, str, list[str]]:
    """({arm: its verdict line's verdict}, the answer, the lines) of partial_verdicts on the sweep."""
    rows, sweep = load(write_partial(tmp_path, partial))
    lines = rc_lab.verdicts(rows, sweep)
    assert lines == rc_lab.partial_verdicts(rows, sweep)  # verdicts() dispatches a partial sweep to PARTIAL_RULE
    assert lines[:2] == ["Verdicts (the rule above, applied):", f"- `{PART}` against `{WHOLE}`:"]
    read = {}
    for p in ARMS:
        (line,) = [x for x in lines if x.startswith(f"  - `{p}`: ")]
        read[p] = verdict_of(line)
    (answer,) = [x for x in lines if x.startswith("  - token-level arms: ")]
    assert len(lines) == 2 + len(ARMS) + 1
    return read, verdict_of(answer), lines


YES = {"naive": LOSES, TOKEN_IS: HOLDS, BYPASS: EDGE, SEQ_MIS: LOSES, GEO_RS: LOSES}
# A hold one seed away from undecided: seeds -0.03, -0.03, +0.01 against REF (interval covers 0, Δ within margin)
NEAR = (0.77, 0.79, 0.85)
NO = {"naive": LOSES, TOKEN_IS: HOLDS, BYPASS: HOLDS, SEQ_MIS: NEAR, GEO_RS: HOLDS}


def test_is_partial_needs_a_mismatch_level_that_sets_partial_rollout_true():
    assert rc_lab.is_partial({"dial": rc_lab.MISMATCH, "levels": [WHOLE, PART]})
    assert rc_lab.is_partial({"dial": rc_lab.MISMATCH, "levels": [WHOLE, "max_staleness=8+partial_rollout=True"]})
    assert not rc_lab.is_partial({"dial": rc_lab.MISMATCH, "levels": [WHOLE, "max_staleness=4"]})
    assert not rc_lab.is_partial({"dial": rc_lab.MISMATCH, "levels": [WHOLE, "max_staleness=8+partial_rollout=false"]})
    assert not rc_lab.is_partial({"dial": rc_lab.MISMATCH, "levels": ["none", "rollout_dtype=bfloat16"]})
    assert not rc_lab.is_partial({"dial": rc_lab.STALENESS_DIAL, "levels": ["0", "8"]})  # not the mismatch dial


def test_the_designed_partial_sweep_is_read_by_the_partial_rule():
    """lab/README.md section 11's command: its levels make a partial sweep, its arms are naive and the rule's
    token-level and sequence-level arms, and its partial level is the one these tests use."""
    argv = readme_sweep("## 11. Partial rollouts")
    levels = flag(argv, "--levels").split(",")
    assert flag(argv, "--dial") == rc_lab.MISMATCH and levels == [WHOLE, PART]
    assert rc_lab.is_partial({"dial": flag(argv, "--dial"), "levels": levels})
    assert flag(argv, "--presets").split(",") == ARMS


def test_partial_yes_when_a_token_arm_holds_and_both_sequence_arms_lose(tmp_path):
    read, answer, lines = partial_read(tmp_path, YES)
    # each arm's line reads paired_hold's word (below); the answer line says the rule's (loses)
    assert read == {"naive": "below", TOKEN_IS: "holds", BYPASS: "undecided", SEQ_MIS: "below", GEO_RS: "below"}
    assert answer == "yes"
    assert lines[-1] == (
        "  - token-level arms: holds, undecided; sequence-level arms: loses, loses → sequence-level corrections lose "
        "what token-level ones keep: **yes**"
    )
    (geo,) = [x for x in lines if x.startswith(f"  - `{GEO_RS}`: ")]
    assert geo.startswith(f"  - `{GEO_RS}`: Δ -0.207 (margin 0.050: below); paired 95 % interval [")
    assert geo.endswith("(below 0) → **below**")
    (edge,) = [x for x in lines if x.startswith(f"  - `{BYPASS}`: ")]
    assert "Δ -0.030 (margin 0.050: not below)" in edge and "(below 0) → **undecided**" in edge
    assert "five seeds" in edge  # an undecided reading says what five seeds would give


def test_partial_no_when_both_sequence_arms_hold_and_naive_is_not_counted(tmp_path):
    """Naive loses, yet the answer is `no`: naive is read the same way and reported, not counted."""
    read, answer, _ = partial_read(tmp_path, NO)
    assert read["naive"] == "below" and read[SEQ_MIS] == read[GEO_RS] == "holds"
    assert answer == "no"
    # nor does naive holding make `yes` out of a sweep where no token-level arm holds
    shared = {"naive": HOLDS, TOKEN_IS: LOSES, BYPASS: LOSES, SEQ_MIS: LOSES, GEO_RS: LOSES}
    read, answer, _ = partial_read(tmp_path / "shared", shared)
    assert read == {"naive": "holds", TOKEN_IS: "below", BYPASS: "below", SEQ_MIS: "below", GEO_RS: "below"}
    assert answer == "undecided"  # a loss every corrected arm shares: the extra lag, not the mixture


@pytest.mark.parametrize(
    "seq_mis, geo_rs",
    [
        (LOSES, EDGE),  # one sequence arm loses, the other undecided
        (HOLDS, LOSES),  # one holds, one loses: neither yes nor no
        (EDGE, EDGE),
    ],
)
def test_partial_undecided_otherwise(tmp_path, seq_mis, geo_rs):
    _, answer, _ = partial_read(tmp_path, {**YES, SEQ_MIS: seq_mis, GEO_RS: geo_rs})
    assert answer == "undecided"


def test_partial_yes_needs_a_token_arm_that_holds(tmp_path):
    _, answer, _ = partial_read(tmp_path, {**YES, TOKEN_IS: EDGE, BYPASS: EDGE})  # token arms both undecided
    assert answer == "undecided"
    _, answer, _ = partial_read(tmp_path / "b", {**YES, TOKEN_IS: LOSES, BYPASS: HOLDS})  # the other one suffices
    assert answer == "yes"


def test_partial_a_planted_seed_changes_the_answer(tmp_path):
    """One seed of the geometric arm's partial row moved from 0.61 to 0.84 (above its whole-response seed): its
    interval now covers 0 and its mean is within the wider margin, so it holds, and `yes` becomes `undecided`. In
    the NO sweep one seed of a holding sequence arm moved from 0.85 to 0.81 puts every seed 0.03 below: the interval
    lies below 0, the margin does not, and `no` becomes `undecided`."""
    read, answer, _ = partial_read(tmp_path / "yes", YES)
    assert (read[GEO_RS], answer) == ("below", "yes")
    read, answer, _ = partial_read(tmp_path / "planted", {**YES, GEO_RS: (0.60, 0.84, 0.63)})
    assert (read[GEO_RS], answer) == ("holds", "undecided")
    read, answer, _ = partial_read(tmp_path / "no", NO)
    assert (read[SEQ_MIS], answer) == ("holds", "no")
    read, answer, _ = partial_read(tmp_path / "planted-no", {**NO, SEQ_MIS: (0.77, 0.79, 0.81)})
    assert (read[SEQ_MIS], answer) == ("undecided", "undecided")


def test_partial_an_arm_not_run_is_not_run(tmp_path):
    rows, sweep = load(write_partial(tmp_path, YES))
    rows = [r for r in rows if (r["preset"], r["level"]) != (GEO_RS, PART)]  # as summarise leaves a refused cell
    lines = rc_lab.partial_verdicts(rows, sweep)
    assert f"  - `{GEO_RS}`: not run (refused; listed under the table)" in lines
    assert lines[-1].startswith("  - token-level arms: holds, undecided; sequence-level arms: loses, not run → ")
    assert verdict_of(lines[-1]) == "undecided"


def test_partial_rows_carry_token_staleness_spanning_and_step_time(tmp_path):
    rows, _ = load(write_partial(tmp_path, YES))
    by = {(r["preset"], r["level"]): r for r in rows}
    for p in ARMS:
        assert by[p, PART]["token_staleness"] == pytest.approx(2.0)  # mean over steps (0.5 s + 1), then over seeds
        assert by[p, PART]["spanning"] == pytest.approx(0.4)
        assert by[p, PART]["step_s"] == pytest.approx(9.0)
        assert by[p, WHOLE]["token_staleness"] is None and by[p, WHOLE]["spanning"] is None  # not logged there
        assert by[p, WHOLE]["step_s"] == pytest.approx(12.0)


def test_the_columns_belong_to_partial_sweeps_only(tmp_path):
    """The same records in a mismatch sweep without a partial level: no token-staleness columns, and the verdicts
    are not the partial rule's."""
    four = "max_staleness=4"
    evals = {(p, lv): REF for p in ARMS for lv in (WHOLE, four)}
    rows, sweep = load(write_sweep(tmp_path, ARMS, rc_lab.MISMATCH, (WHOLE, four), evals, partial_metrics))
    assert not rc_lab.is_partial(sweep)
    assert not any("token_staleness" in r or "spanning" in r or "step_s" in r for r in rows)
    assert "sequence-level corrections" not in "\n".join(rc_lab.verdicts(rows, sweep))
    _, md_path = rc_lab.write_summary(rows, sweep, str(tmp_path), 0.5)
    md = Path(md_path).read_text()
    assert rc_lab.PARTIAL_RULE not in md and "| token staleness |" not in md


def test_partial_summary_states_the_rule_and_the_new_columns(tmp_path):
    out = write_partial(tmp_path, YES)
    rows, sweep = load(out)
    csv_path, md_path = rc_lab.write_summary(rows, sweep, str(out), 0.5)
    md = Path(md_path).read_text()
    assert rc_lab.PARTIAL_RULE in md
    assert md.index("Reading rule") < md.index("| preset | level |") < md.index("Verdicts")
    assert "\n".join(rc_lab.partial_verdicts(rows, sweep)) in md
    header = md[md.index("| preset | level |") :].splitlines()[0]
    assert "| token staleness | spanning | step s |" in header
    cells = header.strip("|").split(" | ")
    at = cells.index("token staleness")

    table = md[md.index("| preset | level |") :].split("\n\n")[0].splitlines()  # the main table, not the paired view

    def table_row(preset, level):
        (line,) = [x for x in table if x.startswith(f"| {preset} | {level} |")]
        return line.strip("|").split(" | ")

    assert [c.strip() for c in table_row(SEQ_MIS, PART)[at : at + 3]] == ["2.00", "0.400", "9.00"]
    dash = rc_lab.DASH
    assert [c.strip() for c in table_row(SEQ_MIS, WHOLE)[at : at + 3]] == [dash, dash, "12.00"]
    assert "Token staleness: mean over steps of `rollout/token_staleness_mean`" in md
    assert "**Paired view (beside the rule above; the partial-rollout rule's verdicts read its rows" in md
    csv_header = Path(csv_path).read_text().splitlines()[0].split(",")
    assert {"token_staleness_mean", "spanning_responses_mean", "step_s_mean"} <= set(csv_header)


# =============================================================================================
# GSPO_MOE_RULE (lab/README.md section 12)
# =============================================================================================
F32 = "rollout_dtype=float32+moe_router_scale=0.3"
B16 = "rollout_dtype=bfloat16+moe_router_scale=0.3"
GSPO = rc_lab.GSPO
GSPO_TOKEN, R3, BYPASS_GSPO = (arm for arm, _, _ in rc_lab.GSPO_FACTORS[1:])
GSPO_ARMS = ["naive", GSPO, GSPO_TOKEN, R3, BYPASS_GSPO]


def routing(preset, level, seed, step):
    return {"rollout_corr/routing_agreement": 1.0 if level == F32 else 0.97}


def write_moe(out: Path, bf16: dict, presets=GSPO_ARMS, metrics=routing) -> Path:
    """An MoE sweep: every arm at REF with the float32 engine, at bf16[arm] (REF when absent) with the bf16 one."""
    evals = {(p, F32): REF for p in presets} | {(p, B16): bf16.get(p, REF) for p in presets}
    return write_sweep(out, presets, rc_lab.MISMATCH, (F32, B16), evals, metrics)


def gspo_read(tmp_path, bf16: dict) -> tuple[str, list[str]]:
    rows, sweep = load(write_moe(tmp_path, bf16))
    lines = rc_lab.verdicts(rows, sweep)
    assert lines == rc_lab.gspo_moe_verdicts(rows, sweep)  # verdicts() dispatches the MoE GSPO sweep to its rule
    (claim,) = [x for x in lines if x.startswith(f"- at `{B16}`: GSPO ")]
    return verdict_of(claim), lines


def factor_line(lines: list[str], level: str, arm: str, against: str) -> str:
    start = lines.index(f"- one factor at a time at `{level}`:")
    (line,) = [x for x in lines[start + 1 : start + 5] if x.startswith(f"  - `{arm}` against `{against}` (")]
    return line


def test_paired_side_above_below_no_difference_undecided():
    other = row(0.80)  # margin against it 0.05
    assert rc_lab.paired_side(row(0.90), other, paired(0.05, 0.15)) == "above"
    assert rc_lab.paired_side(row(0.70), other, paired(-0.15, -0.05)) == "below"
    assert rc_lab.paired_side(row(0.81), other, paired(-0.02, 0.04)) == "no difference found"
    assert rc_lab.paired_side(row(0.90), other, paired(-0.05, 0.25)) == "undecided"  # the margin alone says above
    assert rc_lab.paired_side(row(0.82), other, paired(0.01, 0.03)) == "undecided"  # the interval alone
    assert rc_lab.paired_side(row(0.70), other, paired(-0.25, 0.05)) == "undecided"  # the margin alone says below
    assert rc_lab.paired_side(row(0.78), other, paired(-0.03, -0.01)) == "undecided"  # the interval alone
    assert rc_lab.paired_side(row(0.70), other, paired(0.01, 0.05)) == "undecided"  # the two tests disagree
    assert rc_lab.paired_side(row(0.90), other, paired(None, None)) == "undecided"  # no interval (n < 2)
    assert rc_lab.paired_side({**row(0.8), "eval_acc": None}, other, paired(-0.1, 0.1)) == "undecided"
    # the margin is pooled over both rows: a wide row needs a wider gap
    assert rc_lab.paired_side(row(0.90, std=0.1), other, paired(0.05, 0.15)) == "undecided"


def test_gspo_factors_name_the_arms_of_the_designed_sweep():
    """lab/README.md section 12's command: its arms are naive and GSPO_FACTORS' arms, each pair one factor apart, and
    its levels the float32 and bf16 engines at router scale 0.3 (the MoE reference by scale)."""
    argv = readme_sweep("## 12. GSPO in the MoE lab")
    assert flag(argv, "--presets").split(",") == GSPO_ARMS
    assert flag(argv, "--levels").split(",") == [F32, B16]
    assert GSPO == "naive+loss_mode=gspo+clip_ratio_low=0.0003+clip_ratio_high=0.0004"
    assert [(a, b) for a, b, _ in rc_lab.GSPO_FACTORS] == [
        (GSPO, "naive"),
        (GSPO_TOKEN, GSPO),
        (GSPO + rc_lab.REPLAY_ROUTING, GSPO),
        (BYPASS_GSPO, GSPO),
    ]
    assert rc_lab.is_gspo_moe({"presets": GSPO_ARMS}) and not rc_lab.is_gspo_moe({"presets": ["naive", R3]})
    assert rc_lab.compared_levels({"dial": rc_lab.MISMATCH, "levels": [F32, B16]}) == [B16]


def test_gspo_claim_supported_when_gspo_holds_and_r3_is_not_above(tmp_path):
    claim, lines = gspo_read(tmp_path, {GSPO: HOLDS, R3: HOLDS})
    assert claim == "supported"
    assert lines[-1] == (
        f"- at `{B16}`: GSPO holds; GSPO + R3 against GSPO: no difference found → the claim that GSPO needs no "
        "routing replay: **supported**"
    )
    holds = {p: verdict_of(x) for p in GSPO_ARMS for x in lines if x.startswith(f"  - `{p}` (hold): ")}
    assert holds == dict.fromkeys(GSPO_ARMS, "holds")


def test_gspo_claim_contradicted_when_gspo_is_below_and_r3_holds(tmp_path):
    claim, lines = gspo_read(tmp_path, {GSPO: LOSES, R3: HOLDS})
    assert claim == "contradicted"
    (gspo,) = [x for x in lines if x.startswith(f"  - `{GSPO}` (hold): ")]
    assert gspo.startswith(f"  - `{GSPO}` (hold): Δ -0.207 (margin 0.050: below)") and gspo.endswith("**below**")
    assert verdict_of(factor_line(lines, B16, R3, GSPO)) == "above"  # R3 against GSPO at bf16: both tests


@pytest.mark.parametrize(
    "bf16, claim",
    [
        ({GSPO: EDGE, R3: HOLDS}, "undecided"),  # GSPO's hold undecided
        ({GSPO: HOLDS, R3: ABOVE}, "undecided"),  # GSPO holds, but R3 is above GSPO: replay pays
        ({GSPO: LOSES, R3: LOSES}, "undecided"),  # GSPO below, R3 below too: not contradicted
        ({GSPO: LOSES, R3: EDGE}, "undecided"),  # R3's hold undecided
    ],
)
def test_gspo_claim_undecided_otherwise(tmp_path, bf16, claim):
    assert gspo_read(tmp_path, bf16)[0] == claim


def test_gspo_each_one_factor_line_names_its_pair_at_both_levels(tmp_path):
    _, lines = gspo_read(tmp_path, {GSPO: HOLDS, GSPO_TOKEN: ABOVE, BYPASS_GSPO: LOSES, R3: HOLDS})
    for level in (F32, B16):
        for arm, against, factor in rc_lab.GSPO_FACTORS:
            line = factor_line(lines, level, arm, against)
            assert line.startswith(f"  - `{arm}` against `{against}` ({factor}): Δ ")
    assert verdict_of(factor_line(lines, B16, GSPO_TOKEN, GSPO)) == "above"
    assert verdict_of(factor_line(lines, B16, BYPASS_GSPO, GSPO)) == "below"
    assert verdict_of(factor_line(lines, B16, GSPO, "naive")) == "no difference found"
    assert verdict_of(factor_line(lines, F32, GSPO_TOKEN, GSPO)) == "no difference found"  # REF against REF
    n_hold, n_factor = len(GSPO_ARMS), 2 * len(rc_lab.GSPO_FACTORS)
    assert len(lines) == 1 + (1 + n_hold) + (2 + n_factor) + 1


def test_gspo_an_undecided_pair_says_the_side_its_means_are_on(tmp_path):
    """A one-factor pair is read both ways: R3 0.083 above GSPO at bf16, past the margin 0.078, its interval covering
    0, is undecided, and its line says the mean test says above and what the mean test needs above +0.078 (not `not
    below` and `below −0.078`, which is what the line said when every pair was written as a test of below)."""
    claim, lines = gspo_read(tmp_path, {GSPO: HOLDS, R3: (0.90, 0.95, 0.85), BYPASS_GSPO: LOSES})
    r3 = factor_line(lines, B16, R3, GSPO)
    assert "Δ +0.083 (margin 0.078: above)" in r3 and "(covers 0) → **undecided**" in r3
    assert "Δ +0.083 would lie above 0; the mean test needs Δ above +0.078 at any number of seeds" in r3
    assert "Δ -0.203 (margin 0.050: below)" in factor_line(lines, B16, BYPASS_GSPO, GSPO)
    assert "Δ +0.003 (margin 0.050: not above)" in factor_line(lines, B16, GSPO_TOKEN, GSPO)
    assert "Δ -0.003 (margin 0.050: not below)" in factor_line(lines, B16, GSPO, "naive")
    assert claim == "supported"  # the rule's letter: R3 undecided against GSPO is not `above` it


def test_gspo_a_planted_seed_changes_the_claim(tmp_path):
    """From `supported`, each planted change moves the claim: one GSPO bf16 seed moved from 0.83 to 0.81 puts every
    seed 0.01 below its float32 seed (the interval below 0, the margin not: hold undecided), and R3's bf16 seeds
    lifted 0.15 above GSPO's make replay pay. From `contradicted`, the same one-seed move on R3 makes its hold
    undecided."""
    assert gspo_read(tmp_path / "a", {GSPO: HOLDS, R3: HOLDS})[0] == "supported"
    claim, lines = gspo_read(tmp_path / "b", {GSPO: (0.79, 0.81, 0.83), R3: HOLDS})
    (gspo,) = [x for x in lines if x.startswith(f"  - `{GSPO}` (hold): ")]
    assert verdict_of(gspo) == "undecided" and claim == "undecided"
    claim, lines = gspo_read(tmp_path / "c", {GSPO: HOLDS, R3: (0.94, 0.98, 0.98)})
    assert verdict_of(factor_line(lines, B16, R3, GSPO)) == "above" and claim == "undecided"
    assert gspo_read(tmp_path / "d", {GSPO: LOSES, R3: HOLDS})[0] == "contradicted"
    claim, lines = gspo_read(tmp_path / "e", {GSPO: LOSES, R3: (0.79, 0.81, 0.83)})
    (r3,) = [x for x in lines if x.startswith(f"  - `{R3}` (hold): ")]
    assert verdict_of(r3) == "undecided" and claim == "undecided"


def test_gspo_without_the_r3_arm_is_not_supported(tmp_path):
    presets = [p for p in GSPO_ARMS if p != R3]
    rows, sweep = load(write_moe(tmp_path, {GSPO: HOLDS}, presets))
    lines = rc_lab.verdicts(rows, sweep)
    assert lines[-1].startswith(f"- at `{B16}`: GSPO holds; ") and verdict_of(lines[-1]) == "undecided"
    assert not any(x.startswith(f"  - `{R3}` against") for x in lines)


def test_a_plain_moe_sweep_keeps_the_moe_rule(tmp_path):
    """Without the GSPO arm an MoE sweep is read by MOE_RULE as before; without routing records (not MoE) a sweep
    with the GSPO arm is not read by GSPO_MOE_RULE."""
    plain = ["naive", "decoupled_token_is", "decoupled_token_is" + rc_lab.REPLAY_ROUTING]
    rows, sweep = load(write_moe(tmp_path / "plain", {"naive": LOSES}, plain))
    assert rc_lab.is_moe(rows) and not rc_lab.is_gspo_moe(sweep)
    lines = rc_lab.verdicts(rows, sweep)
    assert lines == rc_lab.staleness_verdicts(rows, sweep, at_level="this level", reference="`ref`") + (
        rc_lab.replay_costs(rows, sweep)
    )
    assert not any("one factor at a time" in x for x in lines)
    md = Path(rc_lab.write_summary(rows, sweep, str(tmp_path / "plain"), 0.5)[1]).read_text()
    assert rc_lab.MOE_RULE in md and rc_lab.GSPO_MOE_RULE not in md
    rows, sweep = load(write_moe(tmp_path / "dense", {GSPO: HOLDS}, metrics=lambda *a: {}))
    assert not rc_lab.is_moe(rows) and rc_lab.is_gspo_moe(sweep)
    assert rc_lab.verdicts(rows, sweep) != rc_lab.gspo_moe_verdicts(rows, sweep)


def test_gspo_summary_states_its_rule(tmp_path):
    out = write_moe(tmp_path, {GSPO: HOLDS, R3: HOLDS})
    rows, sweep = load(out)
    _, md_path = rc_lab.write_summary(rows, sweep, str(out), 0.5)
    md = Path(md_path).read_text()
    assert rc_lab.GSPO_MOE_RULE in md and rc_lab.MOE_RULE not in md
    assert "Δ vs ref: eval acc minus that of the same preset at its `ref` level." in md
    assert md.index("Reading rule") < md.index("| preset | level |") < md.index("Verdicts")
    assert "\n".join(rc_lab.gspo_moe_verdicts(rows, sweep)) in md
    assert "| routing agreement |" in md


# =============================================================================================
# REPLAY_VS_STALENESS_RULE (lab/README.md section 13)
# =============================================================================================
SYNC, STALE, REPLAY = "max_staleness=0", "max_staleness=3", "max_staleness=0+replay_window=8+replay_fraction=0.75"
RS_ARMS = ["naive", "bypass_ppo_clip", "decoupled_token_is", "decoupled_seq_is_rs"]


def replay_read(tmp_path, stale: dict, replay: dict) -> list[str]:
    evals = {(p, SYNC): REF for p in RS_ARMS} | {(p, STALE): stale[p] for p in RS_ARMS}
    evals |= {(p, REPLAY): replay[p] for p in RS_ARMS}
    rows, sweep = load(write_sweep(tmp_path / "rs", RS_ARMS, rc_lab.MISMATCH, (SYNC, STALE, REPLAY), evals))
    assert rc_lab.is_replay_vs_staleness(sweep) and not rc_lab.is_partial(sweep)
    return rc_lab.verdicts(rows, sweep)


def test_replay_costs_more_when_naive_and_two_corrected_arms_are_below_their_staleness_rows(tmp_path):
    lines = replay_read(
        tmp_path, {p: HOLDS for p in RS_ARMS}, {**{p: LOSES for p in RS_ARMS}, "decoupled_seq_is_rs": HOLDS}
    )
    assert verdict_of(lines[-1]) == "yes"
    assert sum("replay against staleness" in x and "**below**" in x for x in lines) == 3


def test_replay_and_staleness_alike_is_no_and_one_edge_seed_makes_it_undecided(tmp_path):
    lines = replay_read(tmp_path, {p: HOLDS for p in RS_ARMS}, {p: HOLDS for p in RS_ARMS})
    assert verdict_of(lines[-1]) == "no"
    edge = replay_read(tmp_path / "b", {p: HOLDS for p in RS_ARMS}, {**{p: HOLDS for p in RS_ARMS}, "naive": LOSES})
    assert verdict_of(edge[-1]) == "undecided"  # naive costs more, the corrected arms do not


def test_the_replay_against_staleness_rule_reads_only_its_own_sweep_and_the_readme_command(tmp_path):
    argv = readme_sweep("## 13. Replay against staleness")
    assert flag(argv, "--levels").split(",") == [SYNC, STALE, REPLAY]
    assert flag(argv, "--presets").split(",") == RS_ARMS
    split = {"dial": rc_lab.MISMATCH, "levels": [SYNC, "max_staleness=2", "max_staleness=8", REPLAY]}
    assert not rc_lab.is_replay_vs_staleness(split)  # lab/split's four levels are the split rule's
    assert not rc_lab.is_replay_vs_staleness({"dial": "max_staleness", "levels": ["0", "3", "8"]})
