"""The README's "Fork it" recipes, run as written, so that they cannot rot.

Each test takes a recipe's code block from README.md (the first ```python block after the paragraph whose bold heading
it names: readme_block), adds it to a copy of the repository (copy_repo, append_to), and checks the result by hand:
in-process on the copy's own modules (imported_from), and where the recipe is a trainer flag, with the copy's real
rc_train.py (run_copy). A recipe must add something the repository does not have yet; each test checks that too, on
the copy without the recipe (without_recipe: a fork that applied it in place keeps these tests green).

test_every_recipe_in_place_keeps_the_forks_tests_green applies every recipe at once, in place, to a copy of the
repository's files, and runs there the fast tests that pin the registries, the docs and the command line's unknown
names.
"""

import contextlib
import importlib
import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import rc_core
from tests.test_docs import objective_problems
from tests.test_train import session_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
README = os.path.join(ROOT, "README.md")


# ---- helpers for every recipe ----------------------------------------------------------------------------------
def readme_block(heading: str, lang: str = "python") -> str:
    """The code of the ```python (```lang) block that follows the README paragraph starting with **heading** (before
    the next bold paragraph heading or section)."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    start = text.find(f"**{heading}**")
    assert start >= 0, f"README.md has no paragraph **{heading}**"
    fence = text.find(f"```{lang}\n", start)
    after = re.compile(r"^(\*\*[^*\n]+\*\*|#+ )", re.M).search(text, start + len(heading) + 4)
    assert fence >= 0 and (after is None or fence < after.start()), f"**{heading}** has no ```{lang} block"
    body = fence + len(f"```{lang}\n")
    return text[body : text.index("\n```", body) + 1]


def copy_repo(tmp_path) -> str:
    """A copy of the repository's top-level .py files and configs/ in tmp_path/repo: enough to import and run
    rc_train.py. Returns its path."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in os.listdir(ROOT):
        if name.endswith(".py"):
            shutil.copy2(os.path.join(ROOT, name), repo / name)
    shutil.copytree(os.path.join(ROOT, "configs"), repo / "configs")
    return str(repo)


def append_to(repo: str, module: str, code: str) -> None:
    """Append `code` to the copy's module file (e.g. 'rc_core.py'), as the recipe says."""
    with open(os.path.join(repo, module), "a", encoding="utf-8") as f:
        f.write("\n\n" + code)


def without_recipe(repo: str, module: str, code: str) -> None:
    """Take the recipe's `code` out of the copy's module where a fork has appended it already (README "Fork it"), so
    that the test starts from the repository without it and appends it once."""
    path = os.path.join(repo, module)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if code in text:  # with the blank lines append_to put before it, so that what stays is formatted as before
        with open(path, "w", encoding="utf-8") as f:
            f.write(text.replace("\n\n" + code if "\n\n" + code in text else code, "").rstrip("\n") + "\n")


def ruff_problems(repo: str, module: str) -> str:
    """ruff's format and lint report on the copy's module under the repository's own settings ('' when clean)."""
    exe = os.path.join(os.path.dirname(sys.executable), "ruff")
    ruff = [exe] if os.path.exists(exe) else [sys.executable, "-m", "ruff"]
    config = ["--config", os.path.join(ROOT, "pyproject.toml")]
    out = ""
    for args in (["format", "--check", "--diff"], ["check"]):
        proc = subprocess.run([*ruff, *args, *config, module], capture_output=True, text=True, cwd=repo, timeout=120)
        out += proc.stdout + proc.stderr if proc.returncode else ""
    return out


def with_objective_row(running_text: str, row: str) -> str:
    """docs/running.md with `row` added to its objective table, after the last `--rc.loss-mode` row: what the
    README's policy-loss recipe asks of a new objective."""
    lines = running_text.splitlines(keepends=True)
    last = max(i for i, line in enumerate(lines) if line.startswith("| `--rc.loss-mode "))
    return "".join(lines[: last + 1] + [row] + lines[last + 1 :])


