"""--prox-logp (issue 50 item 2, docs/corrections.md §7.10): pi_old from mu and pi_theta by version, AReaL's
log-linear interpolation, in place of the decoupled pass (loglinear) or beside it (metrics)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import rc_config
import rc_core
import rc_train
from benchmarks import bench_gpu_step as bench


# ---- the formula -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mu, theta, v_mu, v_prox, v_theta, expected",
    [
        # AReaL's own cases (tests/test_prox_approx.py, areal 1.0.4), its v_prox = v_theta - 1
        ([[-1.0, -2.0, -3.0]], [[-1.5, -2.5, -3.5]], [[0, 0, 0]], 1, 2, [[-1.25, -2.25, -3.25]]),
        ([[-1.0], [-2.0]], [[-1.5], [-2.2]], [[0], [2]], 3, 4, [[-1.375], [-2.1]]),
        ([[-1.0]], [[-2.0]], [[4]], 4, 5, [[-1.0]]),  # v_mu = v_prox: alpha 0, mu
        ([[-1.0]], [[-2.0]], [[3]], 2, 3, [[-1.0]]),  # v_mu = v_theta: no division, alpha 0
        # ours: per-row versions; v_prox = v_theta (the step's first optimizer step): alpha 1, pi_theta itself
        ([[-1.0, -2.0], [-3.0, -4.0]], [[-1.5, -2.5], [-3.5, -4.5]], [1, 3], 3, 3, [[-1.5, -2.5], [-3.0, -4.0]]),
    ],
)
def test_loglinear_equals_areals_cases(mu, theta, v_mu, v_prox, v_theta, expected):
    mu, theta = torch.tensor(mu, dtype=torch.float64), torch.tensor(theta, dtype=torch.float64)
    alpha = rc_core.loglinear_alpha(torch.tensor(v_mu), v_prox, v_theta)
    approx = rc_core.loglinear_proximal_log_prob(mu, theta, alpha)
    assert torch.allclose(approx, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)


def test_alpha_is_clamped_and_the_approximation_is_detached():
    alpha = rc_core.loglinear_alpha(torch.tensor([0, 5]), 4.0, 2.0)  # v_prox beyond v_theta: 2 -> 1; behind v_mu: 0
    assert alpha.tolist() == [1.0, 0.0]
    theta = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    approx = rc_core.loglinear_proximal_log_prob(torch.tensor([[-0.5, -0.5]]), theta, torch.tensor([0.5]))
    assert not approx.requires_grad


def test_approximation_errors_by_hand():
    g = torch.tensor([[-1.0, -2.0, 9.0]], dtype=torch.float64)  # recomputed; the last token is padding
    a = torch.tensor([[-1.5, -2.0, 0.0]], dtype=torch.float64)
    mu = torch.tensor([[-1.2, -1.0, 0.0]], dtype=torch.float64)
    cur = torch.tensor([[-0.9, -2.5, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    errors = rc_core.proximal_approximation_errors(a, g, mu, cur, mask).items()
    got = {k.removeprefix("actor/prox_loglinear_"): float(v) for k, v in errors}
    e = torch.exp
    assert got["abs_error"] == pytest.approx(0.25)
    assert got["rel_error"] == pytest.approx(0.25 / (1 + 1e-8))
    assert got["squared_error"] == pytest.approx(0.125)
    assert got["behave_imp_weight_abs_error"] == pytest.approx(
        float(abs(e(torch.tensor(0.2)) - e(torch.tensor(-0.3))) / 2)
    )
    w = abs(e(torch.tensor(0.1)) - e(torch.tensor(0.6)))
    assert got["importance_weight_abs_error"] == pytest.approx(float(w) / 2)


# ---- in the update -----------------------------------------------------------------------------------------------
def _update(method: str, minibatches: int, versions_behind: int = 1, step: int = 3):
    """One rc_train update of the tiny token-TIS batch, every row sampled `versions_behind` versions ago: pi_old
    recomputed (decoupled_correction) or approximated (--prox-logp)."""
    plan = bench.parse_plan(["--tiny", "--config", "configs/gsm8k_qwen0.5b_token_tis.yaml"])
    plan = dataclasses.replace(plan, train=dataclasses.replace(plan.train, ppo_epochs=1, train_dtype="float32"))
    args = rc_train.load_yaml_defaults(plan.config_path)
    args = dataclasses.replace(
        args, **{**bench.TINY_ARGS, "ppo_epochs": 1, "num_minibatches": minibatches, "prox_logp": method}
    )
    b = bench.setup(plan)
    b.batch["version"] = torch.full((len(b.batch["group"]),), step - versions_behind)
    tensors = {k: b.batch[k] for k in ("response_mask", "advantages", "rollout_log_prob")}
    correction, size = {}, None
    if method != "loglinear":
        unwrapped = b.learner.accelerator.unwrap_model(b.learner.model)
        correction, size = rc_train.decoupled_correction(args, plan.correction, unwrapped, b.batch, tensors)
    metrics, actor, _ = rc_train.update_policy(
        args,
        plan.correction,
        rc_train.Learner(**vars(b.learner)),
        b.batch,
        tensors,
        generator=torch.Generator().manual_seed(0),
        batch_correction=correction,
        step=step,
    )
    return b.learner.model, metrics, actor, tensors


def _weights(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_loglinear_skips_the_pass_and_equals_recompute_when_the_update_is_one_optimizer_step():
    """One minibatch, one epoch: pi_theta is pi_old when the only optimizer step's loss is computed, alpha = 1, so the
    approximation is the recompute up to the two forwards' rounding; no old_log_prob pass ran."""
    ours, _, ours_actor, ours_tensors = _update("loglinear", 1)
    theirs, _, their_actor, their_tensors = _update("recompute", 1)
    assert "old_log_prob" in their_tensors and "old_log_prob" not in ours_tensors  # the pass did not run
    assert ours_actor["actor/pg_loss"] == pytest.approx(their_actor["actor/pg_loss"], rel=1e-5, abs=1e-7)
    assert torch.allclose(_weights(ours), _weights(theirs), rtol=0, atol=1e-6)


