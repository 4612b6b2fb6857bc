"""The peers' mismatch metrics (issue 50, item 3; docs/corrections.md §6.8, docs/metrics.md): |Δ log p| mean and max
(TRL, slime), token_mult_prob_error and the sampled-token JS divergence (NeMo-RL), and the mismatch split by the loss
mask with the advantage sign of the dropped tokens (prime-rl).

Each formula is recomputed here in plain Python floats, as the peer writes it, on a small float64 batch with padding
(NaN at padded positions, a fully padded row); the empty cases (nothing dropped, nothing kept) give no key or a
finite 0.0, never NaN; and a tiny in-process update (rc_train.update_policy on a random 2-layer Qwen2, no engine)
shows the keys in the step's reduced metrics as rc_train.py logs them.
"""

import math

import pytest
import torch

import rc_core as rc

F64 = torch.float64
NAN = float("nan")
SPLIT_KEYS = {
    "rollout_corr/masked_mismatch_kl",
    "rollout_corr/kept_mismatch_kl",
    "rollout_corr/masked_adv_positive_fraction",
    "rollout_corr/masked_adv_negative_fraction",
}
MISMATCH_KEYS = {
    "rollout_corr/log_prob_abs_diff_mean",
    "rollout_corr/log_prob_abs_diff_max",
    "rollout_corr/token_mult_prob_error",
    "rollout_corr/js_divergence",
}

# (log pi_train, log mu) per valid token, one list per row; row 2 is fully padded. Row 3 is NeMo-RL's own example of
# a rare token (docs/guides/grpo.md: logp_gen -5, logp_policy -15).
ROWS = [
    [(-0.5, -0.7), (-1.2, -1.0), (-2.0, -2.0)],
    [(-3.0, -1.0), (-0.1, -0.3)],
    [],
    [(-15.0, -5.0)],
    [(-0.2, -0.2), (-4.0, -1.0)],
]
ADVANTAGES = [1.0, -0.5, 0.0, 0.0, 1.0]  # one per response, as GRPO's
# token_k1 with [0.5, 1.5] keeps 0.5 <= rho <= 1.5: it drops (1, 0) (rho = e^-2), (3, 0) (e^-10) and (4, 1) (e^-3)
RS = dict(rollout_rs="token_k1", rollout_rs_threshold="0.5_1.5")
DROPPED = {(1, 0), (3, 0), (4, 1)}


def batch():
    """(log pi_train, log mu, mask, advantages) of ROWS, NaN at every padded position."""
    width = max(len(r) for r in ROWS)
    train = torch.full((len(ROWS), width), NAN, dtype=F64)
    rollout, adv = train.clone(), train.clone()
    mask = torch.zeros((len(ROWS), width), dtype=F64)
    for i, row in enumerate(ROWS):
        for t, (p, q) in enumerate(row):
            train[i, t], rollout[i, t], adv[i, t], mask[i, t] = p, q, ADVANTAGES[i], 1.0
    return train, rollout, mask, adv


def tokens():
    return [(i, t, p, q) for i, row in enumerate(ROWS) for t, (p, q) in enumerate(row)]


def mean(xs):
    return sum(xs) / len(xs)


def nemo_js(p: float, q: float) -> float:
    """NeMo-RL's per-token JS term as ClippedPGLossFn writes it: the mixture's log, then both k3 terms."""
    log_mix = math.log(0.5 * math.exp(p) + 0.5 * math.exp(q))
    kl_train = math.exp(p - log_mix) - (p - log_mix) - 1
    kl_gen = math.exp(q - log_mix) - (q - log_mix) - 1
    return 0.5 * kl_train + 0.5 * kl_gen


def kappa(p: float, q: float) -> float:
    """prime-rl's per-token mismatch_kl, rho - 1 - log rho (|log rho| <= 20 here, so the clip does nothing)."""
    return math.exp(p - q) - 1 - (p - q)


def approx(x):
    return pytest.approx(x, rel=1e-12, abs=1e-15)


def test_the_four_token_metrics_by_hand_with_padding():
    train, rollout, mask, _ = batch()
    _, _, met = rc.compute_rollout_correction_and_rejection_mask(train, rollout, mask, rc.RolloutCorrectionConfig())
    gaps = [abs(p - q) for _, _, p, q in tokens()]
    assert met["rollout_corr/log_prob_abs_diff_mean"] == approx(mean(gaps))  # TRL: mean of |delta| over the mask
    assert met["rollout_corr/log_prob_abs_diff_max"] == approx(10.0)
    assert met["rollout_corr/token_mult_prob_error"] == approx(mean([math.exp(g) for g in gaps]))  # not e^mean
    assert met["rollout_corr/js_divergence"] == approx(mean([nemo_js(p, q) for _, _, p, q in tokens()]))
    # NeMo-RL's rare token alone: 0.5 * 8.307 + 0.5 * 0.307 = 4.307 by its code (its guide's prose says about 9)
    one = rc.sampled_js_divergence(torch.tensor([-15.0 - -5.0], dtype=F64)).item()
    assert one == approx(nemo_js(-15.0, -5.0)) and one == pytest.approx(4.307, abs=1e-3)
    # the same with the two sides swapped: the JS term is symmetric in p and q
    assert rc.sampled_js_divergence(torch.tensor([10.0], dtype=F64)).item() == approx(one)
    assert all(math.isfinite(v) for v in met.values() if v == v)


