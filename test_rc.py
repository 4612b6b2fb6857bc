"""Tests of rc_core against the project spec ``docs/corrections.md``.

Expected values are derived by hand from the formulas of the spec (with ``math``), never copied
from the code's output.  Section numbers ("§N") refer to the spec.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rc_core as rc

F64 = torch.float64
NAN = math.nan
PROPS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------


def make(rows, garbage=NAN):
    """Build (train, rollout, mask) from ragged rows of token ratios rho = pi_train / mu.

    rollout log-prob = 0, train log-prob = log(rho), so l = log(rho) exactly.  Padded positions
    (beyond a row's length; ``[]`` = fully padded row) hold ``garbage`` in both tensors.
    """
    return logs([[math.log(ratio) for ratio in row] for row in rows], garbage)


def logs(rows, garbage=NAN):
    """(train, rollout, mask) with l given exactly (train = l, rollout = 0)."""
    width = max(len(r) for r in rows)
    train = torch.full((len(rows), width), garbage, dtype=F64)
    rollout = torch.full((len(rows), width), garbage, dtype=F64)
    mask = torch.zeros((len(rows), width), dtype=F64)
    for i, row in enumerate(rows):
        for t, v in enumerate(row):
            train[i, t], rollout[i, t], mask[i, t] = v, 0.0, 1.0
    return train, rollout, mask


def corr(train, rollout, mask, **kw):
    w, m2, met = rc.compute_rollout_correction_and_rejection_mask(
        train, rollout, mask, rc.RolloutCorrectionConfig(**kw)
    )
    assert all(k.startswith("rollout_corr/") for k in met)
    return w, m2, {k[len("rollout_corr/") :]: v for k, v in met.items()}


def approx(x, rel=1e-9, abs_=1e-12):
    return pytest.approx(x, rel=rel, abs=abs_)


def std_pop(xs):
    mean = sum(xs) / len(xs)
    return math.sqrt(max(sum(x * x for x in xs) / len(xs) - mean * mean, 0.0))


def std_unbiased(xs):
    if len(xs) < 2:
        return 0.0
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))


def quantile(xs, q):
    xs = sorted(xs)
    h = q * (len(xs) - 1)
    lo, hi = math.floor(h), math.ceil(h)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


@st.composite
def batches(draw, min_rows=1, max_rows=5, max_len=6, scale=None):
    """Random (train, rollout, mask) in float64 with >= 1 valid token and NaN padding."""
    b = draw(st.integers(min_rows, max_rows))
    t = draw(st.integers(1, max_len))
    seed = draw(st.integers(0, 2**31 - 1))
    sc = draw(st.sampled_from([0.05, 0.3, 1.0])) if scale is None else scale
    gen = torch.Generator().manual_seed(seed)
    rollout = -torch.rand((b, t), generator=gen, dtype=F64) * 3
    train = rollout + torch.randn((b, t), generator=gen, dtype=F64) * sc
    lengths = torch.randint(0, t + 1, (b,), generator=gen)
    lengths[torch.randint(0, b, (1,), generator=gen)] = torch.randint(1, t + 1, (1,), generator=gen)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(F64)
    train = torch.where(mask.bool(), train, torch.full_like(train, NAN))
    rollout = torch.where(mask.bool(), rollout, torch.full_like(rollout, NAN))
    return train, rollout, mask


def same_metrics(a, b, rel=1e-7, abs_=1e-7):
    """Equal metric dicts; the tolerance only absorbs reduction-order rounding (e.g. the
    sqrt of a cancelled variance), far below the O(1/B) effect of a leaked padded row."""
    assert set(a) == set(b)
    for key in a:
        if math.isnan(a[key]):
            assert math.isnan(b[key]), key
        else:
            assert b[key] == pytest.approx(a[key], rel=rel, abs=abs_), key


# ------------------------------------------------------------------------------------------
# primitives
# ------------------------------------------------------------------------------------------


def test_masked_reductions_select_valid_entries_and_ignore_nan_padding():
    x = torch.tensor([[1.0, 2.0, NAN], [4.0, math.inf, 6.0]], dtype=F64)
    m = torch.tensor([[1, 1, 0], [1, 0, 1]], dtype=F64)
    assert rc.masked_sum(x, m).item() == 13.0
    assert rc.masked_mean(x, m).item() == 3.25
    assert rc.masked_sum(x, m, dim=-1).tolist() == [3.0, 10.0]
    assert rc.masked_mean(x, m, dim=-1).tolist() == [1.5, 5.0]
    # deviations from 3.25: -2.25, -1.25, 0.75, 2.75 -> sum of squares 14.75
    assert rc.masked_var(x, m).item() == approx(14.75 / 3)
    assert rc.masked_var(x, m, unbiased=False).item() == approx(14.75 / 4)
    one = torch.tensor([[1, 0, 0], [0, 0, 0]], dtype=F64)
    assert rc.masked_var(x, one).item() == 0.0


def test_safety_clip_bounds_at_twenty():
    x = torch.tensor([-25.0, -20.0, 3.0, 25.0])
    assert rc.safety_clip(x).tolist() == [-20.0, -20.0, 3.0, 20.0]
    assert rc.SAFETY_BOUND == 20.0


def test_sequence_log_ratio():
    train, rollout, mask = make([[2.0, 8.0], [4.0], []])
    ell = rc.token_log_ratio(train, rollout)
    seq = rc.sequence_log_ratio(ell, mask)
    assert seq.tolist() == [approx(math.log(16.0)), approx(math.log(4.0)), 0.0]


def test_bypass_loss_without_correction_metrics_is_the_same_loss():
    gen = torch.Generator().manual_seed(4)
    rollout = -torch.rand(6, 9, generator=gen, dtype=F64) * 3
    log_prob = (rollout + 0.1 * torch.randn(6, 9, generator=gen, dtype=F64)).requires_grad_()
    adv, mask = torch.randn(6, 9, generator=gen, dtype=F64), (torch.rand(6, 9, generator=gen) > 0.2).double()
    config = rc.RolloutCorrectionConfig.bypass_ppo_clip_geo_rs()
    full, with_metrics = rc.compute_policy_loss_bypass_mode(log_prob, rollout, adv, mask, config)
    bare, without = rc.compute_policy_loss_bypass_mode(
        log_prob, rollout, adv, mask, config, with_correction_metrics=False
    )
    assert bare.item() == full.item()
    assert any(k.startswith("rollout_corr/") for k in with_metrics)
    assert not any(k.startswith("rollout_corr/") for k in without) and set(without) < set(with_metrics)


# ------------------------------------------------------------------------------------------
# IS weights (§3) and IS metrics (§6.1)
# ------------------------------------------------------------------------------------------


def test_token_tis_weights_and_metrics_by_hand():
    train, rollout, mask = make([[0.5, 3.0, 1.5], [1.2, 0.4]])
    w, m2, met = corr(train, rollout, mask, rollout_is="token", rollout_is_threshold=2.0)
    assert w.tolist() == [approx(v) for v in [[0.5, 2.0, 1.5], [1.2, 0.4, 0.0]]]
    assert torch.equal(m2, mask)
    applied = [0.5, 2.0, 1.5, 1.2, 0.4]
    mean = sum(applied) / 5  # 1.12
    assert met["rollout_is_mean"] == approx(mean)
    assert met["rollout_is_std"] == approx(std_pop(applied))
    second = sum(v * v for v in applied) / 5
    assert met["rollout_is_eff_sample_size"] == approx((mean + 1e-8) ** 2 / second)
    assert met["rollout_is_max"] == approx(2.0)
    assert met["rollout_is_min"] == approx(0.4)
    assert met["rollout_is_ratio_fraction_high"] == approx(1 / 5)  # raw 3.0 > 2
    assert met["rollout_is_ratio_fraction_low"] == approx(1 / 5)  # raw 0.4 < 1/2
    row_means = [4.0 / 3.0, 0.8]
    assert met["rollout_is_seq_mean"] == approx(sum(row_means) / 2)
    assert met["rollout_is_seq_std"] == approx(std_unbiased(row_means))
    assert met["rollout_is_seq_max"] == approx(4.0 / 3.0)
    assert met["rollout_is_seq_min"] == approx(0.8)
    assert met["rollout_is_seq_max_deviation"] == approx(1.0 / 3.0)
    assert met["rollout_is_seq_fraction_high"] == 0.0  # raw row means 5/3 and 0.8
    assert met["rollout_is_seq_fraction_low"] == 0.0
    raw = [0.5, 3.0, 1.5, 1.2, 0.4]
    for name, q in [("p25", 0.25), ("p50", 0.5), ("p75", 0.75), ("p95", 0.95), ("p99", 0.99)]:
        assert met[f"rollout_is_{name}"] == approx(quantile(raw, q))
    assert met["rollout_is_p95"] == approx(1.5 + 0.8 * 1.5)  # h = 3.8


def test_sequence_tis_weights_and_metrics_by_hand():
    train, rollout, mask = make([[2.0, 1.5], [0.5, 0.8, 1.0], []])
    w, _, met = corr(train, rollout, mask, rollout_is="sequence", rollout_is_threshold=2.0)
    # row 0: product 3 -> capped at 2; row 1: product 0.4 kept; padded row: 0
    assert w.tolist() == [approx(v) for v in [[2.0, 2.0, 0.0], [0.4, 0.4, 0.4], [0, 0, 0]]]
    applied = [2.0, 2.0, 0.4, 0.4, 0.4]
    assert met["rollout_is_mean"] == approx(sum(applied) / 5)
    assert met["rollout_is_std"] == approx(std_pop(applied))
    assert met["rollout_is_max"] == approx(3.0)  # exp of the max unclipped log-sum
    assert met["rollout_is_min"] == approx(0.4)
    assert met["rollout_is_ratio_fraction_high"] == approx(0.5)  # over valid rows only
    assert met["rollout_is_ratio_fraction_low"] == approx(0.5)  # 0.4 < 1/2
    assert met["rollout_is_seq_mean"] == approx((2.0 + 0.4) / 2)
    assert met["rollout_is_seq_std"] == approx(std_unbiased([2.0, 0.4]))
    assert met["rollout_is_seq_max_deviation"] == approx(1.0)
    assert met["rollout_is_seq_fraction_high"] == approx(0.5)  # raw row mean 3 > 2
    assert met["rollout_is_seq_fraction_low"] == approx(0.5)
    assert met["rollout_is_p50"] == approx(0.4)
    assert met["rollout_is_p75"] == approx(3.0)
    assert "rollout_is_oob_ratio" not in met


def test_icepop_token_is_inclusive_and_keeps_mask():
    train, rollout, mask = make([[0.4, 0.5, 4.0, 6.0, 1.0]])
    w, m2, met = corr(train, rollout, mask, rollout_is="token", rollout_is_threshold="0.5_4.0")
    assert w.tolist() == [approx(v) for v in [[0.0, 0.5, 4.0, 0.0, 1.0]]]
    assert torch.equal(m2, mask)  # IcePop never changes the mask
    assert met["rollout_is_oob_ratio"] == approx(2 / 5)
    assert met["rollout_is_ratio_fraction_low"] == approx(1 / 5)  # L' = L for IcePop
    assert met["rollout_is_ratio_fraction_high"] == approx(1 / 5)
    assert met["rollout_is_mean"] == approx(5.5 / 5)  # zeroed tokens still count


def test_icepop_sequence_zeroes_whole_rows():
    train, rollout, mask = make([[2.0, 2.0], [1.5, 1.0], [0.5, 0.5]])
    w, m2, met = corr(train, rollout, mask, rollout_is="sequence", rollout_is_threshold="0.5_2.0")
    # products 4 (out), 1.5 (in), 0.25 (out)
    assert w.tolist() == [approx(v) for v in [[0, 0], [1.5, 1.5], [0, 0]]]
    assert torch.equal(m2, mask)
    assert met["rollout_is_oob_ratio"] == approx(4 / 6)


def test_safety_bound_placement_token_vs_sequence():
    # token level clips each l; sequence level clips the sum of unclipped terms
    train, rollout, mask = logs([[15.0, 15.0], [-15.0, -15.0], [30.0, 0.0]])
    w, _, met = corr(train, rollout, mask, rollout_is="sequence", rollout_is_threshold=1e10)
    assert w[0, 0].item() == approx(math.exp(20.0))
    assert w[1, 0].item() == approx(math.exp(-20.0))
    assert met["rollout_is_max"] == approx(math.exp(20.0))
    assert met["rollout_is_min"] == approx(math.exp(-30.0))  # not clipped
    w, _, met = corr(train, rollout, mask, rollout_is="token", rollout_is_threshold=1e10)
    assert w[2, 0].item() == approx(math.exp(20.0))
    assert w[0, 0].item() == approx(math.exp(15.0))
    # RS clips each token before summing: seq_sum_k1 sees -(20 + 0) for row 2
    _, _, met = corr(*logs([[25.0, -10.0]]), rollout_rs="seq_sum_k2", rollout_rs_threshold=1e9)
    assert met["rollout_rs_seq_sum_k2_seq_max"] == approx(0.5 * 400 + 0.5 * 100)


def test_batch_normalization_token_and_sequence():
    train, rollout, mask = make([[0.5, 3.0, 1.5], [1.2, 0.4]])
    w, _, met = corr(
        train, rollout, mask, rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True
    )
    z = 5.6 / 5
    assert met["rollout_is_batch_norm_factor"] == approx(z)
    assert met["rollout_is_mean"] == approx(z)  # metrics describe un-normalised weights
    assert w[0].tolist() == [approx(v / z) for v in [0.5, 2.0, 1.5]]
    w, _, _ = corr(
        *make([[0.2, 0.2, 3.0]]), rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True
    )
    assert w[0].tolist() == [approx(v) for v in [0.25, 0.25, 2.5]]  # Z = 0.8; 2.5 > U intended
    train, rollout, mask = make([[2.0, 1.5], [0.5, 0.8, 1.0], []])
    w, _, met = corr(
        train, rollout, mask, rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_batch_normalize=True
    )
    z = (2.0 + 0.4) / 2  # valid rows only, one value per sequence
    assert met["rollout_is_batch_norm_factor"] == approx(z)
    assert w[0, 0].item() == approx(2.0 / z)
    assert w[1, 2].item() == approx(0.4 / z)
    assert w[2].abs().sum().item() == 0.0


def test_all_weights_zeroed_gives_zero_ess_and_unit_factor():
    train, rollout, mask = make([[1.0, 1.1], [0.9, 1.0]])
    w, _, met = corr(
        train, rollout, mask, rollout_is="token", rollout_is_threshold="3_5", rollout_is_batch_normalize=True
    )
    assert w.abs().sum().item() == 0.0
    assert met["rollout_is_eff_sample_size"] == 0.0
    assert met["rollout_is_batch_norm_factor"] == 1.0


def test_is_weights_are_detached():
    train, rollout, mask = make([[0.5, 3.0], [1.2, 0.4]])
    train.requires_grad_()
    for level in ("token", "sequence"):
        w, _, _ = corr(train, rollout, mask, rollout_is=level)
        assert not w.requires_grad


def test_parse_is_threshold_forms():
    assert rc.parse_is_threshold(2) == rc.ISThreshold("tis", None, 2.0)
    assert rc.parse_is_threshold(" 3.5 ") == rc.ISThreshold("tis", None, 3.5)
    assert rc.parse_is_threshold(" 0.5 _ 5 ") == rc.ISThreshold("icepop", 0.5, 5.0)
    assert rc.parse_is_threshold("2_2") == rc.ISThreshold("icepop", 2.0, 2.0)
    assert rc.parse_is_threshold(4.0).diagnostic_lower == 0.25


# ------------------------------------------------------------------------------------------
# rejection sampling (§4) and RS metrics (§6.2)
# ------------------------------------------------------------------------------------------


def _k3(v):
    return math.exp(v) - 1.0 - v


RS_CASES = [
    # option, threshold, rows of log-ratios, expected per-row keep (token list or row bool)
    ("token_k1", "0.5_2.0", [[math.log(0.4), math.log(0.6), math.log(1.9), math.log(2.1)]], [[0, 1, 1, 0]]),
    ("token_k2", 0.5, [[0.9, -0.9, 1.1, -1.1]], [[1, 1, 0, 0]]),  # |l| <= sqrt(2 U) = 1
    ("token_k3", 0.1, [[0.4, -0.45, 0.45, -0.5]], [[int(_k3(v) <= 0.1) for v in (0.4, -0.45, 0.45, -0.5)]]),
    (
        "seq_sum_k1",
        "0.5_2.0",
        [[math.log(1.5)] * 2, [math.log(1.5), math.log(1.2)], [math.log(0.7)] * 2, [math.log(0.8), math.log(0.7)]],
        [0, 1, 0, 1],
    ),  # products 2.25 1.8 0.49 0.56
    ("seq_sum_k2", 0.5, [[0.6, 0.6], [0.8, 0.7]], [1, 0]),  # 0.36 / 0.565
    (
        "seq_sum_k3",
        0.1,
        [[0.2, 0.2], [0.4, 0.2]],  # 0.043 / 0.113
        [int(_k3(0.2) * 2 <= 0.1), int(_k3(0.4) + _k3(0.2) <= 0.1)],
    ),
    (
        "seq_mean_k1",
        "0.9_1.1",
        [[math.log(1.2), math.log(0.95)], [math.log(1.3), 0.0], [math.log(0.8), math.log(0.9)]],
        [1, 0, 0],
    ),  # geometric means 1.068 1.140 0.849
    ("seq_mean_k2", 0.1, [[0.4, 0.0], [0.6, 0.5]], [1, 0]),  # (0.08 + 0)/2, (0.18 + 0.125)/2
    (
        "seq_mean_k3",
        0.02,
        [[0.2, 0.1], [0.3, 0.2]],
        [int((_k3(0.2) + _k3(0.1)) / 2 <= 0.02), int((_k3(0.3) + _k3(0.2)) / 2 <= 0.02)],
    ),
    ("seq_max_k2", 0.125, [[0.4, -0.5], [0.1, -0.6]], [1, 0]),  # max 0.125 (inclusive) / 0.18
    ("seq_max_k3", 0.05, [[0.3, -0.2], [0.35, 0.0]], [int(max(_k3(0.3), _k3(-0.2)) <= 0.05), int(_k3(0.35) <= 0.05)]),
]


@pytest.mark.parametrize("option,threshold,rows,expected", RS_CASES, ids=[c[0] for c in RS_CASES])
def test_each_rs_option_keep_mask_by_hand(option, threshold, rows, expected):
    train, rollout, mask = logs(rows)
    w, m2, met = corr(train, rollout, mask, rollout_rs=option, rollout_rs_threshold=threshold)
    assert w is None
    if isinstance(expected[0], list):
        assert m2.tolist() == [[float(v) for v in row] for row in expected]
    else:
        want = [[float(keep)] * len(row) for keep, row in zip(expected, rows)]
        assert m2.tolist() == want
    assert 0 in (m2.flatten().tolist()) and 1 in m2.flatten().tolist()  # cases are mixed
    rejected = 1 - m2.sum().item() / mask.sum().item()
    assert met[f"rollout_rs_{option}_masked_fraction"] == approx(rejected)


@pytest.mark.parametrize("option", ["token_k1", "seq_sum_k1", "seq_mean_k1"])
def test_k1_bounds_apply_to_rho_in_ratio_space(option):
    # asymmetric spec: keep iff 0.8 <= rho <= 1.5 (project direction, §11 item 1)
    rows = [[0.79], [0.81], [1.49], [1.51]]
    _, m2, _ = corr(*make(rows), rollout_rs=option, rollout_rs_threshold="0.8_1.5")
    assert m2[:, 0].tolist() == [0.0, 1.0, 1.0, 0.0]
    # inclusive on exactly representable bounds
    _, m2, _ = corr(*make([[0.5], [2.0], [0.25]]), rollout_rs=option, rollout_rs_threshold="0.5_2.0")
    assert m2[:, 0].tolist() == [1.0, 1.0, 0.0]


def test_rs_metrics_token_k1_by_hand():
    train, rollout, mask = make([[0.4, 1.0, 2.5], [1.0, 0.8], []])
    _, m2, met = corr(train, rollout, mask, rollout_rs="token_k1", rollout_rs_threshold=2.0)
    assert m2.tolist() == [[0, 1, 0], [1, 1, 0], [0, 0, 0]]
    q = [-math.log(0.4), 0.0, -math.log(2.5), 0.0, -math.log(0.8)]
    p = "rollout_rs_token_k1_"
    assert met[p + "mean"] == approx(sum(q) / 5)
    assert met[p + "max"] == approx(-math.log(0.4))
    assert met[p + "min"] == approx(-math.log(2.5))
    assert met[p + "fraction_high"] == approx(1 / 5)  # rho 0.4 below L
    assert met[p + "fraction_low"] == approx(1 / 5)  # rho 2.5 above U
    # q clipped to [a, b] = [-log 2, log 2]: -log 0.4 -> log 2 and -log 2.5 -> -log 2
    assert met[p + "std"] == approx(std_pop([math.log(2), 0.0, -math.log(2), 0.0, -math.log(0.8)]))
    rows = [sum(q[:3]) / 3, sum(q[3:]) / 2]
    assert met[p + "seq_mean"] == approx(sum(rows) / 2)
    assert met[p + "seq_std"] == approx(std_unbiased(rows))
    assert met[p + "seq_max"] == approx(max(rows))
    assert met[p + "seq_min"] == approx(min(rows))
    assert met[p + "seq_max_deviation"] == approx(max(abs(r) for r in rows))
    assert met[p + "seq_fraction_high"] == 0.0
    assert met[p + "seq_fraction_low"] == 0.0
    assert met[p + "masked_fraction"] == approx(2 / 5)
    assert met[p + "seq_masked_fraction"] == approx(1 / 2)  # padded row excluded
    assert met["rollout_rs_masked_fraction"] == approx(2 / 5)
    assert met["rollout_rs_seq_masked_fraction"] == approx(1 / 2)


def test_rs_metrics_sequence_k2_by_hand():
    rows = [[0.2, -0.4], [0.6], []]
    _, m2, met = corr(*logs(rows), rollout_rs="seq_sum_k2", rollout_rs_threshold=0.15)
    big_q = [0.5 * (0.04 + 0.16), 0.5 * 0.36]  # 0.10 and 0.18
    assert m2.tolist() == [[1, 1], [0, 0], [0, 0]]
    p = "rollout_rs_seq_sum_k2_"
    assert met[p + "mean"] == approx((2 * big_q[0] + big_q[1]) / 3)  # length-weighted
    assert met[p + "max"] == approx(0.18)
    assert met[p + "min"] == approx(0.10)
    assert met[p + "fraction_high"] == approx(0.5)
    assert met[p + "fraction_low"] == 0.0
    assert met[p + "std"] == approx(std_pop([0.10, 0.10, 0.15]))  # clipped to [0, U]
    assert met[p + "seq_mean"] == approx(0.14)
    assert met[p + "seq_max_deviation"] == approx(0.18)
    assert met[p + "seq_fraction_high"] == approx(0.5)
    assert p + "seq_fraction_low" not in met
    assert met[p + "masked_fraction"] == approx(1 / 3)
    assert met[p + "seq_masked_fraction"] == approx(1 / 2)


def test_rs_broadcast_and_per_option_thresholds():
    rows = [[math.log(1.9), 0.0], [math.log(2.1), 0.0], [1.9, 0.0]]
    _, m2, _ = corr(*logs(rows), rollout_rs="token_k1,seq_max_k2", rollout_rs_threshold=2.0)
    # token_k1 [0.5, 2]: rejects token (1, 0) and (2, 0); seq_max_k2 U = 2: |l| <= 2 keeps all
    assert m2.tolist() == [[1, 1], [0, 1], [0, 1]]
    _, m2, _ = corr(*logs(rows), rollout_rs="token_k1, seq_max_k2", rollout_rs_threshold="3.0, 1.0")
    # token_k1 [1/3, 3] rejects only (2, 0) (rho = e^1.9); seq_max_k2 U = 1 rejects row 2
    # (0.5 * 1.9^2 = 1.805), and keeps row 1 (0.5 * log(2.1)^2 = 0.275)
    assert m2.tolist() == [[1, 1], [1, 1], [0, 0]]
    with pytest.raises(ValueError, match="k2/k3"):
        rc.RolloutCorrectionConfig(rollout_rs="token_k1,token_k2", rollout_rs_threshold="0.5_2")


def test_legacy_names_map_to_canonical_options():
    cases = [("token", "token_k1"), ("sequence", "seq_sum_k1"), ("geometric", "seq_mean_k1")]
    rows = [[1.3, 0.9], [0.7, 0.75], [1.1, 1.25], [1.0, 0.8]]
    for legacy, canonical in cases:
        _, m_legacy, met = corr(
            *make(rows), rollout_rs=legacy, rollout_rs_threshold=1.2, rollout_rs_threshold_lower=0.8
        )
        _, m_canon, met_c = corr(*make(rows), rollout_rs=canonical, rollout_rs_threshold="0.8_1.2")
        assert torch.equal(m_legacy, m_canon)
        same_metrics(met, met_c)
        assert f"rollout_rs_{canonical}_mean" in met
        assert "rollout_rs_mean" not in met and "rollout_rs_eff_sample_size" not in met
        _, m_default, _ = corr(*make(rows), rollout_rs=legacy, rollout_rs_threshold=1.2)
        _, m_recip, _ = corr(*make(rows), rollout_rs=canonical, rollout_rs_threshold=1.2)
        assert torch.equal(m_default, m_recip)  # default lower = 1/U
    spec = rc.parse_rs_options("geometric", 1.001)[0]
    assert spec == rc.RSOption("seq_mean_k1", "k1", "seq_mean", 1 / 1.001, 1.001)


def test_rs_does_not_change_is_weights():
    train, rollout, mask = make([[0.5, 3.0, 1.5], [1.2, 0.4]])
    w1, _, _ = corr(train, rollout, mask, rollout_is="token", rollout_is_threshold=2.0)
    w2, m2, _ = corr(
        train,
        rollout,
        mask,
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_rs="token_k1",
        rollout_rs_threshold=2.0,
    )
    assert torch.equal(w1, w2)  # rejected tokens keep their IS weight
    assert m2.tolist() == [[1, 0, 1], [1, 0, 0]]


# ------------------------------------------------------------------------------------------
# veto (§4.5)
# ------------------------------------------------------------------------------------------


def test_veto_uses_unclipped_ratios_and_rejects_whole_rows():
    tau = math.exp(-21.0)
    rows = [[0.0, -25.0], [-19.0, 0.0], [0.0, 0.0, 0.0], []]
    train, rollout, mask = logs(rows)
    train[1, 2] = -100.0  # padded position: never read
    _, m2, met = corr(train, rollout, mask, rollout_token_veto_threshold=tau)
    assert m2.tolist() == [[0, 0, 0], [1, 1, 0], [1, 1, 1], [0, 0, 0]]
    assert met["rollout_is_veto_fraction"] == approx(1 / 3)
    assert met["rollout_is_catastrophic_token_fraction"] == approx(1 / 7)
    # strict inequality: rho == tau is kept
    _, m2, _ = corr(*make([[0.25, 1.0], [0.2, 1.0]]), rollout_token_veto_threshold=0.25)
    assert m2.tolist() == [[1, 1], [0, 0]]


def test_veto_is_anded_after_rs():
    rows = [[1.0, 3.0], [1.0, 1e-5], [1.0, 1.0]]
    _, m2, met = corr(*make(rows), rollout_rs="token_k1", rollout_rs_threshold=2.0, rollout_token_veto_threshold=1e-4)
    assert m2.tolist() == [[1, 0], [0, 0], [1, 1]]
    # the global RS metric excludes the veto
    assert met["rollout_rs_masked_fraction"] == approx(2 / 6)
    assert met["rollout_is_veto_fraction"] == approx(1 / 3)


def test_is_mean_is_token_weighted_and_seq_mean_row_weighted():
    # docs/design-readings.md §20: at sequence level the two agree only for equal lengths or equal weights
    rows = [[2.0], [0.2 ** (1 / 3)] * 3]  # sequence weights 2 (one token) and 0.2 (three tokens)
    _, _, met = corr(*make(rows), rollout_is="sequence", rollout_is_threshold=5.0)
    assert met["rollout_is_mean"] == approx(0.65) and met["rollout_is_seq_mean"] == approx(1.1)


def test_chi2_token_estimate_is_negative_when_every_ratio_is_below_one():
    # docs/design-readings.md §21: <rho^2> - 1 over the sampled tokens, not clipped at 0
    _, _, met = corr(*make([[0.9, 0.9], [0.9]]))
    assert met["chi2_token"] == approx(0.81 - 1.0)


def test_raising_the_veto_threshold_vetoes_more_rows():
    # the veto fires when a ratio falls below tau: relaxing it means a smaller tau (docs/corrections.md §4.5)
    rows = [[1.0, 1.0], [0.9, 1.0], [1.0, 0.5], [0.05, 1.0], [1.0, 2.0]]
    fractions = [
        corr(*make(rows), rollout_token_veto_threshold=tau)[2]["rollout_is_veto_fraction"]
        for tau in (1e-4, 1e-3, 1e-2, 0.1)
    ]
    assert fractions == approx([0.0, 0.0, 0.0, 0.2])


# ------------------------------------------------------------------------------------------
# off-policy, consistency and TV metrics (§6.4, §6.5, §12.7)
# ------------------------------------------------------------------------------------------


def _offpolicy_example():
    train = torch.tensor([[-1.0, -2.0], [-0.5, NAN], [NAN, NAN]], dtype=F64)
    rollout = torch.tensor([[-1.5, -1.5], [-1.0, NAN], [NAN, NAN]], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]], dtype=F64)
    return train, rollout, mask


def test_k3_is_never_negative_for_near_identical_policies():
    # float32 log-probs a rounding error apart (an fp32 engine against an fp32 trainer): exp(l) - 1 - l came out
    # near -1e-8 here; expm1(l) - l is >= 0 for every token and the metric is a tiny non-negative number.
    gen = torch.Generator().manual_seed(0)
    rollout = -torch.rand(64, 32, generator=gen) * 1e-3  # near-certain tokens: log-ratios of ~1e-8 are representable
    train = rollout + (torch.rand(64, 32, generator=gen) - 0.5) * 1e-7
    mask = torch.ones(64, 32)
    _, _, met = corr(train, rollout, mask)
    assert 0.0 <= met["k3_kl"] < 1e-10
    assert bool((rc.rs_base_statistic(train - rollout, "k3") >= 0).all())
    old = torch.exp(train - rollout) - 1.0 - (train - rollout)
    assert bool((old < 0).any())  # the naive form does go negative on these inputs


def test_offpolicy_metrics_by_hand():
    train, rollout, mask = _offpolicy_example()
    _, _, met = corr(train, rollout, mask)
    e = math.exp
    assert met["training_ppl"] == approx((e(1.5) + e(0.5)) / 2)
    assert met["training_log_ppl"] == approx(1.0)
    assert met["rollout_ppl"] == approx((e(1.5) + e(1.0)) / 2)
    assert met["rollout_log_ppl"] == approx(1.25)
    ell = [0.5, -0.5, 0.5]
    assert met["kl"] == approx(-sum(ell) / 3)
    assert met["k3_kl"] == approx(sum(e(v) - v - 1 for v in ell) / 3)
    d = [0.0, -0.5]  # row-mean rollout minus row-mean train
    assert met["log_ppl_diff"] == approx(-0.25)
    assert met["log_ppl_abs_diff"] == approx(0.25)
    assert met["log_ppl_diff_max"] == approx(0.0)
    assert met["log_ppl_diff_min"] == approx(-0.5)
    assert met["ppl_ratio"] == approx((e(d[0]) + e(d[1])) / 2)
    assert met["chi2_token"] == approx((e(1) + e(-1) + e(1)) / 3 - 1)
    assert met["chi2_seq"] == approx((e(0) + e(1.0)) / 2 - 1)


def test_consistency_and_tv_metrics_by_hand():
    train, rollout, mask = _offpolicy_example()
    _, _, met = corr(train, rollout, mask)
    e = math.exp
    p_tr, p_ro = [e(-1), e(-2), e(-0.5)], [e(-1.5), e(-1.5), e(-1.0)]
    delta = [abs(a - b) for a, b in zip(p_tr, p_ro)]
    assert met["rollout_probs_diff_max"] == approx(max(delta))
    assert met["rollout_probs_diff_mean"] == approx(sum(delta) / 3)
    assert met["rollout_probs_diff_std"] == approx(std_unbiased(delta))
    mx, my = sum(p_tr) / 3, sum(p_ro) / 3
    cov = sum((a - mx) * (b - my) for a, b in zip(p_tr, p_ro))
    vx = sum((a - mx) ** 2 for a in p_tr)
    vy = sum((b - my) ** 2 for b in p_ro)
    assert met["rollout_actor_probs_pearson_corr"] == approx(cov / math.sqrt(vx * vy))
    assert met["tv_mismatch"] == approx(0.5 * (2 * abs(1 - e(0.5)) + abs(1 - e(-0.5))) / 3)
    _, _, single = corr(train[:1, :1], rollout[:1, :1], mask[:1, :1])
    assert single["rollout_probs_diff_std"] == 0.0
    assert math.isnan(single["rollout_actor_probs_pearson_corr"])


# ------------------------------------------------------------------------------------------
# metric key sets (§6)
# ------------------------------------------------------------------------------------------

IS_KEYS = {
    f"rollout_is_{k}"
    for k in (
        "mean",
        "std",
        "eff_sample_size",
        "max",
        "min",
        "ratio_fraction_high",
        "ratio_fraction_low",
        "seq_mean",
        "seq_std",
        "seq_max",
        "seq_min",
        "seq_max_deviation",
        "seq_fraction_high",
        "seq_fraction_low",
        "p25",
        "p50",
        "p75",
        "p95",
        "p99",
    )
}
OFFPOLICY_KEYS = {
    "training_ppl",
    "training_log_ppl",
    "rollout_ppl",
    "rollout_log_ppl",
    "kl",
    "k3_kl",
    "log_ppl_diff",
    "log_ppl_abs_diff",
    "log_ppl_diff_max",
    "log_ppl_diff_min",
    "ppl_ratio",
    "chi2_token",
    "chi2_seq",
}
ALWAYS_KEYS = OFFPOLICY_KEYS | {
    "rollout_probs_diff_max",
    "rollout_probs_diff_mean",
    "rollout_probs_diff_std",
    "rollout_actor_probs_pearson_corr",
    "tv_mismatch",
    # the peers' mismatch metrics (docs/corrections.md §6.8), beside verl's
    "log_prob_abs_diff_mean",
    "log_prob_abs_diff_max",
    "token_mult_prob_error",
    "js_divergence",
}
VETO_KEYS = {"rollout_is_veto_fraction", "rollout_is_catastrophic_token_fraction"}


def rs_keys(option):
    suffixes = [
        "mean",
        "max",
        "min",
        "fraction_high",
        "fraction_low",
        "std",
        "seq_mean",
        "seq_std",
        "seq_max",
        "seq_min",
        "seq_max_deviation",
        "seq_fraction_high",
        "masked_fraction",
        "seq_masked_fraction",
    ]
    if option.endswith("k1"):
        suffixes.append("seq_fraction_low")
    return {f"rollout_rs_{option}_{s}" for s in suffixes}


RS_GLOBAL = {"rollout_rs_masked_fraction", "rollout_rs_seq_masked_fraction"}
KEY_CASES = [
    ({}, ALWAYS_KEYS),
    ({"rollout_is": "token"}, ALWAYS_KEYS | IS_KEYS),
    (
        {"rollout_is": "sequence", "rollout_is_threshold": "0.5_5", "rollout_is_batch_normalize": True},
        ALWAYS_KEYS | IS_KEYS | {"rollout_is_oob_ratio", "rollout_is_batch_norm_factor"},
    ),
    (
        {"rollout_rs": "token_k1,seq_max_k3", "rollout_rs_threshold": 2.0},
        ALWAYS_KEYS | rs_keys("token_k1") | rs_keys("seq_max_k3") | RS_GLOBAL,
    ),
    (
        {"rollout_rs": "geometric", "rollout_rs_threshold": 1.01, "rollout_token_veto_threshold": 1e-4},
        ALWAYS_KEYS | rs_keys("seq_mean_k1") | RS_GLOBAL | VETO_KEYS,
    ),
    ({"rollout_token_veto_threshold": 1e-4}, ALWAYS_KEYS | VETO_KEYS),
    (
        {
            "rollout_is": "token",
            "rollout_is_threshold": "0.5_2",
            "rollout_rs": "seq_mean_k2",
            "rollout_rs_threshold": 0.1,
            "rollout_token_veto_threshold": 1e-3,
        },
        ALWAYS_KEYS | IS_KEYS | {"rollout_is_oob_ratio"} | rs_keys("seq_mean_k2") | RS_GLOBAL | VETO_KEYS,
    ),
]


@pytest.mark.parametrize("kwargs,expected", KEY_CASES)
def test_metric_key_sets_match_spec_exactly(kwargs, expected):
    _, _, met = corr(*make([[1.1, 0.9, 1.0], [1.2, 0.95]]), **kwargs)
    assert set(met) == expected
    assert all(isinstance(v, float) for v in met.values())


def test_rs_metric_fraction_low_is_zero_for_k2_k3():
    _, _, met = corr(*make([[1.1, 0.9]]), rollout_rs="token_k3", rollout_rs_threshold=0.5)
    assert met["rollout_rs_token_k3_fraction_low"] == 0.0


# ------------------------------------------------------------------------------------------
# losses (§7) and actor metrics (§6.6)
# ------------------------------------------------------------------------------------------


def _ppo_example():
    ratios = [1.5, 0.5, 0.5, 5.0, 1.1]
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -2.0]], dtype=F64)
    old = torch.full((1, 5), -1.0, dtype=F64)
    log_prob = (old + torch.log(torch.tensor([ratios], dtype=F64))).requires_grad_()
    mask = torch.ones((1, 5), dtype=F64)
    return ratios, adv, old, log_prob, mask


def test_ppo_loss_asymmetric_dual_clip_and_is_after_clipping():
    ratios, adv, old, log_prob, mask = _ppo_example()
    w = torch.tensor([[1.0, 2.0, 0.5, 1.0, 1.0]], dtype=F64)
    rollout = old - math.log(2.0)  # pi_old / mu = 2 everywhere
    loss, met = rc.compute_policy_loss_vanilla(
        old, log_prob, adv, mask, "token-mean", 0.2, 0.28, 3.0, w, rollout_log_prob=rollout
    )
    # per token: -1.28 (clip high), -0.5, 0.8 (clip low), 3.0 (dual clip), 2.2
    phi = [-1.28, -0.5, 0.8, 3.0, 2.2]
    assert loss.item() == approx(sum(p * wi for p, wi in zip(phi, w[0].tolist())) / 5)
    assert met["actor/pg_loss"] == approx(loss.item())
    assert met["actor/pg_clipfrac"] == approx(2 / 5)
    assert met["actor/pg_clipfrac_lower"] == approx(1 / 5)
    assert met["actor/ppo_kl"] == approx(-sum(math.log(r) for r in ratios) / 5)
    assert met["actor/tv_update"] == approx(0.5 * sum(abs(2 - 2 * r) for r in ratios) / 5)
    loss.backward()
    # d phi / d log pi = -A r where unclipped, 0 where clipped; times w, over N = 5
    grad = [0.0, -1.0 * 0.5 * 2.0 / 5, 0.0, 0.0, 2.0 * 1.1 / 5]
    assert log_prob.grad[0].tolist() == [approx(g) for g in grad]
    _, met = rc.compute_policy_loss_vanilla(old, log_prob.detach(), adv, mask)
    assert "actor/tv_update" not in met
    assert set(met) == {"actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"}


def test_reinforce_loss_value_gradient_and_detached_weights():
    log_prob = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, NAN]], dtype=F64, requires_grad=True)
    rollout = torch.tensor([[-1.2, -1.5, -0.5], [-0.3, -1.0, NAN]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0]], dtype=F64)
    keep = torch.tensor([[1, 0, 1], [1, 1, 1]], dtype=F64)
    weights = torch.exp(log_prob - rollout)  # carries a graph: must be detached inside
    loss, met = rc.compute_policy_loss_reinforce(log_prob, rollout, adv, mask, "token-mean", weights, keep_mask=keep)
    wv = [[math.exp(0.2), math.exp(-0.5), 1.0], [1.0, math.exp(0.3), 0.0]]
    lp = [[-1.0, -2.0, -0.5], [-0.3, -0.7]]
    kept = [(0, 0), (0, 2), (1, 0), (1, 1)]
    want = sum(-adv[i, t].item() * lp[i][t] * wv[i][t] for i, t in kept) / 5
    assert loss.item() == approx(want)
    loss.backward()
    expected = torch.zeros((2, 3), dtype=F64)
    for i, t in kept:
        expected[i, t] = -adv[i, t].item() * wv[i][t] / 5
    torch.testing.assert_close(log_prob.grad, expected, rtol=1e-12, atol=1e-12)
    assert met["actor/ppo_kl"] == approx((-0.2 + 0.0 + 0.0 - 0.3) / 4)
    assert set(met) == {"actor/pg_loss", "actor/ppo_kl"}


AGG_CASES = [
    ("token-mean", None, 13 / 5, 13 / 10),
    ("token-sum", None, 13.0, 13.0),
    ("seq-mean-token-sum", None, 13 / 2, 13 / 4),
    ("seq-mean-token-mean", None, (4 / 3 + 9 / 2) / 2, (4 / 3 + 9 / 2) / 4),
    ("seq-mean-token-sum-norm", 4.0, 13 / (2 * 4), 13 / (4 * 4)),
    ("seq-mean-token-sum-norm", None, 13 / (2 * 3), 13 / (4 * 3)),
]


@pytest.mark.parametrize("mode,scale,local,global_", AGG_CASES)
def test_agg_loss_modes_with_original_mask_denominators(mode, scale, local, global_):
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, NAN], [NAN, NAN, NAN]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=F64)
    effective = torch.tensor([[1, 0, 1], [1, 1, 0], [0, 0, 0]], dtype=F64)
    got = rc.agg_loss(loss_mat, effective, mode, response_mask=mask, loss_scale_factor=scale)
    assert got.item() == approx(local)
    got = rc.agg_loss(
        loss_mat,
        effective,
        mode,
        response_mask=mask,
        global_token_count=10,
        global_seq_count=torch.tensor(4.0),
        loss_scale_factor=scale,
    )
    assert got.item() == approx(global_)


def test_no_kept_token_contributes_exactly_zero():
    _, adv, old, log_prob, mask = _ppo_example()
    keep = torch.zeros_like(mask)
    for mode in rc.LOSS_AGG_MODES:
        loss, met = rc.compute_policy_loss_vanilla(old, log_prob, adv, mask, mode, keep_mask=keep, loss_scale_factor=8)
        assert loss.item() == 0.0
        assert met["actor/pg_clipfrac"] == 0.0 and met["actor/ppo_kl"] == 0.0
        loss.backward()
        assert torch.equal(log_prob.grad, torch.zeros_like(log_prob))
        log_prob.grad = None
    assert rc.agg_loss(torch.ones(2, 2), torch.zeros(2, 2), global_token_count=4).item() == 0.0


def test_nan_padding_does_not_leak_into_loss_or_gradient():
    log_prob = torch.tensor([[-1.0, NAN], [-0.5, -0.2]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.1, math.inf], [-0.4, -0.2]], dtype=F64)
    rollout = torch.tensor([[-1.2, NAN], [-0.6, -0.1]], dtype=F64)
    adv = torch.tensor([[1.0, NAN], [-1.0, 1.0]], dtype=F64)
    mask = torch.tensor([[1, 0], [1, 1]], dtype=F64)
    cfg = rc.RolloutCorrectionConfig.bypass_pg_is()
    for fn in (
        lambda: rc.compute_policy_loss_vanilla(old, log_prob, adv, mask, rollout_log_prob=rollout),
        lambda: rc.compute_policy_loss_reinforce(log_prob, rollout, adv, mask),
        lambda: rc.compute_policy_loss_bypass_mode(log_prob, rollout, adv, mask, cfg),
    ):
        loss, met = fn()
        loss.backward()
        assert math.isfinite(loss.item())
        assert torch.isfinite(log_prob.grad).all() and log_prob.grad[0, 1].item() == 0.0
        assert all(math.isfinite(v) for k, v in met.items() if "pearson" not in k)
        log_prob.grad = None


def _bypass_batch(seed: int, shape: tuple, noise: float):
    """(log_prob, rollout log-prob, advantages, mask): log pi_theta = log mu + noise * N(0, 1), all tokens valid."""
    gen = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(shape, generator=gen, dtype=F64)
    log_prob = rollout + noise * torch.randn(shape, generator=gen, dtype=F64)
    return log_prob, rollout, torch.randn(shape, generator=gen, dtype=F64), torch.ones(shape, dtype=F64)


def test_bypass_ppo_clip_ignores_is_weights_but_reports_them():
    log_prob, rollout, adv, mask = _bypass_batch(3, (3, 4), 0.05)
    plain = rc.RolloutCorrectionConfig.bypass_ppo_clip()
    with pytest.warns(UserWarning, match="only adds"):
        with_is = rc.RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1.01, bypass_mode=True)
    loss_a, met_a = rc.compute_policy_loss_bypass_mode(log_prob, rollout, adv, mask, plain)
    loss_b, met_b = rc.compute_policy_loss_bypass_mode(log_prob, rollout, adv, mask, with_is)
    assert loss_a.item() == loss_b.item()
    assert "rollout_corr/rollout_is_mean" in met_b and "rollout_corr/rollout_is_mean" not in met_a
    assert "actor/pg_clipfrac" in met_a and "rollout_corr/kl" in met_a
    # the PPO ratio against mu: pi_theta/mu = exp(log_prob - rollout)
    ref, _ = rc.compute_policy_loss_vanilla(rollout, log_prob, adv, mask)
    assert loss_a.item() == approx(ref.item())


def test_icepop_is_metrics_only_in_bypass_ppo_clip():
    # bypass PPO-clip applies no IS weight (§7.3): an IcePop window that zeroes most tokens leaves the loss as it is,
    # a rejection rule that masks rows changes it (docs/corrections.md §3.4, §7.5)
    log_prob, rollout, adv, mask = _bypass_batch(5, (4, 5), 0.2)
    plain = rc.RolloutCorrectionConfig.bypass_ppo_clip()
    with pytest.warns(UserWarning, match="only adds"):
        icepop = rc.RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold="0.99_1.01", bypass_mode=True)
    rs = rc.RolloutCorrectionConfig(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.99_1.01", bypass_mode=True)
    loss, _ = rc.compute_policy_loss_bypass_mode(log_prob, rollout, adv, mask, plain)
    loss_icepop, met = rc.compute_policy_loss_bypass_mode(log_prob, rollout, adv, mask, icepop)
    loss_rs, met_rs = rc.compute_policy_loss_bypass_mode(log_prob, rollout, adv, mask, rs)
    assert met["rollout_corr/rollout_is_oob_ratio"] > 0.5
    assert loss_icepop.item() == loss.item()
    assert met_rs["rollout_corr/rollout_rs_masked_fraction"] > 0 and loss_rs.item() != approx(loss.item())


def test_bypass_reinforce_uses_weights_from_current_policy():
    # token ratios pi_theta / mu per row: products 1.1, 1.5 (over the cap 1.2) and 0.9
    ratios = [[1.1, 1.0, 1.0, 1.0], [1.5, 1.0], [0.9]]
    log_prob = torch.tensor(
        [[-0.5, -1.0, -0.2, -2.0], [-0.3, -0.8, NAN, NAN], [-1.2, NAN, NAN, NAN]], dtype=F64, requires_grad=True
    )
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=F64)
    rollout = log_prob.detach().clone()
    for i, row in enumerate(ratios):
        for t, r in enumerate(row):
            rollout[i, t] -= math.log(r)
    adv = torch.tensor([[0.5], [-1.0], [2.0]], dtype=F64).expand(3, 4)
    cfg = rc.RolloutCorrectionConfig.bypass_pg_is(threshold=1.2)
    loss, met = rc.compute_policy_loss_bypass_mode(log_prob, rollout, adv, mask, cfg, "seq-mean-token-sum")
    loss.backward()
    seq = [1.1, 1.2, 0.9]  # row 1 truncated at U = 1.2
    want = torch.tensor([[-0.5 * 1.1] * 4, [1.0 * 1.2] * 2 + [0, 0], [-2.0 * 0.9, 0, 0, 0]], dtype=F64) / 3
    torch.testing.assert_close(log_prob.grad, want, rtol=1e-10, atol=1e-12)  # V = 3 valid rows
    lp = [[-0.5, -1.0, -0.2, -2.0], [-0.3, -0.8], [-1.2]]
    a = [0.5, -1.0, 2.0]
    assert loss.item() == approx(sum(-a[i] * seq[i] * sum(lp[i]) for i in range(3)) / 3)
    assert "rollout_corr/rollout_is_seq_mean" in met and "actor/ppo_kl" in met


# ------------------------------------------------------------------------------------------
# GRPO advantage (§8)
# ------------------------------------------------------------------------------------------


def grpo_loop(scores, index, eps=1e-6, norm=True):
    """Per-sample reference written from §8."""
    out = []
    for i, s in enumerate(scores):
        group = [scores[j] for j in range(len(scores)) if index[j] == index[i]]
        if len(group) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(group) / len(group)
            std = math.sqrt(sum((g - mean) ** 2 for g in group) / (len(group) - 1))
        out.append((s - mean) / (std + eps) if norm else s - mean)
    return out


def test_grpo_by_hand_singleton_and_equal_groups():
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.7, 0.3, 0.3, 0.3], dtype=F64)
    index = ["a", "a", "a", "a", "solo", "b", "b", "b"]
    adv = rc.compute_grpo_outcome_advantage(scores, index)
    std_a = math.sqrt(1.0 / 3.0)
    assert adv[:4].tolist() == [approx(v) for v in [0.5 / (std_a + 1e-6), -0.5 / (std_a + 1e-6)] * 2]
    assert adv[4].item() == approx(0.7 / (1 + 1e-6))  # singleton keeps its raw score
    assert adv[5:].tolist() == [0.0, 0.0, 0.0]  # exactly zero, not rounding noise
    dr = rc.compute_grpo_outcome_advantage(scores, index, norm_adv_by_std=False)
    assert dr.tolist() == [approx(v) for v in [0.5, -0.5, 0.5, -0.5, 0.7, 0, 0, 0]]


def test_grpo_matches_loop_reference_with_tensor_ids_token_scores_and_mask():
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 6, (40,), generator=gen)
    token_scores = torch.rand((40, 3), generator=gen, dtype=F64)
    ref = grpo_loop(token_scores.sum(-1).tolist(), ids.tolist())
    got = rc.compute_grpo_outcome_advantage(token_scores, ids)
    assert got.tolist() == [approx(v, rel=1e-9, abs_=1e-9) for v in ref]
    same = rc.compute_grpo_outcome_advantage(token_scores, [f"p{i}" for i in ids.tolist()])
    torch.testing.assert_close(same, got)
    mask = (torch.rand((40, 5), generator=gen) > 0.3).to(F64)
    full = rc.compute_grpo_outcome_advantage(token_scores, ids, response_mask=mask)
    torch.testing.assert_close(full, got[:, None] * mask)
    with pytest.raises(ValueError, match="39"):
        rc.compute_grpo_outcome_advantage(token_scores, ids[:39])


def test_compute_advantage_grpo_is_exactly_the_grpo_call_and_unknown_names_fail():
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 4, (16,), generator=gen)
    scores, mask = torch.rand(16, generator=gen), (torch.rand((16, 3), generator=gen) > 0.3).float()
    for norm in (True, False):
        direct = rc.compute_grpo_outcome_advantage(scores, ids, response_mask=mask, norm_adv_by_std=norm)
        assert torch.equal(rc.compute_advantage("grpo", scores, ids, response_mask=mask, norm_adv_by_std=norm), direct)
    # the built-in, by its own function; a fork adds more (README "Fork it": "rloo"), so the registry is a superset
    assert rc.ADVANTAGE_ESTIMATORS["grpo"] is rc.compute_grpo_outcome_advantage
    with pytest.raises(ValueError, match="'ppo'.*grpo"):
        rc.compute_advantage("ppo", scores, ids)


@PROPS
@given(
    st.lists(st.tuples(st.integers(0, 4), st.sampled_from([0.0, 1.0, 0.5, 2.0])), min_size=1, max_size=20),
    st.booleans(),
)
def test_grpo_property_matches_loop(pairs, norm):
    index = [p[0] for p in pairs]
    scores = [p[1] for p in pairs]
    got = rc.compute_grpo_outcome_advantage(torch.tensor(scores, dtype=F64), index, norm_adv_by_std=norm)
    ref = grpo_loop(scores, index, norm=norm)
    assert got.tolist() == [approx(v, rel=1e-9, abs_=1e-9) for v in ref]


# ------------------------------------------------------------------------------------------
# KL penalty (§7.6)
# ------------------------------------------------------------------------------------------


def test_kl_penalty_estimators_by_hand_and_straight_through():
    logp = torch.tensor([[-1.0, -2.0, -40.0]], dtype=F64)
    ref = torch.tensor([[-1.5, -1.7, -10.0]], dtype=F64)
    d = [0.5, -0.3, -30.0]
    k3 = [min(math.exp(-v) + v - 1, 10.0) for v in d[:2]] + [10.0]  # kappa clipped at 20
    expect = {
        "kl": d,
        "k1": d,
        "abs": [abs(v) for v in d],
        "mse": [0.5 * v * v for v in d],
        "k2": [0.5 * v * v for v in d],
        "low_var_kl": k3,
        "k3": k3,
    }
    for name, values in expect.items():
        assert rc.kl_penalty(logp, ref, name)[0].tolist() == [approx(v) for v in values]
        leaf = logp.clone().requires_grad_()
        out = rc.kl_penalty(leaf, ref, name + "+")
        assert out[0].tolist() == [approx(v) for v in values]
        out.sum().backward()
        assert leaf.grad[0].tolist() == [approx(v) for v in d]  # the k2 gradient
    assert set(rc.KL_ESTIMATORS) == set(expect) | {k + "+" for k in expect}


@pytest.mark.parametrize("name", ["full", "full+", "k4", "low-var-kl"])
def test_kl_penalty_rejects_unknown(name):
    with pytest.raises(ValueError, match=repr(name).replace("+", r"\+")):
        rc.kl_penalty(torch.zeros(1, 2), torch.zeros(1, 2), name)


# ------------------------------------------------------------------------------------------
# validation (§10)
# ------------------------------------------------------------------------------------------

C = rc.RolloutCorrectionConfig
CONFIG_ERRORS = [
    ({"rollout_is": 1}, TypeError, "got 1"),
    ({"rollout_is": "geometric", "rollout_is_threshold": -0.5}, ValueError, "-0.5"),  # opt-in level: it warns (§10)
    ({"rollout_is": "seq"}, ValueError, "'seq'"),
    ({"rollout_is": "token", "rollout_is_threshold": None}, ValueError, "rollout_is_threshold=None"),
    ({"rollout_is": "token", "rollout_is_threshold": True}, TypeError, "True"),
    ({"rollout_is": "token", "rollout_is_threshold": [2.0]}, TypeError, "[2.0]"),
    ({"rollout_is": "token", "rollout_is_threshold": ""}, ValueError, "''"),
    ({"rollout_is": "token", "rollout_is_threshold": "abc"}, ValueError, "'abc'"),
    ({"rollout_is": "token", "rollout_is_threshold": "0.5_1_2"}, ValueError, "'0.5_1_2'"),
    ({"rollout_is": "token", "rollout_is_threshold": "_2"}, ValueError, "'_2'"),
    ({"rollout_is": "token", "rollout_is_threshold": math.nan}, ValueError, "value nan"),
    ({"rollout_is": "token", "rollout_is_threshold": -math.inf}, ValueError, "value -inf"),  # +inf: no truncation
    ({"rollout_is": "token", "rollout_is_threshold": "0.5_inf"}, ValueError, "value inf"),  # IcePop bounds stay finite
    ({"rollout_is": "token", "rollout_is_threshold": -1.5}, ValueError, "-1.5"),
    ({"rollout_is": "token", "rollout_is_threshold": 0}, ValueError, "value 0.0"),
    ({"rollout_is": "token", "rollout_is_threshold": "3_2"}, ValueError, "'3_2'"),
    ({"rollout_is_batch_normalize": "yes"}, TypeError, "'yes'"),
    ({"rollout_rs": 5}, TypeError, "got 5"),
    ({"rollout_rs": " , ,"}, ValueError, "' , ,'"),
    ({"rollout_rs": "seq_max_k1", "rollout_rs_threshold": 1}, ValueError, "'seq_max_k1'"),
    ({"rollout_rs": "token_k4", "rollout_rs_threshold": 1}, ValueError, "'token_k4'"),
    ({"rollout_rs": "token_k1,token_k1", "rollout_rs_threshold": 2}, ValueError, "duplicate option 'token_k1'"),
    ({"rollout_rs": "token,token_k1", "rollout_rs_threshold": 2}, ValueError, "'token,token_k1'"),
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": None}, ValueError, "(got None)"),
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": True}, TypeError, "True"),
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": [2]}, TypeError, "[2]"),
    ({"rollout_rs": "token_k1,token_k2,token_k3", "rollout_rs_threshold": "2,0.1"}, ValueError, "2 entries"),
    ({"rollout_rs": "token_k2", "rollout_rs_threshold": "0.1_0.5"}, ValueError, "'0.1_0.5'"),
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": "abc"}, ValueError, "'abc'"),
    ({"rollout_rs": "token_k2", "rollout_rs_threshold": "nan"}, ValueError, "'nan'"),
    ({"rollout_rs": "token_k3", "rollout_rs_threshold": -0.5}, ValueError, "-0.5"),
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": "2_1"}, ValueError, "'2_1'"),
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": 0.5}, ValueError, "0.5"),
    ({"rollout_rs_threshold_lower": 0.25}, ValueError, "0.25"),
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": 2, "rollout_rs_threshold_lower": 0.25}, ValueError, "0.25"),
    ({"rollout_rs": "token", "rollout_rs_threshold": 2, "rollout_rs_threshold_lower": -0.25}, ValueError, "-0.25"),
    ({"rollout_rs": "token", "rollout_rs_threshold": 2, "rollout_rs_threshold_lower": 2.5}, ValueError, "2.5"),
    ({"rollout_rs": "sequence", "rollout_rs_threshold": 0.5}, ValueError, "0.5"),
    ({"rollout_rs": "geometric", "rollout_rs_threshold": "0.9_1.1"}, ValueError, "'0.9_1.1'"),
    ({"rollout_token_veto_threshold": True}, TypeError, "True"),
    ({"rollout_token_veto_threshold": "0.1"}, TypeError, "'0.1'"),
    ({"rollout_token_veto_threshold": 1.0}, ValueError, "1.0"),
    ({"rollout_token_veto_threshold": 0.0}, ValueError, "0.0"),
    ({"rollout_token_veto_threshold": math.nan}, ValueError, "=nan"),
    ({"bypass_mode": "yes"}, TypeError, "'yes'"),
    ({"loss_type": "ppo"}, ValueError, "'ppo'"),
    ({"loss_type": "reinforce"}, ValueError, "'reinforce'"),
    ({"bypass_mode": True, "loss_type": "reinforce", "use_policy_gradient": False}, ValueError, "False"),
    ({"bypass_mode": True, "loss_type": "ppo_clip", "use_policy_gradient": True}, ValueError, "'ppo_clip'"),
    ({"use_policy_gradient": True}, ValueError, "use_policy_gradient=True"),
    ({"use_policy_gradient": "yes", "bypass_mode": True}, TypeError, "'yes'"),
]


@pytest.mark.parametrize("kwargs,exc,fragment", CONFIG_ERRORS, ids=[repr(c[0])[:60] for c in CONFIG_ERRORS])
def test_config_errors_name_the_bad_value(kwargs, exc, fragment):
    with pytest.raises(exc) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        C(**kwargs)
    assert fragment in str(info.value)


def test_rs_statistics_registry_names_every_option_statistic():
    # every option's statistic is registered and every statistic has an option; the built-ins are there (a fork may add
    # more: README "Fork it" adds "chi2")
    assert {name.rsplit("_", 1)[1] for name in rc.RS_OPTIONS} == set(rc.RS_STATISTICS) >= {"k1", "k2", "k3"}
    lam = torch.tensor([-0.5, 0.0, 0.25], dtype=F64)
    assert torch.equal(rc.rs_base_statistic(lam, "k1"), -lam)
    assert torch.equal(rc.rs_base_statistic(lam, "k2"), rc.k2_divergence(lam))
    with pytest.raises(ValueError, match="'k9'"):
        rc.rs_base_statistic(lam, "k9")


def test_error_messages_list_alternatives():
    with pytest.raises(ValueError) as info:
        C(rollout_rs="seq_max_k1", rollout_rs_threshold=1.0)
    assert all(name in str(info.value) for name in rc.RS_OPTIONS + ("token", "geometric"))
    with pytest.raises(ValueError, match="3 options"):
        C(rollout_rs="token_k1,token_k2,token_k3", rollout_rs_threshold="2,0.1")


def test_config_accepts_valid_edge_cases():
    assert C(rollout_rs_threshold=5.0).rs_specs == ()  # ignored without rollout_rs
    assert C(rollout_is="token", rollout_is_threshold="2_2").is_spec.lower == 2.0
    assert C(bypass_mode=True, use_policy_gradient=True).loss_type == "reinforce"
    assert C(bypass_mode=True, use_policy_gradient=False).loss_type == "ppo_clip"
    assert C(bypass_mode=True, loss_type="reinforce", use_policy_gradient=True).loss_type == "reinforce"
    assert C(bypass_mode=True, loss_type=None, use_policy_gradient=True).loss_type == "reinforce"
    assert C(loss_type=None).loss_type == "ppo_clip"
    cfg = C(rollout_rs="token_k1, seq_mean_k3", rollout_rs_threshold="0.5_2.0, 0.01")
    assert cfg.rs_specs == (
        rc.RSOption("token_k1", "k1", "token", 0.5, 2.0),
        rc.RSOption("seq_mean_k3", "k3", "seq_mean", None, 0.01),
    )


LOSS_SETTING_ERRORS = [
    ((1.0, 0.2, 3.0, "token-mean"), "1.0"),
    ((-0.1, 0.2, 3.0, "token-mean"), "-0.1"),
    ((0.2, -0.1, 3.0, "token-mean"), "-0.1"),
    ((0.2, 0.2, 1.0, "token-mean"), "1.0"),
    ((0.2, 0.2, 3.0, "mean"), "'mean'"),
    ((0.2, 0.2, 3.0, "token-mean", 0), "loss_scale_factor=0 "),
    ((0.2, 0.2, 3.0, "seq-mean-token-sum-norm", -4.0), "-4.0"),
]


@pytest.mark.parametrize("args,fragment", LOSS_SETTING_ERRORS)
def test_check_loss_settings(args, fragment):
    with pytest.raises(ValueError) as info:
        rc.check_loss_settings(*args)
    assert fragment in str(info.value)
    if args[3] == "mean":
        assert all(mode in str(info.value) for mode in rc.LOSS_AGG_MODES)


def test_tensor_validation_errors():
    good = torch.zeros((2, 3))
    mask = torch.ones((2, 3))
    plain = C.disabled()
    with pytest.raises(ValueError, match=r"\(2, 4\).*\(2, 3\)"):
        rc.compute_rollout_correction_and_rejection_mask(torch.zeros((2, 4)), good, mask, plain)
    with pytest.raises(ValueError, match="at least one valid token"):
        rc.compute_rollout_correction_and_rejection_mask(good, good, torch.zeros((2, 3)), plain)
    with pytest.raises(ValueError, match="2.0"):
        rc.compute_rollout_correction_and_rejection_mask(good, good, mask * 2, plain)
    bad = good.clone()
    bad[0, 0], bad[1, 2] = NAN, -math.inf
    with pytest.raises(ValueError, match="2 non-finite"):
        rc.compute_rollout_correction_and_rejection_mask(bad, good, mask, plain)
    partial = mask.clone()
    partial[1, 2] = 0.0  # the -inf sits on padding now: only the NaN counts
    with pytest.raises(ValueError, match="log_prob has 1 non-finite"):
        rc.compute_policy_loss_vanilla(good, bad, good, partial)
    with pytest.raises(ValueError, match="at least one valid token"):
        rc.compute_policy_loss_reinforce(good, good, good, torch.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"\(3, 3\)"):
        rc.compute_rollout_correction_and_rejection_mask(good, torch.zeros((3, 3)), mask, plain)
    with pytest.raises(ValueError, match="at least one valid token"):
        rc.agg_loss(good, torch.zeros((2, 3)))


@pytest.mark.parametrize(
    "cfg",
    [
        None,
        C(loss_mode="gspo", rollout_opsm_threshold=0.01),
        C.bypass_ppo_clip(),
        C(bypass_mode=True, loss_type="reinforce", rollout_is="token", rollout_opsm_threshold=0.01),
    ],
    ids=["vanilla", "decoupled-gspo-opsm", "bypass-ppo", "bypass-reinforce-opsm"],
)
def test_validate_false_skips_the_checks_and_nothing_else(cfg):
    """validate=False (a trainer's micro-batches after the first of a step) gives the loss, gradient and metrics of
    validate=True bit for bit; only the checks of §10 go: a 0.5 in the mask or a mismatched shape raises with
    validate=True, and the 0.5 passes unnoticed with validate=False (it counts as a valid token)."""
    log_prob, rollout, adv, mask = _bypass_batch(5, (4, 6), 0.3)
    mask[1, 3:] = 0.0
    keep = mask.clone()
    keep[2, 1] = 0.0
    weights = torch.linspace(0.5, 1.5, 24, dtype=F64).view(4, 6)

    def call(lp, m, validate):
        settings = dict(loss_agg_mode="seq-mean-token-mean", clip_ratio_high=0.28, loss_scale_factor=6)
        if cfg is not None and cfg.bypass_mode:
            return rc.compute_policy_loss_bypass_mode(lp, rollout, adv, m, cfg, **settings, validate=validate)
        extra = dict(rollout_is_weights=weights, keep_mask=keep, rollout_log_prob=rollout, config=cfg)
        return rc.compute_policy_loss_vanilla(rollout + 0.1, lp, adv, m, **settings, **extra, validate=validate)

    results = []
    for validate in (True, False):
        lp = log_prob.clone().requires_grad_()
        loss, met = call(lp, mask, validate)
        loss.backward()
        results.append((loss.detach(), lp.grad, list(met.items())))
    (loss_a, grad_a, met_a), (loss_b, grad_b, met_b) = results
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b)
    assert met_a == met_b and all(math.isfinite(v) for _, v in met_a)
    bad = mask.clone()
    bad[0, 0] = 0.5
    with pytest.raises(ValueError, match="only 0/1"):
        call(log_prob, bad, True)
    assert math.isfinite(call(log_prob, bad, False)[0].item())  # not checked: trusted
    with pytest.raises(ValueError, match=r"\(4, 6\).*\(4, 5\)"):
        call(log_prob, mask[:, :5], True)


# ------------------------------------------------------------------------------------------
# presets (§9.2, §9.3)
# ------------------------------------------------------------------------------------------

PRESET_TABLE = {
    # name: (rollout_is, is_threshold, rollout_rs, rs_threshold, bypass, loss_type, veto)
    "decoupled_token_is": ("token", 2.0, None, None, False, "ppo_clip", None),
    "decoupled_seq_is": ("sequence", 2.0, None, None, False, "ppo_clip", None),
    "decoupled_token_icepop": ("token", "0.5_5.0", None, None, False, "ppo_clip", None),
    "decoupled_seq_is_rs": ("sequence", 2.0, "seq_sum_k1", "0.5_2.0", False, "ppo_clip", None),
    "decoupled_seq_mis": ("sequence", 2.0, "seq_sum_k1", "_2.0", False, "ppo_clip", None),
    "bypass_pg_seq_mis": ("sequence", 2.0, "seq_sum_k1", "_2.0", True, "reinforce", None),
    "decoupled_geo_rs": (None, 2.0, "seq_mean_k1", "0.999_1.001", False, "ppo_clip", None),
    "bypass_ppo_clip": (None, 2.0, None, None, True, "ppo_clip", None),
    "bypass_ppo_clip_geo_rs": (None, 2.0, "seq_mean_k1", "0.999_1.001", True, "ppo_clip", None),
    "bypass_ppo_clip_k3_rs": (None, 2.0, "seq_mean_k3", 0.01, True, "ppo_clip", None),
    "bypass_pg_is": ("sequence", 2.0, None, None, True, "reinforce", None),
    "bypass_pg_token_icepop": ("token", "0.5_5.0", None, None, True, "reinforce", None),
    "bypass_pg_geo_rs": (None, 2.0, "seq_mean_k1", "0.999_1.001", True, "reinforce", None),
    "decoupled_geo_rs_seq_tis": ("sequence", 2.0, "seq_mean_k1", "0.999_1.001", False, "ppo_clip", None),
    "decoupled_geo_rs_token_tis": ("token", 2.0, "seq_mean_k1", "0.999_1.001", False, "ppo_clip", None),
    "bypass_pg_geo_rs_seq_tis": ("sequence", 2.0, "seq_mean_k1", "0.999_1.001", True, "reinforce", None),
    "bypass_pg_geo_rs_token_tis": ("token", 2.0, "seq_mean_k1", "0.999_1.001", True, "reinforce", None),
    "decoupled_k3_rs": (None, 2.0, "seq_mean_k3", 0.01, False, "ppo_clip", None),
    "decoupled_k3_rs_seq_tis": ("sequence", 2.0, "seq_mean_k3", 0.01, False, "ppo_clip", None),
    "decoupled_k3_rs_token_tis": ("token", 2.0, "seq_mean_k3", 0.01, False, "ppo_clip", None),
    "disabled": (None, 2.0, None, None, False, "ppo_clip", None),
    "naive": (None, 2.0, None, None, False, "ppo_clip", None),
    "ppo_is_bypass": ("token", 2.0, None, None, True, "ppo_clip", None),
    "pg_is": ("sequence", 2.0, None, None, True, "reinforce", None),
    "pg_rs": (None, 2.0, "geometric", 1.001, True, "reinforce", 1e-4),
    "bypass_pg_rs": (None, 2.0, "seq_mean_k1", "0.999_1.001", True, "reinforce", None),
    "decoupled_geo_is": ("geometric", 2.0, None, None, False, "ppo_clip", None),
    "decoupled_seq_mask_tis": ("token", math.inf, "seq_mean_k1", "0.999_1.002", False, "ppo_clip", None),
    "bypass_pg_seq_mask_tis": ("token", math.inf, "seq_mean_k1", "0.999_1.002", True, "reinforce", None),
}


FIELDS = (
    "rollout_is",
    "rollout_is_threshold",
    "rollout_rs",
    "rollout_rs_threshold",
    "bypass_mode",
    "loss_type",
    "rollout_token_veto_threshold",
)


@pytest.mark.parametrize("name", list(PRESET_TABLE))
def test_every_preset_matches_the_spec_table(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no preset warns (ppo_is_bypass is metrics-only on purpose)
        cfg = C.from_name(name)
        by_method = getattr(C, name)()
    assert tuple(getattr(cfg, f) for f in FIELDS) == PRESET_TABLE[name]
    assert cfg.rollout_is_batch_normalize is False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ppo_is_bypass built by hand warns, as it should
        by_hand = C(**dict(zip(FIELDS, PRESET_TABLE[name])))
    assert by_method == by_hand  # the classmethod form builds the table's config


def test_preset_names_and_lookup():
    assert len(rc.PRESET_NAMES) == 34 and set(rc.PRESET_NAMES) == set(PRESET_TABLE) | set(MASK_PRESETS)
    assert C.from_name("decoupled_seq_is", threshold=3.0) == C(rollout_is="sequence", rollout_is_threshold=3.0)
    assert C.from_name("decoupled_token_icepop", threshold=4.0, threshold_lower=0.25).is_spec == rc.ISThreshold(
        "icepop", 0.25, 4.0
    )
    assert C.bypass_pg_seq_mis(threshold=3.0).rs_specs == (rc.RSOption("seq_sum_k1", "k1", "seq_sum", None, 3.0),)
    assert C.pg_is(threshold=1.5) == C(
        rollout_is="sequence", rollout_is_threshold=1.5, bypass_mode=True, loss_type="reinforce"
    )
    with pytest.raises(ValueError) as info:
        C.from_name("decoupled_k1_rs")
    assert "'decoupled_k1_rs'" in str(info.value) and "bypass_pg_geo_rs" in str(info.value)
    with pytest.raises(TypeError, match="is_threshold; its arguments are threshold$"):
        C.decoupled_seq_is(is_threshold=3.0)  # a misspelt argument is refused, never ignored
    # naive and disabled are the same no-correction arm: decoupled PPO, every correction off
    off = C(
        rollout_is=None, rollout_rs=None, rollout_token_veto_threshold=None, bypass_mode=False, loss_type="ppo_clip"
    )
    assert C.naive() == off and C.disabled() == off
    assert C.naive().is_spec is None and C.naive().rs_specs == () and C.naive().veto_tau is None


def test_preset_variants_with_veto_and_legacy_lower():
    cfg = C.decoupled_geo_rs(rs_threshold=1.001, veto_threshold=1e-4)
    assert cfg.rs_specs[0] == rc.RSOption("seq_mean_k1", "k1", "seq_mean", 1 / 1.001, 1.001)
    assert cfg.veto_tau == 1e-4
    cfg = C.decoupled_geo_rs(rs_threshold=1.002, rs_threshold_lower=0.999)
    assert cfg.rollout_rs == "geometric"
    assert cfg.rs_specs[0] == rc.RSOption("seq_mean_k1", "k1", "seq_mean", 0.999, 1.002)
    assert C.pg_rs(rs_threshold_lower=0.998).rs_specs[0].lower == 0.998
    assert C.decoupled_seq_is_rs(is_threshold=3.0).is_spec == rc.ISThreshold("tis", None, 3.0)


def test_entry_point_takes_the_config_object():
    cfg = C.decoupled_geo_rs_token_tis()
    train, rollout, mask = make([[1.0005, 0.9995], [1.01, 1.0]])
    w, m2, met = rc.compute_rollout_correction_and_rejection_mask(train, rollout, mask, cfg)
    with pytest.raises(TypeError, match="RolloutCorrectionConfig"):
        rc.compute_rollout_correction_and_rejection_mask(train, rollout, mask, {"rollout_is": "token"})
    assert m2.tolist() == [[1, 1], [0, 0]]
    assert w is not None and "rollout_corr/rollout_rs_seq_mean_k1_mean" in met


def test_bypass_ppo_clip_with_is_warns():
    with pytest.warns(UserWarning, match="only adds IS metrics"):
        C(rollout_is="sequence", bypass_mode=True, loss_type="ppo_clip")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        C(rollout_is="sequence", bypass_mode=True, loss_type="reinforce")
        C(rollout_is="sequence")


# ------------------------------------------------------------------------------------------
# property tests (hypothesis)
# ------------------------------------------------------------------------------------------

CORR_CONFIGS = [
    {},
    {"rollout_is": "token", "rollout_is_threshold": 1.5},
    {"rollout_is": "sequence", "rollout_is_threshold": "0.5_3", "rollout_is_batch_normalize": True},
    {"rollout_is": "token", "rollout_is_threshold": "0.7_1.3", "rollout_is_batch_normalize": True},
    {"rollout_rs": "token_k1,seq_mean_k3,seq_max_k2", "rollout_rs_threshold": "0.6_1.6,0.05,0.3"},
    {"rollout_rs": "seq_sum_k1", "rollout_rs_threshold": 1.5, "rollout_token_veto_threshold": 0.3},
]


@PROPS
@given(batches(), st.sampled_from(CORR_CONFIGS), st.integers(1, 3))
def test_padding_invariance(batch, kwargs, extra):
    train, rollout, mask = batch
    w, m2, met = corr(train, rollout, mask, **kwargs)
    b, t = mask.shape

    def pad(x, v):
        return torch.nn.functional.pad(x, (0, extra, 0, extra), value=v)

    w_p, m2_p, met_p = corr(pad(train, NAN), pad(rollout, -math.inf), pad(mask, 0.0), **kwargs)
    same_metrics(met, met_p)
    assert torch.equal(m2_p[:b, :t], m2) and m2_p[b:].abs().sum() == 0
    if w is not None:
        torch.testing.assert_close(w_p[:b, :t], w)
        assert w_p[b:].abs().sum() == 0 and w_p[:, t:].abs().sum() == 0
    adv = torch.linspace(-1, 1, b * t, dtype=F64).reshape(b, t)
    for mode in rc.LOSS_AGG_MODES:
        loss, _ = rc.compute_policy_loss_vanilla(rollout, train, adv, mask, mode, keep_mask=m2, loss_scale_factor=7)
        loss_p, _ = rc.compute_policy_loss_vanilla(
            pad(rollout, 0.0), pad(train, 0.0), pad(adv, 5.0), pad(mask, 0.0), mode, keep_mask=m2_p, loss_scale_factor=7
        )
        assert loss_p.item() == approx(loss.item())


@PROPS
@given(batches(min_rows=2), st.sampled_from(CORR_CONFIGS), st.randoms())
def test_row_permutation_equivariance(batch, kwargs, rnd):
    train, rollout, mask = batch
    perm = list(range(mask.shape[0]))
    rnd.shuffle(perm)
    perm = torch.tensor(perm)
    w, m2, met = corr(train, rollout, mask, **kwargs)
    w_p, m2_p, met_p = corr(train[perm], rollout[perm], mask[perm], **kwargs)
    same_metrics(met, met_p)
    assert torch.equal(m2_p, m2[perm])
    if w is not None:
        torch.testing.assert_close(w_p, w[perm])


@PROPS
@given(batches(), st.sampled_from(["token", "sequence"]), st.floats(1.0, 3.0))
def test_tis_never_exceeds_cap_and_pads_with_zero(batch, level, cap):
    train, rollout, mask = batch
    w, _, met = corr(train, rollout, mask, rollout_is=level, rollout_is_threshold=cap)
    assert w.max().item() <= cap
    assert w[mask == 0].abs().sum().item() == 0.0
    assert met["rollout_is_max"] <= cap or level == "sequence"
    if level == "sequence":  # all valid tokens of a row share one weight
        for i in range(mask.shape[0]):
            vals = w[i][mask[i] == 1]
            assert vals.numel() == 0 or torch.all(vals == vals[0])


@PROPS
@given(
    batches(), st.sampled_from(CORR_CONFIGS[4:] + [{"rollout_rs": "seq_sum_k2,token_k3", "rollout_rs_threshold": 0.05}])
)
def test_rs_never_adds_tokens(batch, kwargs):
    train, rollout, mask = batch
    _, m2, _ = corr(train, rollout, mask, **kwargs)
    assert torch.all(m2 <= mask)


@PROPS
@given(batches(), st.sampled_from(["token", "sequence"]), st.sampled_from([1.2, "0.5_2.0"]))
def test_batch_normalization_gives_mean_one(batch, level, threshold):
    train, rollout, mask = batch
    w, _, met = corr(
        train, rollout, mask, rollout_is=level, rollout_is_threshold=threshold, rollout_is_batch_normalize=True
    )
    m = mask.bool()
    if met["rollout_is_batch_norm_factor"] == 1.0 and w[m].sum() == 0:
        return  # everything zeroed by IcePop: factor 1, weights unchanged
    if level == "token":
        assert w[m].mean().item() == approx(1.0, rel=1e-9)
    else:
        rows = [w[i][m[i]].mean().item() for i in range(m.shape[0]) if m[i].any()]
        assert sum(rows) / len(rows) == approx(1.0, rel=1e-9)


@PROPS
@given(batches(min_rows=2), st.sampled_from(rc.LOSS_AGG_MODES), st.data())
def test_micro_batch_split_independence(batch, mode, data):
    train, rollout, mask = batch
    b = mask.shape[0]
    cut = data.draw(st.integers(1, b - 1))
    adv = torch.sin(torch.arange(mask.numel(), dtype=F64)).reshape(mask.shape)
    _, keep, _ = corr(train, rollout, mask, rollout_rs="token_k1", rollout_rs_threshold=1.3)
    w, _, _ = corr(train, rollout, mask, rollout_is="token", rollout_is_threshold=1.5)
    n_tok, n_seq = mask.sum(), (mask.sum(-1) > 0).sum()
    current = (train + 0.01).requires_grad_()
    kw = {"global_token_count": n_tok, "global_seq_count": n_seq, "loss_scale_factor": 9.0}
    full, _ = rc.compute_policy_loss_vanilla(
        train, current, adv, mask, mode, rollout_is_weights=w, keep_mask=keep, **kw
    )
    full.backward()
    grad_full, current.grad = current.grad.clone(), None
    total = 0.0
    for sl in (slice(0, cut), slice(cut, b)):
        if mask[sl].sum() == 0:
            continue  # an all-padded micro-batch contributes nothing
        part, _ = rc.compute_policy_loss_vanilla(
            train[sl], current[sl], adv[sl], mask[sl], mode, rollout_is_weights=w[sl], keep_mask=keep[sl], **kw
        )
        part.backward()
        total += part.item()
    assert total == approx(full.item(), rel=1e-9, abs_=1e-12)
    torch.testing.assert_close(current.grad, grad_full)


@PROPS
@given(batches(), st.sampled_from(rc.LOSS_AGG_MODES), st.booleans())
def test_rs_equals_zeroing_rejected_token_losses(batch, mode, bypass):
    train, rollout, mask = batch
    adv = torch.cos(torch.arange(mask.numel(), dtype=F64)).reshape(mask.shape)
    rs = {"rollout_rs": "token_k1,seq_max_k2", "rollout_rs_threshold": "0.8_1.25,0.02"}
    _, keep, _ = corr(train, rollout, mask, **rs)
    zeroed_adv = torch.where(keep.bool(), adv, torch.zeros_like(adv))  # phi(A = 0) = 0
    if bypass:
        with_rs = C(bypass_mode=True, **rs)
        loss, _ = rc.compute_policy_loss_bypass_mode(train, rollout, adv, mask, with_rs, mode, loss_scale_factor=5)
        ref, _ = rc.compute_policy_loss_bypass_mode(
            train, rollout, zeroed_adv, mask, C.bypass_ppo_clip(), mode, loss_scale_factor=5
        )
    else:
        current = train + 0.05
        loss, _ = rc.compute_policy_loss_vanilla(train, current, adv, mask, mode, keep_mask=keep, loss_scale_factor=5)
        ref, _ = rc.compute_policy_loss_vanilla(train, current, zeroed_adv, mask, mode, loss_scale_factor=5)
    assert loss.item() == approx(ref.item(), rel=1e-12, abs_=1e-15)


@PROPS
@given(batches(scale=0.05), st.sampled_from(["token-mean", "seq-mean-token-mean"]))
def test_bypass_ppo_clip_gradient_is_is_weighted_policy_gradient(batch, mode):
    train, rollout, mask = batch  # |log pi_theta - log mu| small: inside the clip w.h.p.
    theta = torch.where(mask.bool(), train, torch.zeros_like(train))
    inside = ((theta - rollout).abs() < math.log(1.19)) | ~mask.bool()
    if not bool(inside.all()):
        return
    adv = torch.tanh(torch.arange(mask.numel(), dtype=F64).reshape(mask.shape) - 3.0)
    a = theta.clone().requires_grad_()
    loss, _ = rc.compute_policy_loss_bypass_mode(a, rollout, adv, mask, C.bypass_ppo_clip(), mode)
    loss.backward()
    b = theta.clone().requires_grad_()
    rho = torch.exp(theta - torch.where(mask.bool(), rollout, torch.zeros_like(rollout)))
    ref, _ = rc.compute_policy_loss_reinforce(b, rollout, adv, mask, mode, rollout_is_weights=rho)
    ref.backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)


@PROPS
@given(batches())
def test_reinforce_gradient_is_minus_a_w_over_n(batch):
    train, rollout, mask = batch
    adv = torch.sin(torch.arange(mask.numel(), dtype=F64)).reshape(mask.shape)
    lp = torch.where(mask.bool(), train, torch.zeros_like(train)).requires_grad_()
    weights = torch.exp(lp - torch.where(mask.bool(), rollout, torch.zeros_like(rollout)))
    keep = (torch.arange(mask.numel()).reshape(mask.shape) % 3 != 0).to(F64)
    loss, _ = rc.compute_policy_loss_reinforce(
        lp, rollout, adv, mask, "token-mean", rollout_is_weights=weights, keep_mask=keep
    )
    loss.backward()
    expected = torch.where((mask * keep).bool(), -adv * weights.detach() / mask.sum(), torch.zeros_like(adv))
    torch.testing.assert_close(lp.grad, expected, rtol=1e-10, atol=1e-12)


@PROPS
@given(batches(scale=1.0), st.floats(0.3, 0.95), st.floats(1.05, 3.0))
def test_k1_direction_with_asymmetric_bounds(batch, lower, upper):
    train, rollout, mask = batch
    _, m2, _ = corr(train, rollout, mask, rollout_rs="token_k1", rollout_rs_threshold=f"{lower}_{upper}")
    expected = [
        [
            bool(mask[i, t]) and lower <= math.exp(train[i, t].item() - rollout[i, t].item()) <= upper
            for t in range(mask.shape[1])
        ]
        for i in range(mask.shape[0])
    ]  # ratio space, |l| << 20
    assert m2.bool().tolist() == expected


@PROPS
@given(batches(scale=0.3), st.lists(st.sampled_from(rc.RS_OPTIONS), min_size=2, max_size=4, unique=True))
def test_chaining_is_product_of_single_masks(batch, options):
    train, rollout, mask = batch
    thresholds = ["0.7_1.4" if o.endswith("k1") else "0.03" for o in options]
    _, chained, _ = corr(train, rollout, mask, rollout_rs=",".join(options), rollout_rs_threshold=",".join(thresholds))
    product = mask.clone()
    for option, threshold in zip(options, thresholds):
        _, single, _ = corr(train, rollout, mask, rollout_rs=option, rollout_rs_threshold=threshold)
        product = product * single
    assert torch.equal(chained, product)


@PROPS
@given(
    batches(scale=0.3),
    st.sampled_from(list(rc.LEGACY_RS_NAMES)),
    st.floats(1.01, 2.0),
    st.one_of(st.none(), st.floats(0.5, 0.99)),
)
def test_legacy_names_equal_canonical_mapping(batch, legacy, upper, lower):
    train, rollout, mask = batch
    _, m_legacy, met = corr(
        train, rollout, mask, rollout_rs=legacy, rollout_rs_threshold=upper, rollout_rs_threshold_lower=lower
    )
    spec = f"{1 / upper if lower is None else lower}_{upper}"
    _, m_canon, met_c = corr(train, rollout, mask, rollout_rs=rc.LEGACY_RS_NAMES[legacy], rollout_rs_threshold=spec)
    assert torch.equal(m_legacy, m_canon)
    same_metrics(met, met_c)


@PROPS
@given(batches(scale=1.0), st.floats(0.05, 0.9))
def test_veto_on_unclipped_ratios(batch, tau):
    train, rollout, mask = batch
    train = train * 12  # produce log-ratios beyond the safety bound too
    _, m2, met = corr(train, rollout, mask, rollout_token_veto_threshold=tau)
    for i in range(mask.shape[0]):
        valid = mask[i].bool()
        ratios = [math.exp(train[i, t].item() - rollout[i, t].item()) for t in range(mask.shape[1]) if valid[t]]
        vetoed = bool(ratios) and min(ratios) < tau  # min_t rho < tau, in Python floats
        assert torch.equal(m2[i].bool(), valid & (not vetoed))
    assert 0.0 <= met["rollout_is_veto_fraction"] <= 1.0


@PROPS
@given(batches(scale=0.05), st.sampled_from(["token", "sequence"]))
def test_ess_is_zero_when_icepop_zeroes_everything(batch, level):
    train, rollout, mask = batch
    w, m2, met = corr(
        train, rollout, mask, rollout_is=level, rollout_is_threshold="1e3_1e4", rollout_is_batch_normalize=True
    )
    assert w.abs().sum().item() == 0.0
    assert torch.equal(m2, mask)
    assert met["rollout_is_eff_sample_size"] == 0.0
    assert met["rollout_is_batch_norm_factor"] == 1.0
    assert met["rollout_is_oob_ratio"] == 1.0


# ---- Defects found by review (issue 14) -------------------------------------------------------------------
def test_replace_keeps_the_unset_loss_type_open():
    base = rc.RolloutCorrectionConfig()
    assert base.loss_type == "ppo_clip"
    replaced = dataclasses.replace(base, bypass_mode=True, use_policy_gradient=True)
    assert replaced.loss_type == "reinforce"
    assert replaced == rc.RolloutCorrectionConfig(bypass_mode=True, use_policy_gradient=True)
    explicit = rc.RolloutCorrectionConfig(bypass_mode=True, loss_type="ppo_clip")
    with pytest.raises(ValueError, match="conflicts"):  # a loss_type the user set still wins over the alias
        dataclasses.replace(explicit, use_policy_gradient=True)


@pytest.mark.parametrize("count", [torch.tensor(0.0), torch.tensor(-3.0), torch.tensor([2.0, 3.0])])
def test_agg_loss_refuses_a_bad_tensor_count(count):
    loss, mask = torch.ones(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="global_token_count must be a positive number"):
        rc.agg_loss(loss, mask, "token-mean", global_token_count=count)
    assert rc.agg_loss(loss, mask, "token-mean", global_token_count=torch.tensor(12.0)).item() == 0.5


def test_thresholds_of_a_correction_that_is_off_are_not_parsed():
    # IS like RS: a threshold left behind by a preset whose correction an override turned off is ignored.
    config = rc.RolloutCorrectionConfig(rollout_is=None, rollout_is_threshold="not-a-number")
    assert config.is_spec is None
    assert rc.RolloutCorrectionConfig(rollout_rs=None, rollout_rs_threshold="not-a-number").rs_specs == ()
    with pytest.raises(ValueError):
        rc.RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold="not-a-number")


# ---- One-sided Seq-MIS and k1 gates without a lower bound (§3.4, §4.2, §9.2) ------------------------------
def test_seq_mis_preset_drops_rows_over_c_and_weights_the_rest_by_rho():
    # sequence ratios: 1.8 (kept), 3.0 (> C = 2: dropped, not truncated), 0.05 (kept: no lower bound),
    # 2.0 (kept: the bound is inclusive); the last row has one padded position
    train, rollout, mask = make([[1.5, 1.2], [2.0, 1.5], [0.1, 0.5], [2.0]])
    for cfg in (C.decoupled_seq_mis(), C.bypass_pg_seq_mis()):
        w, m2, met = rc.compute_rollout_correction_and_rejection_mask(train, rollout, mask, cfg)
        assert m2.tolist() == [[1, 1], [0, 0], [1, 1], [1, 0]]
        kept = (w * m2).tolist()  # the applied weight rho * 1[rho <= C]
        assert kept == [[approx(1.8), approx(1.8)], [0.0, 0.0], [approx(0.05), approx(0.05)], [approx(2.0), 0.0]]
        assert met["rollout_corr/rollout_rs_seq_sum_k1_seq_masked_fraction"] == approx(1 / 4)
        assert met["rollout_corr/rollout_rs_seq_sum_k1_fraction_high"] == 0.0  # no ratio below a lower bound
        assert met["rollout_corr/rollout_rs_seq_sum_k1_fraction_low"] == approx(1 / 4)  # ratio above C
    # the two-sided Seq-MIS of decoupled_seq_is_rs ([0.5, 2]) would also drop the 0.05 row
    _, m2, _ = rc.compute_rollout_correction_and_rejection_mask(train, rollout, mask, C.decoupled_seq_is_rs())
    assert m2.tolist() == [[1, 1], [0, 0], [0, 0], [1, 0]]


def test_bypass_pg_seq_mis_loss_by_hand():
    log_prob = torch.tensor([[-0.4, -1.0], [-0.2, -0.3], [-2.0, -0.5]], dtype=F64, requires_grad=True)
    ratios = [[1.5, 1.2], [2.0, 1.5], [0.1, 0.5]]  # products 1.8, 3.0 (rejected), 0.05
    rollout = log_prob.detach() - torch.log(torch.tensor(ratios, dtype=F64))
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [0.5, 0.5]], dtype=F64)
    mask = torch.ones((3, 2), dtype=F64)
    loss, _ = rc.compute_policy_loss_bypass_mode(
        log_prob, rollout, adv, mask, C.bypass_pg_seq_mis(), "seq-mean-token-sum"
    )
    # -(1/V) sum_i 1[rho_i <= 2] rho_i A_i sum_t log pi, V = 3 (the rejected row still counts)
    assert loss.item() == approx(-(1.8 * 1.0 * -1.4 + 0.05 * 0.5 * -2.5) / 3)


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0_2.0"}, "lower bound of '0' is"),
        ({"rollout_rs": "token_k1", "rollout_rs_threshold": " 0.0 _1.5"}, "lower bound of '0.0' is"),
        ({"rollout_rs": "seq_mean_k2,seq_mean_k1", "rollout_rs_threshold": "0.1,0e0_1.01"}, "lower bound of '0e0' is"),
        (
            {"rollout_rs": "sequence", "rollout_rs_threshold": 2.0, "rollout_rs_threshold_lower": 0},
            "lower bound of 0 is",
        ),
    ],
)
def test_k1_lower_bound_of_zero_is_refused(kwargs, named):
    with pytest.raises(ValueError, match="log\\(0\\) = -inf") as info:
        C(**kwargs)
    assert named in str(info.value)  # the bad value itself, as given
    assert "'_2.0'" in str(info.value)  # and the one-sided form to use instead


def test_k1_single_upper_bound_form():
    spec = rc.parse_rs_options("token_k1", "_1.5")[0]
    assert spec == rc.RSOption("token_k1", "k1", "token", None, 1.5)
    assert spec.interval == (-math.log(1.5), math.inf)
    assert rc.parse_rs_options("token_k1", 1.5)[0].lower == 1 / 1.5  # a plain number stays [1/u, u]
    _, m2, _ = corr(*make([[1e-6, 0.5, 1.5, 1.6]]), rollout_rs="token_k1", rollout_rs_threshold="_1.5")
    assert m2.tolist() == [[1, 1, 1, 0]]
    for bad in (
        {"rollout_rs": "token_k2", "rollout_rs_threshold": "_0.5"},  # k2/k3: one upper bound only
        {"rollout_is": "token", "rollout_is_threshold": "_2.0"},
    ):  # IcePop needs both sides
        with pytest.raises(ValueError, match="'_"):
            C(**bad)


# ---- The +/-20 safety clip in the k3 and chi2 metrics (§2, §6.4) -------------------------------------
def test_k3_and_chi2_metrics_clip_log_ratios_beyond_twenty():
    train, rollout, mask = logs([[25.0, 0.0], [-25.0]])
    _, _, met = corr(train, rollout, mask)
    e = math.exp
    k3 = [e(20.0) - 1 - 20.0, 0.0, e(-20.0) - 1 + 20.0]  # l = 25 and -25 enter as +/-20
    assert met["k3_kl"] == pytest.approx(sum(k3) / 3, rel=1e-12)
    assert met["chi2_token"] == pytest.approx((e(40.0) + 1 + e(-40.0)) / 3 - 1, rel=1e-12)
    assert met["chi2_seq"] == pytest.approx((e(40.0) + e(-40.0)) / 2 - 1, rel=1e-12)  # s = 25, -25 clipped
    assert met["kl"] == approx(0.0)  # the k1 metric is not clipped: (-25 - 0 + 25) / 3
    assert met["chi2_token"] < e(45.0)  # unclipped it would be (e^50 + 1 + e^-50) / 3 - 1


# ---- Bypass REINFORCE with RS, veto, IcePop and batch normalisation together (§7.4, §3.7) ---------------
def test_bypass_reinforce_with_rs_veto_icepop_and_batch_norm_by_hand():
    ratios = [[1.0, 3.0, 1.5], [0.4, 1.2], [1.1, 0.001], [0.8]]
    log_prob = torch.tensor(
        [[-1.0, -0.2, -0.7], [-1.5, -0.3, NAN], [-0.1, -3.0, NAN], [-0.9, NAN, NAN]], dtype=F64, requires_grad=True
    )
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 0, 0]], dtype=F64)
    rollout = log_prob.detach().clone()
    for i, row in enumerate(ratios):
        for t, r in enumerate(row):
            rollout[i, t] -= math.log(r)
    adv = torch.tensor([[1.0], [-0.5], [2.0], [1.5]], dtype=F64).expand(4, 3)
    cfg = C(
        rollout_is="token",
        rollout_is_threshold="0.5_2.0",
        rollout_is_batch_normalize=True,
        rollout_rs="token_k1",
        rollout_rs_threshold="0.3_2.5",
        rollout_token_veto_threshold=0.01,
        bypass_mode=True,
        loss_type="reinforce",
    )
    loss, met = rc.compute_policy_loss_bypass_mode(log_prob, rollout, adv, mask, cfg)
    # IcePop [0.5, 2] zeroes 3.0, 0.4, 0.001: applied [1, 0, 1.5 | 0, 1.2 | 1.1, 0 | 0.8], Z = 5.6 / 8 = 0.7
    # RS token_k1 [0.3, 2.5] rejects 3.0 and 0.001; the veto (rho < 0.01) rejects all of row 2
    # kept: (0,0) w 1, (0,2) w 1.5, (1,0) w 0, (1,1) w 1.2, (3,0) w 0.8; N = 8 (pre-rejection)
    z, n = 0.7, 8
    kept = {(0, 0): 1.0, (0, 2): 1.5, (1, 0): 0.0, (1, 1): 1.2, (3, 0): 0.8}
    a = [1.0, -0.5, 2.0, 1.5]
    lp = log_prob.detach()
    assert loss.item() == approx(sum(-a[i] * lp[i, t].item() * w / z for (i, t), w in kept.items()) / n)
    assert loss.item() == approx((1.0 + 1.05 - 0.18 + 1.08) / 0.7 / 8)  # the same sum written out
    loss.backward()
    want = torch.zeros((4, 3), dtype=F64)
    for (i, t), w in kept.items():
        want[i, t] = -a[i] * w / z / n
    torch.testing.assert_close(log_prob.grad, want, rtol=1e-10, atol=1e-12)
    assert met["rollout_corr/rollout_is_batch_norm_factor"] == approx(z)
    assert met["rollout_corr/rollout_is_veto_fraction"] == approx(1 / 4)
    assert met["rollout_corr/rollout_rs_masked_fraction"] == approx(2 / 8)
    assert met["rollout_corr/rollout_is_oob_ratio"] == approx(3 / 8)


# ---- Sequence IS over micro-batches with global denominators (§7.5) ------------------------------------
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_sequence_is_over_micro_batches_equals_the_whole_batch(mode):
    gen = torch.Generator().manual_seed(7)
    rollout = -torch.rand((6, 5), generator=gen, dtype=F64) * 2
    theta = rollout + 0.2 * torch.randn((6, 5), generator=gen, dtype=F64)
    mask = torch.tensor(
        [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]],
        dtype=F64,
    )
    adv = torch.randn((6, 1), generator=gen, dtype=F64).expand(6, 5)
    cfg = C(
        rollout_is="sequence",
        rollout_is_threshold=1.3,
        rollout_rs="seq_mean_k3",
        rollout_rs_threshold=0.014,
        bypass_mode=True,
        loss_type="reinforce",
    )
    w, keep, _ = rc.compute_rollout_correction_and_rejection_mask(theta, rollout, mask, cfg)
    assert keep.sum(-1).tolist() == [0, 3, 1, 4, 2, 0] and w[5, 0].item() == 1.3  # RS and the cap both act
    counts = {"global_token_count": mask.sum(), "global_seq_count": 6}
    whole_in = theta.clone().requires_grad_()
    whole, _ = rc.compute_policy_loss_bypass_mode(whole_in, rollout, adv, mask, cfg, mode, **counts)
    whole.backward()
    parts_in = theta.clone().requires_grad_()
    total = sum(
        rc.compute_policy_loss_bypass_mode(parts_in[rows], rollout[rows], adv[rows], mask[rows], cfg, mode, **counts)[0]
        for rows in (slice(0, 2), slice(2, 6))
    )
    total.backward()
    assert total.item() == approx(whole.item(), rel=1e-12)
    torch.testing.assert_close(parts_in.grad, whole_in.grad, rtol=1e-12, atol=1e-14)
    assert whole_in.grad.abs().sum() > 0
    # without the global count a micro-batch divides by its own tokens: the sum is then another number
    local = sum(
        rc.compute_policy_loss_bypass_mode(theta[rows], rollout[rows], adv[rows], mask[rows], cfg, mode)[0]
        for rows in (slice(0, 2), slice(2, 6))
    )
    assert local.item() != approx(whole.item(), rel=1e-6)


# ---- bf16 log-probs (§1 work dtype) ---------------------------------------------------------------------
def test_bf16_log_probs_match_float32_within_bf16_tolerance():
    gen = torch.Generator().manual_seed(8)
    rollout32 = -torch.rand((4, 6), generator=gen) * 2
    train32 = rollout32 + 0.05 * torch.randn((4, 6), generator=gen)
    mask = torch.ones((4, 6))
    mask[1, 4:] = 0
    cfg = C(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="token_k1", rollout_rs_threshold=1.5)
    train16, rollout16 = train32.bfloat16(), rollout32.bfloat16()
    w16, m16, met16 = rc.compute_rollout_correction_and_rejection_mask(train16, rollout16, mask, cfg)
    assert w16.dtype == torch.float32 and m16.dtype == mask.dtype
    assert all(isinstance(v, float) and math.isfinite(v) for k, v in met16.items() if "pearson" not in k)
    # the correction runs in fp32: bf16 inputs give exactly what fp32 copies of the same values give
    w_same, m_same, met_same = rc.compute_rollout_correction_and_rejection_mask(
        train16.float(), rollout16.float(), mask, cfg
    )
    assert torch.equal(w16, w_same) and torch.equal(m16, m_same) and met16.keys() == met_same.keys()
    # and the fp32 originals within bf16 rounding (|l| error ~ 2^-8 |log p| per token)
    w32, _, met32 = rc.compute_rollout_correction_and_rejection_mask(train32, rollout32, mask, cfg)
    torch.testing.assert_close(w16, w32, rtol=0.05, atol=1e-3)
    assert met16["rollout_corr/rollout_ppl"] == pytest.approx(met32["rollout_corr/rollout_ppl"], rel=1e-2)
    # losses: a bf16 log_prob gives an fp32 loss and a bf16 gradient
    adv = torch.randn((4, 6), generator=gen)
    for loss_cfg in (C.bypass_ppo_clip(), C.bypass_pg_is()):
        lp16 = train16.clone().requires_grad_()
        loss16, _ = rc.compute_policy_loss_bypass_mode(lp16, rollout16, adv.bfloat16(), mask, loss_cfg)
        loss16.backward()
        assert loss16.dtype == torch.float32 and lp16.grad.dtype == torch.bfloat16
        loss32, _ = rc.compute_policy_loss_bypass_mode(train32, rollout32, adv, mask, loss_cfg)
        assert loss16.item() == pytest.approx(loss32.item(), rel=0.05, abs=1e-3)


# ------------------------------------------------------------------------------------------
# objectives: the loss-mode registry (§7.7)
# ------------------------------------------------------------------------------------------


def _one_row(log_prob, prox, adv, mode, **cfg):
    """Decoupled loss of one response with the objective ``mode``; returns (loss, metrics, grad)."""
    lp = torch.tensor([log_prob], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([prox], dtype=torch.float64)
    a = torch.tensor([adv], dtype=torch.float64)
    mask = torch.ones_like(old)
    loss, met = rc.compute_policy_loss_vanilla(old, lp, a, mask, config=C(loss_mode=mode, **cfg))
    loss.backward()
    return float(loss.detach()), met, lp.grad[0].tolist()


def test_registry_holds_verls_loss_modes():
    assert set(rc.POLICY_LOSSES) >= {  # verl's; a fork adds its own (README "Fork it": "topr")
        "vanilla",
        "gspo",
        "gspo_token",
        "cispo",
        "sapo",
        "geo_mean",
        "dppo_tv",
        "dppo_kl",
        "clip_cov",
        "kl_cov",
    }
    cfg = C()
    assert (cfg.loss_mode, cfg.clip_cov_ratio, cfg.clip_cov_lb, cfg.clip_cov_ub) == ("vanilla", 0.0002, 1.0, 5.0)
    assert (cfg.kl_cov_ratio, cfg.ppo_kl_coef, cfg.tau_pos, cfg.tau_neg) == (0.0002, 0.1, 1.0, 1.05)


def test_vanilla_mode_is_the_ppo_loss_bit_for_bit():
    gen = torch.Generator().manual_seed(3)
    old = -torch.rand((3, 4), generator=gen)
    lp = old + 0.3 * torch.randn((3, 4), generator=gen)
    adv, mask = torch.randn((3, 4), generator=gen), torch.ones((3, 4))
    w = torch.rand((3, 4), generator=gen) + 0.5
    a, ma = rc.compute_policy_loss_vanilla(old, lp, adv, mask, rollout_is_weights=w)
    b, mb = rc.compute_policy_loss_vanilla(old, lp, adv, mask, rollout_is_weights=w, config=C())
    assert torch.equal(a, b) and ma == mb


def test_gspo_sequence_ratio_and_its_token_variant_agree_with_a_row_advantage():
    # l = (0.2, 0.0): log s = 0.1, s = e^0.1 inside [0.8, 1.2]; A = 1: L = -e^0.1 on both tokens.
    # gradient: -A s / n = -e^0.1 / 2 on each token, for both forms.
    for mode in ("gspo", "gspo_token"):
        loss, met, grad = _one_row([-1.0, -2.0], [-1.2, -2.0], [1.0, 1.0], mode)
        assert loss == pytest.approx(-math.exp(0.1))
        assert grad == pytest.approx([-math.exp(0.1) / 2] * 2)
        assert met["actor/pg_clipfrac"] == 0.0
    # s = e^0.5 > 1.2 with A = 1: the clipped term wins and the gradient is 0
    loss, met, grad = _one_row([-1.0, -2.0], [-2.0, -2.0], [1.0, 1.0], "gspo")
    assert loss == pytest.approx(-1.2) and grad == [0.0, 0.0] and met["actor/pg_clipfrac"] == 1.0


def test_gspo_spreads_token_is_weights_over_the_row():
    # One row, l = (0.2, 0.0): s = e^0.1 inside [0.8, 1.2], A = 1, seq-mean-token-mean over n = 2 tokens.
    # gspo_token: phi_t = -w_t s_t, grad_t = -(1/2) w_t s (each token's own weight, verl's gspo).
    # gspo:       phi_t = -w_t s_i, loss = -s_i mean(w), grad_t = -mean(w) s / 2 (the row's mean weight).
    # Both losses are -s mean(w); with w constant in the row the gradients agree too.
    s = math.exp(0.1)

    def run(mode, weights):
        lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
        old = torch.tensor([[-1.2, -2.0]], dtype=torch.float64)
        adv, mask = torch.ones_like(old), torch.ones_like(old)
        w = torch.tensor([weights], dtype=torch.float64)
        loss, _ = rc.compute_policy_loss_vanilla(old, lp, adv, mask, rollout_is_weights=w, config=C(loss_mode=mode))
        loss.backward()
        return float(loss.detach()), lp.grad[0].tolist()

    for mode, grad in (("gspo_token", [-0.25 * s, -0.75 * s]), ("gspo", [-0.5 * s, -0.5 * s])):
        loss, g = run(mode, [0.5, 1.5])
        assert loss == pytest.approx(-s) and g == pytest.approx(grad), mode
    for mode in ("gspo_token", "gspo"):
        loss, g = run(mode, [0.8, 0.8])
        assert loss == pytest.approx(-0.8 * s) and g == pytest.approx([-0.4 * s, -0.4 * s]), mode


def test_cispo_keeps_the_gradient_of_a_clipped_token_through_a_stop_gradient_weight():
    # r = e^0.5 = 1.65 -> clip 1.2 (detached); phi = -1.2 * A * log pi = -1.2 * 2 * (-1) = 2.4
    loss, met, grad = _one_row([-1.0], [-1.5], [2.0], "cispo")
    assert loss == pytest.approx(2.4) and grad == pytest.approx([-2.4]) and met["actor/pg_clipfrac"] == 1.0
    _, _, ppo_grad = _one_row([-1.0], [-1.5], [2.0], "vanilla")
    assert ppo_grad == [0.0]  # PPO zeroes this token; CISPO does not


def test_sapo_gate_value_and_slope_at_ratio_one():
    # r = 1, tau_pos = 1: f = 4/tau * sigmoid(0) = 2, phi = -2 A; d phi / d log pi = -A * 4 * sigmoid'(0) = -1
    loss, met, grad = _one_row([-1.0], [-1.0], [1.0], "sapo")
    assert (
        loss == pytest.approx(-2.0)
        and grad == pytest.approx([-1.0])
        and met == {"actor/pg_loss": -2.0, "actor/ppo_kl": 0.0}
    )
    # A < 0 takes tau_neg = 1.05: phi = -(4/1.05) * 0.5 * (-1) = 2/1.05
    assert _one_row([-1.0], [-1.0], [-1.0], "sapo")[0] == pytest.approx(2.0 / 1.05)


def test_geo_mean_clips_the_log_ratio_and_averages_it_geometrically():
    # l = (0.5, -0.1), A = 1: clip(l, -0.2, 0.2) = (0.2, -0.1), min -> (0.2, -0.1); r = e^0.05; L = -e^0.05
    loss, met, grad = _one_row([-0.5, -1.1], [-1.0, -1.0], [1.0, 1.0], "geo_mean")
    assert loss == pytest.approx(-math.exp(0.05))
    assert grad == pytest.approx([0.0, -math.exp(0.05) / 2])  # the clipped token has no gradient
    assert met["actor/pg_clipfrac"] == 0.5 and met["actor/pg_clipfrac_lower"] == 0.0


def test_dppo_tv_and_kl_trust_regions():
    # token 1: p = 0.5, q = 0.2, p - q = 0.3 > 0.2 with A > 0 -> outside; token 2: p = 0.3, q = 0.25 -> inside,
    # r = 1.2: phi = -A * 1.2 * log 0.3; token-mean over 2 tokens
    lp, q = [math.log(0.5), math.log(0.3)], [math.log(0.2), math.log(0.25)]
    loss, met, grad = _one_row(lp, q, [1.0, 1.0], "dppo_tv")
    assert loss == pytest.approx(-1.2 * math.log(0.3) / 2)
    assert grad == pytest.approx([0.0, -1.2 / 2]) and met["actor/pg_clipfrac"] == 0.5
    # binary KL(0.2 || 0.5) = 0.2 log 0.4 + 0.8 log 1.6 = 0.1927 <= 0.2 -> inside for dppo_kl
    d = rc.binary_kl(torch.tensor(math.log(0.2), dtype=torch.float64), torch.tensor(math.log(0.5), dtype=torch.float64))
    assert float(d) == pytest.approx(0.2 * math.log(0.4) + 0.8 * math.log(0.8 / 0.5), abs=1e-7)
    loss, met, _ = _one_row(lp, q, [1.0, 1.0], "dppo_kl")
    assert met["actor/pg_clipfrac"] == 0.0
    assert loss == pytest.approx(-(2.5 * math.log(0.5) + 1.2 * math.log(0.3)) / 2)


def test_cov_modes_select_by_advantage_log_prob_covariance():
    # 4 tokens, A = (2, 0, 0, -2), log pi = (-1, -2, -2, -3): cov = (A - 0)(log pi + 2) = (2, 0, 0, 2)
    lp, adv = [-1.0, -2.0, -2.0, -3.0], [2.0, 0.0, 0.0, -2.0]
    # kl_cov: ratio 0.25 -> 1 token of largest cov (tie: topk picks one); r = 1 so |l| = 0 adds nothing
    loss, _, _ = _one_row(lp, lp, adv, "kl_cov", kl_cov_ratio=0.25)
    assert loss == pytest.approx(0.0)
    # clip_cov with lb = 1.5, ub = 5, ratio 0.5 -> 2 tokens, exactly the two candidates: their gradient is gone
    loss, met, grad = _one_row(lp, lp, adv, "clip_cov", clip_cov_ratio=0.5, clip_cov_lb=1.5)
    assert grad == [0.0, 0.0, 0.0, 0.0] and met["actor/pg_clipfrac"] == 0.5
    # kl_cov's penalty: l = (0.1, 0, 0, 0), A = (2, 0, 0, -1), <A> = 0.25: cov = (1.75, 0, 0, 1.25), so token 1
    # alone gets + 0.1 * |0.1|; phi = (-2 e^0.1 + 0.01, 0, 0, 1)
    loss, _, _ = _one_row(lp, [-1.1, -2.0, -2.0, -3.0], [2.0, 0.0, 0.0, -1.0], "kl_cov", kl_cov_ratio=0.25)
    assert loss == pytest.approx((-2 * math.exp(0.1) + 0.1 * 0.1 + 1.0) / 4)


def test_loss_mode_in_bypass_uses_the_ratio_against_mu_and_never_multiplies_is():
    gen = torch.Generator().manual_seed(5)
    mu = -torch.rand((2, 3), generator=gen, dtype=torch.float64)
    lp = (mu + 0.1 * torch.randn((2, 3), generator=gen, dtype=torch.float64)).requires_grad_()
    adv, mask = torch.tensor([[1.0] * 3, [-1.0] * 3], dtype=torch.float64), torch.ones((2, 3), dtype=torch.float64)
    for mode in rc.POLICY_LOSSES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            cfg = C(bypass_mode=True, loss_mode=mode, rollout_is="token")
        by, _ = rc.compute_policy_loss_bypass_mode(lp, mu, adv, mask, cfg)
        torch.manual_seed(0)
        dec, _ = rc.compute_policy_loss_vanilla(mu, lp, adv, mask, config=C(loss_mode=mode))
        assert float(by.detach()) == pytest.approx(float(dec.detach())), mode


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"loss_mode": "grpo"}, "loss_mode='grpo'"),
        ({"loss_mode": "gspo", "bypass_mode": True, "loss_type": "reinforce"}, "loss_mode='gspo'"),
        ({"clip_cov_ratio": 0.0}, "clip_cov_ratio=0.0"),
        ({"kl_cov_ratio": 1.0}, "kl_cov_ratio=1.0"),
        ({"clip_cov_lb": 5.0}, "clip_cov_lb=5.0"),
        ({"ppo_kl_coef": -0.1}, "ppo_kl_coef=-0.1"),
        ({"tau_pos": 0.0}, "tau_pos=0.0"),
        ({"tau_neg": math.nan}, "tau_neg=nan"),
        ({"rollout_opsm_threshold": 0.0}, "rollout_opsm_threshold=0.0"),
        ({"rollout_m2_threshold": -1.0}, "rollout_m2_threshold=-1.0"),
        (
            {"rollout_outlier_threshold_low": 2.0, "rollout_outlier_threshold_high": 1.0},
            "rollout_outlier_threshold_low",
        ),
        ({"rollout_is": "token", "rollout_is_threshold_lower": 2.0}, "rollout_is_threshold_lower=2.0"),
        ({"rollout_is": "token", "rollout_is_threshold": "0.5_5", "rollout_is_threshold_lower": 0.1}, "IcePop"),
    ],
)
def test_bad_objective_and_mask_settings_name_the_setting(fields, needle):
    with pytest.raises(ValueError) as info:
        C(**fields)
    assert needle in str(info.value)


# ------------------------------------------------------------------------------------------
# masks and clamps (§3.8, §4.6-§4.8)
# ------------------------------------------------------------------------------------------

MASK_PRESETS = {
    "decoupled_token_tis_two_sided": {
        "rollout_is": "token",
        "rollout_is_threshold": 5.0,
        "rollout_is_threshold_lower": 0.5,
    },
    "decoupled_opsm": {"rollout_opsm_threshold": 0.5},
    "decoupled_m2po": {
        "rollout_is": "token",
        "rollout_is_threshold": 5.0,
        "rollout_rs": "token_k1",
        "rollout_rs_threshold": "_5.0",
        "rollout_m2_threshold": 0.04,
    },
    "decoupled_m2_mask": {"rollout_m2_threshold": 0.04},
    "decoupled_outlier_rs": {"rollout_outlier_threshold_low": 1e-4, "rollout_outlier_threshold_high": 100.0},
}


@pytest.mark.parametrize("name", list(MASK_PRESETS))
def test_mask_presets(name):
    assert C.from_name(name) == C(**MASK_PRESETS[name])


def test_two_sided_tis_clamps_both_ends_and_logs_both_fractions():
    mu = torch.zeros((1, 4))
    train = torch.log(torch.tensor([[0.2, 1.0, 8.0, 3.0]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w, _, met = rc.compute_rollout_correction_and_rejection_mask(train, mu, mask, C.decoupled_token_tis_two_sided())
    assert w[0].tolist() == pytest.approx([0.5, 1.0, 5.0, 0.0])
    assert met["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(1 / 3)
    assert met["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)


def test_opsm_drops_only_stale_negative_rows():
    # rows: (A<0, D=0.5) dropped; (A<0, D=0) kept; (A>0, D=0.5) kept; D = mean(log mu - log pi)
    mu = torch.zeros((3, 2), dtype=torch.float64)
    lp = torch.tensor([[-0.5, -0.5], [0.0, 0.0], [-0.5, -0.5]], dtype=torch.float64)
    adv = torch.tensor([[-1.0] * 2, [-1.0] * 2, [1.0] * 2], dtype=torch.float64)
    keep, met = rc.compute_opsm_mask(lp, mu, adv, torch.ones((3, 2), dtype=torch.bool), 0.1)
    assert keep.tolist() == [[False, False], [True, True], [True, True]]
    assert met["actor/opsm_seq_masked_fraction"] == pytest.approx(1 / 3)
    assert met["actor/opsm_neg_adv_seq_masked_fraction"] == pytest.approx(1 / 2)
    # through the loss: the dropped row has no gradient
    lp = lp.clone().requires_grad_()
    _, met = rc.compute_policy_loss_vanilla(
        mu, lp, adv, torch.ones((3, 2)), rollout_log_prob=mu, config=C.decoupled_opsm(opsm_threshold=0.1)
    )
    assert met["actor/opsm_seq_masked_fraction"] == pytest.approx(1 / 3)


def test_m2_mask_removes_the_largest_squared_log_ratios_until_the_second_moment_fits():
    # squares (0.01, 0.09, 0.25): M2 = 0.35/3 > 0.05; the two smallest have mean 0.05 <= 0.05 -> drop the 0.25 one
    ell = torch.tensor([[0.1, -0.3, 0.5, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False]])
    keep, met = rc.compute_m2_mask(ell, mask, 0.05)
    assert keep.tolist() == [[True, True, False, False]]
    assert float(met["rollout_m2"]) == pytest.approx(0.35 / 3)
    assert float(met["rollout_m2_after"]) == pytest.approx(0.05)
    assert float(met["rollout_m2_masked_fraction"]) == pytest.approx(1 / 3)
    assert rc.compute_m2_mask(ell, mask, 1.0)[0].tolist() == mask.tolist()  # within budget: nothing removed


def test_m2po_preset_is_the_decoupled_is_weighted_ppo_loss_under_the_m2_mask_by_hand():
    # M2PO as AReaL's recipe runs it (examples/math/gsm8k_m2po.yaml): sg(w) phi_PPO(pi_theta / pi_old), w = pi_old / mu
    # (token), tokens with w > 5 masked, under the M2 mask (§4.7), token-mean over m (§7.5); log mu = 0: l = log pi_old.
    # l = (0.1, -0.2, 1.8 | 0.05, 2.0, pad); tau_M2 = 1 so that the ratio mask acts on a token the M2 mask keeps:
    # squares sorted (0.0025, 0.01, 0.04, 3.24, 4.0), running means (.0025, .00625, .0175, .8256, 1.4585): the 4.0 one
    # (l = 2.0) is masked; of the rest, e^1.8 = 6.05 > 5 is masked by the ratio; kept: (0,0), (0,1), (1,0).
    mu = torch.zeros((2, 3), dtype=torch.float64)
    old = torch.tensor([[0.1, -0.2, 1.8], [0.05, 2.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0] * 3, [-0.5] * 3], dtype=torch.float64)
    w, keep, met = rc.compute_rollout_correction_and_rejection_mask(old, mu, mask, C.decoupled_m2po(m2_threshold=1.0))
    assert keep.tolist() == [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    assert met["rollout_corr/rollout_m2_masked_fraction"] == pytest.approx(1 / 5)
    assert met["rollout_corr/rollout_rs_token_k1_masked_fraction"] == pytest.approx(2 / 5)  # 6.05 and 7.39 > 5

    def phi(r, a, low=0.2, high=0.2, c=3.0):  # PPO with dual clip, one token (§7.1)
        clipped = max(-a * r, -a * min(max(r, 1 - low), 1 + high))
        return min(clipped, -a * c) if a < 0 else clipped

    d = [[0.3, -0.1, 0.0], [0.4, 0.0, 0.0]]  # log pi_theta - log pi_old
    lp = (old + torch.tensor(d, dtype=torch.float64)).requires_grad_()
    loss, _ = rc.compute_policy_loss_vanilla(old, lp, adv, mask, rollout_is_weights=w, keep_mask=keep)
    kept = [(0, 0), (0, 1), (1, 0)]
    by_hand = sum(math.exp(old[i][j]) * phi(math.exp(d[i][j]), float(adv[i][j])) for i, j in kept) / 5
    assert float(loss.detach()) == pytest.approx(by_hand, rel=1e-12, abs=0)
    # The recipe's eps_clip 0 and one minibatch: pi_theta = pi_old at the update, and the gradient is M2PO's,
    # -A w grad log pi on the kept tokens, 0 elsewhere.  (AReaL divides by the 4 tokens the M2 mask keeps,
    # this loss by the 5 valid ones: design-readings §29.)
    lp = old.clone().requires_grad_()
    loss, _ = rc.compute_policy_loss_vanilla(
        old, lp, adv, mask, clip_ratio_low=0.0, clip_ratio_high=0.0, rollout_is_weights=w, keep_mask=keep
    )
    loss.backward()
    expected = [[-math.exp(0.1) / 5, -math.exp(-0.2) / 5, 0.0], [0.5 * math.exp(0.05) / 5, 0.0, 0.0]]
    assert lp.grad.tolist() == [pytest.approx(row, rel=1e-12, abs=0) for row in expected]
    # decoupled_m2_mask (the catalogue's arm before issue 48): the same M2 mask, no weight, no ratio mask
    w0, keep0, _ = rc.compute_rollout_correction_and_rejection_mask(
        old, mu, mask, C.decoupled_m2_mask(m2_threshold=1.0)
    )
    assert w0 is None and keep0.tolist() == [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]


def test_outlier_rejection_is_two_sided_worst_token():
    ell = torch.log(torch.tensor([[1.0, 0.5], [1.0, 200.0], [1e-5, 1.0], [1.0, 1.0]], dtype=torch.float64))
    mask = torch.ones((4, 2), dtype=torch.bool)
    keep, met = rc.compute_outlier_token_mask(ell, mask, 1e-4, 100.0)
    assert keep.all(dim=-1).tolist() == [True, False, False, True]
    assert float(met["rollout_outlier_seq_masked_fraction"]) == 0.5
    assert float(met["rollout_outlier_token_fraction_low"]) == 0.125
    assert float(met["rollout_outlier_token_fraction_high"]) == 0.125
    _, k, _ = rc.compute_rollout_correction_and_rejection_mask(
        ell, torch.zeros_like(ell), mask.double(), C.decoupled_outlier_rs()
    )
    assert k.tolist() == keep.double().tolist()


# ------------------------------------------------------------------------------------------
# IS-corrected KL (§7.8) and the health check (§6.7)
# ------------------------------------------------------------------------------------------


def test_is_corrected_k3_value_and_gradient():
    # log pi = -1, log ref = -1.5, log old = -1.2: kappa = -0.5, k3 = e^-0.5 + 0.5 - 1, r = e^0.2
    lp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    ref, old = torch.tensor([[-1.5]], dtype=torch.float64), torch.tensor([[-1.2]], dtype=torch.float64)
    v = rc.kl_penalty(lp, ref, "k3", old_log_prob=old)
    k3, r = math.exp(-0.5) - 0.5, math.exp(0.2)
    assert float(v.detach()) == pytest.approx(r * k3)
    v.sum().backward()
    # d/dlog pi [r k3] = r k3 + r (1 - e^kappa)
    assert float(lp.grad) == pytest.approx(r * (k3 + 1 - math.exp(-0.5)))
    assert torch.equal(rc.kl_penalty(lp, ref, "k3", old_log_prob=lp.detach()), rc.kl_penalty(lp, ref, "k3"))


def test_is_corrected_k3_is_unbiased_for_kl_of_the_current_policy():
    # exact expectation over a 3-token vocabulary: sum_y pi_old(y) r(y) k3(y) = KL(pi_theta || pi_ref)
    pi = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64)
    ref = torch.tensor([[0.2, 0.4, 0.4]], dtype=torch.float64)
    old = torch.tensor([[0.3, 0.3, 0.4]], dtype=torch.float64)
    v = rc.kl_penalty(pi.log(), ref.log(), "k3", old_log_prob=old.log())
    assert float((old * v).sum()) == pytest.approx(float((pi * (pi / ref).log()).sum()))


def test_health_check_fires_on_the_guide_thresholds_only():
    healthy = {
        "rollout_corr/rollout_is_mean": 1.0,
        "rollout_corr/rollout_is_eff_sample_size": 0.9,
        "rollout_corr/rollout_is_std": 0.2,
        "rollout_corr/kl": -0.01,
        "rollout_corr/chi2_token": 0.1,
    }
    assert rc.check_rollout_correction_health(healthy) == {}
    assert rc.check_rollout_correction_health({}) == {}  # IS off, no metrics: nothing fires
    sick = {
        "rollout_corr/rollout_is_mean": 0.4,
        "rollout_corr/rollout_is_eff_sample_size": 0.29,
        "rollout_corr/rollout_is_std": 1.5,
        "rollout_corr/kl": -0.2,
        "rollout_corr/chi2_token": 2.0,
    }
    assert rc.check_rollout_correction_health(sick) == {
        "health/is_mean": 0.4,
        "health/is_ess": 0.29,
        "health/is_std": 1.5,
        "health/kl": -0.2,
        "health/chi2_token": 2.0,
    }
    assert rc.check_rollout_correction_health({"rollout_corr/rollout_is_mean": 2.5}) == {"health/is_mean": 2.5}
    assert rc.check_rollout_correction_health({"rollout_corr/rollout_is_mean": 2.0}) == {}  # the bound is healthy
    assert set(rc.HEALTH_CHECKS) == {
        "health/is_mean",
        "health/is_ess",
        "health/is_std",
        "health/kl",
        "health/chi2_token",
    }
