"""The 2026 objectives of rc_core (issue 50, item 3; docs/corrections.md §7.7, §7.9), each checked by hand.

* `luspo` (TRL 1.16): GSPO's row loss weighted by its length, so a token's gradient does not shrink with 1/n_i.
* `vespo` (TRL 1.16): REINFORCE scaled by the Gamma gate phi(W) = W^k e^(lambda (1 - W)) of the response's ratio W to
  mu; the IS weights enter W.
* `dro`, `gpg` (verl 0.9.1): -(A log pi - beta/2 lambda^2) and -A log pi, both times the IS weights.
* `ipo` (prime-rl): -A r on the tokens with -delta_low <= pi_theta - pi_prox <= delta_high, whatever the sign of A.
* the penalty tau (log pi_theta - log mu)^2 against the *inference* log-probs (Kimi-K2.5, prime-rl), in every mode.

Inputs are float64 with probabilities chosen so that every expected number is a short formula computed here with
`math`, never by rc_core; the gradient is checked wherever the objective's point is its gradient.
"""

import math
import os
import shlex
import sys

import pytest
import torch

import rc_config
import rc_core as rc

C = rc.RolloutCorrectionConfig
F64 = torch.float64
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
log = math.log


def approx(rows, abs=1e-12):
    """pytest.approx of a nested list, flattened row by row (as run returns the gradient)."""
    return pytest.approx([x for row in rows for x in row], abs=abs)


def run(mode_or_config, log_prob, prox, adv, mask=None, weights=None, bypass=False, rollout=None, **kwargs):
    """(loss, metrics, d loss / d log pi flattened row by row) of one decoupled (pi_prox = prox) or bypass (mu = prox)
    call, token-mean, clip 0.2 / 0.2, C = 3, unless kwargs say otherwise."""
    config = mode_or_config if isinstance(mode_or_config, C) else C(loss_mode=mode_or_config, bypass_mode=bypass)
    lp = torch.tensor(log_prob, dtype=F64, requires_grad=True)
    q, a = torch.tensor(prox, dtype=F64), torch.tensor(adv, dtype=F64)
    m = torch.ones_like(q) if mask is None else torch.tensor(mask, dtype=F64)
    if config.bypass_mode:
        loss, met = rc.compute_policy_loss_bypass_mode(lp, q, a, m, config, **kwargs)
    else:
        w = None if weights is None else torch.tensor(weights, dtype=F64)
        r = None if rollout is None else torch.tensor(rollout, dtype=F64)
        loss, met = rc.compute_policy_loss_vanilla(
            q, lp, a, m, rollout_is_weights=w, rollout_log_prob=r, config=config, **kwargs
        )
    loss.backward()
    return float(loss.detach()), met, lp.grad.flatten().tolist()


def test_the_registry_holds_the_2026_objectives():
    assert {"luspo", "vespo", "dro", "gpg", "ipo"} <= set(rc.POLICY_LOSSES)
    cfg = C()
    assert (cfg.vespo_k_pos, cfg.vespo_lambda_pos, cfg.vespo_k_neg, cfg.vespo_lambda_neg) == (2.0, 3.0, 3.0, 2.0)
    assert (cfg.dro_beta, cfg.rollout_sq_log_ratio_coef) == (0.1, 0.0)  # TRL's VESPO defaults; the penalty off


# ---- luspo ---------------------------------------------------------------------------------------------------------
def test_luspo_weights_each_response_by_its_length_so_the_token_gradient_does_not_shrink():
    # Row 0: one token, l = 0.1, s = e^0.1 (inside [0.8, 1.2]), A = 1 -> L = -e^0.1.
    # Row 1: three tokens, l = (0, 0.3, -0.3), s = 1, A = -2 -> L = 2.
    # Row 2: one token, l = 0.5, s = e^0.5 > 1.2, A = 1 -> clipped, L = -1.2, no gradient.
    q = [[log(0.5), 0.0, 0.0], [log(0.4), log(0.4), log(0.4)], [log(0.3), 0.0, 0.0]]
    lp = [[log(0.5) + 0.1, -1.0, -1.0], [log(0.4), log(0.4) + 0.3, log(0.4) - 0.3], [log(0.3) + 0.5, -1.0, -1.0]]
    mask = [[1, 0, 0], [1, 1, 1], [1, 0, 0]]
    adv = [[1.0] * 3, [-2.0] * 3, [1.0] * 3]
    s0 = math.exp(0.1)
    loss, met, grad = run("luspo", lp, q, adv, mask)
    # (1/V) sum_i n_i L_i, V = 3; d/d log pi_it = -A_i s_i / V on an unclipped row, whatever n_i
    assert loss == pytest.approx((1 * -s0 + 3 * 2.0 + 1 * -1.2) / 3, abs=1e-12)
    assert grad == approx([[-s0 / 3, 0, 0], [2 / 3, 2 / 3, 2 / 3], [0, 0, 0]], abs=1e-12)
    assert met["actor/pg_clipfrac"] == pytest.approx(1 / 5)  # one token of five kept sits in a clipped row
    # GSPO (seq-mean-token-mean) on the same inputs: (1/V) sum_i L_i, the 3-token row's gradient split by n_i = 3
    loss_g, _, grad_g = run("gspo", lp, q, adv, mask)
    assert loss_g == pytest.approx((-s0 + 2.0 - 1.2) / 3, abs=1e-12)
    assert grad_g[3:6] == pytest.approx([2 / 9] * 3, abs=1e-12)
    # bypass: mu = prox, the same number
    assert run("luspo", lp, q, adv, mask, bypass=True)[0] == pytest.approx(loss, abs=1e-12)


