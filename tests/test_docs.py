"""The documents against the code: presets and metrics are each documented once, and checked both ways.

* Presets: the one table is docs/corrections.md §9.2. Every name of rc_core.PRESETS and rc_core.PRESET_ALIASES has a
  row there, and every row names a preset of rc_core.
* Metrics: the one list is docs/metrics.md. Every metric the trainer logs is there, and every name there is logged.

Runs in seconds and starts no engine: the rollout_corr/* and actor/* names come from rc_core's own functions on a
small random batch (every preset, every RS option, batch normalisation, the veto, both loss modes), the trainer's own
names from the string literals of its files.
"""

import dataclasses
import functools
import os
import re
import warnings

import torch

import rc_core as rc
import tasks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
CORRECTIONS = os.path.join(ROOT, "docs", "corrections.md")
METRICS = os.path.join(ROOT, "docs", "metrics.md")
# Pages that must not hold a second preset table or a second metric list (docs/corrections.md §6 keeps the formulas
# of the rollout_corr/* and actor/* metrics and is not one of them).
OTHER_PAGES = (
    "README.md",
    "docs/running.md",
    "docs/results.md",
    "docs/async.md",
    "docs/gpus.md",
    "docs/moe.md",
    "lab/README.md",
)

PREFIXES = ("rollout_corr", "actor", "reward", "response_length", "rollout", "eval", "timing", "perf", "health")
PREFIX = "(?:" + "|".join(PREFIXES) + ")/"
NAME = PREFIX + r"[\w<>]+"  # a metric name as docs/metrics.md spells it (placeholders included)
LITERAL = re.compile(r"""(?<![\w/])["'](""" + PREFIX + r"""\w+)["']""")
DYNAMIC_FSTRING = re.compile(r"""f["']""" + PREFIX + r"""[^"']*\{""")
DYNAMIC_CONCAT = re.compile(r"""["']""" + PREFIX + r"""["']\s*\+""")
# The files whose string literals name metrics (rc_core's rollout_corr/* names are built at run time: see below).
LITERAL_FILES = ("rc_train.py", "rc_config.py", "rc_rollout.py", "rc_run.py", "rc_core.py", "rc_moe.py")
# Metric names built at run time, each handled on purpose: (file, the start of its f-string) -> how it is collected.
DYNAMIC = {
    ("rc_core.py", 'f"rollout_corr/{'): "_apply_correction prefixes every correction metric; core_metrics "
    "calls rc_core for every preset, RS option, batch norm and the veto",
    ("rc_run.py", 'f"eval/accuracy_{'): "evaluate logs one per score key of the task (progress and print_summary "
    "read the task's accuracy key, one of them); task_metrics collects those of every task in tasks.TASKS",
    ("rc_moe.py", 'f"rollout_corr/routing_agreement_layer{'): "routing_metrics logs one per MoE layer; moe_metrics "
    "calls it on a 3-layer routing",
}
# The placeholders docs/metrics.md may use: an RS option of rc_core.RS_OPTIONS (the per-option RS metrics
# rollout_corr/rollout_rs_<option>_*, built by rc_core.compute_rs_option_metrics as f"rollout_rs_{option.name}_..."),
# and a score key of a task of tasks.TASKS (eval/accuracy_<key>, built by rc_run.evaluate).
OPTION = "<option>"
KEY = "<key>"
LAYER = "<layer>"  # an MoE layer's index (rollout_corr/routing_agreement_layer<layer>, rc_moe.routing_metrics)