def test_loglinear_after_the_first_optimizer_step_interpolates_and_metrics_mode_reports_its_error():
    """Two minibatches: the second is scored with alpha = (t - v) / (t + 1/2 - v) = 2/3 (v = t - 1), not with the
    recompute, so the weights part; metrics mode trains as recompute (equal weights) and reports the error."""
    ours, _, _, _ = _update("loglinear", 2)
    theirs, _, _, _ = _update("recompute", 2)
    metered, metrics, _, _ = _update("metrics", 2)
    assert not torch.allclose(_weights(ours), _weights(theirs), rtol=0, atol=1e-7)
    assert torch.equal(_weights(metered), _weights(theirs))
    sums = metrics.sums
    for k in ("abs_error", "rel_error", "squared_error", "behave_imp_weight_abs_error", "importance_weight_abs_error"):
        assert f"actor/prox_loglinear_{k}" in sums, k
    mean_abs = sums["actor/prox_loglinear_abs_error"][0] / sums["actor/prox_loglinear_abs_error"][1]
    assert 0 < mean_abs < 1.0


def test_alpha_follows_the_optimizer_steps_taken(monkeypatch):
    seen = []
    real = rc_core.loglinear_alpha

    def record(v, prox, theta):
        seen.append((int(v[0]), prox, theta))
        return real(v, prox, theta)

    monkeypatch.setattr(rc_core, "loglinear_alpha", record)
    _update("loglinear", 2, versions_behind=2, step=5)
    assert seen == [(3, 5, 5.0), (3, 5, 5.5)]


# ---- bad input ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "changes, rc, named",
    [
        ({}, {"preset": "bypass_ppo_clip"}, "is bypass"),
        ({"max_staleness": 0}, {}, "--max-staleness 0 and no replay"),
        ({}, {"rollout_is_batch_normalize": True}, "--rc.rollout-is-batch-normalize"),
        ({}, {"rollout_m2_threshold": 0.04}, "--rc.rollout-m2-threshold"),
        ({"dump_log_ratio_every": 1}, {}, "--dump-log-ratio-every"),
    ],
)
def test_refused_in_one_line_naming_the_value(changes, rc, named):
    args = dataclasses.replace(rc_train.Args(), prox_logp="loglinear", **{"max_staleness": 1, **changes})
    args.rc = dataclasses.replace(args.rc, **{"preset": "decoupled_token_is", **rc})
    with pytest.raises(ValueError, match=named) as e:
        rc_config.check_prox_logp(args, rc_config.build_correction_config(args.rc))
    assert "\n" not in str(e.value) and "loglinear" in str(e.value)


def test_accepted_with_staleness_or_replay_and_recompute_always():
    for changes in ({"max_staleness": 1}, {"max_staleness": 0, "replay_window": 2, "replay_fraction": 0.5}):
        for method in ("loglinear", "metrics"):
            args = dataclasses.replace(rc_train.Args(), prox_logp=method, **changes)
            args.rc = dataclasses.replace(args.rc, preset="decoupled_token_is")
            rc_config.check_prox_logp(args, rc_config.build_correction_config(args.rc))
    args = dataclasses.replace(rc_train.Args(), max_staleness=0)
    rc_config.check_prox_logp(args, rc_config.build_correction_config(args.rc))