# ---- vespo ---------------------------------------------------------------------------------------------------------
def gamma(w, k, lam):
    return w**k * math.exp(lam * (1 - w))


def test_vespo_gate_is_one_at_ratio_one_and_peaks_at_k_over_lambda():
    for w, want in ((1.0, 1.0), (2 / 3, gamma(2 / 3, 2, 3)), (2.0, 4 * math.exp(-3))):
        got = rc.vespo_gate(torch.tensor(log(w), dtype=F64), torch.tensor(2.0, dtype=F64), torch.tensor(3.0, dtype=F64))
        assert float(got) == pytest.approx(want, rel=1e-12)
    assert gamma(2 / 3, 2, 3) > max(gamma(0.6, 2, 3), gamma(0.7, 2, 3))  # the maximum is at W = k / lambda


def test_vespo_scales_reinforce_by_the_gate_of_the_response_ratio():
    # Row 0: pi = (0.4, 0.5), prox = (0.2, 0.5): W = 2, A = +1 -> k, lambda = 2, 3: phi0 = 4 e^-3.
    # Row 1: pi = (0.25, 0.6), prox = (0.5, 0.6): W = 0.5, A = -1 -> k, lambda = 3, 2: phi1 = 0.125 e.
    lp = [[log(0.4), log(0.5)], [log(0.25), log(0.6)]]
    q = [[log(0.2), log(0.5)], [log(0.5), log(0.6)]]
    adv = [[1.0, 1.0], [-1.0, -1.0]]
    phi0, phi1 = gamma(2.0, 2, 3), gamma(0.5, 3, 2)
    loss, met, grad = run("vespo", lp, q, adv)
    assert loss == pytest.approx((-phi0 * (log(0.4) + log(0.5)) + phi1 * (log(0.25) + log(0.6))) / 4, abs=1e-12)
    # the gradient is -phi A / N on every token: no token is zeroed, none keeps its full REINFORCE weight
    assert grad == approx([[-phi0 / 4] * 2, [phi1 / 4] * 2], abs=1e-12)
    assert met["actor/vespo_gate_mean"] == pytest.approx((phi0 + phi1) / 2, abs=1e-12)
    assert run("vespo", lp, q, adv, bypass=True)[0] == pytest.approx(loss, abs=1e-12)  # bypass: mu = prox


def test_vespo_folds_the_is_weights_into_the_response_ratio():
    # Row 0 of the test above (W = 2 against pi_old) with IS weights pi_old/mu: W is the ratio to mu.
    lp, q, adv = [[log(0.4), log(0.5)]], [[log(0.2), log(0.5)]], [[1.0, 1.0]]
    # token weights (0.5, 1): W = 2 * 0.5 * 1 = 1, phi = 1, and the weights do not multiply the loss
    loss, _, grad = run("vespo", lp, q, adv, weights=[[0.5, 1.0]])
    assert loss == pytest.approx(-(log(0.4) + log(0.5)) / 2, abs=1e-12) and grad == approx([[-0.5, -0.5]])
    # token weights (0.5, 0.5): W = 0.5, phi = 0.25 e^1.5
    _, _, grad = run("vespo", lp, q, adv, weights=[[0.5, 0.5]])
    assert grad == approx([[-gamma(0.5, 2, 3) / 2] * 2], abs=1e-12)
    # a sequence-level weight 0.5 (the same on every token of the row) enters once: W = 1 again
    seq = C(loss_mode="vespo", rollout_is="sequence")
    _, _, grad = run(seq, lp, q, adv, weights=[[0.5, 0.5]])
    assert grad == approx([[-0.5, -0.5]], abs=1e-12)