def read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def cells(row: str) -> list[str]:
    """The cells of one markdown table row ('\\|' inside a cell is not a separator)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


def tables(text: str) -> list[list[list[str]]]:
    """Every markdown table of `text`: its body rows (header and separator dropped), each a list of cells."""
    out, rows = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            rows.append(cells(line))
            continue
        if rows:
            out.append([r for r in rows[1:] if not re.fullmatch(r"[-:| ]*", "".join(r))])
            rows = []
    return out


def section(text: str, number: str) -> str:
    """The body of the section whose heading starts with `number` (e.g. '9.2'), up to the next heading of its level
    or above."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"(#+) " + re.escape(number) + r"\b", line)
        if m:
            level = len(m.group(1))
            end = next((j for j in range(i + 1, len(lines)) if re.match(rf"#{{1,{level}}} ", lines[j])), len(lines))
            return "\n".join(lines[i:end])
    raise AssertionError(f"no section {number} in docs/corrections.md")


# ---------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------
def preset_names() -> tuple[str, ...]:
    return tuple(rc.PRESETS) + tuple(getattr(rc, "PRESET_ALIASES", {}))


def table_presets(corrections_text: str) -> tuple[list[str], list[str]]:
    """(preset names of the §9.2 table in row order, rows that name none). A row names its preset in one cell as
    `name(arguments)`."""
    names, unparsed = [], []
    for table in tables(section(corrections_text, "9.2")):
        for row in table:
            found = [m.group(1) for c in row for m in [re.fullmatch(r"`([A-Za-z_]\w*)\(.*\)`", c)] if m]
            if len(found) == 1:
                names.append(found[0])
            else:
                unparsed.append(" | ".join(row))
    return names, unparsed


def preset_problems(corrections_text: str) -> list[str]:
    names, unparsed = table_presets(corrections_text)
    problems = [f"§9.2 row names no single preset: {row}" for row in unparsed]
    if not names:
        return problems + ["§9.2 has no preset table"]
    code = preset_names()
    problems += [f"preset {n!r} of rc_core has no row in §9.2" for n in code if n not in names]
    problems += [f"§9.2 names {n!r}, which rc_core does not define" for n in names if n not in code]
    problems += [f"§9.2 lists {n!r} twice" for n in sorted({n for n in names if names.count(n) > 1})]
    heading = section(corrections_text, "9.2").splitlines()[0]
    counts = re.search(r"\((\d+) current names, (\d+) aliases\)", heading)
    if counts and (int(counts[1]), int(counts[2])) != (len(rc.PRESETS), len(getattr(rc, "PRESET_ALIASES", {}))):
        problems.append(
            f"§9.2 heading {heading!r} does not match rc_core's {len(rc.PRESETS)} presets and "
            f"{len(getattr(rc, 'PRESET_ALIASES', {}))} aliases"
        )
    return problems


def test_every_preset_has_one_row_in_the_table_and_every_row_is_a_preset():
    assert rc.PRESET_NAMES == preset_names()
    assert preset_problems(read(CORRECTIONS)) == []


def test_no_other_page_holds_a_second_preset_table():
    for page in OTHER_PAGES:
        for table in tables(read(page)):
            listed = {n for row in table if row for n in re.findall(r"`(\w+)`", row[0]) if n in rc.PRESET_NAMES}
            assert len(listed) <= len(rc.PRESET_NAMES) // 2, (
                f"{page} has a preset table ({len(listed)} presets); the one table is docs/corrections.md §9.2"
            )


# ---------------------------------------------------------------------------------------------
# Configuration fields and objectives
# ---------------------------------------------------------------------------------------------
RUNNING = os.path.join(ROOT, "docs", "running.md")


def field_table(corrections_text: str) -> list[str]:
    """The field names of the §9.1 table (a row may name several, e.g. `clip_cov_lb`, `clip_cov_ub`)."""
    return [
        n for table in tables(section(corrections_text, "9.1")) for row in table for n in re.findall(r"`(\w+)`", row[0])
    ]


def test_every_config_field_has_a_row_in_9_1_and_every_row_is_a_field():
    fields = [f.name for f in dataclasses.fields(rc.RolloutCorrectionConfig) if f.init]
    listed = field_table(read(CORRECTIONS))
    assert [f for f in fields if f not in listed] == []
    assert [n for n in listed if n not in fields] == []