@contextlib.contextmanager
def imported_from(repo: str, *names: str):
    """The copy's modules `names` (its rc_core, rc_config, rc_train, ...), imported under their own names so that they
    import each other; afterwards sys.modules holds the repository's own modules again."""
    shadowed = [name[: -len(".py")] for name in os.listdir(repo) if name.endswith(".py")]
    saved = {name: sys.modules.pop(name, None) for name in shadowed}
    sys.path.insert(0, repo)
    try:
        yield [importlib.import_module(name) for name in names]
    finally:
        sys.path.remove(repo)
        for name in shadowed:
            sys.modules.pop(name, None)
            if saved[name] is not None:
                sys.modules[name] = saved[name]


def run_copy(repo: str, tmp_path, *flags, name: str = "run", timeout: int = 300):
    """Run the copy's rc_train.py on the one-token fixture (configs/cpu_add.yaml), small: 8 prompts x 8 samples, a
    10-problem evaluation at the end only. Returns (metrics rows of the training steps, completed process)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", RC_CACHE_DIR=str(session_cache(tmp_path.parent)))
    quick = ["--config", os.path.join("configs", "cpu_add.yaml"), "--num-prompts-per-step", "8"]
    quick += ["--num-samples-per-prompt", "8", "--eval-limit", "10", "--no-eval-before", "--no-save-final"]
    out = tmp_path / "runs"
    cmd = [sys.executable, "rc_train.py", *quick, "--output-dir", str(out), "--run-name", name, *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=repo)
    assert proc.returncode == 0, f"rc_train.py failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    lines = (out / name / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if row["step"] >= 0], proc


# ---- A new advantage estimator: RLOO -------------------------------------------------------------------------
def rloo_by_hand(scores: list[float], index: list) -> list[float]:
    """A_i = R_i - (sum of the other R_j of i's group) / (n_g - 1); a group of one keeps R_i."""
    out = []
    for score, group in zip(scores, index):
        others = [s for s, g in zip(scores, index) if g == group]
        others.remove(score)
        out.append(score - sum(others) / len(others) if others else score)
    return out


# Appended after the recipe for the training run: each call of the "rloo" entry is written to TRACE_PATH, so the
# test sees that the trainer dispatched through ADVANTAGE_ESTIMATORS, and with which scores, groups and mask.
TRACE_RLOO = """
import json

_recipe_rloo = ADVANTAGE_ESTIMATORS["rloo"]


def _traced_rloo(scores, index, **kwargs):
    adv = _recipe_rloo(scores, index, **kwargs)
    call = {"scores": torch.as_tensor(scores).tolist(), "index": torch.as_tensor(index).tolist(), "adv": adv.tolist()}
    with open(TRACE_PATH, "a") as f:
        f.write(json.dumps({**call, "mask": kwargs["response_mask"].tolist()}) + "\\n")
    return adv


ADVANTAGE_ESTIMATORS["rloo"] = _traced_rloo
"""


def test_rloo_recipe(tmp_path):
    repo, code = copy_repo(tmp_path), readme_block("A new advantage estimator.")
    without_recipe(repo, "rc_core.py", code)
    with imported_from(repo, "rc_core") as (core,):
        assert "rloo" not in core.ADVANTAGE_ESTIMATORS  # the recipe adds an estimator the repository lacks
    append_to(repo, "rc_core.py", code)
    assert ruff_problems(repo, "rc_core.py") == ""

    # In-process, by hand: two groups of four and two, a group of one, a group whose scores are all equal.
    scores = [1.0, 0.0, 1.0, 0.0, 0.7, 0.3, 0.3, 0.3, 1.0, 0.0]
    index = ["a", "a", "a", "a", "solo", "b", "b", "b", "c", "c"]
    want = [2 / 3, -2 / 3, 2 / 3, -2 / 3, 0.7, 0.0, 0.0, 0.0, 1.0, -1.0]
    assert rloo_by_hand(scores, index) == pytest.approx(want)
    with imported_from(repo, "rc_core", "rc_config", "rc_run", "rc_train") as (core, settings, run, trainer):
        adv = core.compute_advantage("rloo", torch.tensor(scores, dtype=torch.float64), index)
        assert adv.tolist() == pytest.approx(want, abs=1e-12)
        # the trainer's call: an integer group tensor, token scores summed over T, A_i m_it back
        ids = torch.tensor([0, 0, 0, 0, 1, 2, 2, 2, 3, 3])
        token_scores = torch.tensor(scores, dtype=torch.float64)[:, None] * torch.tensor([0.25, 0.75])
        mask = torch.ones(10, 2)
        mask[1, 1] = mask[4, 0] = 0.0
        full = core.compute_advantage("rloo", token_scores, ids, response_mask=mask, norm_adv_by_std=True)
        torch.testing.assert_close(full, torch.tensor(want, dtype=torch.float64)[:, None] * mask)
        settings.validate_args(trainer.Args(adv_estimator="rloo"), world_size=1)  # now a valid --adv-estimator
        with pytest.raises(ValueError, match="--adv-estimator.*grpo, gpg, rloo.*'ppo'"):
            settings.validate_args(trainer.Args(adv_estimator="ppo"), world_size=1)

    # The copy's real trainer, two steps on the one-token fixture with --adv-estimator rloo.
    trace = tmp_path / "rloo_calls.jsonl"
    append_to(repo, "rc_core.py", TRACE_RLOO.replace("TRACE_PATH", repr(str(trace))))
    rows, _ = run_copy(repo, tmp_path, "--num-steps", "2", "--adv-estimator", "rloo")
    assert [r["step"] for r in rows] == [0, 1]
    assert all(math.isfinite(r["actor/pg_loss"]) and 0.0 <= r["reward/mean"] <= 1.0 for r in rows)
    assert trace.exists(), "the trainer never called the 'rloo' estimator: its loop must call rc_core.compute_advantage"
    calls = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(calls) == 2  # one advantage per step, on this one rank
    for call in calls:
        scores, index = call["scores"], call["index"]
        assert len(scores) == 64 and sorted(set(index)) == list(range(8))  # 8 prompts x 8 samples, one group each
        want = rloo_by_hand(scores, index)
        assert call["adv"] == [[pytest.approx(a * m, abs=1e-6) for m in row] for a, row in zip(want, call["mask"])]


# ---- A new rejection rule: a chi^2 gate ------------------------------------------------------------------------
def test_chi2_gate_recipe(tmp_path, monkeypatch):
    option, p = "seq_mean_chi2", "rollout_corr/rollout_rs_seq_mean_chi2_"
    repo, code = copy_repo(tmp_path), readme_block("A new rejection rule.")
    without_recipe(repo, "rc_core.py", code)
    with imported_from(repo, "rc_core") as (core,), pytest.raises(ValueError, match=f"unknown option '{option}'"):
        core.RolloutCorrectionConfig(rollout_rs=option, rollout_rs_threshold=0.1)  # an option the repository lacks
    append_to(repo, "rc_core.py", code)
    assert ruff_problems(repo, "rc_core.py") == ""

    # Token ratios rho = pi_train / mu: row 0 (1.5, 0.5), row 1 (1.2, 1.0), row 2 (0.9) and a padded slot (NaN).
    # Row values Q_i = mean_t (rho_t - 1)^2 = 0.25, 0.02, 0.01: the gate U = 0.1 rejects row 0 only.
    ratios = [[1.5, 0.5], [1.2, 1.0], [0.9, math.nan]]
    train_lp = torch.tensor(ratios, dtype=torch.float64).log()
    rollout_lp = torch.where(train_lp.isnan(), train_lp, torch.zeros_like(train_lp))
    mask = (~train_lp.isnan()).double()
    q, rows_q = [0.25, 0.25, 0.02, 0.02, 0.01], [0.25, 0.02, 0.01]  # Q_i broadcast over each row's tokens; Q_i
    clipped = [min(v, 0.1) for v in q]  # q clipped to the option's interval [0, U]
    by_hand = {
        "mean": sum(q) / 5,  # token-weighted
        "max": 0.25,
        "min": 0.01,
        "fraction_high": 1 / 3,  # of the rows
        "fraction_low": 0.0,  # one-sided: nothing is below
        "std": math.sqrt(sum(v * v for v in clipped) / 5 - (sum(clipped) / 5) ** 2),
        "seq_mean": sum(rows_q) / 3,
        "seq_std": math.sqrt(sum((v - sum(rows_q) / 3) ** 2 for v in rows_q) / 2),
        "seq_max": 0.25,
        "seq_min": 0.01,
        "seq_max_deviation": 0.25,
        "seq_fraction_high": 1 / 3,
        "masked_fraction": 2 / 5,  # of the valid tokens
        "seq_masked_fraction": 1 / 3,
    }
    with imported_from(repo, "rc_core", "rc_config", "rc_run", "rc_train") as (core, settings, run, trainer):
        assert option in core.RS_OPTIONS and "chi2" in core.RS_STATISTICS

        def correct(rollout_rs, threshold):
            config = core.RolloutCorrectionConfig(rollout_rs=rollout_rs, rollout_rs_threshold=threshold)
            return core.compute_rollout_correction_and_rejection_mask(train_lp, rollout_lp, mask, config)

        weights, keep, metrics = correct(option, 0.1)
        assert weights is None and keep.tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 0.0]]
        assert {k[len(p) :]: v for k, v in metrics.items() if k.startswith(p)} == pytest.approx(by_hand, abs=1e-12)
        assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 5)
        # the metric names of a built-in one-sided option, each reduced by its own last word
        k3_names = set(correct("seq_mean_k3", 0.1)[2])
        assert {k.replace(option, "seq_mean_k3") for k in metrics} == k3_names
        assert [run.reduction(p + word) for word in ("mean", "max", "seq_min")] == ["mean", "max", "min"]
        # AND-ed with a built-in option: token_k1 at [0.95, 1.3] also rejects row 2's rho = 0.9
        keep = correct(f"{option},token_k1", "0.1,0.95_1.3")[1]
        assert keep.tolist() == [[0.0, 0.0], [1.0, 1.0], [0.0, 0.0]]

        # The copy's trainer takes it from the command line: parsed, validated and built into its correction config.
        config = os.path.join(repo, "configs", "cpu_add.yaml")
        flags = ["--rc.rollout-rs", option, "--rc.rollout-rs-threshold", "0.1"]
        monkeypatch.setattr(sys, "argv", ["rc_train.py", "--config", config, *flags])
        args = settings.parse_cli(trainer.Args, trainer.load_yaml_defaults)
        settings.validate_args(args, 1)
        (spec,) = settings.build_correction_config(args.rc).rs_specs
        assert spec == core.RSOption(option, "chi2", "seq_mean", None, 0.1)