# ---- dro, gpg ------------------------------------------------------------------------------------------------------
def test_dro_pulls_the_advantage_back_by_beta_times_the_log_ratio():
    # pi = (0.5, 0.3), prox = (0.4, 0.3): l = (log 1.25, 0); A = (1, -1); beta = 0.5; IS weights (2, 1)
    lp, q, adv, beta = [[log(0.5), log(0.3)]], [[log(0.4), log(0.3)]], [[1.0, -1.0]], 0.5
    ell = log(1.25)
    config = C(loss_mode="dro", dro_beta=beta)
    loss, met, grad = run(config, lp, q, adv, weights=[[2.0, 1.0]])
    assert loss == pytest.approx((-2 * (log(0.5) - beta / 2 * ell**2) + log(0.3)) / 2, abs=1e-12)
    # d/d log pi = -(A - beta l) w / N
    assert grad == approx([[-(1 - beta * ell) * 2 / 2, 0.5]], abs=1e-12)
    assert met["actor/ppo_kl"] == pytest.approx(-ell / 2, abs=1e-12)
    # bypass (mu = prox): the same penalty against mu, no IS factor
    by = C(loss_mode="dro", dro_beta=beta, bypass_mode=True)
    assert run(by, lp, q, adv)[2] == approx([[-(1 - beta * ell) / 2, 0.5]], abs=1e-12)


def test_gpg_is_reinforce_with_the_is_weights_and_bypass_reinforce_in_bypass():
    lp, q, adv = [[log(0.5), log(0.2)]], [[log(0.4), log(0.1)]], [[2.0, -1.0]]
    loss, _, grad = run("gpg", lp, q, adv, weights=[[0.5, 1.5]])
    assert loss == pytest.approx((-2 * 0.5 * log(0.5) + 1.5 * log(0.2)) / 2, abs=1e-12)
    assert grad == approx([[-0.5, 0.75]], abs=1e-12)  # -A w / N; pi_prox plays no part
    by_gpg = run("gpg", lp, q, adv, bypass=True)
    by_pg = run(C(bypass_mode=True, loss_type="reinforce"), lp, q, adv)
    assert by_gpg[0] == pytest.approx(by_pg[0], abs=1e-15) and by_gpg[2] == pytest.approx(by_pg[2], abs=1e-15)


# ---- ipo -----------------------------------------------------------------------------------------------------------
def test_ipo_masks_a_large_move_in_either_direction_whatever_the_advantage():
    # token 0: p - q = 0.5 - 0.2 = 0.3 > 0.2, outside; token 1: 0.3 - 0.25 = 0.05, inside, r = 1.2;
    # token 2: 0.1 - 0.4 = -0.3 < -0.2, outside although A > 0 (DPPO-TV keeps it: it moved against A)
    lp, q = [[log(0.5), log(0.3), log(0.1)]], [[log(0.2), log(0.25), log(0.4)]]
    adv = [[1.0, 1.0, 1.0]]
    loss, met, grad = run("ipo", lp, q, adv)
    assert loss == pytest.approx(-1.2 / 3, abs=1e-12)
    assert grad == approx([[0.0, -1.2 / 3, 0.0]], abs=1e-12)  # -A r / N inside, through r
    assert met["actor/pg_clipfrac"] == pytest.approx(2 / 3) and met["actor/pg_clipfrac_lower"] == pytest.approx(1 / 3)
    assert run("dppo_tv", lp, q, adv)[2][2] != 0.0


# ---- the penalty against mu (§7.9) ---------------------------------------------------------------------------------
def test_the_penalty_is_tau_times_the_squared_log_ratio_to_mu_in_every_mode():
    # A = 0: the objective adds nothing, so the loss is tau <l^2>_m and its gradient 2 tau l / N, l = log pi - log mu.
    lp = [[log(0.5), log(0.2), log(0.7)]]
    mu = [[log(0.4), log(0.25), log(0.7)]]
    old = [[log(0.45), log(0.1), log(0.6)]]  # pi_old differs from mu: the penalty must use mu
    adv, tau = [[0.0, 0.0, 0.0]], 0.01
    ell = [log(0.5 / 0.4), log(0.2 / 0.25), 0.0]
    want = tau * sum(x * x for x in ell) / 3
    want_grad = [[2 * tau * x / 3 for x in ell]]
    configs = [
        C(rollout_sq_log_ratio_coef=tau, loss_mode="cispo"),  # decoupled
        C(rollout_sq_log_ratio_coef=tau, bypass_mode=True, loss_mode="dppo_tv"),  # bypass PPO-clip family
        C(rollout_sq_log_ratio_coef=tau, bypass_mode=True, loss_type="reinforce"),  # bypass REINFORCE
    ]
    for config in configs:
        prox = mu if config.bypass_mode else old
        loss, met, grad = run(config, lp, prox, adv, rollout=mu)
        assert loss == pytest.approx(want, abs=1e-15) and grad == approx(want_grad, abs=1e-15), config
        assert met["actor/rollout_sq_log_ratio"] == pytest.approx(want / tau, abs=1e-15)
        assert met["actor/pg_loss"] == pytest.approx(want, abs=1e-15)  # the loss returned, penalty included
    # off by default: no term, no metric
    assert "actor/rollout_sq_log_ratio" not in run("vanilla", lp, old, adv, rollout=mu)[1]


