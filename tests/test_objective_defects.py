"""Objective defects an independent differential against verl 0.9.1 and TRL 1.16 found (issue 48, item 6).

1. `dppo_kl` rebuilt log q from exp(log pi_prox): a float32 log-prob below about -103 underflowed q to 0, the binary KL
   became 0 * -inf = NaN, the trust-region test failed and the token was dropped, where verl keeps it.
2. The M2PO mask kept no token when every squared log-ratio exceeded tau_M2; AReaL's rule keeps the smallest.
3. `cispo` clamped the IS weight from below as verl does; MiniMax-M1 and TRL cap it from above only, and
   clip_ratio_low >= 1 is refused, so the paper's form could not be expressed. `cispo` is now the paper's form and
   `cispo_verl` verl's.

Every expected number is computed here by hand from the formula (docs/corrections.md §4.7, §7.7), never by rc_core.
"""

import math

import pytest
import torch

import rc_core as rc

C = rc.RolloutCorrectionConfig


def _loss(log_prob, prox, adv, mode, dtype, **kwargs):
    """Decoupled loss of one response (token-mean, clip 0.2 / 0.2, C = 3): (loss, metrics, d loss / d log pi)."""
    lp = torch.tensor([log_prob], dtype=dtype, requires_grad=True)
    old = torch.tensor([prox], dtype=dtype)
    a = torch.tensor([adv], dtype=dtype)
    loss, met = rc.compute_policy_loss_vanilla(old, lp, a, torch.ones_like(old), config=C(loss_mode=mode), **kwargs)
    loss.backward()
    return loss.detach(), met, lp.grad[0].tolist()


# ---- 1. dppo_kl with an underflowing pi_prox ------------------------------------------------------------------------


def _binary_kl_float64(log_q: float, log_p: float) -> float:
    """KL(Bern(q) || Bern(p)) with verl's 1e-8 guard on 1 - q and 1 - p, in float64 from the log-probs."""
    q = math.exp(log_q)
    return q * (log_q - log_p) + (1 - q) * math.log((-math.expm1(log_q) + 1e-8) / (-math.expm1(log_p) + 1e-8))


def test_dppo_kl_keeps_a_token_whose_prox_probability_underflows_in_float32():
    # token 1: log q = -110 (exp underflows to 0 in float32), p = 0.05, A = 1: a move up, KL ~ -log 0.95 = 0.051 <= 0.2
    # -> inside; r = exp(clip_S(l)) = e^20, truncated at C = 3: phi_1 = -3 log 0.05.
    # token 2: q = 0.25, p = 0.3, A = 1: KL = 0.0063 <= 0.2 -> inside; r = 1.2: phi_2 = -1.2 log 0.3. Token-mean of 2.
    lp, prox = [math.log(0.05), math.log(0.3)], [-110.0, math.log(0.25)]
    assert _binary_kl_float64(prox[0], lp[0]) == pytest.approx(-math.log(0.95), rel=1e-6)
    assert _binary_kl_float64(prox[0], lp[0]) <= 0.2 and _binary_kl_float64(prox[1], lp[1]) <= 0.2
    expected = (-3.0 * math.log(0.05) - 1.2 * math.log(0.3)) / 2
    assert math.exp(torch.tensor(prox[0], dtype=torch.float32).item()) > 0  # float64 holds q, float32 does not:
    assert torch.exp(torch.tensor(prox[0], dtype=torch.float32)).item() == 0.0

    loss32, met32, grad32 = _loss(lp, prox, [1.0, 1.0], "dppo_kl", torch.float32)
    loss64, met64, grad64 = _loss(lp, prox, [1.0, 1.0], "dppo_kl", torch.float64)
    assert math.isfinite(loss32.item())
    assert met32["actor/pg_clipfrac"] == 0.0  # the token is kept (before: 0.5, the underflowing token dropped)
    assert loss32.item() == pytest.approx(expected, rel=1e-6)
    assert loss64.item() == pytest.approx(expected, rel=1e-12) and met64["actor/pg_clipfrac"] == 0.0
    assert grad32 == pytest.approx([-3.0 / 2, -1.2 / 2], rel=1e-6) and grad64 == pytest.approx(grad32, rel=1e-6)


@pytest.mark.parametrize(
    "log_q, log_p",
    [
        (-110.0, math.log(0.05)),  # q underflows in float32
        (math.log(0.5), -1e-6),  # p within 1e-6 of 1: 1 - exp(log p) loses 6% in float32, -expm1(log p) does not
        (math.log(0.2), math.log(0.5)),
    ],
)
def test_binary_kl_from_log_probs_in_float32_equals_the_float64_formula(log_q, log_p):
    d = rc.binary_kl(torch.tensor(log_q, dtype=torch.float32), torch.tensor(log_p, dtype=torch.float32))
    assert math.isfinite(d.item())
    assert d.item() == pytest.approx(_binary_kl_float64(log_q, log_p), rel=1e-5, abs=1e-7)


# ---- 2. M2PO keeps at least the smallest second moment --------------------------------------------------------------