def page_section(text: str, title: str) -> str:
    """The body of the '## title' section of a page without section numbers, up to the next '## ' heading."""
    lines = text.splitlines()
    start = lines.index(f"## {title}")
    end = next((j for j in range(start + 1, len(lines)) if lines[j].startswith("## ")), len(lines))
    return "\n".join(lines[start:end])


def objective_problems(running_text: str) -> list[str]:
    """docs/running.md "Choosing an objective and a mask": every objective of rc_core.POLICY_LOSSES has a row, and every
    loss mode a row names is one (a row names modes as `--rc.loss-mode NAME` and then `NAME`, `NAME`, ...)."""
    named = []
    for table in tables(page_section(running_text, "Choosing an objective and a mask")):
        for row in table:
            if "--rc.loss-mode" in row[0]:
                named += [n.removeprefix("--rc.loss-mode ") for n in re.findall(r"`([^`]+)`", row[0])]
    problems = [f"objective {n!r} has no row in running.md" for n in rc.POLICY_LOSSES if n not in named]
    return problems + [
        f"running.md names objective {n!r}, not in rc_core.POLICY_LOSSES" for n in named if n not in rc.POLICY_LOSSES
    ]


def test_the_objective_table_names_every_loss_mode_and_only_those():
    assert objective_problems(read(RUNNING)) == []
    running = read(RUNNING)
    row = next(line for line in running.splitlines() if line.startswith("| `--rc.loss-mode cispo`"))
    assert any("'cispo'" in p for p in objective_problems(running.replace(row + "\n", "")))
    assert any(
        "'bogus'" in p for p in objective_problems(running.replace("`--rc.loss-mode cispo`", "`--rc.loss-mode bogus`"))
    )


def test_every_rc_flag_on_the_running_page_is_a_correction_field():
    """Every `--rc.NAME` that docs/running.md spells is a field of rc_config.CorrectionArgs (its --rc.* flags)."""
    import rc_config

    fields = {f.name.replace("_", "-") for f in dataclasses.fields(rc_config.CorrectionArgs)}
    spelled = set(re.findall(r"--rc\.([a-z0-9-]+)", read(RUNNING)))
    spelled = {n.removesuffix("-") for n in spelled}  # '--rc.rollout-outlier-threshold-low/-high'
    assert spelled and sorted(spelled - fields - {"rollout-outlier-threshold"}) == []


def test_the_workflow_commands_build_valid_corrections(monkeypatch):
    """The commands of docs/running.md "Choosing a correction step by step" parse (rc_config.parse_cli) into a
    correction rc_core accepts (rc_config.build_correction_config), and do what the page says of them."""
    import sys

    import rc_config
    import rc_train

    text = page_section(read(RUNNING), "Choosing a correction step by step")
    commands = [line.split()[2:] for line in text.splitlines() if line.startswith("python rc_train.py ")]
    assert len(commands) == 5
    built = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # none of them asks for metrics-only IS by accident
        for argv in commands:
            monkeypatch.setattr(sys, "argv", ["rc_train.py", *argv])
            built.append(
                rc_config.build_correction_config(rc_config.parse_cli(rc_train.Args, rc_train.load_yaml_defaults).rc)
            )
    measure, measure_is, band, geo, full = built
    assert all(c.bypass_mode for c in built)
    assert (measure.rollout_is, measure.rs_specs) == (None, ()) and measure.loss_type == "ppo_clip"
    assert measure_is.rollout_is == "token" and measure_is.rs_specs == ()
    assert [o.name for o in band.rs_specs] == ["seq_sum_k1"] and band.rollout_is is None
    assert [o.name for o in geo.rs_specs] == ["seq_mean_k1"]
    assert full.loss_type == "reinforce" and full.rollout_is == "sequence" and full.rs_specs == band.rs_specs


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------
def correction_configs() -> list:
    """Every preset, each RS option alone, IS batch normalisation at both levels and the veto: together they turn
    on every metric rc_core's correction can log (a --rc.* override can reach each of them)."""
    configs = [rc.RolloutCorrectionConfig.from_name(n) for n in rc.PRESET_NAMES]
    for option in rc.RS_OPTIONS:
        configs.append(
            rc.RolloutCorrectionConfig(
                rollout_rs=option, rollout_rs_threshold="0.5_2.0" if option.endswith("_k1") else 0.01
            )
        )
    for level in rc.IS_LEVELS:
        configs.append(rc.RolloutCorrectionConfig(rollout_is=level, rollout_is_batch_normalize=True))
    configs.append(rc.RolloutCorrectionConfig(rollout_token_veto_threshold=1e-4))
    return configs