def test_the_penalty_keeps_a_rejected_token_and_uses_the_loss_denominators():
    # keep mask drops token 1; the penalty still counts it (mask m, as the KL penalty), seq-mean-token-sum over V = 1
    lp, mu, tau = [[log(0.5), log(0.2)]], [[log(0.4), log(0.25)]], 0.5
    config = C(rollout_sq_log_ratio_coef=tau)
    lp_t = torch.tensor(lp, dtype=F64, requires_grad=True)
    mu_t = torch.tensor(mu, dtype=F64)
    zero = torch.zeros_like(mu_t)
    keep = torch.tensor([[1.0, 0.0]], dtype=F64)
    loss, met = rc.compute_policy_loss_vanilla(
        mu_t,
        lp_t,
        zero,
        torch.ones_like(mu_t),
        "seq-mean-token-sum",
        keep_mask=keep,
        rollout_log_prob=mu_t,
        config=config,
    )
    loss.backward()
    ell = [log(0.5 / 0.4), log(0.2 / 0.25)]
    assert float(loss.detach()) == pytest.approx(tau * (ell[0] ** 2 + ell[1] ** 2), abs=1e-15)
    assert lp_t.grad.flatten().tolist() == approx([[2 * tau * ell[0], 2 * tau * ell[1]]], abs=1e-15)


def test_the_penalty_coefficient_is_checked_and_needs_log_mu():
    for bad, needle in ((-1e-3, "rollout_sq_log_ratio_coef=-0.001 must be >= 0"), (math.nan, "=nan")):
        with pytest.raises(ValueError, match=needle):
            C(rollout_sq_log_ratio_coef=bad)
    lp = torch.tensor([[-1.0]], dtype=F64)
    with pytest.raises(ValueError, match="rollout_sq_log_ratio_coef=0.001 needs rollout_log_prob"):
        rc.compute_policy_loss_vanilla(lp, lp, lp, torch.ones_like(lp), config=C(rollout_sq_log_ratio_coef=1e-3))


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"vespo_k_pos": -1.0}, "vespo_k_pos=-1.0 must be >= 0"),
        ({"vespo_lambda_neg": 0.0}, "vespo_lambda_neg=0.0 must be > 0"),
        ({"dro_beta": 0.0}, "dro_beta=0.0 must be > 0"),
        ({"dro_beta": math.inf}, "dro_beta=inf must be a finite number"),
    ],
)
def test_the_new_settings_are_refused_outside_their_range(fields, needle):
    with pytest.raises(ValueError, match=needle):
        C(**fields)


def test_the_settings_reach_the_config_from_the_command_line_fields():
    args = rc_config.CorrectionArgs(loss_mode="vespo", vespo_k_pos=1.0, dro_beta=0.3, rollout_sq_log_ratio_coef=1e-3)
    config = rc_config.build_correction_config(args)
    assert (config.loss_mode, config.vespo_k_pos, config.dro_beta, config.rollout_sq_log_ratio_coef) == (
        "vespo",
        1.0,
        0.3,
        1e-3,
    )


# ---- prime-rl's losses as recipes ----------------------------------------------------------------------------------
def prime_rl_loss(lp, mu, adv, keep, tau):
    """prime-rl's per-token rl loss (loss.py:109-195), written from its formula: (1/N) sum_t [-1[keep_t] A_t r_t +
    tau (log r_t)^2], r = pi_theta / mu carrying the gradient; returns (value, gradient w.r.t. log pi)."""
    n = len(lp)
    r = [math.exp(a - b) for a, b in zip(lp, mu)]
    value = sum(-k * a * x + tau * (p - m) ** 2 for k, a, x, p, m in zip(keep, adv, r, lp, mu)) / n
    grad = [(-k * a * x + 2 * tau * (p - m)) / n for k, a, x, p, m in zip(keep, adv, r, lp, mu)]
    return value, grad


