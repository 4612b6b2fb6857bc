"""The geometric-mean IS weight and seq-mask-tis, opt-in and peer-compatible (issue 50, item 3; docs/corrections.md
§3.1, §3.9; docs/design-readings.md §10), each checked by hand in float64.

* `rollout_is="geometric"`: w_i = exp((1/n_i) sum_t l_it), broadcast to the row's tokens, then TIS / two-sided clamp /
  IcePop exactly as at sequence level (AReaL level=sequence metric=ratio, slime tis_level=geometric, ROLL
  weight_type=geometric). It warns once per config: as a weight it corrects no distribution.
* seq-mask-tis (NeMo-RL, OpenRLHF): rows whose geometric-mean ratio leaves [L, U] are rejected (`seq_mean_k1`), the kept
  tokens carry their *untruncated* token ratio (token IS with the cap +inf).

Every expected number is a short formula computed here with `math`, never by rc_core.
"""

import dataclasses
import math
import warnings

import pytest
import torch

import rc_core as rc

C = rc.RolloutCorrectionConfig
F64 = torch.float64
exp = math.exp

# Two rows of different lengths, padded to T = 4: row 0 has 3 tokens, row 1 has 2. The padding holds values that would
# change every number if they were read.
L0, L1 = [0.3, -0.1, 0.4], [0.05, -0.25]
ROLLOUT = [[-1.0, -2.0, -0.5, 0.0], [-0.7, -1.5, 0.0, 0.0]]
MASK = [[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]]
G0, G1 = sum(L0) / 3, sum(L1) / 2  # log geometric means 0.2, -0.1
S0, S1 = sum(L0), sum(L1)  # log trajectory ratios 0.6, -0.2


def tensors(l_rows=(L0, L1), rollout=ROLLOUT, mask=MASK, pad=3.0):
    """(log pi_train, log mu, mask): log pi_train = log mu + l on valid tokens, `pad` on padding."""
    mu = torch.tensor(rollout, dtype=F64)
    m = torch.tensor(mask, dtype=F64)
    ell = torch.full_like(mu, pad)
    for i, row in enumerate(l_rows):
        ell[i, : len(row)] = torch.tensor(row, dtype=F64)
    return torch.where(m.bool(), mu + ell, ell), mu, m