@functools.cache
def core_metrics() -> frozenset:
    """The metric names rc_core returns to the trainer, from its own functions: the correction entry point (decoupled
    mode), the bypass loss (both loss types; its rollout_corr/* come from the same code) and the decoupled loss."""
    gen = torch.Generator().manual_seed(0)
    rollout = -torch.rand((8, 6), generator=gen, dtype=torch.float64) * 2
    train = rollout + 0.3 * torch.randn((8, 6), generator=gen, dtype=torch.float64)
    mask = torch.ones((8, 6), dtype=torch.float64)
    mask[1, 3:] = mask[5, 1:] = 0.0
    adv = torch.randn((8, 1), generator=gen, dtype=torch.float64).expand(8, 6) * mask
    names = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # bypass PPO-clip with IS: metrics only, as documented
        for config in correction_configs():
            weights, keep, metrics = rc.compute_rollout_correction_and_rejection_mask(train, rollout, mask, config)
            names |= set(metrics)
            if config.bypass_mode:
                _, metrics = rc.compute_policy_loss_bypass_mode(
                    train.clone().requires_grad_(), rollout, adv, mask, config
                )
            else:
                _, metrics = rc.compute_policy_loss_vanilla(
                    train,
                    train.clone().requires_grad_(),
                    adv,
                    mask,
                    rollout_is_weights=weights,
                    keep_mask=keep,
                    rollout_log_prob=rollout,
                )
            names |= set(metrics)
    for option in rc.RS_OPTIONS:  # the per-option names exist for every option, not only those of the presets
        assert any(n.startswith(f"rollout_corr/rollout_rs_{option}_") for n in names), option
    return frozenset(names)


def literal_metrics() -> frozenset:
    """Metric names written as string literals in the trainer's files.

    Dynamic names need care: a metric name built with an f-string or by concatenation would escape this scan, so
    each one must be listed in DYNAMIC with the way it is collected. The one there, rc_core's f"rollout_corr/{k}"
    (with f"rollout_rs_{option.name}_{k}" inside), is collected by calling rc_core (core_metrics). A new dynamic
    name must be collected the same way, or written out as a literal."""
    names = set()
    for path in LITERAL_FILES:
        text = read(path)
        dynamic = DYNAMIC_FSTRING.findall(text) + DYNAMIC_CONCAT.findall(text)
        unknown = [d for d in dynamic if (path, d) not in DYNAMIC]
        assert not unknown, f"{path} builds metric names at run time ({unknown}); see literal_metrics"
        names |= set(LITERAL.findall(text))
    return frozenset(names)


@functools.cache
def task_metrics() -> frozenset:
    """eval/accuracy_<key> for every score key of every task in tasks.TASKS (rc_run.evaluate's names)."""
    return frozenset(f"eval/accuracy_{k}" for name in tasks.TASKS for k in tasks.make_task(name).score_keys)


@functools.cache
def moe_metrics() -> frozenset:
    """rc_moe.routing_metrics's names, per-layer ones included, from a 3-layer routing."""
    import rc_moe

    routing = torch.zeros((1, 4, 3, 2), dtype=torch.long)
    return frozenset(rc_moe.routing_metrics(routing, routing, torch.ones((1, 2))))