def test_padding_and_a_fully_padded_row_change_nothing():
    train, rollout, mask, _ = batch()
    config = rc.RolloutCorrectionConfig()
    _, _, met = rc.compute_rollout_correction_and_rejection_mask(train, rollout, mask, config)
    keep = mask.sum(-1) > 0
    _, _, dense = rc.compute_rollout_correction_and_rejection_mask(train[keep], rollout[keep], mask[keep], config)
    assert {k: met[k] for k in MISMATCH_KEYS} == {k: approx(dense[k]) for k in MISMATCH_KEYS}  # up to sum order


def test_js_divergence_small_large_and_float32():
    ell = torch.tensor([1e-3, -1e-3, 0.0, 30.0, -30.0], dtype=F64)
    js = rc.sampled_js_divergence(ell)
    assert js[0].item() == pytest.approx(1e-6 / 8, rel=1e-3) and js[2].item() == 0.0
    assert js[3].item() == approx(js[4].item()) and js[3].item() == approx(nemo_js(-20.0, 0.0))  # clipped at S
    small = torch.tensor([1e-4, 3e-3, -2e-2], dtype=torch.float32)
    torch.testing.assert_close(rc.sampled_js_divergence(small).double(), rc.sampled_js_divergence(small.double()))
    train = torch.tensor([[0.0, -30.0]], dtype=F64)
    _, _, met = rc.compute_rollout_correction_and_rejection_mask(
        train, torch.zeros_like(train), torch.ones_like(train), rc.RolloutCorrectionConfig()
    )
    assert met["rollout_corr/log_prob_abs_diff_max"] == 30.0  # no exponential: not clipped
    assert met["rollout_corr/token_mult_prob_error"] == approx((1.0 + math.exp(20.0)) / 2)  # |l| > 20 reads 20


def split_by_hand():
    dropped = [(i, t, p, q) for i, t, p, q in tokens() if (i, t) in DROPPED]
    kept = [(i, t, p, q) for i, t, p, q in tokens() if (i, t) not in DROPPED]
    return {
        "rollout_corr/masked_mismatch_kl": mean([kappa(p, q) for _, _, p, q in dropped]),
        "rollout_corr/kept_mismatch_kl": mean([kappa(p, q) for _, _, p, q in kept]),
        "rollout_corr/masked_adv_positive_fraction": mean([ADVANTAGES[i] > 0 for i, *_ in dropped]),  # 1/3
        "rollout_corr/masked_adv_negative_fraction": mean([ADVANTAGES[i] < 0 for i, *_ in dropped]),  # 1/3: A = 0
    }


def test_the_mask_split_by_hand_in_both_modes():
    train, rollout, mask, adv = batch()
    want = split_by_hand()
    config = rc.RolloutCorrectionConfig(**RS)
    weights, keep, corr = rc.compute_rollout_correction_and_rejection_mask(train, rollout, mask, config)
    assert sorted(map(tuple, torch.nonzero((mask > 0) & (keep == 0)).tolist())) == sorted(DROPPED)
    assert not SPLIT_KEYS & set(corr)  # the entry point has no advantages: the split is the loss's

    bypass = rc.RolloutCorrectionConfig(**RS, bypass_mode=True, loss_type="ppo_clip")
    _, met = rc.compute_policy_loss_bypass_mode(train.clone().requires_grad_(), rollout, adv, mask, bypass)
    assert {k: met[k] for k in SPLIT_KEYS} == {k: approx(v) for k, v in want.items()}
    _, met = rc.compute_policy_loss_bypass_mode(
        train.clone().requires_grad_(), rollout, adv, mask, bypass, with_correction_metrics=False
    )
    assert not SPLIT_KEYS & set(met)  # the optimizer steps after a batch's first log no rollout_corr/*

    # decoupled: l from pi_old (not pi_theta) against mu, the keep mask frozen with the batch
    log_prob = (train + 0.05).requires_grad_()
    _, met = rc.compute_policy_loss_vanilla(
        train, log_prob, adv, mask, rollout_is_weights=weights, keep_mask=keep, rollout_log_prob=rollout
    )
    assert {k: met[k] for k in SPLIT_KEYS} == {k: approx(v) for k, v in want.items()}
    _, met = rc.compute_policy_loss_vanilla(train, log_prob, adv, mask, keep_mask=keep)
    assert not SPLIT_KEYS & set(met)  # no log mu, no mismatch

    # dropped and kept together give rollout_corr/k3_kl back: |D| <k>_D + |K| <k>_K = N k3_kl
    n_dropped, n = len(DROPPED), len(tokens())
    whole = (
        n_dropped * want["rollout_corr/masked_mismatch_kl"] + (n - n_dropped) * want["rollout_corr/kept_mismatch_kl"]
    )
    assert whole / n == approx(corr["rollout_corr/k3_kl"])