# p - q per token: +0.3 (A > 0: DPPO masks it), +0.05, -0.3 (A < 0: DPPO masks it), -0.3 (A > 0), +0.05
P = [0.5, 0.3, 0.1, 0.1, 0.35]
Q = [0.2, 0.25, 0.4, 0.4, 0.3]
ADV = [1.0, -1.0, -1.0, 1.0, 2.0]


def test_prime_rls_default_loss_is_dppo_tv_in_bypass_with_the_penalty_same_gradient():
    lp, mu = [log(p) for p in P], [log(q) for q in Q]
    dppo_keep = [0, 1, 0, 1, 1]  # masked: p - q > 0.2 with A > 0, p - q < -0.2 with A < 0
    want_value, want_grad = prime_rl_loss(lp, mu, ADV, dppo_keep, 1e-3)
    config = C(bypass_mode=True, loss_mode="dppo_tv", rollout_sq_log_ratio_coef=1e-3)
    loss, met, grad = run(config, [lp], [mu], [ADV], clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=1e9)
    assert grad == approx([want_grad], abs=1e-15)
    assert met["actor/pg_clipfrac"] == pytest.approx(2 / 5)  # prime-rl's is_masked
    # the value is not prime-rl's: dppo_tv's -A sg(r) log pi in place of -A r (the same gradient)
    assert abs(loss - want_value) > 1e-3


def test_prime_rls_ipo_loss_is_ipo_in_bypass_with_the_penalty_value_and_gradient():
    lp, mu = [log(p) for p in P], [log(q) for q in Q]
    ipo_keep = [1 if abs(p - q) <= 0.1 else 0 for p, q in zip(P, Q)]  # prime-rl's ipo_threshold 0.1
    want_value, want_grad = prime_rl_loss(lp, mu, ADV, ipo_keep, 1e-3)
    config = C(bypass_mode=True, loss_mode="ipo", rollout_sq_log_ratio_coef=1e-3)
    loss, _, grad = run(config, [lp], [mu], [ADV], clip_ratio_low=0.1, clip_ratio_high=0.1)
    assert loss == pytest.approx(want_value, abs=1e-15) and grad == approx([want_grad], abs=1e-15)


def test_the_recipes_on_the_running_page_build_these_configs(monkeypatch):
    """docs/running.md's prime-rl recipes parse into the corrections the two tests above check."""
    import rc_train

    with open(os.path.join(ROOT, "docs", "running.md"), encoding="utf-8") as f:
        lines = [line.strip().strip("`") for line in f if "--rc.rollout-sq-log-ratio-coef" in line]
    commands = [line for line in lines if line.startswith("python rc_train.py ")]
    built = {}
    for command in commands:
        monkeypatch.setattr(sys, "argv", ["rc_train.py", *shlex.split(command)[2:]])
        args = rc_config.parse_cli(rc_train.Args, rc_train.load_yaml_defaults)
        config = rc_config.build_correction_config(args.rc)
        assert config.bypass_mode and config.rollout_sq_log_ratio_coef == 1e-3 and args.loss_agg_mode == "token-mean"
        built[config.loss_mode] = (args.clip_ratio_low or args.clip_ratio, args.clip_ratio_high or args.clip_ratio)
    assert built == {"dppo_tv": (0.2, 0.2), "ipo": (0.1, 0.1)}


def test_gpg_advantage_by_hand():
    """GPG's estimator (verl compute_gpg_outcome_advantage): alpha (R - group mean), alpha = B / #(R != 0), no std;
    a group of one keeps its raw score, an all-equal group gets 0, the response mask spreads it over tokens."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.5], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1, 2, 3])  # group 2 and 3: one row each
    alpha = 6 / 4  # four non-zero rewards
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 1.0, 0.5], dtype=torch.float64) * alpha
    assert torch.allclose(rc.compute_advantage("gpg", rewards, groups), expected, rtol=0, atol=1e-15)
    flat = rc.compute_advantage("gpg", torch.tensor([1.0, 1.0, 0.0, 0.0]), [0, 0, 1, 1])
    assert flat.tolist() == [0.0, 0.0, 0.0, 0.0]
    mask = torch.tensor([[1.0, 1.0, 0.0]] * 6, dtype=torch.float64)
    spread = rc.compute_advantage("gpg", rewards, groups, response_mask=mask, norm_adv_by_std=True)
    assert torch.allclose(spread, expected[:, None] * mask, rtol=0, atol=1e-15)