def logged_metrics() -> frozenset:
    return core_metrics() | literal_metrics() | task_metrics() | moe_metrics()


def doc_metrics(metrics_text: str) -> set:
    """Every metric name docs/metrics.md spells out (in backticks), placeholders included."""
    return set(re.findall("`(" + NAME + ")`", metrics_text))


def pattern(name: str) -> re.Pattern:
    """A documented name as a regular expression: <option> stands for any RS option of rc_core, <key> for any score
    key of a task, <layer> for a layer index."""
    options = "|".join(map(re.escape, rc.RS_OPTIONS))
    keys = "|".join(sorted({re.escape(n.removeprefix("eval/accuracy_")) for n in task_metrics()}))
    text = re.escape(name).replace(re.escape(OPTION), f"(?:{options})").replace(re.escape(LAYER), "[0-9]+")
    return re.compile(text.replace(re.escape(KEY), f"(?:{keys})"))


def metric_problems(metrics_text: str, logged: frozenset) -> list[str]:
    documented = doc_metrics(metrics_text)
    problems = [
        f"docs/metrics.md: unknown placeholder in {n!r} (only {OPTION}, {KEY} and {LAYER})"
        for n in sorted(documented)
        if set("<>") & set(n.replace(OPTION, "").replace(KEY, "").replace(LAYER, ""))
    ]
    # The name column of every table spells each name out: no shorthand such as `_max` or `rollout_is_*`.
    for table in tables(metrics_text):
        for row in table:
            spans = re.findall(r"`([^`]+)`", row[0])
            if not spans:
                problems.append(f"docs/metrics.md: a table row names no metric: {row[0]!r}")
            problems += [
                f"docs/metrics.md: {s!r} in a name column is not a full metric name"
                for s in spans
                if not re.fullmatch(NAME, s)
            ]
    patterns = {n: pattern(n) for n in documented}
    problems += [
        f"{n!r} is logged but not in docs/metrics.md"
        for n in sorted(logged)
        if not any(p.fullmatch(n) for p in patterns.values())
    ]
    problems += [
        f"docs/metrics.md lists {n!r}, which the trainer never logs"
        for n, p in sorted(patterns.items())
        if not any(p.fullmatch(m) for m in logged)
    ]
    return problems


def test_every_logged_metric_is_in_the_glossary_and_every_listed_name_is_logged():
    assert metric_problems(read(METRICS), logged_metrics()) == []


def test_no_other_page_holds_a_second_metric_list():
    for page in OTHER_PAGES:
        for table in tables(read(page)):
            listed = {n for row in table if row for n in re.findall("`(" + NAME + ")`", row[0])}
            assert len(listed) <= 3, f"{page} lists metrics in a table ({sorted(listed)}); the list is docs/metrics.md"


def reduction_problems(metrics_text: str, logged: frozenset, reductions: dict) -> list[str]:
    """rc_run.METRIC_REDUCTIONS against the logged names and the glossary: every declared name is logged and
    documented, and every logged name whose last word is max or min (a maximum or minimum over rows or tokens, by the
    glossary's own naming) is declared as that extreme; a declared name is never left to the default mean."""
    patterns = [pattern(n) for n in doc_metrics(metrics_text)]
    problems = [
        f"METRIC_REDUCTIONS declares {n!r}, which the trainer never logs" for n in reductions if n not in logged
    ]
    problems += [
        f"METRIC_REDUCTIONS declares {n!r}, which docs/metrics.md does not list"
        for n in reductions
        if not any(p.fullmatch(n) for p in patterns)
    ]
    for name in sorted(logged):
        last = re.sub("_(?:" + "|".join(rc.RS_OPTIONS) + ")_", "_", name.rsplit("/", 1)[-1]).split("_")[-1]
        if last in ("max", "min") and reductions.get(name) != last:
            problems.append(
                f"{name!r} is a {last}imum but METRIC_REDUCTIONS reduces it as {reductions.get(name, 'mean')}"
            )
    return problems