# ---- A new policy loss: tapered off-policy REINFORCE -------------------------------------------------------------
TRACE_TOPR = """
_recipe_topr = POLICY_LOSSES["topr"]


def _traced_topr(a):
    with open(TRACE_PATH, "a") as f:
        f.write(f"{float(a.mask.sum())}\\n")
    return _recipe_topr(a)


POLICY_LOSSES["topr"] = _traced_topr
"""


def test_policy_loss_recipe(tmp_path, monkeypatch):
    repo, code = copy_repo(tmp_path), readme_block("A new policy loss.")
    without_recipe(repo, "rc_core.py", code)
    with imported_from(repo, "rc_core") as (core,):
        assert "topr" not in core.POLICY_LOSSES  # the recipe adds an objective the repository lacks
        with pytest.raises(ValueError, match="loss_mode.*'topr'"):
            core.RolloutCorrectionConfig(loss_mode="topr")
    append_to(repo, "rc_core.py", code)
    assert ruff_problems(repo, "rc_core.py") == ""

    # The recipe's docs row: docs/running.md's objective table needs one for every objective (tests/test_docs.py).
    row = readme_block("A new policy loss.", "markdown")
    assert row.startswith("| `--rc.loss-mode topr` |") and row.count("\n") == 1
    with open(os.path.join(ROOT, "docs", "running.md"), encoding="utf-8") as f:
        running = f.read().replace(row, "")  # a fork that added the row in place: start without it
    monkeypatch.setitem(rc_core.POLICY_LOSSES, "topr", None)  # the copy's registry, as far as the table checks it
    assert objective_problems(running) == ["objective 'topr' has no row in running.md"]
    assert objective_problems(with_objective_row(running, row)) == []

    # By hand: row 0 has A = +1 (weight 1 on every token), row 1 A = -1 (weight min(pi/pi_prox, 1)); row 1's last token
    # is padding. phi = -w A log pi, token-mean over the 4 valid tokens; d loss / d log pi = -w A / 4.
    pi = [[0.5, 0.2, 0.4], [0.3, 0.6, 0.1]]
    prox = [[0.25, 0.4, 0.4], [0.2, 0.9, 0.1]]
    adv = [[1.0] * 3, [-1.0] * 3]
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    w = [[1.0, 1.0, 1.0], [1.0, 0.6 / 0.9, 0.0]]
    valid = [(i, t) for i in range(2) for t in range(3) if mask[i, t]]
    want_loss = sum(-w[i][t] * adv[i][t] * math.log(pi[i][t]) for i, t in valid) / len(valid)
    want_grad = [[-w[i][t] * adv[i][t] / len(valid) if mask[i, t] else 0.0 for t in range(3)] for i in range(2)]
    with imported_from(repo, "rc_core") as (core,):
        log_pi = torch.tensor(pi, dtype=torch.float64).log().requires_grad_()
        log_prox = torch.tensor(prox, dtype=torch.float64).log()
        advantages = torch.tensor(adv, dtype=torch.float64)
        config = core.RolloutCorrectionConfig(loss_mode="topr")  # decoupled: pi_prox = pi_old
        loss, _ = core.compute_policy_loss_vanilla(log_prox, log_pi, advantages, mask, config=config)
        loss.backward()
        assert loss.item() == pytest.approx(want_loss, abs=1e-12)
        torch.testing.assert_close(log_pi.grad, torch.tensor(want_grad, dtype=torch.float64))
        # bypass: pi_prox = mu, the same objective through the other entry point
        bypass = core.RolloutCorrectionConfig(bypass_mode=True, loss_mode="topr")
        loss_b, _ = core.compute_policy_loss_bypass_mode(log_pi.detach(), log_prox, advantages, mask, bypass)
        assert float(loss_b) == pytest.approx(want_loss, abs=1e-12)

    # The copy's real trainer (bypass PPO-clip preset of the fixture), two steps with --rc.loss-mode topr.
    trace = tmp_path / "topr_calls.txt"
    append_to(repo, "rc_core.py", TRACE_TOPR.replace("TRACE_PATH", repr(str(trace))))
    rows, _ = run_copy(repo, tmp_path, "--num-steps", "2", "--rc.loss-mode", "topr")
    assert [r["step"] for r in rows] == [0, 1] and all(math.isfinite(r["actor/pg_loss"]) for r in rows)
    assert trace.exists(), "the trainer never called the 'topr' objective: policy_loss must pass the config on"
    assert len(trace.read_text().splitlines()) >= 2  # at least one micro-batch per step