def test_m2_mask_keeps_the_smallest_token_when_every_token_is_above_tau():
    # squares (0.25, 0.09, 0.16 | 0.36): every one > tau = 0.01, so no prefix of the sorted squares has mean <= tau;
    # AReaL drops the largest until the mean fits or one token is left: the 0.09 one (-0.3) stays, alone.
    ell = torch.tensor([[0.5, -0.3, 0.4], [0.6, 7.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    keep, met = rc.compute_m2_mask(ell, mask, 0.01)
    assert keep.tolist() == [[False, True, False], [False, False, False]]
    assert float(met["rollout_m2"]) == pytest.approx((0.25 + 0.09 + 0.16 + 0.36) / 4)
    assert float(met["rollout_m2_after"]) == pytest.approx(0.09)
    assert float(met["rollout_m2_masked_fraction"]) == pytest.approx(3 / 4)


def test_m2_mask_with_tied_smallest_squares_keeps_exactly_one_of_them():
    ell = torch.tensor([[0.3, -0.3, 0.5]], dtype=torch.float64)
    keep, _ = rc.compute_m2_mask(ell, torch.ones((1, 3), dtype=torch.bool), 0.01)
    assert int(keep.sum()) == 1 and not keep[0, 2]


def test_m2po_preset_leaves_a_token_to_learn_from_when_the_whole_batch_is_off_policy():
    # Through the entry point and the loss: the kept token carries the gradient, the others none.
    mu = torch.zeros((1, 3), dtype=torch.float64)
    old = torch.tensor([[0.5, -0.3, 0.4]], dtype=torch.float64)
    mask = torch.ones((1, 3), dtype=torch.float64)
    _, keep, met = rc.compute_rollout_correction_and_rejection_mask(old, mu, mask, C.decoupled_m2po())
    assert keep.tolist() == [[0.0, 1.0, 0.0]]
    assert met["rollout_corr/rollout_m2_masked_fraction"] == pytest.approx(2 / 3)
    lp = old.clone().requires_grad_()
    loss, _ = rc.compute_policy_loss_vanilla(old, lp, torch.ones_like(old), mask, keep_mask=keep)
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([0.0, -1 / 3, 0.0])  # r = 1, A = 1, token-mean over m (3 tokens)


def test_m2_mask_of_an_empty_mask_keeps_nothing_and_does_not_raise():
    keep, _ = rc.compute_m2_mask(torch.zeros((1, 2)), torch.zeros((1, 2), dtype=torch.bool), 0.04)
    assert not keep.any()


# ---- 3. cispo: MiniMax-M1's / TRL's upper cap; cispo_verl: verl's two-sided clamp -----------------------------------


def test_cispo_caps_the_weight_from_above_only_and_cispo_verl_clamps_both_sides():
    # l = (-0.5, 0.5, 0.1), A = (1, 2, -1), log pi = (-2, -1, -1.5), eps = 0.2 / 0.2, token-mean over 3.
    # cispo (MiniMax-M1 §3.1, TRL): w = min(r, 1.2) = (e^-0.5, 1.2, e^0.1)          -- no floor at 0.8
    # cispo_verl (verl):             w = clip(r, 0.8, 1.2) = (0.8, 1.2, e^0.1)
    # phi = -sg(w) A log pi; grad_t = -w_t A_t / 3.
    lp, prox, adv = [-2.0, -1.0, -1.5], [-1.5, -1.5, -1.6], [1.0, 2.0, -1.0]
    for mode, w, clipfrac in (
        ("cispo", [math.exp(-0.5), 1.2, math.exp(0.1)], 1 / 3),
        ("cispo_verl", [0.8, 1.2, math.exp(0.1)], 2 / 3),
    ):
        loss, met, grad = _loss(lp, prox, adv, mode, torch.float64)
        expected = sum(-wt * at * lt for wt, at, lt in zip(w, adv, lp)) / 3
        assert loss.item() == pytest.approx(expected, rel=1e-12), mode
        assert grad == pytest.approx([-wt * at / 3 for wt, at in zip(w, adv)], rel=1e-12), mode
        assert met["actor/pg_clipfrac"] == pytest.approx(clipfrac), mode


def test_cispo_ignores_clip_ratio_low_and_cispo_verl_uses_it():
    lp, prox, adv = [-2.0], [-1.0], [1.0]  # r = e^-1 = 0.37
    for low in (0.0, 0.5, 0.9):
        assert _loss(lp, prox, adv, "cispo", torch.float64, clip_ratio_low=low)[2] == pytest.approx([-math.exp(-1)])
        floor = max(math.exp(-1), 1 - low)
        assert _loss(lp, prox, adv, "cispo_verl", torch.float64, clip_ratio_low=low)[2] == pytest.approx([-floor])


def test_cispo_verl_is_a_registered_objective():
    assert rc.POLICY_LOSSES["cispo_verl"] is rc.policy_loss_cispo_verl
    assert C(loss_mode="cispo_verl").loss_mode == "cispo_verl"