def test_every_extreme_metric_is_declared_and_every_declared_name_is_logged():
    import rc_run

    assert reduction_problems(read(METRICS), logged_metrics(), rc_run.METRIC_REDUCTIONS) == []


# ---------------------------------------------------------------------------------------------
# The checks themselves can fail
# ---------------------------------------------------------------------------------------------
def test_the_checks_catch_a_missing_or_unknown_preset_and_metric():
    corrections = read(CORRECTIONS)
    row = next(line for line in section(corrections, "9.2").splitlines() if "`decoupled_token_icepop(" in line)
    assert any("'decoupled_token_icepop'" in p for p in preset_problems(corrections.replace(row + "\n", "")))
    bogus = row.replace("`decoupled_token_icepop(", "`decoupled_token_nonsense(")
    assert any("'decoupled_token_nonsense'" in p for p in preset_problems(corrections.replace(row, row + "\n" + bogus)))

    metrics, logged = read(METRICS), logged_metrics()
    row = next(line for line in metrics.splitlines() if line.startswith("| `actor/entropy`"))
    assert any("'actor/entropy'" in p for p in metric_problems(metrics.replace(row + "\n", ""), logged))
    row = next(line for line in metrics.splitlines() if "`rollout_corr/rollout_rs_<option>_mean`" in line)
    problems = metric_problems(metrics.replace(row + "\n", ""), logged)
    assert any("'rollout_corr/rollout_rs_seq_max_k3_mean'" in p for p in problems)
    table = "\n| metric | meaning | range |\n|---|---|---|\n| `%s` | x | |\n"
    assert any("'actor/bogus'" in p for p in metric_problems(metrics + table % "actor/bogus", logged))
    assert any("not a full metric name" in p for p in metric_problems(metrics + table % "_max", logged))
    assert any("placeholder" in p for p in metric_problems(metrics + table % "actor/<name>_max", logged))
    import rc_run

    declared = dict(rc_run.METRIC_REDUCTIONS)
    assert any(
        "'rollout_corr/rollout_is_max'" in p
        for p in reduction_problems(metrics, logged, {**declared, "rollout_corr/rollout_is_max": "mean"})
    )
    declared.pop("response_length/max")
    assert any("'response_length/max'" in p for p in reduction_problems(metrics, logged, declared))
    assert any("'actor/bogus_max'" in p for p in reduction_problems(metrics, logged, {"actor/bogus_max": "max"}))


# ---------------------------------------------------------------------------------------------
# Links
# ---------------------------------------------------------------------------------------------
DOC_PAGES = ("README.md", "lab/README.md", *(f"docs/{n}" for n in sorted(os.listdir(os.path.join(ROOT, "docs")))))


def broken_links(page: str, text: str) -> list[str]:
    """The relative links of `page` ([text](target); web addresses and in-page anchors aside) whose target, read from
    the page's folder and without its #anchor, is no file or folder of the repository."""
    folder = os.path.dirname(os.path.join(ROOT, page))
    return [
        f"{page}: {target}"
        for target in re.findall(r"\]\(([^)\s]+)\)", text)
        if not re.match(r"[a-z][a-z0-9+.-]*:|#", target)
        and not os.path.exists(os.path.join(folder, target.split("#")[0]))
    ]


def test_every_relative_link_of_the_pages_resolves():
    pages = [p for p in DOC_PAGES if p.endswith(".md")]
    assert len(pages) >= 10 and [problem for page in pages for problem in broken_links(page, read(page))] == []
    links = "[a](running.md), [b](../lab/README.md#in-short), [c](https://example.org), [d](#top), [e](../nowhere.md)"
    assert broken_links("docs/README.md", links) == ["docs/README.md: ../nowhere.md"]