# ---- Every recipe at once, in place: the fork's own tests stay green ----------------------------------------------
RECIPES = {  # each "Fork it" recipe's bold heading -> the module the README appends its code to
    "A new advantage estimator.": "rc_core.py",
    "A new rejection rule.": "rc_core.py",
    "A new policy loss.": "rc_core.py",
    "A new task.": "tasks.py",
}
# The fast tests that pin what a fork extends: rc_core's registries, tasks.TASKS, the docs checked against them, the
# command line's unknown names and the task recipe's helper (about 10 s on the 2-core machine; the whole files would
# take minutes). -k matches a test's name or its file's.
FORK_FILES = ["test_rc.py", "tests/test_docs.py", "tests/test_cli.py", "tests/test_tasks.py", "tests/test_infra.py"]
FORK_SELECTION = (
    "registry or compute_advantage or rs_statistics or error_messages or loss_mode or chaining or test_docs"
    " or bad_value or unknown_name or recipe_scores or reductions_cover"
)
MUST_PASS = (  # the tests a fork's additions used to turn red: the selection must keep running them
    "test_rc.py::test_registry_holds_verls_loss_modes",
    "test_rc.py::test_compute_advantage_grpo_is_exactly_the_grpo_call_and_unknown_names_fail",
    "test_rc.py::test_rs_statistics_registry_names_every_option_statistic",
    "tests/test_docs.py::test_the_objective_table_names_every_loss_mode_and_only_those",
    "tests/test_cli.py::test_bad_value_is_refused_naming_flag_and_value",
    "tests/test_tasks.py::test_registry_takes_a_new_task_without_editing_make_task",
    "tests/test_tasks.py::test_readme_task_recipe_scores_the_row",
)