def quiet(**fields):
    """A config built without the geometric level's construction warning (tested on its own below)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return C(**fields)


def correct(config, l_rows=(L0, L1), rollout=ROLLOUT, mask=MASK):
    train, mu, m = tensors(l_rows, rollout, mask)
    return rc.compute_rollout_correction_and_rejection_mask(train, mu, m, config)


def rows(weights, mask=MASK):
    """The valid entries, row by row, as one list of floats."""
    return [float(w) for row, mrow in zip(weights.tolist(), mask) for w, k in zip(row, mrow) if k]


def approx(nested, **kwargs):
    """pytest.approx of a list of rows, flattened row by row (as `rows` returns them)."""
    return pytest.approx([x for row in nested for x in row], **kwargs)


# ---------------------------------------------------------------------------------------------
# The weight
# ---------------------------------------------------------------------------------------------
def test_the_geometric_weight_is_exp_of_the_row_mean_broadcast_and_zero_on_padding():
    train, mu, m = tensors()
    ell = rc.token_log_ratio(train, mu)
    g = rc.geometric_log_ratio(ell, m.bool())
    assert g.tolist() == pytest.approx([G0, G1], abs=1e-15)
    assert torch.equal(g, rc.sequence_log_ratio(ell, m.bool()) / m.sum(-1))  # s_i / n_i, the same operations
    raw = rc.raw_is_weights(ell, m.bool(), "geometric")
    # exactly exp of the mean, on every valid token; padding 0
    assert torch.equal(raw, torch.where(m.bool(), torch.exp(g).unsqueeze(-1).expand_as(raw), torch.zeros_like(raw)))
    assert rows(raw) == approx([[exp(G0)] * 3, [exp(G1)] * 2], rel=1e-15)
    assert raw[:, 3].tolist() == [0.0, 0.0] and raw[1, 2] == 0.0


def test_the_geometric_level_differs_from_sequence_on_rows_of_different_length():
    train, mu, m = tensors()
    ell = rc.token_log_ratio(train, mu)
    geo = rows(rc.raw_is_weights(ell, m.bool(), "geometric"))
    seq = rows(rc.raw_is_weights(ell, m.bool(), "sequence"))
    assert seq == approx([[exp(S0)] * 3, [exp(S1)] * 2], rel=1e-15)
    assert geo[0] != pytest.approx(seq[0]) and geo[3] != pytest.approx(seq[3])  # rows 0 and 1
    # the n_i-th root of the trajectory ratio: length-normalised
    assert [geo[0] ** 3, geo[3] ** 2] == pytest.approx([seq[0], seq[3]], rel=1e-14)
    # a one-token row has g = s: the two levels agree there
    one = rc.raw_is_weights(torch.tensor([[0.7]], dtype=F64), torch.tensor([[True]]), "geometric")
    assert one.item() == rc.raw_is_weights(torch.tensor([[0.7]], dtype=F64), torch.tensor([[True]]), "sequence").item()


def test_truncation_clamp_and_icepop_act_on_the_geometric_weight():
    # TIS cap U = 1.1: exp(0.2) = 1.2214 is capped, exp(-0.1) = 0.9048 passes
    w, keep, _ = correct(quiet(rollout_is="geometric", rollout_is_threshold=1.1))
    assert rows(w) == approx([[1.1] * 3, [exp(G1)] * 2], rel=1e-15)
    assert keep.tolist() == MASK  # IS never edits the mask
    # two-sided clamp [0.95, 1.1]: the small weight is lifted to 0.95
    w, _, _ = correct(quiet(rollout_is="geometric", rollout_is_threshold=1.1, rollout_is_threshold_lower=0.95))
    assert rows(w) == approx([[1.1] * 3, [0.95] * 2], rel=1e-15)
    # IcePop [0.9, 1.1]: row 0 (1.2214) zeroed whole, row 1 (0.9048) kept
    w, keep, met = correct(quiet(rollout_is="geometric", rollout_is_threshold="0.9_1.1"))
    assert rows(w) == approx([[0.0] * 3, [exp(G1)] * 2], rel=1e-15)
    assert keep.tolist() == MASK and met["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(3 / 5)


def test_the_row_level_metrics_read_the_geometric_statistic():
    _, _, met = correct(quiet(rollout_is="geometric", rollout_is_threshold=1.1))
    get = {k.removeprefix("rollout_corr/rollout_is_"): v for k, v in met.items() if "rollout_is_" in k}
    assert (get["max"], get["min"]) == pytest.approx((exp(G0), exp(G1)), rel=1e-14)
    # exp(0.2) > U = 1.1 and exp(-0.1) = 0.9048 < L' = 1/1.1 = 0.9091: one row each
    assert (get["ratio_fraction_high"], get["ratio_fraction_low"]) == (0.5, 0.5)
    assert (get["seq_fraction_high"], get["seq_fraction_low"]) == (0.5, 0.5)
    assert get["mean"] == pytest.approx((3 * 1.1 + 2 * exp(G1)) / 5, rel=1e-14)  # applied, token-weighted
    assert get["seq_mean"] == pytest.approx((1.1 + exp(G1)) / 2, rel=1e-14)
    # sequence level, same data: its statistic is the product
    _, _, seq = correct(C(rollout_is="sequence", rollout_is_threshold=1.1))
    assert (seq["rollout_corr/rollout_is_max"], seq["rollout_corr/rollout_is_min"]) == pytest.approx(
        (exp(S0), exp(S1)), rel=1e-14
    )


def test_batch_normalisation_is_per_row_as_at_sequence_level():
    w, _, met = correct(quiet(rollout_is="geometric", rollout_is_threshold=5.0, rollout_is_batch_normalize=True))
    z = (exp(G0) + exp(G1)) / 2  # mean over valid rows, unweighted by length (§3.7)
    assert met["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(z, rel=1e-14)
    assert rows(w) == approx([[exp(G0) / z] * 3, [exp(G1) / z] * 2], rel=1e-14)


# ---------------------------------------------------------------------------------------------
# Opt-in: the warning
# ---------------------------------------------------------------------------------------------
def test_a_geometric_config_warns_once_with_the_caveat_in_one_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = C(rollout_is="geometric")
    assert [w.category for w in caught] == [UserWarning]
    text = str(caught[0].message)
    assert text == rc.GEOMETRIC_IS_WARNING and "\n" not in text
    assert "corrects no distribution" in text and "design-readings.md §10" in text
    assert caught[0].filename == __file__  # points at the caller
    assert config.rollout_is == "geometric" and config.is_spec == rc.ISThreshold("tis", None, 2.0)
    assert "geometric" in rc.IS_LEVELS and rc.ROW_IS_LEVELS == ("sequence", "geometric")
    with pytest.warns(UserWarning, match="corrects no distribution"):
        dataclasses.replace(config, rollout_is_threshold=3.0)  # each construction
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        C(rollout_is="token")
        C(rollout_is="sequence")
        C(rollout_rs="geometric", rollout_rs_threshold=1.001)  # the legacy RS level is unchanged and silent
        C.decoupled_geo_is()  # a preset is a deliberate choice: from_name builds it silently


def test_bad_geometric_input_gives_one_clear_error_and_no_warning():
    for bad, fragment in ((-1.0, "-1.0"), (0.0, "0.0"), ("-inf", "-inf"), ("nan", "nan"), ("0.5_inf", "inf")):
        with warnings.catch_warnings(record=True) as caught, pytest.raises(ValueError) as info:
            warnings.simplefilter("always")
            C(rollout_is="geometric", rollout_is_threshold=bad)
        assert caught == []  # the caveat is for a config that exists
        assert "rollout_is_threshold" in str(info.value) and fragment in str(info.value)
    with pytest.raises(ValueError, match="'geo'"):
        C(rollout_is="geo")
    with pytest.raises(ValueError, match="'geometric'"):  # the listed levels
        C(rollout_is="product")


def test_an_infinite_cap_means_no_truncation():
    assert rc.parse_is_threshold(math.inf) == rc.ISThreshold("tis", None, math.inf)
    assert rc.parse_is_threshold(" inf ") == rc.parse_is_threshold(float("inf"))
    assert rc.parse_is_threshold(math.inf).diagnostic_lower == 0.0
    w, _, met = correct(C(rollout_is="token", rollout_is_threshold="inf"))
    assert rows(w) == approx([[exp(x) for x in L0], [exp(x) for x in L1]], rel=1e-15)
    assert met["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0
    _, _, met = correct(quiet(rollout_is="geometric", rollout_is_threshold=math.inf))
    assert (met["rollout_corr/rollout_is_ratio_fraction_high"], met["rollout_corr/rollout_is_ratio_fraction_low"]) == (
        0.0,
        0.0,
    )


# ---------------------------------------------------------------------------------------------
# Presets, through the public entry point and the policy losses
# ---------------------------------------------------------------------------------------------
def test_decoupled_geo_is_caps_the_geometric_weight_and_multiplies_the_ppo_loss():
    config = C.decoupled_geo_is()
    assert config == quiet(rollout_is="geometric", rollout_is_threshold=2.0)
    assert C.decoupled_geo_is(threshold=1.2).is_spec.upper == 1.2  # ROLL's upper_bound
    big = [0.9, 0.7, 0.8]  # g = 0.8: exp = 2.2255, capped at 2
    w, keep, _ = correct(config, (big, L1))
    assert rows(w) == approx([[2.0] * 3, [exp(G1)] * 2], rel=1e-15)
    # decoupled PPO at pi_theta = pi_old (r = 1, no clip): d loss / d log pi_t = -A_t w_t / N, N = 5 valid tokens
    train, _, m = tensors((big, L1))
    lp = train.clone().requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, 1.0, 0.0], [-2.0, -2.0, 0.0, 0.0]], dtype=F64)
    loss, _ = rc.compute_policy_loss_vanilla(train, lp, adv, m, rollout_is_weights=w, keep_mask=keep, config=config)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-(3 * 2.0 - 2 * 2 * exp(G1)) / 5, rel=1e-14)
    assert rows(lp.grad) == approx([[-2.0 / 5] * 3, [2 * exp(G1) / 5] * 2], rel=1e-14)


def test_the_geometric_level_works_in_bypass_reinforce():
    config = quiet(rollout_is="geometric", rollout_is_threshold=1.1, bypass_mode=True, loss_type="reinforce")
    train, mu, m = tensors()
    lp = train.clone().requires_grad_(True)
    adv = torch.tensor([[1.0] * 4, [1.0] * 4], dtype=F64)
    loss, met = rc.compute_policy_loss_bypass_mode(lp, mu, adv, m, config)
    loss.backward()
    # -A log pi sg(w), token-mean over N = 5: the gradient is -A w / N with w = min(exp(g_i), 1.1)
    assert rows(lp.grad) == approx([[-1.1 / 5] * 3, [-exp(G1) / 5] * 2], rel=1e-14)
    assert met["rollout_corr/rollout_is_max"] == pytest.approx(exp(G0), rel=1e-14)


# seq-mask-tis: row 0 has a token ratio e^2 = 7.39 but geometric mean e^0.001 = 1.0010 (kept, weights untruncated);
# row 1's geometric mean e^0.003 = 1.0030 > 1.002 and row 2's e^-0.002 = 0.9980 < 0.999 (both rejected whole).
MASK_L = ([2.0, -1.0, -0.997], [0.004, 0.002], [-0.002])
MASK_ROLLOUT = [[-1.0, -2.0, -0.5], [-0.7, -1.5, 0.0], [-0.3, 0.0, 0.0]]
MASK_MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_seq_mask_tis_is_a_geometric_band_plus_untruncated_token_weights():
    config = C.decoupled_seq_mask_tis()
    by_hand = dict(rollout_is="token", rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.002")
    assert config == C(**by_hand, rollout_is_threshold=math.inf)
    assert config.is_spec == C(**by_hand, rollout_is_threshold="inf").is_spec == rc.ISThreshold("tis", None, math.inf)
    assert config.rs_specs == (rc.RSOption("seq_mean_k1", "k1", "seq_mean", 0.999, 1.002),)
    w, keep, met = correct(config, MASK_L, MASK_ROLLOUT, MASK_MASK)
    assert keep.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert rows(w, MASK_MASK) == approx([[exp(x) for x in row] for row in MASK_L], rel=1e-15)
    assert w[0, 0] == pytest.approx(exp(2.0)) and w[0, 0] > 7  # not truncated
    assert met["rollout_corr/rollout_rs_seq_mean_k1_seq_masked_fraction"] == pytest.approx(2 / 3)
    assert met["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0  # nothing above an infinite cap
    # OpenRLHF's default band [0.5, 5.0] keeps every row
    _, keep, _ = correct(C.decoupled_seq_mask_tis(threshold_lower=0.5, threshold=5.0), MASK_L, MASK_ROLLOUT, MASK_MASK)
    assert keep.tolist() == MASK_MASK


def test_seq_mask_tis_through_the_decoupled_loss_matches_the_peers_formula():
    # NeMo-RL / OpenRLHF: loss = agg(seq_mask_i * rho_it * phi_it) over the *original* mask (a rejected row adds 0 and
    # still counts in the denominator); here the rows leave m' and the denominators come from m (§7.5): the same.
    config = C.decoupled_seq_mask_tis()
    w, keep, _ = correct(config, MASK_L, MASK_ROLLOUT, MASK_MASK)
    train, _, m = tensors(MASK_L, MASK_ROLLOUT, MASK_MASK)
    lp = train.clone().requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [3.0, 3.0, 0.0], [5.0, 0.0, 0.0]], dtype=F64)
    loss, _ = rc.compute_policy_loss_vanilla(train, lp, adv, m, rollout_is_weights=w, keep_mask=keep, config=config)
    loss.backward()
    n = 6  # valid tokens of m
    assert float(loss.detach()) == pytest.approx(-sum(exp(x) for x in MASK_L[0]) / n, rel=1e-14)
    assert rows(lp.grad, MASK_MASK) == approx([[-exp(x) / n for x in MASK_L[0]], [0.0, 0.0], [0.0]], abs=1e-15)


def test_bypass_pg_seq_mask_tis_is_reinforce_with_the_untruncated_token_weight_on_kept_rows():
    config = C.bypass_pg_seq_mask_tis()
    assert (config.bypass_mode, config.loss_type, config.is_spec.upper) == (True, "reinforce", math.inf)
    train, mu, m = tensors(MASK_L, MASK_ROLLOUT, MASK_MASK)
    lp = train.clone().requires_grad_(True)
    adv = torch.tensor([[2.0, 2.0, 2.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=F64)
    loss, met = rc.compute_policy_loss_bypass_mode(lp, mu, adv, m, config)
    loss.backward()
    # NeMo-RL's force_on_policy_ratio: -A exp(log pi - sg log pi) sg(w); gradient -A w / N on kept rows, 0 elsewhere
    n = 6
    assert rows(lp.grad, MASK_MASK) == approx([[-2.0 * exp(x) / n for x in MASK_L[0]], [0.0, 0.0], [0.0]], abs=1e-15)
    assert met["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(2 / 3)


def test_bad_preset_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="'1.01_1.002'"):  # L > U
        C.decoupled_seq_mask_tis(threshold_lower=1.01)
    with pytest.raises(ValueError, match="-2.0"):
        C.decoupled_geo_is(threshold=-2.0)
    with pytest.raises(TypeError, match="its arguments are threshold_lower, threshold$"):
        C.decoupled_seq_mask_tis(is_threshold=3.0)  # the token weight is untruncated by definition


def test_vespo_folds_a_geometric_weight_in_once_as_a_sequence_weight():
    train, mu, m = tensors()
    w, _, _ = correct(quiet(rollout_is="geometric", rollout_is_threshold=5.0))
    adv = torch.tensor([[1.0] * 4, [-1.0] * 4], dtype=F64)

    def loss(level):
        config = quiet(loss_mode="vespo", rollout_is=level, rollout_is_threshold=5.0)
        loss, _ = rc.compute_policy_loss_vanilla(train, train.clone(), adv, m, rollout_is_weights=w, config=config)
        return float(loss.detach())

    # the row's weight enters log W once (g_i), not once per token (n_i g_i = s_i)
    assert loss("geometric") == loss("sequence") != pytest.approx(loss("token"))


def test_the_command_line_reaches_both_options(monkeypatch):
    """--rc.rollout-is geometric and an untruncated cap --rc.rollout-is-threshold inf parse into the configs above."""
    import sys

    import rc_config
    import rc_train

    def build(*flags):
        monkeypatch.setattr(sys, "argv", ["rc_train.py", *flags])
        return rc_config.build_correction_config(rc_config.parse_cli(rc_train.Args, rc_train.load_yaml_defaults).rc)

    seq_mask = ["--rc.preset", "decoupled_geo_rs_token_tis", "--rc.rollout-is-threshold", "inf"]
    assert build(*seq_mask, "--rc.rollout-rs-threshold", "0.999_1.002") == C.decoupled_seq_mask_tis()
    with pytest.warns(UserWarning, match="corrects no distribution"):
        geo = build("--rc.preset", "decoupled_token_is", "--rc.rollout-is", "geometric")
    assert geo == C.decoupled_geo_is()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert build("--rc.preset", "decoupled_geo_is") == C.decoupled_geo_is()  # the preset as it is: silent