def test_opsm_drops_join_the_split_in_bypass():
    """OPSM drops rows with A < 0 inside the bypass loss: they are part of m', so of the dropped set."""
    train, rollout, mask, adv = batch()
    config = rc.RolloutCorrectionConfig(bypass_mode=True, loss_type="ppo_clip", rollout_opsm_threshold=1e-4)
    _, met = rc.compute_policy_loss_bypass_mode(train.clone().requires_grad_(), rollout, adv, mask, config)
    # row 1 (A = -0.5, mean log(mu / pi) = (2.0 - 0.2) / 2 > 1e-4) is the one dropped: both its tokens
    dropped = ROWS[1]
    assert met["rollout_corr/masked_mismatch_kl"] == approx(mean([kappa(p, q) for p, q in dropped]))
    assert met["rollout_corr/masked_adv_negative_fraction"] == 1.0
    assert met["rollout_corr/masked_adv_positive_fraction"] == 0.0


def test_empty_sets_give_no_key_or_a_finite_zero():
    train, rollout, mask, adv = batch()
    m = mask > 0
    ell = torch.where(m, train - rollout, 0.0)
    adv0 = torch.where(m, adv, 0.0)
    assert rc.mask_split_metrics(ell, adv0, m, m) == {}  # nothing dropped: no key at all
    assert rc.mask_split_metrics(ell, adv0, mask, torch.ones_like(mask)) == {}  # a 0/1 keep mask, padding kept
    everything = rc.mask_split_metrics(ell, adv0, m, torch.zeros_like(m))  # nothing kept
    assert everything["rollout_corr/kept_mismatch_kl"] == 0.0
    assert everything["rollout_corr/masked_mismatch_kl"] == approx(mean([kappa(p, q) for _, _, p, q in tokens()]))
    assert all(math.isfinite(v) for v in everything.values())
    config = rc.RolloutCorrectionConfig(bypass_mode=True, loss_type="ppo_clip")  # no mask of any kind
    _, met = rc.compute_policy_loss_bypass_mode(train.clone().requires_grad_(), rollout, adv, mask, config)
    assert MISMATCH_KEYS <= set(met) and not SPLIT_KEYS & set(met)


@pytest.mark.parametrize(
    "preset, dropped", [("bypass_ppo_clip_k3_rs", True), ("decoupled_k3_rs", True), ("bypass_ppo_clip", False)]
)
def test_the_trainer_logs_them(preset, dropped):
    """rc_train.py's step after the rollout, call for call, on a tiny in-process update (tests/test_nonfinite.py's
    random 2-layer Qwen2, 8 responses, two minibatches; no engine): the reduced step metrics hold every new key."""
    import rc_run
    import rc_train
    from tests.test_nonfinite import tiny_update

    args, correction, learner, batch_, tensors = tiny_update(preset)
    batch_correction = {}
    if not correction.bypass_mode:
        model = learner.accelerator.unwrap_model(learner.model)
        batch_correction, _ = rc_train.decoupled_correction(args, correction, model, batch_, tensors)
        assert MISMATCH_KEYS <= set(batch_correction)
    step_metrics, _, _ = rc_train.update_policy(
        args,
        correction,
        learner,
        batch_,
        tensors,
        generator=torch.Generator().manual_seed(0),
        batch_correction=batch_correction,
    )
    step_metrics.add(batch_correction, weight=float(tensors["response_mask"].sum()))
    metrics = rc_run.reduce_metrics(step_metrics, learner.host)
    assert MISMATCH_KEYS <= set(metrics)
    assert all(math.isfinite(metrics[k]) for k in MISMATCH_KEYS)
    assert metrics["rollout_corr/token_mult_prob_error"] >= 1.0
    assert metrics["rollout_corr/log_prob_abs_diff_max"] >= metrics["rollout_corr/log_prob_abs_diff_mean"] > 0
    if not dropped:  # no mask: no split, and no empty-set value in the log
        assert not SPLIT_KEYS & set(metrics)
        return
    assert SPLIT_KEYS <= set(metrics) and all(math.isfinite(metrics[k]) for k in SPLIT_KEYS)
    signs = metrics["rollout_corr/masked_adv_positive_fraction"] + metrics["rollout_corr/masked_adv_negative_fraction"]
    assert 0.0 < signs <= 1.0 + 1e-12