def copy_checkout(tmp_path) -> str:
    """A copy of the repository's files as the work tree holds them, in tmp_path/fork: those git tracks and the new ones
    it does not ignore (git ls-files), so no virtual environment, runs or caches. Returns its path."""
    ls_files = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    listed = subprocess.run(ls_files, cwd=ROOT, capture_output=True, timeout=60)
    if listed.returncode:
        pytest.skip(f"not a git checkout: {listed.stderr.decode(errors='replace').strip()}")
    fork = tmp_path / "fork"
    for name in listed.stdout.decode().split("\0"):
        if name and os.path.isfile(os.path.join(ROOT, name)):  # a tracked file deleted in the work tree is left out
            os.makedirs(fork / os.path.dirname(name), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, name), fork / name)
    return str(fork)


def test_every_recipe_in_place_keeps_the_forks_tests_green(tmp_path):
    """A fork applies every "Fork it" recipe together, in place, as the README says (each code block appended to its
    module, the policy loss's row added to docs/running.md); the project's own tests that pin the registries, the docs
    and the unknown names must pass there: they ask for the built-ins, never for exactly the built-ins."""
    with open(README, encoding="utf-8") as f:
        fork_it = f.read().split("\n## Fork it\n", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"^\*\*([^*\n]+)\*\*", fork_it, re.M) == list(RECIPES)  # a new recipe is applied here too
    fork = copy_checkout(tmp_path)
    for heading, module in RECIPES.items():  # once each, also where this repository is such a fork already
        code = readme_block(heading)
        without_recipe(fork, module, code)
        append_to(fork, module, code)
    running, row = os.path.join(fork, "docs", "running.md"), readme_block("A new policy loss.", "markdown")
    with open(running, encoding="utf-8") as f:
        text = with_objective_row(f.read().replace(row, ""), row)
    with open(running, "w", encoding="utf-8") as f:
        f.write(text)

    path = os.pathsep.join(filter(None, [fork, os.environ.get("PYTHONPATH")]))  # the fork's modules, not ours
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not a worker of this session's
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=path)
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-rA", *FORK_FILES]
    proc = subprocess.run([*cmd, "-k", FORK_SELECTION], capture_output=True, text=True, cwd=fork, env=env, timeout=600)
    assert proc.returncode == 0, f"the fork's tests failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
    passed = {line.split()[1].split("[")[0] for line in proc.stdout.splitlines() if line.startswith("PASSED ")}
    assert [t for t in MUST_PASS if t not in passed] == [], proc.stdout[-3000:]
