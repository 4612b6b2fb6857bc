"""Rollout correction: the formula module of the GRPO-on-GSM8K reference trainer.

Every training-inference mismatch correction as a plain torch function, in the order of the math:
ratios -> importance-sampling (IS) weights -> rejection sampling (RS) -> veto -> metrics -> the
correction entry point -> policy losses -> aggregation -> GRPO advantage -> KL penalty ->
configuration and presets; then the helpers.  Pure torch and the standard library; the chunked
kernels that turn logits into log pi are in ``rc_forward.py``.  "§N" is a section of
``docs/corrections.md``, the specification.

Notation (§1)
-------------
Per-token tensors have shape (B, T) and cover response tokens only.

* ``m``   original response mask (1 = generated token); rejection never changes it.
* ``k``   keep mask produced by RS and the veto; ``m' = m * k`` is the effective mask.
* ``n_i = sum_t m_it``, ``N = sum m``; row i is valid iff ``n_i > 0``; ``V`` = #valid rows.
* ``mu`` (behaviour policy, the inference engine), ``pi_old`` (proximal policy, frozen
  recompute), ``pi_theta`` (current policy); ``pi_train`` is ``pi_old`` in decoupled mode and
  ``sg(pi_theta)`` in bypass mode.
* ``l_it = log pi_train - log mu``, ``rho = exp(l)``; ``s_i = sum_t m_it l_it``;
  ``rho_geo_i = exp(s_i / n_i)``.
* ``S = 20``: ``clip_S(x) = min(max(x, -S), S)`` before any exponential (§2).

Padded positions are never read: reductions *select* valid entries (``torch.where``) instead of
multiplying by the mask (NaN * 0 = NaN), and every entry point replaces padded inputs by 0 first.

Loss denominators (§7.5, §11 item 5): **rejected tokens are treated as weight-0 tokens; every loss
denominator is computed from the pre-rejection response mask of the whole optimizer-step batch,
identically in decoupled and bypass modes.**  Numerators use ``m'``; ``N_B``, ``V_B`` and ``n_i``
come from ``m``.  The loss of a batch is the sum of its micro-batch contributions, and a
micro-batch with no kept token contributes exactly 0.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import warnings
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

# ============================================================================================
# Notation: reductions and the safety bound (docs/corrections.md §1, §2)
# ============================================================================================

#: Safety bound S: log-ratios are clipped to [-S, S] before exponentiation (§2).
SAFETY_BOUND = 20.0


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum_{mask} x: selects the entries where ``mask`` is set, never multiplies
    (docs/corrections.md §1)."""
    picked = torch.where(_as_bool(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return picked.sum() if dim is None else picked.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """<x>_q = sum q x / sum q over selected entries (docs/corrections.md §1).

    An empty selection gives 0 (never NaN); callers that need ">= 1 entry" validate it first.
    """
    mask = _as_bool(mask)
    total = masked_sum(x, mask, dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp(min=1).to(total.dtype)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the selected entries: sum (x - <x>)^2 / (n - 1) (or / n if not unbiased).

    Returns 0 when fewer than two entries are selected (the sd_V rule of docs/corrections.md §1).
    """
    mask = _as_bool(mask)
    count = mask.sum().to(x.dtype)
    centred = x - masked_mean(x, mask)
    squares = masked_sum(centred * centred, mask)
    denom = count - 1 if unbiased else count
    var = squares / denom.clamp(min=1)
    return torch.where(count > 1, var, torch.zeros_like(var))


def safety_clip(x: torch.Tensor, bound: float = SAFETY_BOUND) -> torch.Tensor:
    """clip_S(x) = min(max(x, -S), S), S = 20 (docs/corrections.md §2)."""
    return torch.clamp(x, min=-bound, max=bound)


def safe_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp(clip_S(x)): a ratio from its log, in [e^-20, e^20], never overflowing (§2)."""
    return torch.exp(safety_clip(log_ratio))


# ============================================================================================
# Ratios (docs/corrections.md §1)
# ============================================================================================


def token_log_ratio(train_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor) -> torch.Tensor:
    """l_it = log pi_train(y_it | s_it) - log mu(y_it | s_it) (docs/corrections.md §1).

    pi_train is pi_old in decoupled mode and sg(pi_theta) in bypass mode.
    """
    return train_log_prob - rollout_log_prob


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """s_i = sum_t m_it l_it: log of the trajectory ratio prod_t rho_it (docs/corrections.md §1,
    §12.1).  Built from the *unclipped* token log-ratios (§2).  Fully padded rows give 0.
    """
    return masked_sum(log_ratio, mask, dim=-1)


def geometric_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """g_i = (1/n_i) sum_t m_it l_it = s_i / n_i: log of the row's geometric-mean ratio
    (prod_t rho_it)^(1/n_i) (docs/corrections.md §3.1).  The mean, not the sum, of the *unclipped*
    token log-ratios; fully padded rows give 0."""
    return _row_mean(log_ratio, mask)


def k2_divergence(log_ratio: torch.Tensor) -> torch.Tensor:
    """k2 = x^2 / 2 >= 0 for x = log(pi / mu): biased, low-variance, and its expected gradient is
    that of KL (docs/corrections.md §7.6, §12.9; Schulman 2020)."""
    return 0.5 * log_ratio * log_ratio


def k3_divergence(log_ratio: torch.Tensor) -> torch.Tensor:
    """k3 = exp(x) - 1 - x >= 0, the k3 estimator of KL(mu || pi) for x = log(pi / mu) under mu
    (docs/corrections.md §12.9; Schulman 2020, "Approximating KL Divergence").

    Computed as expm1(x) - x: exp(x) - 1 rounds to 0 or 2^-23 in float32 for |x| ~ 1e-8 and made
    near-identical policies show k3 ~ -1e-8; expm1 keeps it >= 0.  The caller clips x.
    """
    return torch.expm1(log_ratio) - log_ratio


# ============================================================================================
# IS weights (docs/corrections.md §3, metrics §6.1)
# ============================================================================================

#: IS levels of docs/corrections.md §3.1.  "geometric" is opt-in, for peer compatibility, and warns
#: when a config selects it (docs/design-readings.md §10): as a weight it corrects no distribution.
IS_LEVELS = ("token", "sequence", "geometric")

#: The levels whose weight is one number per row, broadcast to the row's tokens (§3.1).
ROW_IS_LEVELS = ("sequence", "geometric")

#: The one-line caveat of ``rollout_is="geometric"`` (docs/design-readings.md §10).
GEOMETRIC_IS_WARNING = (
    "rollout_is='geometric' (opt-in, for AReaL/slime/ROLL compatibility) is a length-normalised divergence test, "
    "not an importance weight: exp(mean_t log(pi/mu)) corrects no distribution (docs/design-readings.md §10)"
)


_ZERO_GUARD = 1e-8  # the Z > 1e-8 batch-norm guard and the ESS epsilon (§3.7, §6.1)


class ISThreshold(NamedTuple):
    """Parsed ``rollout_is_threshold``: TIS (upper cap) or IcePop (two-sided zeroing)."""

    mode: str  # "tis" or "icepop"
    lower: float | None  # IcePop L; two-sided TIS C_min (rollout_is_threshold_lower); None for TIS
    upper: float  # U

    @property
    def diagnostic_lower(self) -> float:
        """L' of docs/corrections.md §6.1: L for IcePop, 1/U for TIS (metrics only)."""
        return 1.0 / self.upper if self.lower is None else self.lower


def _parse_positive(text: Any, field: str, spec: Any) -> float:
    """Parse one threshold value, finite and > 0 (docs/corrections.md §3.2, §4.2 step 4)."""
    if isinstance(text, bool):
        raise TypeError(f"{field} must be a number or string, not a boolean (got {spec!r})")
    if isinstance(text, str):
        text = text.strip()
        if not text:
            raise ValueError(f"{field}={spec!r}: empty value (expected a number)")
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{field}={spec!r}: {text!r} is not a number") from None
    elif isinstance(text, numbers.Real):
        value = float(text)
    else:
        raise TypeError(f"{field} entries must be numbers or strings, got {spec!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{field}={spec!r}: value {value!r} must be finite and > 0")
    return value


def _parse_lower_upper(text: str, field: str, spec: Any, open_lower: bool = False) -> tuple[float | None, float]:
    """Parse ``"L_U"``, exactly one underscore, L <= U (docs/corrections.md §3.2, §11 item 19).

    With ``open_lower`` (k1 RS options) an empty L, ``"_U"``, means "no lower bound" (L = None).
    """
    parts = text.split("_")
    if len(parts) != 2:
        raise ValueError(f"{field}={spec!r}: a lower_upper spec must contain exactly one underscore, e.g. '0.5_5.0'")
    if open_lower and not parts[0].strip():
        return None, _parse_positive(parts[1], field, spec)
    lower, upper = (_parse_positive(p, field, spec) for p in parts)
    if lower > upper:
        raise ValueError(f"{field}={spec!r}: lower bound {lower!r} exceeds upper bound {upper!r}")
    return lower, upper


def parse_is_threshold(spec: Any, field: str = "rollout_is_threshold") -> ISThreshold:
    """Parse the IS threshold spec (docs/corrections.md §3.2).

    number x -> TIS with U = x;  "x" -> TIS;  "L_U" -> IcePop with [L, U].
    A TIS cap may be +inf (``float("inf")`` or "inf"): no truncation, the untruncated token weight
    of seq-mask-tis (NeMo-RL, OpenRLHF; §3.9).  bool and non-number/non-string types raise
    TypeError; None, "", bad grammar, NaN, -inf, an infinite IcePop bound, non-positive values and
    L > U raise ValueError naming the spec.
    """
    if spec is None:
        raise ValueError(
            f"{field}=None while rollout_is is set: give a number (TIS cap) or "
            f"'L_U' (IcePop); IS is never disabled silently"
        )
    if isinstance(spec, bool):
        raise TypeError(f"{field} must be a number or string, not a boolean (got {spec!r})")
    if isinstance(spec, numbers.Real):
        return ISThreshold("tis", None, _parse_cap(spec, field, spec))
    if not isinstance(spec, str):
        raise TypeError(f"{field} must be a number or string, got {type(spec).__name__} {spec!r}")
    text = spec.strip()
    if not text:
        raise ValueError(f"{field}={spec!r}: empty string (expected a number or 'L_U')")
    if "_" in text:
        lower, upper = _parse_lower_upper(text, field, spec)
        return ISThreshold("icepop", lower, upper)
    return ISThreshold("tis", None, _parse_cap(text, field, spec))


def _parse_cap(value: Any, field: str, spec: Any) -> float:
    """A TIS cap U: finite and > 0 as :func:`_parse_positive`, or +inf, "no truncation" (§3.2)."""
    try:
        if float(value) == math.inf:
            return math.inf
    except (TypeError, ValueError):
        pass  # not a number: _parse_positive names it
    return _parse_positive(value, field, spec)


def raw_is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Raw IS weights w_hat with padding zeroed (docs/corrections.md §3.1, §3.5).

    token:     w_hat_it = exp(clip_S(l_it)) * m_it     (Yao et al. 2025, TIS)
    sequence:  w_hat_it = exp(clip_S(s_i)) * m_it, s_i = sum_t m_it l_it   (trajectory ratio,
               docs/corrections.md §12.1; Liu, Li et al. 2025, Seq-TIS) -- an exponential of a
               sum, never a sum/product of already-exponentiated ratios.
    geometric: w_hat_it = exp(clip_S(g_i)) * m_it, g_i = s_i / n_i   (GSPO-style geometric mean;
               AReaL ``areal/utils/functional/functional.py`` level=sequence, metric=ratio; slime
               ``examples/train_infer_mismatch_helper/mis.py`` tis_level=geometric; ROLL
               ``roll/utils/train_infer_corrections.py`` weight_type=geometric).  Opt-in: a
               divergence test, not an IS weight (docs/design-readings.md §10).
    """
    if level == "token":
        weights = safe_exp(log_ratio)
    elif level in ROW_IS_LEVELS:
        row = geometric_log_ratio if level == "geometric" else sequence_log_ratio
        weights = safe_exp(row(log_ratio, mask)).unsqueeze(-1).expand_as(log_ratio)
    else:
        raise ValueError(f"rollout_is={level!r}: expected one of {IS_LEVELS}")
    return _zero_padding(weights, mask)


def truncate_is_weights(raw: torch.Tensor, upper: float) -> torch.Tensor:
    """TIS: w = min(w_hat, U); one-sided, small weights are kept (docs/corrections.md §3.3;
    Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training").
    Padded zeros stay 0."""
    return torch.clamp(raw, max=upper)


def clamp_is_weights(raw: torch.Tensor, mask: torch.Tensor, lower: float, upper: float) -> torch.Tensor:
    """Two-sided truncation: w = min(max(w_hat, C_min), C_max) on valid tokens, padding 0
    (docs/corrections.md §3.8; TRL ``vllm_importance_sampling_clip_min``, slime
    ``--tis-clip-low``, OpenRLHF's [0.5, 5]).  Unlike IcePop, no weight is zeroed."""
    return _zero_padding(torch.clamp(raw, min=lower, max=upper), mask)


def icepop_is_weights(raw: torch.Tensor, lower: float, upper: float) -> torch.Tensor:
    """IcePop: w = w_hat * 1[L <= w_hat <= U] (docs/corrections.md §3.4; Ling team 2025, IcePop;
    Ring-1T, arXiv 2510.18855).  The response mask is not changed; a zeroed token stays valid."""
    inside = (raw >= lower) & (raw <= upper)
    return torch.where(inside, raw, torch.zeros_like(raw))


def batch_normalize_is_weights(
    weights: torch.Tensor, mask: torch.Tensor, level: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Self-normalise the applied weights to mean 1 (docs/corrections.md §3.7, §12.10).

    token:    Z = <w> = (1/N) sum m w                (mean over valid tokens)
    sequence: Z = E_V[w_bar_i], w_bar_i = (1/n_i) sum_t m w   (mean over *valid* rows, §11 item 16)
    If Z > 1e-8: w <- w / Z and factor = Z; otherwise w is unchanged and factor = 1.
    Z is computed over the tensors passed in; no implicit all-reduce (§11 item 16).
    Returns (weights, factor).
    """
    if level == "token":
        z = masked_mean(weights, mask)
    else:
        z = masked_mean(_row_mean(weights, mask), _valid_rows(mask))
    ok = z > _ZERO_GUARD
    scaled = torch.where(ok, weights / torch.where(ok, z, torch.ones_like(z)), weights)
    return scaled, torch.where(ok, z, torch.ones_like(z))


def compute_is_metrics(
    raw: torch.Tensor, applied: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, level: str, spec: ISThreshold
) -> dict[str, torch.Tensor]:
    """IS metrics of docs/corrections.md §6.1 (unprefixed), on the applied weights *before* batch
    normalisation; exceedance fractions, seq-level max/min and percentiles use the raw weights.

    mean <w>; std sqrt(max(<w^2> - <w>^2, 0)); ESS 1/<(w/(<w>+1e-8))^2> (0 if all w = 0, §11
    item 2; the Kish ESS as a fraction of N, §12.10); seq_* over valid rows of w_bar;
    oob_ratio for IcePop only.  At a row level max/min/fractions read the row's unclipped log
    weight: s_i (sequence) or g_i = s_i / n_i (geometric).  An infinite cap gives L' = 0.
    """
    rows, dt = _valid_rows(mask), raw.dtype
    upper, low_diag = spec.upper, spec.diagnostic_lower
    mean = masked_mean(applied, mask)
    ess = 1.0 / masked_mean((applied / (mean + _ZERO_GUARD)) ** 2, mask)
    all_zero = _masked_max(applied, mask) == 0
    out = {
        "mean": mean,
        "std": _pop_std(applied, mask),
        "eff_sample_size": torch.where(all_zero, torch.zeros_like(ess), ess),
    }
    if level == "token":
        out["max"], out["min"] = _masked_max(applied, mask), _masked_min(applied, mask)
        out["ratio_fraction_high"] = _fraction(raw > upper, mask, dt)
        out["ratio_fraction_low"] = _fraction(raw < low_diag, mask, dt)
    else:  # unclipped log-sums s_i, or log geometric means g_i
        seq = (geometric_log_ratio if level == "geometric" else sequence_log_ratio)(log_ratio, mask)
        out["max"] = torch.exp(torch.clamp(_masked_max(seq, rows), max=SAFETY_BOUND))
        out["min"] = torch.exp(_masked_min(seq, rows))
        out["ratio_fraction_high"] = _fraction(seq > math.log(upper), rows, dt)
        out["ratio_fraction_low"] = _fraction(seq < (math.log(low_diag) if low_diag > 0 else -math.inf), rows, dt)
    raw_bar = _row_mean(raw, mask)
    out.update(_seq_metrics(_row_mean(applied, mask), rows, 1.0, raw_bar > upper, raw_bar < low_diag))
    if spec.mode == "icepop":
        out["oob_ratio"] = _fraction((raw < spec.lower) | (raw > spec.upper), mask, dt)
    out.update(_quantiles(raw, mask))
    return {f"rollout_is_{k}": v for k, v in out.items()}


def compute_rollout_correction_weights(
    log_ratio: torch.Tensor, mask: torch.Tensor, level: str, spec: ISThreshold, batch_normalize: bool = False
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Processed, detached IS weights and their metrics (docs/corrections.md §5 step 3).

    raw (§3.1, padding zeroed §3.5) -> TIS (§3.3) or IcePop (§3.4) -> metrics (§6.1) ->
    stop-gradient (§3.6, §12.4) -> optional
    batch normalisation (§3.7), whose factor is the metric ``rollout_is_batch_norm_factor``.
    """
    raw = raw_is_weights(log_ratio.detach(), mask, level)
    if spec.mode == "icepop":
        applied = icepop_is_weights(raw, spec.lower, spec.upper)
    elif spec.lower is not None:
        applied = clamp_is_weights(raw, mask, spec.lower, spec.upper)
    else:
        applied = truncate_is_weights(raw, spec.upper)
    metrics = compute_is_metrics(raw, applied, log_ratio.detach(), mask, level, spec)
    weights = applied.detach()
    if batch_normalize:
        weights, factor = batch_normalize_is_weights(weights, mask, level)
        metrics["rollout_is_batch_norm_factor"] = factor
    return weights, metrics


# ============================================================================================
# Rejection sampling (docs/corrections.md §4.1-§4.4, metrics §6.2)
# ============================================================================================

#: The 11 canonical RS options of docs/corrections.md §4.1 (deliberately no ``seq_max_k1``).
RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)


def k1_statistic(clipped_log_ratio: torch.Tensor) -> torch.Tensor:
    """k1 = -lambda = log mu - log pi_train: signed, its mean under mu is KL(mu || pi_train)
    (docs/corrections.md §4.1, §12.9)."""
    return -clipped_log_ratio


#: The per-token RS statistics g(lambda) of docs/corrections.md §4.1, by the name that ends an option name
#: ``<aggregation>_<statistic>``.  k1 is the one signed statistic (a band L <= ratio <= U); every other statistic is
#: >= 0 and bounded from above by one threshold U.  A new statistic: one function, one entry here, and its option
#: names in :data:`RS_OPTIONS` (README "Fork it").
RS_STATISTICS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": k1_statistic,
    "k2": k2_divergence,
    "k3": k3_divergence,
}


#: Legacy RS level names and their canonical mapping (docs/corrections.md §4.4).
LEGACY_RS_NAMES = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}


class RSOption(NamedTuple):
    """One parsed RS option: statistic k1/k2/k3, aggregation token/seq_sum/seq_mean/seq_max.

    k1 options bound the ratio rho (or its product / geometric mean) to [lower, upper], with no
    lower bound when ``lower`` is None (the spec "_U"); k2/k3 options bound the statistic from
    above by ``upper`` (``lower`` is None).
    """

    name: str
    statistic: str
    aggregation: str
    lower: float | None
    upper: float

    @property
    def interval(self) -> tuple[float, float]:
        """[a, b] on the statistic (docs/corrections.md §4.1): k1 -> [-log U, -log L] (b = +inf
        without L); k2/k3 -> [0, U]."""
        if self.statistic == "k1":
            return -math.log(self.upper), math.inf if self.lower is None else -math.log(self.lower)
        return 0.0, self.upper


def _rs_option(name: str, entry: Any) -> RSOption:
    """Parse one threshold entry for a canonical option (docs/corrections.md §4.2 step 4)."""
    field = "rollout_rs_threshold"
    aggregation, statistic = name.rsplit("_", 1)
    if statistic not in RS_STATISTICS:
        raise ValueError(
            f"RS option {name!r}: no statistic {statistic!r} in RS_STATISTICS ({', '.join(RS_STATISTICS)})"
        )
    if statistic == "k1":
        if isinstance(entry, str) and "_" in entry:
            _refuse_zero_lower(entry.split("_")[0], field, entry)
            lower, upper = _parse_lower_upper(entry.strip(), field, entry, open_lower=True)
        else:
            upper = _parse_positive(entry, field, entry)
            lower = _reciprocal_lower(upper, f"{field}={entry!r} for {name}")
        return RSOption(name, "k1", aggregation, lower, upper)
    if isinstance(entry, str) and "_" in entry:
        raise ValueError(f"{field}={entry!r} for {name}: k2/k3 take a single upper bound, not a lower_upper pair")
    return RSOption(name, statistic, aggregation, None, _parse_positive(entry, field, entry))


def _reciprocal_lower(upper: float, context: str) -> float:
    """A single k1 value u means [1/u, u], which needs u >= 1 (docs/corrections.md §4.2, §4.4)."""
    if upper < 1.0:
        raise ValueError(f"{context}: a single k1 value u means [1/u, u] and needs u >= 1 (got {upper!r})")
    return 1.0 / upper


def _refuse_zero_lower(text: Any, field: str, spec: Any) -> None:
    """A k1 gate's lower bound L enters the statistic as -log L: L = 0 (log 0 = -inf) is refused,
    pointing to the one-sided form "_U" of the canonical k1 options (docs/corrections.md §4.2)."""
    text = text.strip() if isinstance(text, str) else text
    try:
        zero = not isinstance(text, bool) and float(text) == 0.0
    except (TypeError, ValueError):
        return  # not a number: _parse_positive names it
    if zero:
        raise ValueError(
            f"{field}={spec!r}: a k1 lower bound of {text!r} is log(0) = -inf; for no "
            f"lower bound give a canonical k1 option the threshold '_U', e.g. '_2.0'"
        )


def _legacy_rs_option(name: str, threshold: Any, lower: Any) -> RSOption:
    """Map a legacy level token/sequence/geometric to its canonical k1 option
    (docs/corrections.md §4.4)."""
    if isinstance(threshold, str) and ("_" in threshold or "," in threshold):
        raise ValueError(
            f"rollout_rs_threshold={threshold!r}: the legacy rollout_rs={name!r} "
            f"takes a single number U (use rollout_rs_threshold_lower for L)"
        )
    upper = _parse_positive(threshold, "rollout_rs_threshold", threshold)
    if lower is None:
        low = _reciprocal_lower(upper, f"rollout_rs_threshold={threshold!r} with no rollout_rs_threshold_lower")
    else:
        _refuse_zero_lower(lower, "rollout_rs_threshold_lower", lower)
        low = _parse_positive(lower, "rollout_rs_threshold_lower", lower)
        if low > upper:
            raise ValueError(f"rollout_rs_threshold_lower={lower!r} exceeds rollout_rs_threshold={threshold!r}")
    canonical = LEGACY_RS_NAMES[name]
    aggregation = canonical.rsplit("_", 1)[0]
    return RSOption(canonical, "k1", aggregation, low, upper)


def _split_rs_names(rollout_rs: Any) -> list[str]:
    """Split and check the option list (docs/corrections.md §4.2 step 1)."""
    if not isinstance(rollout_rs, str):
        raise TypeError(f"rollout_rs must be None or a comma-separated string, got {rollout_rs!r}")
    names = [part.strip() for part in rollout_rs.split(",") if part.strip()]
    if not names:
        raise ValueError(f"rollout_rs={rollout_rs!r} names no option")
    for name in names:
        if name not in RS_OPTIONS and name not in LEGACY_RS_NAMES:
            raise ValueError(
                f"rollout_rs={rollout_rs!r}: unknown option {name!r}; valid options "
                f"are {', '.join(RS_OPTIONS)} and the legacy names "
                f"{', '.join(LEGACY_RS_NAMES)}"
            )
    seen = set()
    for name in names:
        if name in seen:
            raise ValueError(f"rollout_rs={rollout_rs!r}: duplicate option {name!r}")
        seen.add(name)
    if len(names) > 1 and any(name in LEGACY_RS_NAMES for name in names):
        raise ValueError(
            f"rollout_rs={rollout_rs!r}: a legacy name (token/sequence/geometric) must be the only RS option"
        )
    return names


def parse_rs_options(
    rollout_rs: Any, rollout_rs_threshold: Any, rollout_rs_threshold_lower: Any = None
) -> tuple[RSOption, ...]:
    """Parse ``rollout_rs`` and its thresholds into RS options (docs/corrections.md §4.2, §4.4).

    Options are comma-separated and chained with AND (§4.3).  One threshold entry is broadcast to
    every option, otherwise entries match options by position.  k1 entries are "L_U", "_U" (no
    lower bound) or u (-> [1/u, u]); k2/k3 entries are one upper bound.  Legacy names map to k1
    options.
    """
    if rollout_rs is None:
        if rollout_rs_threshold_lower is not None:
            raise ValueError(
                f"rollout_rs_threshold_lower={rollout_rs_threshold_lower!r} is only "
                f"accepted with a legacy rollout_rs (token/sequence/geometric)"
            )
        return ()
    names = _split_rs_names(rollout_rs)
    legacy = names[0] in LEGACY_RS_NAMES
    if rollout_rs_threshold_lower is not None and not legacy:
        raise ValueError(
            f"rollout_rs_threshold_lower={rollout_rs_threshold_lower!r} is only "
            f"accepted with a legacy rollout_rs, not rollout_rs={rollout_rs!r}"
        )
    threshold = rollout_rs_threshold
    if threshold is None:
        raise ValueError(f"rollout_rs={rollout_rs!r} needs rollout_rs_threshold (got None)")
    if isinstance(threshold, bool):
        raise TypeError(f"rollout_rs_threshold must be a number or string, not a boolean (got {threshold!r})")
    if legacy:
        return (_legacy_rs_option(names[0], threshold, rollout_rs_threshold_lower),)
    if isinstance(threshold, numbers.Real):
        entries: list[Any] = [threshold]
    elif isinstance(threshold, str):
        entries = [part.strip() for part in threshold.split(",") if part.strip()]
        if not entries:
            raise ValueError(f"rollout_rs_threshold={threshold!r} contains no value")
    else:
        raise TypeError(f"rollout_rs_threshold must be a number or string, got {threshold!r}")
    if len(entries) not in (1, len(names)):
        raise ValueError(
            f"rollout_rs_threshold={threshold!r} has {len(entries)} entries but "
            f"rollout_rs={rollout_rs!r} has {len(names)} options; give 1 entry "
            f"(broadcast) or {len(names)}"
        )
    if len(entries) == 1:
        entries = entries * len(names)
    return tuple(_rs_option(name, entry) for name, entry in zip(names, entries))


def rs_base_statistic(clipped_log_ratio: torch.Tensor, statistic: str) -> torch.Tensor:
    """Per-token RS statistic from lambda = clip_S(l), looked up in :data:`RS_STATISTICS`
    (docs/corrections.md §4.1, §12.9):

    k1 = -lambda (signed; mean = KL(mu||pi_train) under mu), k2 = lambda^2 / 2,
    k3 = exp(lambda) - 1 - lambda >= 0 (:func:`k3_divergence`).
    """
    if statistic not in RS_STATISTICS:
        raise ValueError(f"unknown RS statistic {statistic!r}; known: {', '.join(RS_STATISTICS)}")
    return RS_STATISTICS[statistic](clipped_log_ratio)


def rs_aggregate(stat: torch.Tensor, mask: torch.Tensor, aggregation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Aggregate a per-token statistic g to (q, R) (docs/corrections.md §4.1, §6.2).

    token:    q_it = g_it;                       R_i = (1/n_i) sum_t m g
    seq_sum:  Q_i = sum_t m_it g_it              (q = Q_i broadcast, R = Q)
    seq_mean: Q_i = (1/n_i) sum_t m_it g_it      (Liu, Li et al. 2025, Geo-RS; TRM average)
    seq_max:  Q_i = max_{t: m_it = 1} g_it       (Trust Region Masking, arXiv 2512.23075, max)
    Invalid rows get Q_i = 0.
    """
    rows = _valid_rows(mask)
    if aggregation == "token":
        return stat, _row_mean(stat, mask)
    if aggregation == "seq_sum":
        row_value = masked_sum(stat, mask, dim=-1)
    elif aggregation == "seq_mean":
        row_value = _row_mean(stat, mask)
    elif aggregation == "seq_max":
        neg_inf = torch.full((), -math.inf, dtype=stat.dtype, device=stat.device)
        row_value = torch.where(mask, stat, neg_inf).amax(dim=-1)
        row_value = torch.where(rows, row_value, torch.zeros_like(row_value))
    else:
        raise ValueError(f"unknown RS aggregation {aggregation!r}")
    return row_value.unsqueeze(-1).expand_as(stat), row_value


def rs_option_keep_mask(q: torch.Tensor, mask: torch.Tensor, option: RSOption) -> torch.Tensor:
    """Keep mask of one option, restricted to valid tokens (docs/corrections.md §4.1 "Acceptance").

    k1: keep iff a <= q <= b with [a, b] = [-log U, -log L], i.e. L <= rho <= U in ratio space
        (project direction, docs/corrections.md §11 item 1); b = +inf without L.
    k2/k3: keep iff q <= U (one-sided).
    """
    a, b = option.interval
    keep = q <= b
    if option.statistic == "k1":
        keep = keep & (q >= a)
    return keep & mask


def compute_rs_option_metrics(
    q: torch.Tensor, row_value: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor, option: RSOption
) -> dict[str, torch.Tensor]:
    """Per-option RS metrics ``rollout_rs_<option>_*`` of docs/corrections.md §6.2.  For k1
    ``_fraction_high`` counts ratios below L and ``_fraction_low`` ratios above U;
    ``_seq_fraction_low`` exists for k1 options only."""
    rows, dt = _valid_rows(mask), q.dtype
    a, b = option.interval
    is_k1 = option.statistic == "k1"
    out = {"mean": masked_mean(q, mask)}
    if option.aggregation == "token":
        out["max"], out["min"] = _masked_max(q, mask), _masked_min(q, mask)
        out["fraction_high"] = _fraction(q > b, mask, dt)
        out["fraction_low"] = _fraction(q < a, mask, dt) if is_k1 else 0.0
    else:
        out["max"], out["min"] = _masked_max(row_value, rows), _masked_min(row_value, rows)
        out["fraction_high"] = _fraction(row_value > b, rows, dt)
        out["fraction_low"] = _fraction(row_value < a, rows, dt) if is_k1 else 0.0
    out["std"] = _pop_std(torch.clamp(q, min=a, max=b), mask)
    out.update(_seq_metrics(row_value, rows, 0.0, row_value > b, row_value < a if is_k1 else None))
    rejected = mask & ~keep
    out["masked_fraction"] = _fraction(rejected, mask, dt)
    out["seq_masked_fraction"] = _fraction(rejected.any(dim=-1), rows, dt)
    return {f"rollout_rs_{option.name}_{k}": v for k, v in out.items()}


def compute_rejection_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, options: Sequence[RSOption]
) -> tuple[torch.Tensor, dict]:
    """Chained RS keep mask k_RS = AND_o k^(o) and the RS metrics (docs/corrections.md §4.3,
    §6.2).

    Statistics use lambda = clip_S(l) (§2).  RS only produces a keep mask; it never touches IS
    weights.  Returns (keep restricted to valid tokens, metrics).
    """
    lam = safety_clip(log_ratio.detach())
    keep = mask.clone()
    metrics: dict[str, torch.Tensor | float] = {}
    for option in options:
        q, row_value = rs_aggregate(rs_base_statistic(lam, option.statistic), mask, option.aggregation)
        option_keep = rs_option_keep_mask(q, mask, option)
        metrics.update(compute_rs_option_metrics(q, row_value, option_keep, mask, option))
        keep = keep & option_keep
    rejected = mask & ~keep
    metrics["rollout_rs_masked_fraction"] = _fraction(rejected, mask, log_ratio.dtype)
    metrics["rollout_rs_seq_masked_fraction"] = _fraction(rejected.any(dim=-1), _valid_rows(mask), log_ratio.dtype)
    return keep, metrics


# ============================================================================================
# Veto: worst-token rejection (docs/corrections.md §4.5, metrics §6.3)
# ============================================================================================


def parse_veto_threshold(tau: Any) -> float | None:
    """The veto threshold tau: None disables it, otherwise 0 < tau < 1 (§4.5, §10)."""
    if tau is None:
        return None
    if isinstance(tau, bool) or not isinstance(tau, numbers.Real):
        raise TypeError(f"rollout_token_veto_threshold must be None or a number in (0, 1), got {tau!r}")
    value = float(tau)
    if not (math.isfinite(value) and 0.0 < value < 1.0):
        raise ValueError(f"rollout_token_veto_threshold={tau!r} must be finite and in (0, 1)")
    return value


def compute_veto_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, tau: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Worst-token veto (docs/corrections.md §4.5; INTELLECT-3, arXiv 2512.16144):
    c_it = m_it 1[l_it < log tau] on the *unclipped* l (strict <);
    row i is vetoed iff h_i = max_t c_it = 1, i.e. iff min_{t valid} rho_it < tau.

    Returns the row keep mask (1 - h_i) broadcast over tokens (restricted to valid tokens) and the
    metrics rollout_is_veto_fraction = E_V h, rollout_is_catastrophic_token_fraction = <c>.
    """
    catastrophic = mask & (log_ratio.detach() < math.log(tau))
    vetoed = catastrophic.any(dim=-1)
    keep = mask & ~vetoed.unsqueeze(-1)
    dt = log_ratio.dtype
    metrics = {
        "rollout_is_veto_fraction": _fraction(vetoed, _valid_rows(mask), dt),
        "rollout_is_catastrophic_token_fraction": _fraction(catastrophic, mask, dt),
    }
    return keep, metrics


# ============================================================================================
# Sequence and token masks: OPSM, M2PO, outlier tokens (docs/corrections.md §4.6-§4.8)
# ============================================================================================


def compute_opsm_mask(
    log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, delta: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Off-policy sequence masking (DeepSeek-AI 2025, DeepSeek-V3.2, arXiv 2512.02556, §3.1;
    TRL ``off_policy_mask_threshold``, slime ``--use-opsm``):

    D_i = (1/n_i) sum_t m_it (log mu - sg(log pi_theta)); drop row i iff A_i < 0 and D_i > delta
    (A_i = the row's mean advantage).  Uses the current policy, so it is applied in the loss, per
    micro-batch.  Metrics: actor/opsm_seq_masked_fraction (dropped / valid rows) and
    actor/opsm_neg_adv_seq_masked_fraction (dropped / rows with A_i < 0): positive rows are never
    dropped, so the split by sign is the point.
    """
    rows = _valid_rows(mask)
    divergence = _row_mean(rollout_log_prob - log_prob.detach(), mask)
    negative = _row_mean(advantages, mask) < 0
    dropped = rows & negative & (divergence > delta)
    keep = mask & ~dropped.unsqueeze(-1)
    dt = divergence.dtype
    metrics = {
        "actor/opsm_seq_masked_fraction": _fraction(dropped, rows, dt),
        "actor/opsm_neg_adv_seq_masked_fraction": _fraction(dropped, rows & negative, dt),
    }
    return keep, metrics


def compute_m2_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """M2PO's second-moment token mask (Zheng, Zhao & Chen 2025, "Prosperity before Collapse",
    arXiv 2510.01161, §4; AReaL ``m2_threshold``):

    M2 = <lambda^2>, lambda = clip_S(l).  If M2 > tau_M2, mask the tokens of largest lambda^2, the
    fewest such that the kept tokens' <lambda^2> <= tau_M2, but never the last one: when every
    lambda^2 exceeds tau_M2 the token of smallest lambda^2 stays, alone (AReaL's rule; the first in
    row-major order among ties).  Over the tensors passed (the batch in decoupled mode, the
    micro-batch in bypass).  Metrics: rollout_m2 (M2 before), rollout_m2_after (over the kept
    tokens), rollout_m2_masked_fraction.
    """
    squares = safety_clip(log_ratio.detach()) ** 2
    flat = torch.where(mask, squares, torch.full_like(squares, math.inf)).flatten()
    order = torch.argsort(flat, stable=True)  # ascending; padding (inf) last
    n = int(mask.sum())
    sorted_values = flat[order][:n]
    means = torch.cumsum(sorted_values, 0) / torch.arange(1, n + 1, dtype=squares.dtype, device=squares.device)
    kept_count = n
    if n and float(means[-1]) > threshold:  # the means rise with the count: keep the longest prefix that fits
        kept_count = max(int((means <= threshold).sum()), 1)
    keep = torch.zeros_like(flat, dtype=torch.bool)
    keep[order[:kept_count]] = True
    keep = keep.view_as(mask) & mask
    dt = squares.dtype
    metrics = {
        "rollout_m2": masked_mean(squares, mask),
        "rollout_m2_after": masked_mean(squares, keep),
        "rollout_m2_masked_fraction": _fraction(mask & ~keep, mask, dt),
    }
    return keep, metrics


def compute_outlier_token_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, low: float | None, high: float | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Two-sided worst-token rejection (SkyRL ``outlier_token_is_threshold_low/high``): row i is
    rejected iff some valid token has rho < low or rho > high (unclipped l, strict), i.e.
    min_t rho < low or max_t rho > high.  ``low`` alone is the veto of §4.5.  Metrics:
    rollout_outlier_seq_masked_fraction, rollout_outlier_token_fraction_low / _high."""
    ell = log_ratio.detach()
    below = mask & (ell < math.log(low)) if low is not None else torch.zeros_like(mask)
    above = mask & (ell > math.log(high)) if high is not None else torch.zeros_like(mask)
    rejected = (below | above).any(dim=-1)
    dt = log_ratio.dtype
    metrics = {
        "rollout_outlier_seq_masked_fraction": _fraction(rejected, _valid_rows(mask), dt),
        "rollout_outlier_token_fraction_low": _fraction(below, mask, dt),
        "rollout_outlier_token_fraction_high": _fraction(above, mask, dt),
    }
    return mask & ~rejected.unsqueeze(-1), metrics


# ============================================================================================
# Metrics: off-policy, consistency, TV (docs/corrections.md §6.4, §6.5, §12.7)
# ============================================================================================


def chi2_divergence(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """chi^2(pi || mu) ~ <exp(2 clip_S(x))>_mask - 1 for x = log(pi / mu) sampled from mu
    (docs/corrections.md §6.4, §12.9): per token (x = l over valid tokens) or per sequence
    (x = s_i over valid rows)."""
    return masked_mean(torch.exp(2.0 * safety_clip(log_ratio)), mask) - 1.0


def _offpolicy_metric_tensors(
    train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Off-policy diagnostics of docs/corrections.md §6.4 (unprefixed; the entry point's step 6), over valid tokens
    and rows of the sanitised log-probs.

    With a_bar_i, b_bar_i the row means of log pi_train and log mu and d_i = b_bar_i - a_bar_i:
    training_ppl = E_V exp(-a_bar); training_log_ppl = E_V(-a_bar); rollout_ppl / rollout_log_ppl
    likewise; kl = <log mu - log pi_train> (k1); k3_kl = <e^lambda - lambda - 1>, lambda = clip_S(l)
    (§11 item 12); log_ppl_diff = E_V d; log_ppl_abs_diff = E_V |d|; log_ppl_diff_max/min;
    ppl_ratio = E_V e^d (per sequence, then averaged); chi2_token = <e^{2 lambda}> - 1;
    chi2_seq = E_V e^{2 clip_S(s_i)} - 1.  KL estimators: Schulman 2020 (§12.9).
    """
    rows = _valid_rows(mask)
    a_bar = _row_mean(train, mask)
    b_bar = _row_mean(rollout, mask)
    ell = token_log_ratio(train, rollout)
    d = b_bar - a_bar
    return {
        "training_ppl": masked_mean(torch.exp(-a_bar), rows),
        "training_log_ppl": masked_mean(-a_bar, rows),
        "rollout_ppl": masked_mean(torch.exp(-b_bar), rows),
        "rollout_log_ppl": masked_mean(-b_bar, rows),
        "kl": masked_mean(-ell, mask),
        "k3_kl": masked_mean(k3_divergence(safety_clip(ell)), mask),
        "log_ppl_diff": masked_mean(d, rows),
        "log_ppl_abs_diff": masked_mean(d.abs(), rows),
        "log_ppl_diff_max": _masked_max(d, rows),
        "log_ppl_diff_min": _masked_min(d, rows),
        "ppl_ratio": masked_mean(torch.exp(d), rows),
        "chi2_token": chi2_divergence(ell, mask),
        "chi2_seq": chi2_divergence(sequence_log_ratio(ell, mask), rows),
    }


def _consistency_metric_tensors(
    train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Probability-space consistency metrics of docs/corrections.md §6.5 (the entry point's step 6).

    With p_tr = exp(log pi_train), p_ro = exp(log mu), delta = |p_tr - p_ro| over valid tokens:
    rollout_probs_diff_max = max delta; _mean = <delta>; _std = unbiased std (0 if N = 1);
    rollout_actor_probs_pearson_corr = Pearson(p_tr, p_ro) (NaN if N < 2 or a constant series).
    """
    p_tr, p_ro = torch.exp(train), torch.exp(rollout)
    delta = (p_tr - p_ro).abs()
    n = mask.sum()
    mx, my = masked_mean(p_tr, mask), masked_mean(p_ro, mask)
    cov = masked_mean((p_tr - mx) * (p_ro - my), mask)
    vx, vy = masked_mean((p_tr - mx) ** 2, mask), masked_mean((p_ro - my) ** 2, mask)
    constant = (_masked_max(p_tr, mask) == _masked_min(p_tr, mask)) | (
        _masked_max(p_ro, mask) == _masked_min(p_ro, mask)
    )
    corr = cov / torch.sqrt(vx * vy)
    nan = torch.full_like(corr, math.nan)
    return {
        "rollout_probs_diff_max": _masked_max(delta, mask),
        "rollout_probs_diff_mean": masked_mean(delta, mask),
        "rollout_probs_diff_std": torch.sqrt(masked_var(delta, mask, unbiased=True)),
        "rollout_actor_probs_pearson_corr": torch.where((n < 2) | constant, nan, corr),
    }


def estimate_tv_distance(log_rho_1: torch.Tensor, log_rho_2: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    """D_TV(pi_1, pi_2) ~ (1/2) <|rho_1 - rho_2|> with rho_j = pi_j / mu, a = sampled from mu
    (docs/corrections.md §12.6-§12.7; Wang & Zhang 2025, "From Two Policies to Three", Theorem 2:
    alpha_0 = D_TV(pi_old, pi_theta), alpha_1 = D_TV(mu, pi_old)).

    ``log_rho_2=None`` means pi_2 = mu (rho_2 = 1): the alpha_1 estimate (1/2)<|1 - rho|>.
    Log-ratios are clipped to +/-S before exponentiation.  These are averages over visited states,
    i.e. lower proxies of the max-over-states alpha; they cannot certify the TRPO bound.
    An empty mask gives 0.
    """
    rho_1 = safe_exp(log_rho_1)
    rho_2 = torch.ones_like(rho_1) if log_rho_2 is None else safe_exp(log_rho_2)
    return 0.5 * masked_mean((rho_1 - rho_2).abs(), mask)


# ============================================================================================
# Metrics: the mismatch diagnostics the peers log (docs/corrections.md §6.8)
# ============================================================================================


def mult_prob_error(log_ratio: torch.Tensor) -> torch.Tensor:
    """e^{|lambda|}, lambda = clip_S(l) (§2): the factor by which pi_train and mu disagree on the sampled token, >= 1
    (docs/corrections.md §6.8).  Its mean over valid tokens is NeMo-RL's ``token_mult_prob_error``
    (nemo_rl/algorithms/loss/loss_functions.py, ClippedPGLossFn: the token-normalised mean of
    exp(|log mu - log pi_old|); a mean of per-token factors, not the exp of a mean).  NeMo-RL does not clip."""
    return torch.exp(safety_clip(log_ratio).abs())


def sampled_js_divergence(log_ratio: torch.Tensor) -> torch.Tensor:
    """NeMo-RL's Jensen-Shannon term at the sampled token (docs/corrections.md §6.8;
    nemo_rl/algorithms/loss/loss_functions.py, ClippedPGLossFn, ``js_divergence_error``): with p = pi_train(y_t),
    q = mu(y_t), m = (p + q)/2 and k3(x) = e^x - 1 - x, JS_t = (1/2) k3(log p - log m) + (1/2) k3(log q - log m).

    A function of l = log p - log q alone: log p - log m = -log1p(expm1(-l)/2), log q - log m = -log1p(expm1(l)/2),
    so float32 keeps small l; l is clipped to +/-S (§2; NeMo-RL does not clip).  >= 0, 0 iff p = q, ~ l^2/8 for
    small l (a quarter of the k3 term).  Read from two log-probs of one sampled token, it is not the JS divergence
    of the two distributions (which needs the vocabulary and is <= log 2): ~ |l|/2 for large |l|."""
    lam = safety_clip(log_ratio)
    train_vs_mixture = -torch.log1p(0.5 * torch.expm1(-lam))
    rollout_vs_mixture = -torch.log1p(0.5 * torch.expm1(lam))
    return 0.5 * k3_divergence(train_vs_mixture) + 0.5 * k3_divergence(rollout_vs_mixture)


def _mismatch_metric_tensors(train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The peers' mismatch metrics over valid tokens (docs/corrections.md §6.8; the entry point's step 6, beside the
    verl-parity ones of §6.4-§6.5), l = log pi_train - log mu: log_prob_abs_diff_mean = <|l|> and
    log_prob_abs_diff_max = max |l| (TRL, trl/trainer/grpo_trainer.py ``sampling/sampling_logp_difference/{mean,max}``;
    slime's CI bound on ``train_rollout_logprob_abs_diff``, slime/backends/megatron_utils/loss.py, a mean per
    response then over responses); token_mult_prob_error = <e^{|lambda|}> (:func:`mult_prob_error`);
    js_divergence = <JS_t> (:func:`sampled_js_divergence`)."""
    ell = token_log_ratio(train, rollout)
    gap = ell.abs()
    return {
        "log_prob_abs_diff_mean": masked_mean(gap, mask),
        "log_prob_abs_diff_max": _masked_max(gap, mask),
        "token_mult_prob_error": masked_mean(mult_prob_error(ell), mask),
        "js_divergence": masked_mean(sampled_js_divergence(ell), mask),
    }


def _mask_split_metric_tensors(
    log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, keep: torch.Tensor
) -> dict[str, torch.Tensor]:
    """prime-rl's split of the mismatch by the loss mask (docs/corrections.md §6.8; src/prime_rl/trainer/rl/loss.py,
    default_loss_fn and ipo_loss_fn), with D = m and not m' (dropped) and K = m' (kept), bool:
    masked_mismatch_kl = <k3(lambda)>_D, kept_mismatch_kl = <k3(lambda)>_K (prime-rl's unmasked_mismatch_kl;
    k3 = rho - 1 - log rho, lambda = clip_S(l) as in rollout_corr/k3_kl); masked_adv_positive_fraction =
    <1[A > 0]>_D, masked_adv_negative_fraction = <1[A < 0]>_D (A = 0 counts in neither).  An empty set gives 0."""
    dropped, kept = mask & ~keep, mask & keep
    kl = k3_divergence(safety_clip(log_ratio))
    return {
        "masked_mismatch_kl": masked_mean(kl, dropped),
        "kept_mismatch_kl": masked_mean(kl, kept),
        "masked_adv_positive_fraction": _fraction(advantages > 0, dropped, kl.dtype),
        "masked_adv_negative_fraction": _fraction(advantages < 0, dropped, kl.dtype),
    }


def mask_split_metrics(
    log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, keep: torch.Tensor
) -> dict[str, float]:
    """:func:`_mask_split_metric_tensors` as ``rollout_corr/*`` floats (one host sync), or {} when m' drops no valid
    token of m: the split exists only where something was dropped (docs/corrections.md §6.8).  ``keep`` is the
    keep mask k or the effective mask m' (0/1 or bool); ``log_ratio`` is l = log pi_train - log mu."""
    mask, keep = _as_bool(mask), _as_bool(keep)
    tensors = _mask_split_metric_tensors(log_ratio, advantages, mask, keep)
    floats = _to_floats({**tensors, "dropped": (mask & ~keep).sum()})
    if floats.pop("dropped") == 0:
        return {}
    return {f"rollout_corr/{k}": v for k, v in floats.items()}


def mismatch_split_metrics(
    current_log_prob: torch.Tensor, sampling_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """The mismatch log(pi_t/mu) split at pi_v, the trainer's policy at the weights that sampled the row
    (docs/corrections.md §6.9): numerics l_n = log pi_v - log mu (same weights, engine against trainer), staleness
    l_s = log pi_t - log pi_v (same numerics, other weights); l_n + l_s = log pi_t - log mu token by token. Over
    valid tokens of mu's samples: numerics_/staleness_log_ratio <l>, _k3_kl <k3(clip_S(l))>, _tv (1/2)<|rho_v - 1|>
    and (1/2)<|rho_t - rho_v|> (estimate_tv_distance, rho = pi/mu; TV(pi_t, mu) <= the two, per sample)."""
    mask = _as_bool(mask)
    dt = _work_dtype(current_log_prob, sampling_log_prob, rollout_log_prob)
    t, v, mu = (_zero_padding(x.detach(), mask, dt) for x in (current_log_prob, sampling_log_prob, rollout_log_prob))
    numerics, staleness = v - mu, t - v
    return _to_floats(
        {
            "rollout_corr/numerics_log_ratio": masked_mean(numerics, mask),
            "rollout_corr/numerics_k3_kl": masked_mean(k3_divergence(safety_clip(numerics)), mask),
            "rollout_corr/numerics_tv": estimate_tv_distance(numerics, None, mask),
            "rollout_corr/staleness_log_ratio": masked_mean(staleness, mask),
            "rollout_corr/staleness_k3_kl": masked_mean(k3_divergence(safety_clip(staleness)), mask),
            "rollout_corr/staleness_tv": estimate_tv_distance(t - mu, numerics, mask),
        }
    )


# ============================================================================================
# Health check (docs/corrections.md §6.7)
# ============================================================================================


class HealthCheck(NamedTuple):
    """One alarm: fires when the metric (or its absolute value) lies below ``low`` or above ``high``."""

    metric: str
    low: float | None
    high: float | None
    absolute: bool = False


#: The usage guide's alarms (verl rollout-correction docs, check_rollout_correction_health):
#: name -> check.  The trainer and plots read the thresholds from here (docs/corrections.md §6.7).
HEALTH_CHECKS: dict[str, HealthCheck] = {
    "health/is_mean": HealthCheck("rollout_corr/rollout_is_mean", 0.5, 2.0),
    "health/is_ess": HealthCheck("rollout_corr/rollout_is_eff_sample_size", 0.3, None),
    "health/is_std": HealthCheck("rollout_corr/rollout_is_std", None, 1.0),
    "health/kl": HealthCheck("rollout_corr/kl", None, 0.1, absolute=True),
    "health/chi2_token": HealthCheck("rollout_corr/chi2_token", None, 1.0),
}


def check_rollout_correction_health(metrics: Mapping[str, float]) -> dict[str, float]:
    """The checks of :data:`HEALTH_CHECKS` that fire on one step's metrics: health name -> the
    metric's value.  Strict comparisons (IS mean outside [0.5, 2], ESS < 0.3, IS std > 1,
    |KL| > 0.1, chi2_token > 1); a metric that is absent (IS off) fires nothing, a NaN or inf one
    fires (a correction that computes no number is the worst health, not a missing one)."""
    fired = {}
    for name, check in HEALTH_CHECKS.items():
        value = metrics.get(check.metric)
        if value is None:
            continue
        x = abs(float(value)) if check.absolute else float(value)
        outside = (check.low is not None and x < check.low) or (check.high is not None and x > check.high)
        if outside or not math.isfinite(x):
            fired[name] = float(value)
    return fired


# ============================================================================================
# The correction entry point (docs/corrections.md §5)
# ============================================================================================


def _apply_correction(old_log_prob, rollout_log_prob, response_mask, config, with_metrics=True, *, validate=True):
    """Entry-point body for an already validated :class:`RolloutCorrectionConfig` (§5).
    with_metrics=False skips the diagnostic metrics and their host transfers (the weights and the
    keep mask are the same); validate=False skips the tensor checks (§10), trusting them."""
    mask, train, rollout = _prepare_log_probs(old_log_prob, rollout_log_prob, response_mask, validate=validate)
    with torch.no_grad():
        ell = token_log_ratio(train, rollout)  # step 2: one l for IS, RS, veto and metrics
        metrics: dict[str, torch.Tensor | float] = {}
        weights = None
        if config.rollout_is is not None:  # step 3
            weights, is_metrics = compute_rollout_correction_weights(
                ell, mask, config.rollout_is, config.is_spec, config.rollout_is_batch_normalize
            )
            metrics.update(is_metrics)
        keep = mask
        if config.rs_specs:  # step 4
            keep, rs_metrics = compute_rejection_mask(ell, mask, config.rs_specs)
            metrics.update(rs_metrics)
        if config.veto_tau is not None:  # step 5: after RS, AND-ed into the keep mask
            veto_keep, veto_metrics = compute_veto_mask(ell, mask, config.veto_tau)
            keep = keep & veto_keep
            metrics.update(veto_metrics)
        if config.rollout_m2_threshold is not None:  # §4.7
            m2_keep, m2_metrics = compute_m2_mask(ell, mask, config.rollout_m2_threshold)
            keep = keep & m2_keep
            metrics.update(m2_metrics)
        if config.outlier_bounds is not None:  # §4.8
            outlier_keep, outlier_metrics = compute_outlier_token_mask(ell, mask, *config.outlier_bounds)
            keep = keep & outlier_keep
            metrics.update(outlier_metrics)
        if with_metrics:
            metrics.update(_offpolicy_metric_tensors(train, rollout, mask))  # step 6
            metrics.update(_consistency_metric_tensors(train, rollout, mask))
            metrics["tv_mismatch"] = estimate_tv_distance(ell, None, mask)
            metrics.update(_mismatch_metric_tensors(train, rollout, mask))  # the peers' (§6.8)
        floats = _to_floats(metrics) if with_metrics else {}
    out_mask = keep.to(response_mask.dtype, copy=True)
    return weights, out_mask, {f"rollout_corr/{k}": v for k, v in floats.items()}  # step 7


def compute_rollout_correction_and_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    config: RolloutCorrectionConfig,
    *,
    with_metrics: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """The correction entry point (docs/corrections.md §5).

    ``old_log_prob`` is log pi_train (pi_old in decoupled mode, sg(pi_theta) in bypass mode),
    ``rollout_log_prob`` is log mu, ``response_mask`` is the original mask m, ``config`` a
    :class:`RolloutCorrectionConfig` (validated when it was built, §10), the same object the
    bypass loss takes.  Steps: validate -> l = log pi_train - log mu -> IS weights + metrics
    (then batch-normalise) -> RS keep mask + metrics -> veto -> off-policy, consistency and
    ``tv_mismatch`` metrics on the original mask -> prefix ``rollout_corr/``.  IS and RS both read
    the same l and m and never alter each other.

    Returns ``(is_weights or None (detached, padding 0), m * k (dtype of response_mask),
    metrics)``.  ``tv_mismatch`` = (1/2)<|1 - rho|> estimates alpha_1 in decoupled mode and beta
    in bypass mode (§12.7).  ``with_metrics=False`` skips the diagnostic metrics and their host
    transfers (the weights and the keep mask are the same).
    """
    if not isinstance(config, RolloutCorrectionConfig):
        raise TypeError(f"config must be a RolloutCorrectionConfig, got {config!r}")
    return _apply_correction(old_log_prob, rollout_log_prob, response_mask, config, with_metrics)


# ============================================================================================
# Losses (docs/corrections.md §7.1-§7.4, metrics §6.6)
# ============================================================================================


def ppo_clipped_token_loss(
    log_prob: torch.Tensor,
    prox_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO loss with asymmetric and dual clip (docs/corrections.md §7.1, §12.2;
    Schulman et al. 2017, PPO; Ye et al. 2020, dual clip; Yu et al. 2025, DAPO clip-higher).

    lambda_r = clip_S(log pi_theta - log pi_prox), r = exp(lambda_r)
    L1 = -A r,  L2 = -A clip(r, 1 - eps_low, 1 + eps_high),  C1 = max(L1, L2)
    L3 = -A c,  C2 = min(L3, C1),  phi = C2 if A < 0 else C1
    Returns phi and the indicators {clipped: L2 > L1, clipped_lower: (C1 > L3) & (A < 0),
    log_ratio: lambda_r} used by the actor metrics.
    """
    log_ratio = safety_clip(log_prob - prox_log_prob)
    ratio = torch.exp(log_ratio)
    loss_1 = -advantages * ratio
    loss_2 = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_1 = torch.maximum(loss_1, loss_2)
    loss_3 = -advantages * clip_ratio_c
    clip_2 = torch.minimum(loss_3, clip_1)
    negative = advantages < 0
    phi = torch.where(negative, clip_2, clip_1)
    info = {"clipped": loss_2 > loss_1, "clipped_lower": (clip_1 > loss_3) & negative, "log_ratio": log_ratio}
    return phi, info


def reinforce_token_loss(
    log_prob: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """phi_PG = -A * log pi_theta * sg(w), w = 1 if IS is off (docs/corrections.md §7.4; Williams
    1992, REINFORCE).  The gradient is -A w grad log pi_theta; the stop-gradient removes the
    spurious log pi grad w term (§12.4)."""
    loss = -advantages * log_prob
    return loss if weights is None else loss * weights.detach()


def _effective_mask(mask: torch.Tensor, keep_mask: torch.Tensor | None, validate: bool = True) -> torch.Tensor:
    """m' = m * k; ``keep_mask`` may be the keep mask k or the effective mask itself (its 0/1 values
    are checked unless ``validate=False``)."""
    if keep_mask is None:
        return mask
    return mask & (_check_mask_values(keep_mask, "keep_mask") if validate else _as_bool(keep_mask))


def _loss_inputs(
    *,
    log_prob: torch.Tensor,
    prox_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: RolloutCorrectionConfig,
    loss_agg_mode: str,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    global_token_count: Any,
    global_seq_count: Any,
    loss_scale_factor: float | None,
    keep_mask: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    rollout_log_prob: torch.Tensor | None = None,
    validate: bool = True,
) -> PolicyLossInputs:
    """The one :class:`PolicyLossInputs` of a policy loss (§7.7): check the loss settings (§7.1) and
    the tensors (§10; ``rollout_log_prob`` only for its shape and finiteness), m' = m * k, and
    every tensor in the work dtype (>= fp32, also for bf16 inputs) with padding replaced by 0.
    ``weights`` are the IS weights to multiply (decoupled mode, §7.2).  ``validate=False`` skips
    the checks and trusts that they hold."""
    if validate:
        check_loss_settings(clip_ratio_low, clip_ratio_high, clip_ratio_c, loss_agg_mode, loss_scale_factor)
    finite = {
        "old_log_prob": prox_log_prob,
        "log_prob": log_prob,
        "advantages": advantages,
        "rollout_log_prob": rollout_log_prob,
    }
    others = {"rollout_is_weights": weights, "keep_mask": keep_mask}
    mask = _validate_inputs(response_mask, finite, others, validate=validate)
    dt = _work_dtype(prox_log_prob, log_prob, advantages)
    return PolicyLossInputs(
        log_prob=_zero_padding(log_prob, mask, dt),
        prox_log_prob=_zero_padding(prox_log_prob.detach(), mask, dt),
        advantages=_zero_padding(advantages.detach(), mask, dt),
        mask=mask,
        keep=_effective_mask(mask, keep_mask, validate),
        weights=None if weights is None else _zero_padding(weights.detach(), mask, dt),
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        config=config,
        loss_agg_mode=loss_agg_mode,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        loss_scale_factor=loss_scale_factor,
    )


@torch.no_grad()
def _actor_metrics(
    a: PolicyLossInputs, loss: torch.Tensor, mode_metrics: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The actor metrics of a ratio objective (§6.6), over m', not IS-weighted: actor/pg_loss, the
    objective's own (e.g. actor/pg_clipfrac), and actor/ppo_kl = <-lambda_r>_{m'}."""
    return {"actor/pg_loss": loss.detach(), **mode_metrics, "actor/ppo_kl": masked_mean(-a.log_ratio(), a.keep)}


def _decoupled_rollout_terms(
    a: PolicyLossInputs, rollout_log_prob: torch.Tensor | None
) -> tuple[PolicyLossInputs, dict[str, torch.Tensor]]:
    """What log mu adds to the decoupled loss: OPSM drops rows from m' (§4.6),
    actor/tv_update = (1/2)<|pi_old/mu - pi_theta/mu|>_{m'} estimates alpha_0 of the
    three-policy TRPO bound (§12.6-§12.7; Wang & Zhang 2025, Theorem 2), and the mismatch
    log pi_old - log mu split by m' (:func:`mask_split_metrics`, §6.8) when m' drops a token."""
    threshold = a.config.rollout_opsm_threshold
    if rollout_log_prob is None:
        if threshold is not None:
            raise ValueError(f"rollout_opsm_threshold={threshold!r} needs rollout_log_prob (log mu) in the loss")
        return a, {}
    rollout = _zero_padding(rollout_log_prob.detach(), a.mask, a.log_prob.dtype)
    metrics = {}
    if threshold is not None:
        opsm_keep, metrics = compute_opsm_mask(a.log_prob, rollout, a.advantages, a.mask, threshold)
        a = a._replace(keep=a.keep & opsm_keep)
    with torch.no_grad():
        metrics["actor/tv_update"] = estimate_tv_distance(a.prox_log_prob - rollout, a.log_prob - rollout, a.keep)
        metrics.update(mask_split_metrics(a.prox_log_prob - rollout, a.advantages, a.mask, a.keep))
    return a, metrics


def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: torch.Tensor | None = None,
    *,
    keep_mask: torch.Tensor | None = None,
    rollout_log_prob: torch.Tensor | None = None,
    global_token_count: Any = None,
    global_seq_count: Any = None,
    loss_scale_factor: float | None = None,
    config: RolloutCorrectionConfig | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped loss, IS weights multiplied *after* all clipping (docs/corrections.md §7.1-§7.2).

    Decoupled objective (§7.2, §12.3; Hilton et al. 2021, decoupled PPO):
    L = agg( sg(w) * phi_PPO(r = pi_theta / pi_old) ) over m' = m * k, denominators from m (§7.5).
    ``old_log_prob`` is log pi_prox (pi_old; mu in bypass).  Metrics (§6.6, over m', not
    IS-weighted, 0.0 when no token is kept): actor/pg_loss, actor/pg_clipfrac (L2 > L1),
    actor/pg_clipfrac_lower, actor/ppo_kl = <-lambda_r>, and with ``rollout_log_prob``
    actor/tv_update, the alpha_0 estimate (§12.6-§12.7).  ``config`` (optional) selects the
    objective ``config.loss_mode`` of :data:`POLICY_LOSSES` (§7.7; None: "vanilla", phi_PPO) and
    turns on OPSM (``rollout_opsm_threshold``, §4.6) and the penalty tau (log pi_theta - log mu)^2
    (``rollout_sq_log_ratio_coef``, §7.9), which need ``rollout_log_prob``.

    ``validate=False`` skips the checks of §10 -- loss settings, equal 2-D shapes, 0/1 masks, a valid
    token, finite values at valid positions -- and their host syncs, trusting that they hold: a
    trainer passes it after a step's first micro-batch was checked with the same settings, for the
    step's other micro-batches.  Valid inputs give identical values; a bad one gives a wrong number
    or a torch error instead of a ValueError naming it.
    """
    if config is not None and not isinstance(config, RolloutCorrectionConfig):
        raise TypeError(f"config must be None or a RolloutCorrectionConfig, got {config!r}")
    inputs = _loss_inputs(
        log_prob=log_prob,
        prox_log_prob=old_log_prob,
        advantages=advantages,
        response_mask=response_mask,
        config=_DEFAULT_CONFIG if config is None else config,
        loss_agg_mode=loss_agg_mode,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        loss_scale_factor=loss_scale_factor,
        keep_mask=keep_mask,
        weights=rollout_is_weights,
        rollout_log_prob=rollout_log_prob,
        validate=validate,
    )
    inputs, rollout_metrics = _decoupled_rollout_terms(inputs, rollout_log_prob)
    loss, mode_metrics = POLICY_LOSSES[inputs.config.loss_mode](inputs)
    counts = {"global_token_count": global_token_count, "global_seq_count": global_seq_count}
    counts["loss_scale_factor"] = loss_scale_factor
    loss, penalty = _add_rollout_penalty(
        loss, inputs.config, log_prob, rollout_log_prob, response_mask, loss_agg_mode, counts
    )
    return loss, _to_floats({**_actor_metrics(inputs, loss, mode_metrics), **penalty, **rollout_metrics})


def compute_policy_loss_reinforce(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    *,
    keep_mask: torch.Tensor | None = None,
    global_token_count: Any = None,
    global_seq_count: Any = None,
    loss_scale_factor: float | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Bypass REINFORCE loss L = agg(-A * log pi_theta * sg(w)) over m' (docs/corrections.md §7.4).

    No ratio clipping; the update size is limited only by TIS/IcePop, RS and the veto.  With
    sequence IS and ``seq-mean-token-sum`` the gradient is the trajectory-IS REINFORCE estimator
    (§12.1) with a truncated weight.  The loss *value* holds log pi_theta and is not comparable
    with the PPO loss; only its gradient is meaningful.  Metrics: actor/pg_loss and
    actor/ppo_kl = <log mu - log pi_theta>_{m'} (§6.6).  ``validate`` as in
    :func:`compute_policy_loss_vanilla`.
    """
    if validate:
        check_loss_settings(0.2, 0.2, 3.0, loss_agg_mode, loss_scale_factor)
    finite = {"log_prob": log_prob, "rollout_log_prob": rollout_log_prob, "advantages": advantages}
    others = {"rollout_is_weights": rollout_is_weights, "keep_mask": keep_mask}
    mask = _validate_inputs(response_mask, finite, others, validate=validate)
    effective = _effective_mask(mask, keep_mask, validate)
    dt = _work_dtype(log_prob, rollout_log_prob, advantages)  # at least fp32, also for bf16 inputs
    current = _zero_padding(log_prob, mask, dt)
    adv = _zero_padding(advantages.detach(), mask, dt)
    weights = None
    if rollout_is_weights is not None:
        weights = _zero_padding(rollout_is_weights.detach(), mask, current.dtype)
    phi = reinforce_token_loss(current, adv, weights)
    loss = agg_loss(
        phi,
        effective,
        loss_agg_mode,
        response_mask=mask,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        loss_scale_factor=loss_scale_factor,
    )
    with torch.no_grad():
        rollout = _zero_padding(rollout_log_prob.detach(), mask, current.dtype)
        metrics = {"actor/pg_loss": loss.detach(), "actor/ppo_kl": masked_mean(rollout - current.detach(), effective)}
    return loss, _to_floats(metrics)


def _bypass_correction(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: RolloutCorrectionConfig,
    with_metrics: bool,
    *,
    validate: bool,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """The correction of one bypass micro-batch, from sg(log pi_theta) versus log mu (§5), then
    OPSM (§4.6: it needs A, so it is applied here, per micro-batch): (IS weights or None, m * k in
    the dtype of ``response_mask``, the actor/opsm_* and rollout_corr/* metrics, with the mismatch
    split by the final m * k when it drops a token, :func:`mask_split_metrics`, §6.8)."""
    weights, keep, corr_metrics = _apply_correction(
        log_prob.detach(), rollout_log_prob, response_mask, config, with_metrics, validate=validate
    )
    if config.rollout_opsm_threshold is None and not with_metrics:
        return weights, keep, corr_metrics
    # validated by _apply_correction just above (or trusted)
    mask, current, rollout = _prepare_log_probs(log_prob.detach(), rollout_log_prob, response_mask, validate=False)
    adv = _zero_padding(advantages.detach(), mask, current.dtype)
    if config.rollout_opsm_threshold is not None:
        opsm_keep, opsm_metrics = compute_opsm_mask(current, rollout, adv, mask, config.rollout_opsm_threshold)
        keep, corr_metrics = keep * opsm_keep.to(keep.dtype), {**_to_floats(opsm_metrics), **corr_metrics}
    if with_metrics:
        corr_metrics.update(mask_split_metrics(current - rollout, adv, mask, keep))
    return weights, keep, corr_metrics


def compute_policy_loss_bypass_mode(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: RolloutCorrectionConfig,
    loss_agg_mode: str = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    *,
    global_token_count: Any = None,
    global_seq_count: Any = None,
    loss_scale_factor: float | None = None,
    with_correction_metrics: bool = True,
    validate: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Bypass-mode loss: pi_old := mu, pi_train = sg(pi_theta) (docs/corrections.md §5, §7.3-§7.4, §12.5).

    The correction (IS/RS/veto, OPSM, all ``rollout_corr/*`` metrics of this micro-batch) is computed
    inside, from sg(log_prob) versus ``rollout_log_prob``.  ``loss_type="ppo_clip"``: the objective
    ``config.loss_mode`` (§7.7) with r = pi_theta / mu and *no* IS factor -- the ratio already is the
    IS ratio (§7.3, §12.5); IS weights are metrics only, RS/veto act through the keep mask.
    ``loss_type="reinforce"``: -A log pi_theta sg(w) (§7.4).  Both add tau (log pi_theta - log mu)^2 when
    ``rollout_sq_log_ratio_coef`` > 0 (§7.9).  Returns the loss and the ``actor/*`` and
    ``rollout_corr/*`` metrics (no ``actor/tv_update``: with pi_old = mu, alpha_0 is
    ``rollout_corr/tv_mismatch``).  ``with_correction_metrics=False`` leaves ``rollout_corr/*`` out
    (same loss), for the optimizer steps after a batch's first.  ``validate`` as in
    :func:`compute_policy_loss_vanilla`; it covers the correction's checks too.
    """
    if not isinstance(config, RolloutCorrectionConfig):
        raise TypeError(f"config must be a RolloutCorrectionConfig, got {config!r}")
    weights, keep, extra_metrics = _bypass_correction(
        log_prob, rollout_log_prob, advantages, response_mask, config, with_correction_metrics, validate=validate
    )
    common = {
        "loss_agg_mode": loss_agg_mode,
        "global_token_count": global_token_count,
        "global_seq_count": global_seq_count,
        "loss_scale_factor": loss_scale_factor,
        "validate": validate,
    }
    counts = {k: common[k] for k in ("global_token_count", "global_seq_count", "loss_scale_factor")}
    if config.loss_type == "reinforce":
        loss, actor_metrics = compute_policy_loss_reinforce(
            log_prob, rollout_log_prob, advantages, response_mask, rollout_is_weights=weights, keep_mask=keep, **common
        )
        loss, penalty = _add_rollout_penalty(
            loss, config, log_prob, rollout_log_prob, response_mask, loss_agg_mode, counts
        )
        if penalty:  # actor/pg_loss is the loss returned (§7.9)
            actor_metrics.update(_to_floats({"actor/pg_loss": loss, **penalty}))
        return loss, {**actor_metrics, **extra_metrics}
    inputs = _loss_inputs(  # no IS weights: the ratio against mu already is the IS ratio (§7.3)
        log_prob=log_prob,
        prox_log_prob=rollout_log_prob,
        advantages=advantages,
        response_mask=response_mask,
        config=config,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        keep_mask=keep,
        **common,
    )
    loss, mode_metrics = POLICY_LOSSES[config.loss_mode](inputs)
    loss, penalty = _add_rollout_penalty(loss, config, log_prob, rollout_log_prob, response_mask, loss_agg_mode, counts)
    return loss, {**_to_floats({**_actor_metrics(inputs, loss, mode_metrics), **penalty}), **extra_metrics}


# ============================================================================================
# Objectives: the loss-mode registry (docs/corrections.md §7.7)
# ============================================================================================


class PolicyLossInputs(NamedTuple):
    """What every objective of :data:`POLICY_LOSSES` receives (docs/corrections.md §7.7).

    Tensors are (B, T), in the work dtype (>= fp32), padding replaced by 0.  ``log_prob`` is
    log pi_theta and carries the gradient; ``prox_log_prob`` is log pi_prox (pi_old in decoupled
    mode, mu in bypass mode), ``advantages`` and ``weights`` are detached.  ``mask`` is the
    original response mask m, ``keep`` the effective mask m' = m * k (bool).  ``weights`` are the
    IS weights to multiply (decoupled mode), None when IS is off or in bypass (the ratio against
    mu already is the IS ratio, §7.3).  ``config`` holds the mode's parameters.  Built once per
    call, checked, by ``_loss_inputs`` (compute_policy_loss_vanilla, compute_policy_loss_bypass_mode).
    """

    log_prob: torch.Tensor
    prox_log_prob: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    keep: torch.Tensor
    weights: torch.Tensor | None
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    config: RolloutCorrectionConfig
    loss_agg_mode: str
    global_token_count: Any = None
    global_seq_count: Any = None
    loss_scale_factor: float | None = None

    def weighted(self, phi: torch.Tensor) -> torch.Tensor:
        """phi * sg(w), the IS weight applied after every clip (§7.2); phi when no weights."""
        return phi if self.weights is None else phi * self.weights

    def aggregate(self, phi: torch.Tensor, loss_agg_mode: str | None = None) -> torch.Tensor:
        """agg_loss over m' with the §7.5 denominators from m; ``loss_agg_mode`` overrides the
        configured mode (GSPO and SAPO fix seq-mean-token-mean: SAPO as verl does, GSPO as its paper
        does, where verl's gspo takes the configured mode; docs/corrections.md §11 item 21)."""
        return agg_loss(
            phi,
            self.keep,
            loss_agg_mode or self.loss_agg_mode,
            response_mask=self.mask,
            global_token_count=self.global_token_count,
            global_seq_count=self.global_seq_count,
            loss_scale_factor=self.loss_scale_factor,
        )

    def sequence_mean(self, row_loss: torch.Tensor) -> torch.Tensor:
        """(1/V_B) sum_{i: n'_i > 0} L_i for a per-sequence loss (V_B from m, §7.5)."""
        rows = _valid_rows(self.keep)
        total = masked_sum(row_loss, rows)
        return total / _count(self.global_seq_count, "global_seq_count", _valid_rows(self.mask).sum(), total.dtype)

    def log_ratio(self) -> torch.Tensor:
        """lambda_r = clip_S(log pi_theta - log pi_prox) (§2)."""
        return safety_clip(self.log_prob - self.prox_log_prob)


#: The signature of a policy objective: inputs -> (loss, metrics as 0-d tensors named actor/*).
PolicyLossFn = Callable[[PolicyLossInputs], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def policy_loss_vanilla(a: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clip, asymmetric and dual (§7.1): phi_PPO(r = pi_theta / pi_prox), times sg(w)."""
    phi, info = ppo_clipped_token_loss(
        a.log_prob, a.prox_log_prob, a.advantages, a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_c
    )
    dt = phi.dtype
    metrics = {
        "actor/pg_clipfrac": _fraction(info["clipped"], a.keep, dt),
        "actor/pg_clipfrac_lower": _fraction(info["clipped_lower"], a.keep, dt),
    }
    return a.aggregate(a.weighted(phi)), metrics


def _ratio_clip_loss(ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float):
    """max(-A s, -A clip(s, 1 - eps_low, 1 + eps_high)) and its "clipped term wins" indicator."""
    loss_1 = -advantages * ratio
    loss_2 = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    return torch.maximum(loss_1, loss_2), loss_2 > loss_1


#: GSPO's bound on the (sequence) log-ratio before exp, verl's one-sided clamp.
GSPO_LOG_RATIO_MAX = 10.0


def gspo_sequence_log_ratio(a: PolicyLossInputs) -> torch.Tensor:
    """log s_i = (1/n'_i) sum_t m'_it (log pi_theta - log pi_prox), the log of GSPO's
    length-normalised sequence ratio (Zheng et al. 2025, GSPO, eq. 7), over kept tokens; (B,)."""
    return _row_mean(a.log_prob - a.prox_log_prob, a.keep)


def policy_loss_gspo(a: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO, sequence level (Zheng et al. 2025, arXiv 2507.18071, eq. 5-7):

    s_i = exp(min(log s_i, 10)),  A_i = <A>_{m', row i},
    L_i = max(-A_i s_i, -A_i clip(s_i, 1 - eps_low, 1 + eps_high)),  loss = seq-mean-token-mean
    of L_i broadcast over row i's kept tokens.  The gradient reaches every token through s_i:
    grad s_i = s_i (1/n'_i) sum_t grad log pi_theta.  No dual clip.  With an advantage and an IS
    weight constant within each row (GRPO; sequence-level IS or none) it equals
    :func:`policy_loss_gspo_token` in value and gradient.  Token-level IS weights scale row i's
    loss by their mean over the row, so each token's gradient carries that mean, where
    gspo_token (verl's gspo) gives each token its own weight: same value, another gradient
    (found by benchmarks/parity_objectives.py; test_rc.py::test_gspo_spreads_token_is_weights_over_the_row).
    """
    phi, metrics = _gspo_row_loss(a)
    return a.aggregate(a.weighted(phi), "seq-mean-token-mean"), metrics


def _gspo_row_loss(a: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO's L_i broadcast over row i's tokens (B, T) and actor/pg_clipfrac, before aggregation."""
    log_s = torch.clamp(gspo_sequence_log_ratio(a), max=GSPO_LOG_RATIO_MAX)
    adv = _row_mean(a.advantages, a.keep)
    row_loss, clipped = _ratio_clip_loss(torch.exp(log_s), adv, a.clip_ratio_low, a.clip_ratio_high)
    phi = row_loss.unsqueeze(-1).expand_as(a.log_prob)
    return phi, {"actor/pg_clipfrac": _fraction(clipped.unsqueeze(-1).expand_as(phi), a.keep, phi.dtype)}


def policy_loss_gspo_token(a: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO-token (Zheng et al. 2025, GSPO, eq. 13-14), verl's ``gspo``:

    log s_it = sg(log s_i) + log pi_theta(y_t) - sg(log pi_theta(y_t)), clamped at 10;
    phi_t = max(-A_t s_it, -A_t clip(s_it, 1 - eps_low, 1 + eps_high)); seq-mean-token-mean.
    s_it equals s_i in value; token advantages A_t are allowed.
    """
    seq = gspo_sequence_log_ratio(a).detach().unsqueeze(-1)
    log_s = torch.clamp(seq + a.log_prob - a.log_prob.detach(), max=GSPO_LOG_RATIO_MAX)
    phi, clipped = _ratio_clip_loss(torch.exp(log_s), a.advantages, a.clip_ratio_low, a.clip_ratio_high)
    metrics = {"actor/pg_clipfrac": _fraction(clipped, a.keep, phi.dtype)}
    return a.aggregate(a.weighted(phi), "seq-mean-token-mean"), metrics


def _cispo_loss(a: PolicyLossInputs, low: float | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """phi = -sg(clamp(r, low, 1 + eps_high)) * A * log pi_theta, r = exp(lambda_r), no floor when
    ``low`` is None; actor/pg_clipfrac = share of kept tokens whose weight was clamped."""
    ratio = torch.exp(a.log_ratio())
    clipped = torch.clamp(ratio, min=low, max=1.0 + a.clip_ratio_high)
    phi = -clipped.detach() * a.advantages * a.log_prob
    metrics = {"actor/pg_clipfrac": _fraction(ratio != clipped, a.keep, phi.dtype)}
    return a.aggregate(a.weighted(phi)), metrics


def policy_loss_cispo(a: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax 2025, MiniMax-M1, arXiv 2506.13585, §3.1; TRL ``loss_type="cispo"``):

    phi = -sg(min(r, 1 + eps_high)) * A * log pi_theta,  r = exp(lambda_r).
    The IS weight is capped from above only (the paper's runs set no lower bound; eps_low is
    unused) and is a stop-gradient: every token keeps its gradient -A min(r, 1 + eps_high)
    grad log pi (no token is zeroed, unlike the PPO clip); only its size is bounded.  verl's
    two-sided clamp is :func:`policy_loss_cispo_verl`.
    """
    return _cispo_loss(a, None)


def policy_loss_cispo_verl(a: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl's ``cispo``: :func:`policy_loss_cispo` with the weight clamped from below as well,
    phi = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi_theta (docs/corrections.md §7.7)."""
    return _cispo_loss(a, 1.0 - a.clip_ratio_low)


def sapo_gate(ratio: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """f(r) = (4 / tau) sigmoid(tau (r - 1)): SAPO's soft gate, f(1) = 2 / tau, f'(1) = 1
    (Gao et al. 2025, SAPO, arXiv 2511.20347, §3)."""
    return torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)


def policy_loss_sapo(a: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO (Gao et al. 2025, arXiv 2511.20347): phi = -f(r; tau) A with tau = tau_pos if A > 0
    else tau_neg (``tau_pos``, ``tau_neg``); seq-mean-token-mean.  The gradient
    -A r sigmoid'(.) 4 grad log pi decays smoothly away from r = 1 instead of a hard clip."""
    ratio = torch.exp(a.log_ratio())
    tau = torch.where(
        a.advantages > 0,
        torch.tensor(a.config.tau_pos, dtype=ratio.dtype, device=ratio.device),
        torch.tensor(a.config.tau_neg, dtype=ratio.dtype, device=ratio.device),
    )
    phi = -sapo_gate(ratio, tau) * a.advantages
    return a.aggregate(a.weighted(phi), "seq-mean-token-mean"), {}


def policy_loss_geo_mean(a: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO, geometric-mean policy optimisation (Zhao et al. 2025, arXiv 2507.20673, eq. 4):

    l = log pi_theta - log pi_prox (unclipped), sigma = sign(A),
    l~ = sigma * min(sigma l, sigma clip(l, -eps_low, eps_high))  (the clip acts on the *log*),
    r_i = exp((1/n'_i) sum_t m' l~),  A_i = <A>_{m', row i},  L_i = -A_i r_i * w_i,
    loss = (1/V_B) sum_i L_i.  w_i = exp(<log(w + 1e-10)>_{m', row i}), the geometric mean of the
    IS weights (1 without IS).  ``loss_agg_mode`` is not used (one term per sequence).
    """
    ell = a.log_prob - a.prox_log_prob
    sign = torch.sign(a.advantages)
    bounded = torch.clamp(ell, -a.clip_ratio_low, a.clip_ratio_high)
    ell_min = sign * torch.minimum(sign * ell, sign * bounded)
    ratio = torch.exp(_row_mean(ell_min, a.keep))
    row_loss = -_row_mean(a.advantages, a.keep) * ratio
    if a.weights is not None:
        row_loss = row_loss * torch.exp(_row_mean(torch.log(a.weights + 1e-10), a.keep))
    clipped = ell != bounded
    dt = ratio.dtype
    metrics = {
        "actor/pg_clipfrac": _fraction(clipped & (a.advantages > 0), a.keep, dt),
        "actor/pg_clipfrac_lower": _fraction(clipped & (a.advantages < 0), a.keep, dt),
    }
    return a.sequence_mean(row_loss), metrics


def _dppo_loss(a: PolicyLossInputs, inside: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """phi = -A * sg(min(r, C)) * log pi_theta * sg(1[inside]): DPPO's truncated-IS policy
    gradient restricted to the tokens inside its divergence trust region (C = clip_ratio_c)."""
    ratio = torch.exp(a.log_ratio())
    truncated = torch.clamp(ratio, max=a.clip_ratio_c).detach()
    phi = -a.advantages * truncated * a.log_prob * inside.detach().to(ratio.dtype)
    dt = ratio.dtype
    metrics = {
        "actor/pg_clipfrac": _fraction(~inside, a.keep, dt),
        "actor/pg_clipfrac_lower": _fraction((ratio > a.clip_ratio_c) & inside, a.keep, dt),
    }
    return a.aggregate(a.weighted(phi)), metrics


def dppo_tv_trust_region(a: PolicyLossInputs) -> torch.Tensor:
    """DPPO-Binary-TV region (arXiv 2602.04879): with p = pi_theta(y_t), q = pi_prox(y_t),
    inside iff p - q <= delta_high (A > 0) or p - q >= -delta_low (A <= 0)."""
    diff = torch.exp(a.log_prob) - torch.exp(a.prox_log_prob)
    return torch.where(a.advantages > 0, diff <= a.clip_ratio_high, diff >= -a.clip_ratio_low)


def binary_kl(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """KL(Bern(q) || Bern(p)) = q (log q - log p) + (1 - q) log((1 - q)/(1 - p)) from the
    log-probs log q, log p, the 1e-8 guard on 1 - q and 1 - p as in verl (DPPO-Binary-KL, arXiv
    2602.04879).  log q enters as given (q = exp(log q) may underflow to 0, never log(0)) and
    1 - q = -expm1(log q) keeps its digits for q near 1, so float32 gives the float64 value."""
    q = torch.exp(log_q)
    one_minus_q, one_minus_p = -torch.expm1(log_q), -torch.expm1(log_p)
    return q * (log_q - log_p) + one_minus_q * (torch.log(one_minus_q + 1e-8) - torch.log(one_minus_p + 1e-8))


def dppo_kl_trust_region(a: PolicyLossInputs) -> torch.Tensor:
    """DPPO-Binary-KL region: d = KL(Bern(q) || Bern(p)); inside iff d <= delta_high or p <= q
    (A > 0), d <= delta_low or p >= q (A <= 0): only moves *towards* the advantage are bounded.
    Computed from the log-probs (:func:`binary_kl`; p <= q as log p <= log q), so a pi_prox that
    underflows in float32 (log q < ~-103) keeps its token, as verl does."""
    log_p, log_q = a.log_prob.detach(), a.prox_log_prob
    d = binary_kl(log_q, log_p)
    below, above = log_p <= log_q, log_p >= log_q
    return torch.where(a.advantages > 0, (d <= a.clip_ratio_high) | below, (d <= a.clip_ratio_low) | above)


def policy_loss_dppo_tv(a: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-TV (arXiv 2602.04879): :func:`_dppo_loss` in :func:`dppo_tv_trust_region`;
    delta_low/high are ``clip_ratio_low/high`` read as probability differences, as in verl."""
    return _dppo_loss(a, dppo_tv_trust_region(a))


def policy_loss_dppo_kl(a: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-KL (arXiv 2602.04879): :func:`_dppo_loss` in :func:`dppo_kl_trust_region`."""
    return _dppo_loss(a, dppo_kl_trust_region(a))


def token_covariance(a: PolicyLossInputs) -> torch.Tensor:
    """c_t = (A_t - <A>_{m'}) (log pi_theta(y_t) - <log pi_theta>_{m'}), detached: each kept
    token's term of the covariance that drives entropy change (Cui et al. 2025, "The Entropy
    Mechanism of RL for Reasoning LMs", arXiv 2505.22617, §3), over the tensors passed.  When A is
    the same on every kept token, A_t - <A> is 0 or one shared float-rounding offset eps, and
    c_t = eps (log pi - <log pi>) measures rounding, not covariance."""
    logp = a.log_prob.detach()
    return (a.advantages - masked_mean(a.advantages, a.keep)) * (logp - masked_mean(logp, a.keep))


def _selection_count(fraction: float, keep: torch.Tensor) -> int:
    """max(1, floor(fraction * N')) tokens, N' = kept tokens of this micro-batch."""
    return max(int(fraction * int(keep.sum())), 1)


def policy_loss_clip_cov(a: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov (Cui et al. 2025, arXiv 2505.22617, §4): PPO's max(-A r, -A clip(r)) (no dual
    clip), with the gradient detached on max(1, floor(rho N')) tokens drawn at random among the
    kept, unclipped tokens with lb < c_t < ub (rho = ``clip_cov_ratio``, [lb, ub] =
    ``clip_cov_lb/ub``).  Selection is per call, i.e. per micro-batch, as verl's is per its
    micro-batch; the draw uses torch's global generator.  With A constant over the call (one
    response, or equal advantages) c_t is rounding noise (:func:`token_covariance`), so which
    tokens are candidates is too (with lb = 1.0, none), as in verl."""
    ratio = torch.exp(a.log_ratio())
    phi, clipped = _ratio_clip_loss(ratio, a.advantages, a.clip_ratio_low, a.clip_ratio_high)
    cov = token_covariance(a)
    cfg = a.config
    candidates = (a.keep & ~clipped & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)).flatten().nonzero()[:, 0]
    count = min(_selection_count(cfg.clip_cov_ratio, a.keep), candidates.numel())
    chosen = candidates[torch.randperm(candidates.numel(), device=candidates.device)[:count]]
    detached = torch.zeros(phi.numel(), dtype=torch.bool, device=phi.device)
    detached[chosen] = True
    detached = detached.view_as(phi)
    phi = torch.where(detached, torch.zeros_like(phi), phi)
    return a.aggregate(a.weighted(phi)), {"actor/pg_clipfrac": _fraction(detached, a.keep, phi.dtype)}


def policy_loss_kl_cov(a: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov (Cui et al. 2025, arXiv 2505.22617, §4): phi = -A r, plus beta |log r| on the
    max(1, floor(rho N')) kept tokens of largest covariance c_t (rho = ``kl_cov_ratio``,
    beta = ``ppo_kl_coef``); no clip.  Per micro-batch, like :func:`policy_loss_clip_cov`.  With A
    constant over the call (one response, or equal advantages) c_t is rounding noise
    (:func:`token_covariance`): the top-k are the tokens of highest or lowest log pi as the noise's
    sign falls, or topk's tie order when it is 0, as in verl (docs/corrections.md §7.7)."""
    ell = a.log_ratio()
    phi = -a.advantages * torch.exp(ell)
    cov = torch.where(a.keep, token_covariance(a), torch.full_like(ell, -math.inf))
    top = torch.topk(cov.flatten(), _selection_count(a.config.kl_cov_ratio, a.keep)).indices
    chosen = torch.zeros(phi.numel(), dtype=torch.bool, device=phi.device)
    chosen[top] = True
    chosen = chosen.view_as(phi) & a.keep
    phi = torch.where(chosen, phi + a.config.ppo_kl_coef * ell.abs(), phi)
    return a.aggregate(a.weighted(phi)), {}


def policy_loss_luspo(a: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """LUSPO, length-unbiased sequence policy optimisation (arXiv 2602.05261; TRL 1.16
    ``loss_type="luspo"``, ``importance_sampling_level="sequence"``): GSPO's L_i
    (:func:`policy_loss_gspo`) weighted by the response's length,

    loss = (1/V_B) sum_i sum_t m'_it L_i sg(w_it)   (seq-mean-token-sum, fixed).

    Unclipped and without IS weights, d loss / d log pi_theta(y_it) = -A_i s_i / V_B: a token's
    gradient no longer shrinks as 1/n_i with its response's length, as under GSPO.
    """
    phi, metrics = _gspo_row_loss(a)
    return a.aggregate(a.weighted(phi), "seq-mean-token-sum"), metrics


#: VESPO's bounds on log W before exp, as TRL's: [log 1e-8, S].
VESPO_LOG_W_MIN = math.log(1e-8)


def vespo_gate(log_w: torch.Tensor, k: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """phi(W) = W^k exp(lam (1 - W)) = exp(lam + k log W - lam W): VESPO's Gamma-shaped weight,
    phi(1) = 1, largest at W = k / lam (arXiv 2602.10693; TRL ``GRPOTrainer.get_gamma_weights``)."""
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w))


def vespo_sequence_log_weight(a: PolicyLossInputs) -> torch.Tensor:
    """log W_i = clip(sum_t m'_it (lambda_r + log w_it), log 1e-8, 20), (B, 1): the log of the
    response's ratio to mu.  IS weights w (decoupled: pi_old / mu, each log clipped to
    [log 1e-8, 20]) enter W instead of multiplying the loss, as TRL folds its vLLM IS ratio in; a
    row-level weight (``rollout_is="sequence"`` or ``"geometric"``) enters once.  Bypass: lambda_r is the log of
    pi_theta / mu already and w is None."""
    log_w = masked_sum(a.log_ratio(), a.keep, dim=-1)
    if a.weights is not None:
        log_is = torch.clamp(torch.log(a.weights), VESPO_LOG_W_MIN, SAFETY_BOUND)
        once = a.config.rollout_is in ROW_IS_LEVELS
        log_w = log_w + (_row_mean(log_is, a.keep) if once else masked_sum(log_is, a.keep, dim=-1))
    return torch.clamp(log_w, VESPO_LOG_W_MIN, SAFETY_BOUND).unsqueeze(-1)


def policy_loss_vespo(a: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """VESPO, variational sequence-level soft policy optimisation (arXiv 2602.10693; TRL 1.16
    ``loss_type="vespo"``):

    phi_it = -sg(phi(W_i; k, lam)) A_it log pi_theta(y_it),  (k, lam) = (``vespo_k_pos``,
    ``vespo_lambda_pos``) if A_it >= 0 else (``vespo_k_neg``, ``vespo_lambda_neg``).
    The gradient is REINFORCE's, -phi A grad log pi, scaled by one weight per response that is 1
    at W = 1 and fades smoothly as W -> 0 (like W^k) and W -> inf (like e^{-lam W}); no token is
    zeroed.  The IS weights enter W (:func:`vespo_sequence_log_weight`), never as a factor.
    actor/vespo_gate_mean = <sg phi>_{m'}.
    """
    cfg, dt, dev = a.config, a.log_prob.dtype, a.log_prob.device
    nonneg = a.advantages >= 0
    k = torch.where(nonneg, torch.tensor(cfg.vespo_k_pos, dtype=dt, device=dev), cfg.vespo_k_neg)
    lam = torch.where(nonneg, torch.tensor(cfg.vespo_lambda_pos, dtype=dt, device=dev), cfg.vespo_lambda_neg)
    gate = vespo_gate(vespo_sequence_log_weight(a), k, lam).detach()
    phi = -gate * a.advantages * a.log_prob
    return a.aggregate(phi), {"actor/vespo_gate_mean": masked_mean(gate, a.keep)}


def policy_loss_dro(a: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl's ``dro`` (core_algos.py:2014): phi = -(A log pi_theta - (beta/2) lambda_r^2) * sg(w),
    beta = ``dro_beta``.  The gradient -(A - beta lambda_r) grad log pi pulls a token's advantage
    back by beta times its log-ratio: a quadratic, soft trust region, no clip.  Up to the factor
    beta it is the policy gradient of DRO's squared residual (1/2)(R - V - beta log pi/pi_ref)^2
    (Richemond et al. 2024, arXiv 2405.19107) with A = R - V and pi_ref := pi_prox
    (docs/corrections.md §7.7).  Bypass: the penalty is (beta/2)(log pi_theta - log mu)^2.
    """
    phi = -(a.advantages * a.log_prob - 0.5 * a.config.dro_beta * a.log_ratio().square())
    return a.aggregate(a.weighted(phi)), {}


def policy_loss_gpg(a: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GPG's loss (Chu et al. 2025, arXiv 2504.02546; verl's ``gpg``, core_algos.py:1707):
    phi = -A log pi_theta * sg(w), no ratio, no clip (:func:`reinforce_token_loss`).  pi_prox enters
    only actor/ppo_kl.  Bypass: bypass REINFORCE (§7.4) with the IS weights unused."""
    return a.aggregate(reinforce_token_loss(a.log_prob, a.advantages, a.weights)), {}


def ipo_trust_region(a: PolicyLossInputs) -> torch.Tensor:
    """prime-rl's IPO region: with p = pi_theta(y_t), q = pi_prox(y_t), inside iff
    -delta_low <= p - q <= delta_high, whatever the sign of A (DPPO-Binary-TV's bound on both
    sides; src/prime_rl/trainer/rl/loss.py:164, there |p - q| <= ``ipo_threshold``)."""
    diff = torch.exp(a.log_prob.detach()) - torch.exp(a.prox_log_prob)
    return (diff <= a.clip_ratio_high) & (diff >= -a.clip_ratio_low)


def policy_loss_ipo(a: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """prime-rl's ``ipo`` ("INTELLECT Policy Optimization", loss.py:164; not Azar et al.'s IPO):
    phi = -A r * sg(1[inside]) * sg(w), r = exp(lambda_r) carrying the gradient -A r grad log pi,
    inside :func:`ipo_trust_region`, no truncation.  prime-rl adds tau (log pi_theta / mu)^2:
    ``rollout_sq_log_ratio_coef`` (§7.9).  actor/pg_clipfrac: share of kept tokens outside;
    actor/pg_clipfrac_lower: those below, p - q < -delta_low."""
    ratio = torch.exp(a.log_ratio())
    inside = ipo_trust_region(a)
    phi = -a.advantages * ratio * inside.to(ratio.dtype)
    diff = torch.exp(a.log_prob.detach()) - torch.exp(a.prox_log_prob)
    metrics = {
        "actor/pg_clipfrac": _fraction(~inside, a.keep, ratio.dtype),
        "actor/pg_clipfrac_lower": _fraction(diff < -a.clip_ratio_low, a.keep, ratio.dtype),
    }
    return a.aggregate(a.weighted(phi)), metrics


#: The policy objectives by ``RolloutCorrectionConfig.loss_mode`` (verl's ``policy_loss.loss_mode``
#: names; docs/corrections.md §7.7).  A new objective: one function of :class:`PolicyLossInputs`
#: returning (loss, metrics) and one entry here (README "Fork it").
POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "vanilla": policy_loss_vanilla,
    "gspo": policy_loss_gspo,
    "gspo_token": policy_loss_gspo_token,
    "cispo": policy_loss_cispo,
    "cispo_verl": policy_loss_cispo_verl,
    "sapo": policy_loss_sapo,
    "geo_mean": policy_loss_geo_mean,
    "dppo_tv": policy_loss_dppo_tv,
    "dppo_kl": policy_loss_dppo_kl,
    "clip_cov": policy_loss_clip_cov,
    "kl_cov": policy_loss_kl_cov,
    "luspo": policy_loss_luspo,
    "vespo": policy_loss_vespo,
    "dro": policy_loss_dro,
    "gpg": policy_loss_gpg,
    "ipo": policy_loss_ipo,
}


# ============================================================================================
# Aggregation (docs/corrections.md §7.5)
# ============================================================================================

#: Loss aggregation modes of docs/corrections.md §7.5.
LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def _count(value: Any, name: str, local: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Resolve a global denominator (N_B or V_B); default: local count from the original mask."""
    if value is None:
        return local.to(dtype)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not bool(value.detach() > 0):  # one scalar host read; 0 would give inf
            raise ValueError(f"{name} must be a positive number, got {value!r}")
        return value.detach().to(device=local.device, dtype=dtype).reshape(())
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return torch.tensor(float(value), dtype=dtype, device=local.device)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    response_mask: torch.Tensor | None = None,
    global_token_count: Any = None,
    global_seq_count: Any = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss over the optimizer-step batch B (docs/corrections.md §7.5).

    Rejected tokens are treated as weight-0 tokens; every loss denominator is computed from the
    pre-rejection response mask of the whole optimizer-step batch, identically in decoupled and
    bypass modes.  With numerator mask m' (``loss_mask``) and original mask m (``response_mask``,
    default ``loss_mask``):

    token-mean              sum m' L / N_B
    token-sum               sum m' L
    seq-mean-token-sum      sum m' L / V_B
    seq-mean-token-mean     (1/V_B) sum_{i: n_i > 0} (1/n_i) sum_t m' L     (n_i from m)
    seq-mean-token-sum-norm sum m' L / (V_B K)   (Dr.GRPO constant normaliser; Liu et al. 2025)

    N_B = ``global_token_count`` and V_B = ``global_seq_count`` (all micro-batches, all ranks);
    by default they are counted locally from m.  K = ``loss_scale_factor``; the trainer passes the
    configured maximum response length, and when omitted K defaults to the tensor width T (then
    the divisor depends on padding -- pass K explicitly, §11 item 14).  Micro-batch contributions
    add up to the batch loss; no kept token gives exactly 0.
    """
    check_loss_settings(0.2, 0.2, 3.0, loss_agg_mode, loss_scale_factor)
    keep = _check_mask_values(loss_mask, "loss_mask")
    mask = keep if response_mask is None else _check_mask_values(response_mask, "response_mask")
    for name, t in (("loss_mat", loss_mat), ("loss_mask", loss_mask)):
        if tuple(t.shape) != tuple(mask.shape) or mask.dim() != 2:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but response_mask has shape "
                f"{tuple(mask.shape)}; expected equal (B, T) shapes"
            )
    keep = keep & mask
    total_per_row = masked_sum(loss_mat, keep, dim=-1)
    if loss_agg_mode == "token-sum":
        return total_per_row.sum()
    dtype = total_per_row.dtype
    needs_local = global_token_count is None if loss_agg_mode == "token-mean" else global_seq_count is None
    if needs_local and not bool(mask.any()):
        raise ValueError("response mask must contain at least one valid token")
    if loss_agg_mode == "token-mean":
        return total_per_row.sum() / _count(global_token_count, "global_token_count", mask.sum(), dtype)
    n_rows = _count(global_seq_count, "global_seq_count", _valid_rows(mask).sum(), dtype)
    if loss_agg_mode == "seq-mean-token-sum":
        return total_per_row.sum() / n_rows
    if loss_agg_mode == "seq-mean-token-mean":
        lengths = mask.sum(dim=-1).clamp(min=1).to(dtype)
        return (total_per_row / lengths).sum() / n_rows
    scale = float(loss_mat.shape[-1]) if loss_scale_factor is None else float(loss_scale_factor)
    return total_per_row.sum() / (n_rows * scale)


# ============================================================================================
# Advantages: GRPO, Dr.GRPO and the estimator registry (docs/corrections.md §8)
# ============================================================================================


def _group_codes(index: Any, batch_size: int, device: torch.device) -> torch.Tensor:
    """Map group ids (hashables or an integer tensor) to dense int64 codes, once."""
    if isinstance(index, torch.Tensor):
        if index.dim() != 1 or index.shape[0] != batch_size:
            raise ValueError(
                f"index has shape {tuple(index.shape)} but the batch has {batch_size} scores; expected ({batch_size},)"
            )
        # sort + "new value" flags + cumsum: the inverse of unique, without torch.unique's slow
        # CPU return_inverse path
        ordered, order = torch.sort(index.to(device), stable=True)
        starts = torch.ones_like(ordered, dtype=torch.bool)
        starts[1:] = ordered[1:] != ordered[:-1]
        return torch.empty_like(order).scatter_(0, order, torch.cumsum(starts, 0) - 1)
    ids = list(index)
    if len(ids) != batch_size:
        raise ValueError(f"index has length {len(ids)} but the batch has {batch_size} scores")
    codes: dict[Hashable, int] = {key: i for i, key in enumerate(dict.fromkeys(ids))}
    return torch.tensor(list(map(codes.__getitem__, ids)), dtype=torch.long, device=device)


@torch.no_grad()
def compute_grpo_outcome_advantage(
    scores: torch.Tensor,
    index: Iterable[Hashable] | torch.Tensor,
    epsilon: float = 1e-6,
    norm_adv_by_std: bool = True,
    response_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO outcome advantage (docs/corrections.md §8), vectorised over groups.

    R_i = sum_t r_it (scores (B, T) are summed over all positions; (B,) is used as is).
    For a group g of size n_g >= 2: mu_g = mean, sigma_g = unbiased std (n_g - 1); for a
    singleton mu_g = 0, sigma_g = 1 (raw score, no baseline).
    A_i = (R_i - mu_g) / (sigma_g + eps) if ``norm_adv_by_std`` else R_i - mu_g (Dr.GRPO).
    A group whose scores are all equal gets exactly A = 0.  With ``response_mask`` the result is
    A_it = A_i m_it (B, T); otherwise (B,).  RS never changes the group statistics.
    """
    scores = torch.as_tensor(scores)
    if scores.dim() not in (1, 2):
        raise ValueError(f"scores must have shape (B,) or (B, T), got {tuple(scores.shape)}")
    dtype = _work_dtype(scores)
    returns = (scores.sum(dim=-1) if scores.dim() == 2 else scores).to(dtype)
    size = returns.shape[0]
    codes = _group_codes(index, size, returns.device)
    n_groups = int(codes.max()) + 1 if size else 0
    counts = torch.bincount(codes, minlength=n_groups).to(dtype)
    mean = torch.zeros(n_groups, dtype=dtype, device=returns.device).index_add_(0, codes, returns)
    mean = mean / counts
    dev = returns - mean[codes]
    sq = torch.zeros_like(mean).index_add_(0, codes, dev * dev)
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    hi = torch.full_like(mean, -math.inf).scatter_reduce_(0, codes, returns, "amax")
    lo = torch.full_like(mean, math.inf).scatter_reduce_(0, codes, returns, "amin")
    single = counts < 2
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    flat = (hi == lo) & ~single  # all-equal groups of size >= 2 carry no signal
    dev = torch.where(flat[codes], torch.zeros_like(returns), returns - mean[codes])
    adv = dev / (std[codes] + epsilon) if norm_adv_by_std else dev
    if response_mask is None:
        return adv
    if response_mask.dim() != 2 or response_mask.shape[0] != size:
        raise ValueError(
            f"response_mask has shape {tuple(response_mask.shape)} but the batch "
            f"has {size} scores; expected ({size}, T)"
        )
    mask = _check_mask_values(response_mask, "response_mask")
    return torch.where(mask, adv.unsqueeze(-1), torch.zeros((), dtype=dtype, device=adv.device))


@torch.no_grad()
def compute_gpg_outcome_advantage(
    scores: torch.Tensor,
    index: Iterable[Hashable] | torch.Tensor,
    norm_adv_by_std: bool = True,
    response_mask: torch.Tensor | None = None,
    f_norm: float = 1.0,
) -> torch.Tensor:
    """GPG outcome advantage (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline", arXiv
    2504.02546; verl ``compute_gpg_outcome_advantage``, core_algos.py) (docs/corrections.md §8):

    A_i = alpha (R_i - mu_g) / F,  alpha = B / max(#{i: R_i != 0}, 1),  F = ``f_norm`` (1),
    mu_g the group mean (0 for a group of one); no std division (``norm_adv_by_std`` is ignored). alpha scales the
    gradient up by the share of rows with a non-zero reward, as verl counts it (the paper counts the valid samples).
    Over this call's rows: under DDP each rank's own B and count (verl: the whole batch)."""
    scores = torch.as_tensor(scores)
    returns = (scores.sum(dim=-1) if scores.dim() == 2 else scores).to(_work_dtype(scores))
    alpha = returns.shape[0] / max(int(torch.count_nonzero(returns)), 1)
    centred = compute_grpo_outcome_advantage(returns, index, norm_adv_by_std=False)
    adv = alpha * centred / f_norm
    if response_mask is None:
        return adv
    mask = _check_mask_values(response_mask, "response_mask")
    return torch.where(mask, adv.unsqueeze(-1), torch.zeros((), dtype=adv.dtype, device=adv.device))


#: Advantage estimators by name, the values of the trainer's ``--adv-estimator``.  One calling convention for all:
#: ``estimator(scores, index, *, response_mask=None, norm_adv_by_std=True)`` with scores (B,) or (B, T) (summed over
#: T), index the group id of each row (B,) (hashables or an integer tensor), returning A (B,), or A_i m_it (B, T)
#: when ``response_mask`` is given.  ``norm_adv_by_std`` is GRPO's std division; an estimator without one ignores
#: it.  A group is always on one rank, so group statistics are local.  A new estimator: one function and one entry
#: here (README "Fork it" adds RLOO).
ADVANTAGE_ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {
    "grpo": compute_grpo_outcome_advantage,
    "gpg": compute_gpg_outcome_advantage,
}


def compute_advantage(
    estimator: str,
    scores: torch.Tensor,
    index: Iterable[Hashable] | torch.Tensor,
    *,
    response_mask: torch.Tensor | None = None,
    norm_adv_by_std: bool = True,
) -> torch.Tensor:
    """The advantage of the estimator named ``estimator`` in :data:`ADVANTAGE_ESTIMATORS`, called with the one
    convention documented there; "grpo" is :func:`compute_grpo_outcome_advantage` (docs/corrections.md §8)."""
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {', '.join(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[estimator](scores, index, response_mask=response_mask, norm_adv_by_std=norm_adv_by_std)


# ============================================================================================
# KL penalty (docs/corrections.md §7.6)
# ============================================================================================

_KL_BASE_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


#: KL-penalty estimator names of docs/corrections.md §7.6, with the straight-through "+" variants.
KL_ESTIMATORS = _KL_BASE_ESTIMATORS + tuple(name + "+" for name in _KL_BASE_ESTIMATORS)


def kl_penalty(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    kl_estimator: str = "low_var_kl",
    *,
    old_log_prob: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL penalty towards pi_ref, d = log pi_theta - log pi_ref (docs/corrections.md
    §7.6).

    kl / k1: d;  abs: |d|;  mse / k2: d^2 / 2;
    low_var_kl / k3: kappa = clip_S(log pi_ref - log pi_theta), clip(e^kappa - kappa - 1, -10, 10)
    (the rho - log rho - 1 form, :func:`k3_divergence`; docs/corrections.md §12.9).
    "<name>+": straight-through -- the value of <name> with the gradient of k2:
    v = d^2/2 - sg(d^2/2) + sg(base).  "full" and unknown names raise ValueError.
    Not IS-weighted; aggregate it with :func:`agg_loss` like the policy loss.

    With ``old_log_prob`` (log pi_old, the policy that sampled; mu in bypass) the estimate is
    IS-corrected: r * v with r = exp(clip_S(log pi_theta - log pi_old)), the gradient flowing
    through r (DeepSeek-AI 2025, DeepSeek-V3.2, §3.1; TRL ``use_bias_correction_kl``, slime
    ``--use-unbiased-kl``).  For k3, E_{pi_old}[r k3] = KL(pi_theta || pi_ref) and its gradient
    is the exact gradient of that KL (docs/corrections.md §7.8).
    """
    if not isinstance(kl_estimator, str):
        raise TypeError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
    straight = kl_estimator.endswith("+")
    base = kl_estimator[:-1] if straight else kl_estimator
    if base == "full":
        raise ValueError(
            f"kl_estimator={kl_estimator!r} needs full-vocabulary distributions and "
            f"is not supported; choose one of {KL_ESTIMATORS}"
        )
    if base not in _KL_BASE_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {kl_estimator!r}; choose one of {KL_ESTIMATORS}")
    if log_prob.shape != ref_log_prob.shape:
        raise ValueError(
            f"log_prob has shape {tuple(log_prob.shape)} but ref_log_prob has shape {tuple(ref_log_prob.shape)}"
        )
    d = log_prob - ref_log_prob
    if base in ("kl", "k1"):
        value = d
    elif base == "abs":
        value = d.abs()
    elif base in ("mse", "k2"):
        value = k2_divergence(d)
    else:
        kappa = safety_clip(ref_log_prob - log_prob)
        value = torch.clamp(k3_divergence(kappa), min=-10.0, max=10.0)
    if straight:
        k2 = k2_divergence(d)
        value = k2 - k2.detach() + value.detach()
    return value if old_log_prob is None else is_corrected_kl(value, log_prob, old_log_prob)


def is_corrected_kl(value: torch.Tensor, log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    """r * v, r = exp(clip_S(log pi_theta - sg(log pi_old))): a per-token KL estimate v of
    samples from pi_old re-weighted to pi_theta (docs/corrections.md §7.8); r carries the
    gradient."""
    if old_log_prob.shape != log_prob.shape:
        raise ValueError(
            f"old_log_prob has shape {tuple(old_log_prob.shape)} but log_prob has shape {tuple(log_prob.shape)}"
        )
    return torch.exp(safety_clip(log_prob - old_log_prob.detach())) * value


def rollout_sq_log_ratio_penalty(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor) -> torch.Tensor:
    """(clip_S(log pi_theta - sg(log mu)))^2 per token: the squared log-ratio against the *inference*
    log-probs that Kimi K2.5 adds to its policy loss (arXiv 2602.02276), prime-rl's ``kl_tau`` term
    (src/prime_rl/trainer/rl/loss.py:109-160) (docs/corrections.md §7.9).  Its gradient
    2 clip_S(.) grad log pi_theta pulls pi_theta back towards mu on every sampled token."""
    return safety_clip(log_prob - rollout_log_prob.detach()).square()


def _add_rollout_penalty(
    loss: torch.Tensor,
    config: RolloutCorrectionConfig,
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor | None,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    counts: Mapping[str, Any],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """loss + tau * P, P = agg over m of :func:`rollout_sq_log_ratio_penalty`, tau =
    ``rollout_sq_log_ratio_coef`` (§7.9): the original mask m (a rejected token keeps it, as the KL
    penalty's, §7.5), not IS-weighted, the §7.5 denominators (``counts``); actor/rollout_sq_log_ratio
    = P.  (loss, {}) when tau = 0."""
    tau = config.rollout_sq_log_ratio_coef
    if tau == 0.0:
        return loss, {}
    if rollout_log_prob is None:
        raise ValueError(f"rollout_sq_log_ratio_coef={tau!r} needs rollout_log_prob (log mu) in the loss")
    mask = _as_bool(response_mask)
    dt = _work_dtype(log_prob, rollout_log_prob)
    current, rollout = _zero_padding(log_prob, mask, dt), _zero_padding(rollout_log_prob.detach(), mask, dt)
    term = agg_loss(rollout_sq_log_ratio_penalty(current, rollout), mask, loss_agg_mode, response_mask=mask, **counts)
    return loss + tau * term, {"actor/rollout_sq_log_ratio": term.detach()}


def loglinear_alpha(
    behave_version: torch.Tensor, proximal_version: float, current_version: float | torch.Tensor
) -> torch.Tensor:
    """alpha = clamp((v_prox - v_mu) / (v_theta - v_mu), 0, 1), and 0 where v_theta <= v_mu: how far pi_prox lies
    from mu towards pi_theta when the policy moves log-linearly in its version (docs/corrections.md §7.10; AReaL
    ``compute_prox_logp_approximations``, areal/trainer/ppo/actor.py, docs/algorithms/prox_approx.md). Versions of
    any shape (per sample or per token); alpha in float64."""
    v_mu = torch.as_tensor(behave_version, dtype=torch.float64)
    ahead = torch.as_tensor(current_version, dtype=torch.float64) - v_mu
    alpha = torch.where(ahead > 0, (proximal_version - v_mu) / torch.where(ahead > 0, ahead, 1.0), 0.0)
    return alpha.clamp(0.0, 1.0)


def loglinear_proximal_log_prob(
    rollout_log_prob: torch.Tensor, log_prob: torch.Tensor, alpha: torch.Tensor
) -> torch.Tensor:
    """log pi_prox ~ log mu + alpha (sg(log pi_theta) - log mu): pi_old without its forward pass (§7.10; AReaL's
    ``prox_logp_method: loglinear``). ``alpha`` per row (B,) or per token (B, T); detached, in the log-probs' dtype."""
    a = alpha.to(rollout_log_prob.dtype)
    a = a.unsqueeze(-1) if a.dim() == rollout_log_prob.dim() - 1 else a
    return rollout_log_prob + a * (log_prob.detach() - rollout_log_prob)


def proximal_approximation_errors(
    approx: torch.Tensor, old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, log_prob: torch.Tensor, mask
) -> dict[str, torch.Tensor]:
    """How far the approximated log pi_prox lies from the recomputed one (§7.10; AReaL's ``metrics`` mode), over
    valid tokens, as actor/prox_loglinear_*: abs_error <|g - a|>, rel_error <|g - a| / (|g| + 1e-8)>,
    squared_error <(g - a)^2> (g = log pi_old recomputed, a = approximated); behave_imp_weight_abs_error
    <|e^(g - log mu) - e^(a - log mu)|> (the IS weight's error); importance_weight_abs_error
    <|e^(log pi_theta - g) - e^(log pi_theta - a)|> (the PPO ratio's). Log-ratios clipped to +/-S before
    exponentiation (§2)."""
    g, a, mu, cur = old_log_prob.detach(), approx.detach(), rollout_log_prob.detach(), log_prob.detach()
    diff = g - a
    return {
        "actor/prox_loglinear_abs_error": masked_mean(diff.abs(), mask),
        "actor/prox_loglinear_rel_error": masked_mean(diff.abs() / (g.abs() + _ZERO_GUARD), mask),
        "actor/prox_loglinear_squared_error": masked_mean(diff.square(), mask),
        "actor/prox_loglinear_behave_imp_weight_abs_error": masked_mean(
            (safe_exp(g - mu) - safe_exp(a - mu)).abs(), mask
        ),
        "actor/prox_loglinear_importance_weight_abs_error": masked_mean(
            (safe_exp(cur - g) - safe_exp(cur - a)).abs(), mask
        ),
    }


# ============================================================================================
# Configuration and presets (docs/corrections.md §9, §10)
# ============================================================================================

_LOSS_TYPES = ("ppo_clip", "reinforce")


def check_loss_settings(
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    loss_agg_mode: str,
    loss_scale_factor: float | None = None,
) -> None:
    """Validate the loss fields (docs/corrections.md §7.1 constraints, §10): 0 <= eps_low < 1,
    eps_high >= 0, c > 1, a known ``loss_agg_mode``, and K > 0 when given.  Raises ValueError."""

    def number(name: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
            raise ValueError(f"{name} must be a number, got {value!r}")
        return float(value)

    if not 0.0 <= number("clip_ratio_low", clip_ratio_low) < 1.0:
        raise ValueError(f"clip_ratio_low={clip_ratio_low!r} must lie in [0, 1)")
    if not number("clip_ratio_high", clip_ratio_high) >= 0.0:
        raise ValueError(f"clip_ratio_high={clip_ratio_high!r} must be >= 0")
    if not number("clip_ratio_c", clip_ratio_c) > 1.0:
        raise ValueError(f"clip_ratio_c={clip_ratio_c!r} must be > 1 (dual-clip bound)")
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; choose one of {', '.join(LOSS_AGG_MODES)}")
    if loss_scale_factor is not None:
        k = number("loss_scale_factor", loss_scale_factor)
        if not (k > 0 and math.isfinite(k)):
            raise ValueError(f"loss_scale_factor={loss_scale_factor!r} must be finite and > 0")


def _setting(name: str, value: Any, above: float | None) -> float:
    """A finite real setting, > ``above`` when given; ValueError naming the setting and value."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a finite number")
    if above is not None and not value > above:
        raise ValueError(f"{name}={value!r} must be > {above:g}")
    return float(value)


class _DefaultLossType(str):
    """Marks ``loss_type`` left at its default, so ``use_policy_gradient`` may set it."""


_LOSS_TYPE_DEFAULT = _DefaultLossType("ppo_clip")


@dataclasses.dataclass(frozen=True)
class RolloutCorrectionConfig:
    """The correction configuration: single source of defaults (docs/corrections.md §9.1),
    validated at construction (§10).  Parsed thresholds are stored in the non-init fields
    ``is_spec`` (:class:`ISThreshold` or None), ``rs_specs`` (tuple of :class:`RSOption`, legacy
    names already mapped) and ``veto_tau``.

    ``loss_type=None`` means "not set": it becomes "ppo_clip", or what the legacy
    ``use_policy_gradient`` implies; an explicit loss_type that contradicts it is an error.

    Mode rules (§9.4): decoupled + ppo_clip multiplies IS weights; bypass + ppo_clip uses IS for
    metrics only (a warning is issued); bypass + reinforce multiplies -A log pi; decoupled +
    reinforce is an error; RS and the veto act in every mode.  Presets: :meth:`from_name`.
    """

    rollout_is: str | None = None
    rollout_is_threshold: float | str | None = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: float | str | None = None
    rollout_rs_threshold_lower: float | None = None
    rollout_token_veto_threshold: float | None = None
    bypass_mode: bool = False
    loss_type: str | None = _LOSS_TYPE_DEFAULT
    use_policy_gradient: bool | None = None
    loss_mode: str = "vanilla"
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    rollout_is_threshold_lower: float | None = None
    rollout_opsm_threshold: float | None = None
    rollout_m2_threshold: float | None = None
    rollout_outlier_threshold_low: float | None = None
    rollout_outlier_threshold_high: float | None = None
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    dro_beta: float = 0.1
    rollout_sq_log_ratio_coef: float = 0.0
    is_spec: ISThreshold | None = dataclasses.field(init=False, repr=False, compare=False, default=None)
    outlier_bounds: tuple | None = dataclasses.field(init=False, repr=False, compare=False, default=None)
    rs_specs: tuple = dataclasses.field(init=False, repr=False, compare=False, default=())
    veto_tau: float | None = dataclasses.field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        init_field = object.__setattr__  # the dataclass is frozen
        if self.rollout_is is not None and not isinstance(self.rollout_is, str):
            raise TypeError(f"rollout_is must be None or a string, got {self.rollout_is!r}")
        if self.rollout_is is not None and self.rollout_is not in IS_LEVELS:
            raise ValueError(f"rollout_is={self.rollout_is!r} is not one of None, {', '.join(map(repr, IS_LEVELS))}")
        # A threshold is parsed only for a correction that is on, for IS as for RS (a preset's
        # threshold may stay behind when an override turns its correction off).
        is_on = self.rollout_is is not None
        init_field(self, "is_spec", self._parse_is_spec() if is_on else None)
        if not isinstance(self.rollout_is_batch_normalize, bool):
            raise TypeError(f"rollout_is_batch_normalize must be a bool, got {self.rollout_is_batch_normalize!r}")
        init_field(
            self,
            "rs_specs",
            parse_rs_options(self.rollout_rs, self.rollout_rs_threshold, self.rollout_rs_threshold_lower),
        )
        init_field(self, "veto_tau", parse_veto_threshold(self.rollout_token_veto_threshold))
        if not isinstance(self.bypass_mode, bool):
            raise TypeError(f"bypass_mode must be a bool, got {self.bypass_mode!r}")
        init_field(self, "loss_type", self._resolve_loss_type())
        self._check_loss_mode()
        init_field(self, "outlier_bounds", self._parse_masks())
        if self.bypass_mode and self.loss_type == "ppo_clip" and self.rollout_is is not None:
            warnings.warn(
                f"rollout_is={self.rollout_is!r} with bypass_mode=True and "
                f"loss_type='ppo_clip' only adds IS metrics: the PPO ratio pi_theta/mu "
                f"already is the IS ratio, weights are never multiplied "
                f"(docs/corrections.md §7.3)",
                UserWarning,
                stacklevel=3,
            )
        if self.rollout_is == "geometric":  # opt-in, peer-compatible: its caveat, once per valid config
            warnings.warn(GEOMETRIC_IS_WARNING, UserWarning, stacklevel=3)

    def _parse_is_spec(self) -> ISThreshold:
        """The IS threshold (§3.2) and, with ``rollout_is_threshold_lower``, two-sided TIS (§3.8)."""
        spec = parse_is_threshold(self.rollout_is_threshold)
        if self.rollout_is_threshold_lower is None:
            return spec
        lower = _setting("rollout_is_threshold_lower", self.rollout_is_threshold_lower, 0.0)
        if spec.mode != "tis":
            raise ValueError(
                f"rollout_is_threshold_lower={self.rollout_is_threshold_lower!r} needs a TIS cap, not the IcePop "
                f"band rollout_is_threshold={self.rollout_is_threshold!r}"
            )
        if not lower < spec.upper:
            raise ValueError(
                f"rollout_is_threshold_lower={self.rollout_is_threshold_lower!r} must be below "
                f"rollout_is_threshold={self.rollout_is_threshold!r} (C_min < C_max)"
            )
        return ISThreshold("tis", lower, spec.upper)

    def _check_loss_mode(self) -> None:
        """The objective and its parameters (§7.7, §7.9, §10): a known ``loss_mode``, fractions in
        (0, 1), lb < ub, beta >= 0, temperatures > 0, VESPO's k >= 0 and lambda > 0, DRO's
        beta > 0, tau >= 0 of the penalty against mu; REINFORCE is its own objective (§7.4)."""
        if not isinstance(self.loss_mode, str) or self.loss_mode not in POLICY_LOSSES:
            raise ValueError(f"loss_mode={self.loss_mode!r} is not one of {', '.join(POLICY_LOSSES)}")
        if self.loss_mode != "vanilla" and self.loss_type == "reinforce":
            raise ValueError(
                f"loss_mode={self.loss_mode!r} is a ratio objective against pi_prox and is undefined with "
                f"loss_type='reinforce' (REINFORCE has no ratio): use loss_mode='vanilla' or loss_type='ppo_clip'"
            )
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            value = _setting(name, getattr(self, name), 0.0)
            if not value < 1.0:
                raise ValueError(f"{name}={getattr(self, name)!r} must lie in (0, 1)")
        if not _setting("clip_cov_lb", self.clip_cov_lb, None) < _setting("clip_cov_ub", self.clip_cov_ub, None):
            raise ValueError(f"clip_cov_lb={self.clip_cov_lb!r} must be below clip_cov_ub={self.clip_cov_ub!r}")
        if _setting("ppo_kl_coef", self.ppo_kl_coef, None) < 0:
            raise ValueError(f"ppo_kl_coef={self.ppo_kl_coef!r} must be >= 0")
        _setting("tau_pos", self.tau_pos, 0.0)
        _setting("tau_neg", self.tau_neg, 0.0)
        for name in ("vespo_k_pos", "vespo_k_neg", "rollout_sq_log_ratio_coef"):
            if _setting(name, getattr(self, name), None) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 0")
        for name in ("vespo_lambda_pos", "vespo_lambda_neg", "dro_beta"):
            _setting(name, getattr(self, name), 0.0)

    def _parse_masks(self) -> tuple | None:
        """OPSM delta > 0 (§4.6), tau_M2 > 0 (§4.7), outlier bounds 0 < low < high (§4.8)."""
        for name in ("rollout_opsm_threshold", "rollout_m2_threshold"):
            if getattr(self, name) is not None:
                _setting(name, getattr(self, name), 0.0)
        low, high = self.rollout_outlier_threshold_low, self.rollout_outlier_threshold_high
        if low is None and high is None:
            return None
        low = None if low is None else _setting("rollout_outlier_threshold_low", low, 0.0)
        high = None if high is None else _setting("rollout_outlier_threshold_high", high, 0.0)
        if low is not None and high is not None and not low < high:
            raise ValueError(
                f"rollout_outlier_threshold_low={low!r} must be below rollout_outlier_threshold_high={high!r}"
            )
        return low, high

    def _resolve_loss_type(self) -> str:
        """Apply the legacy ``use_policy_gradient`` alias and check loss_type (§9.1)."""
        loss_type, upg = self.loss_type, self.use_policy_gradient
        explicit = loss_type is not None and not isinstance(loss_type, _DefaultLossType)
        if loss_type is None:  # unset (e.g. from a CLI): the default, or use_policy_gradient's
            loss_type = _LOSS_TYPE_DEFAULT
        if loss_type not in _LOSS_TYPES:
            raise ValueError(f"loss_type={loss_type!r} must be one of {_LOSS_TYPES}")
        if upg is not None:
            if not isinstance(upg, bool):
                raise TypeError(f"use_policy_gradient must be None or a bool, got {upg!r}")
            implied = "reinforce" if upg else "ppo_clip"
            if explicit and loss_type != implied:
                raise ValueError(f"use_policy_gradient={upg!r} conflicts with loss_type={str(loss_type)!r}")
            if upg and not self.bypass_mode:
                raise ValueError(f"use_policy_gradient={upg!r} requires bypass_mode=True")
            loss_type = implied
        if loss_type == "reinforce" and not self.bypass_mode:
            raise ValueError(
                f"loss_type={str(loss_type)!r} requires bypass_mode=True (decoupled mode always uses ppo_clip)"
            )
        # A value the user did not set stays marked as such, so dataclasses.replace(config,
        # use_policy_gradient=...) may still choose it, exactly as the constructor would.
        return str(loss_type) if explicit else _DefaultLossType(loss_type)

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> RolloutCorrectionConfig:
        """Build the preset ``name`` of :data:`PRESETS` or :data:`PRESET_ALIASES`
        (docs/corrections.md §9.2-§9.3); ``overrides`` set its tunable arguments (e.g.
        ``threshold``, ``rs_threshold``).  ``RolloutCorrectionConfig.<name>(**overrides)`` is the
        same call."""
        fields = _preset_fields(name, overrides)
        with warnings.catch_warnings():  # a preset's metrics-only IS (ppo_is_bypass) is deliberate
            warnings.simplefilter("ignore", UserWarning)
            return cls(**fields)


class _Arg(NamedTuple):
    """A tunable preset field: the keyword argument that sets it, and its default."""

    name: str
    default: Any


class _Band(NamedTuple):
    """A tunable "L_U" threshold string; ``lower=None`` gives "_U" (k1 RS with no lower bound)."""

    lower: _Arg | None
    upper: _Arg


_PPO = {"bypass_mode": True, "loss_type": "ppo_clip"}  # bypass PPO-clip against mu (§7.3)
_PG = {"bypass_mode": True, "loss_type": "reinforce"}  # bypass REINFORCE (§7.4)
_ICEPOP = _Band(_Arg("threshold_lower", 0.5), _Arg("threshold", 5.0))
_GEO_RS = {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": _Arg("rs_threshold", "0.999_1.001")}
_K3_RS = {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": _Arg("rs_threshold", 0.01)}
# One-sided Seq-MIS, w = rho * 1[rho <= C] (Liu, Li et al. 2025): sequence TIS at C, and the rows
# with rho > C rejected by seq_sum_k1 "_C" (no lower bound), so a kept row carries rho itself.
_SEQ_MIS = {
    "rollout_is": "sequence",
    "rollout_is_threshold": _Arg("threshold", 2.0),
    "rollout_rs": "seq_sum_k1",
    "rollout_rs_threshold": _Band(None, _Arg("threshold", 2.0)),
}
# seq-mask-tis (§3.9): reject a row whose geometric-mean ratio leaves [L, U] (seq_mean_k1 "L_U"), and
# weight the kept tokens by their *untruncated* token ratio (token IS, cap +inf).  Bounds: NeMo-RL's
# [0.999, 1.002] (nemo_rl/algorithms/loss/loss_functions.py ClippedPGLossConfig, docs/guides/prorlv2.md);
# OpenRLHF's default band is [0.5, 5.0] (openrlhf/cli/train_ppo_ray.py --algo.advantage.is_correction_threshold).
_SEQ_MASK_TIS = {
    "rollout_is": "token",
    "rollout_is_threshold": math.inf,
    "rollout_rs": "seq_mean_k1",
    "rollout_rs_threshold": _Band(_Arg("threshold_lower", 0.999), _Arg("threshold", 1.002)),
}


def _tis(level: str, arg: str = "is_threshold") -> dict[str, Any]:
    return {"rollout_is": level, "rollout_is_threshold": _Arg(arg, 2.0)}


#: The presets (docs/corrections.md §9.2): name -> the config fields that differ from the
#: defaults; an _Arg / _Band value is tunable by keyword (its default shown).  Decoupled presets
#: (no bypass fields) multiply IS weights into the PPO loss (§7.2).
PRESETS: dict[str, dict[str, Any]] = {
    "decoupled_token_is": _tis("token", "threshold"),  # Token-TIS (Yao et al. 2025)
    "decoupled_seq_is": _tis("sequence", "threshold"),  # Seq-TIS (Liu, Li et al. 2025)
    "decoupled_token_icepop": {"rollout_is": "token", "rollout_is_threshold": _ICEPOP},
    "decoupled_seq_is_rs": {
        **_tis("sequence"),
        "rollout_rs": "seq_sum_k1",
        "rollout_rs_threshold": _Arg("rs_threshold", "0.5_2.0"),
    },
    "decoupled_seq_mis": {**_SEQ_MIS},
    # Geo-RS; a legacy lower bound selects the legacy name "geometric" (see _preset_fields)
    "decoupled_geo_rs": {
        **_GEO_RS,
        "rollout_token_veto_threshold": _Arg("veto_threshold", None),
        "rollout_rs_threshold_lower": _Arg("rs_threshold_lower", None),
    },
    "bypass_ppo_clip": {**_PPO},
    "bypass_ppo_clip_geo_rs": {**_GEO_RS, **_PPO},
    "bypass_ppo_clip_k3_rs": {**_K3_RS, **_PPO},  # TRM average criterion (arXiv 2512.23075)
    "bypass_pg_is": {**_tis("sequence", "threshold"), **_PG},  # trajectory IS (§12.1)
    "bypass_pg_token_icepop": {"rollout_is": "token", "rollout_is_threshold": _ICEPOP, **_PG},
    "bypass_pg_geo_rs": {**_GEO_RS, **_PG},
    "bypass_pg_seq_mis": {**_SEQ_MIS, **_PG},
    "decoupled_geo_rs_seq_tis": {**_tis("sequence"), **_GEO_RS},
    "decoupled_geo_rs_token_tis": {**_tis("token"), **_GEO_RS},
    "bypass_pg_geo_rs_seq_tis": {**_tis("sequence"), **_GEO_RS, **_PG},
    "bypass_pg_geo_rs_token_tis": {**_tis("token"), **_GEO_RS, **_PG},
    "decoupled_k3_rs": {**_K3_RS},
    "decoupled_k3_rs_seq_tis": {**_tis("sequence"), **_K3_RS},
    "decoupled_k3_rs_token_tis": {**_tis("token"), **_K3_RS},
    "disabled": {},  # metrics only: naive PPO against the recompute (§7.2)
    # two-sided token TIS, w clamped to [C_min, C_max] (§3.8; OpenRLHF's [0.5, 5])
    "decoupled_token_tis_two_sided": {
        "rollout_is": "token",
        "rollout_is_threshold": _Arg("threshold", 5.0),
        "rollout_is_threshold_lower": _Arg("threshold_lower", 0.5),
    },
    # OPSM (§4.6) at TRL's documented delta 0.5 (trl docs/source/paper_index.md, GRPOConfig.off_policy_mask_threshold;
    # DeepSeek-V3.2 gives none); slime's --opsm-delta default 1e-4 (the committed catalogue runs) is opsm_threshold=1e-4
    "decoupled_opsm": {"rollout_opsm_threshold": _Arg("opsm_threshold", 0.5)},
    # M2PO as AReaL's recipe runs it (examples/math/gsm8k_m2po.yaml; design-readings §29): the decoupled loss with the
    # token IS weight pi_old/mu, tokens of ratio > 5 masked (rejection_sampling metric=ratio, upper=5, action=mask:
    # the TIS cap at 5 never bites on a kept token), under the second-moment mask at tau_M2 = 0.04
    "decoupled_m2po": {
        "rollout_is": "token",
        "rollout_is_threshold": _Arg("threshold", 5.0),
        "rollout_rs": "token_k1",
        "rollout_rs_threshold": _Band(None, _Arg("threshold", 5.0)),
        "rollout_m2_threshold": _Arg("m2_threshold", 0.04),
    },
    # the M2 mask alone, no IS weight: the catalogue's "decoupled_m2po" arm before issue 48 (§4.7)
    "decoupled_m2_mask": {"rollout_m2_threshold": _Arg("m2_threshold", 0.04)},
    "decoupled_outlier_rs": {  # §4.8, SkyRL's suggested bounds
        "rollout_outlier_threshold_low": _Arg("outlier_low", 1e-4),
        "rollout_outlier_threshold_high": _Arg("outlier_high", 100.0),
    },
    # Opt-in geometric IS weight exp(mean_t l), truncated (§3.9; warns on direct construction, §10 of
    # design-readings): slime mis.yaml tis_level=geometric, tis_mode=truncate, tis_upper_bound=2.0
    # (AReaL RejectionSamplingConfig level=sequence/action=clamp caps at upper=5.0, ROLL
    # TrainInferISWeightConfig weight_type=geometric at upper_bound=1.2: pass threshold=).
    "decoupled_geo_is": _tis("geometric", "threshold"),
    "decoupled_seq_mask_tis": {**_SEQ_MASK_TIS},
    # NeMo-RL's ProRL v2.1 (examples/configs/prorlv2_1_moe.v2.yaml): seq-mask-tis with
    # force_on_policy_ratio, i.e. -A grad log pi * sg(pi_theta / mu) on the kept rows (§7.4)
    "bypass_pg_seq_mask_tis": {**_SEQ_MASK_TIS, **_PG},
}

#: Older preset names (docs/corrections.md §9.3): name -> (preset, fields replaced on top of it).
PRESET_ALIASES: dict[str, tuple[str, dict[str, Any]]] = {
    "naive": ("disabled", {}),  # the explicit no-correction baseline arm
    "pg_is": ("bypass_pg_is", {}),
    "bypass_pg_rs": ("bypass_pg_geo_rs", {}),
    # token IS in bypass PPO-clip: metrics only, on purpose (no warning)
    "ppo_is_bypass": ("bypass_ppo_clip", _tis("token", "threshold")),
    # legacy geometric RS ([lower or 1/U, U]) + veto, REINFORCE
    "pg_rs": (
        "bypass_pg_geo_rs",
        {
            "rollout_rs": "geometric",
            "rollout_rs_threshold": _Arg("rs_threshold", 1.001),
            "rollout_rs_threshold_lower": _Arg("rs_threshold_lower", None),
            "rollout_token_veto_threshold": _Arg("veto_threshold", 1e-4),
        },
    ),
}

#: Every name accepted by :meth:`RolloutCorrectionConfig.from_name`.
PRESET_NAMES = tuple(PRESETS) + tuple(PRESET_ALIASES)


def _preset_table(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(fields of preset ``name``, its tunable arguments -> their defaults)."""
    if name in PRESET_ALIASES:
        target, extra = PRESET_ALIASES[name]
        table = {**PRESETS[target], **extra}
    elif name in PRESETS:
        table = PRESETS[name]
    else:
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(PRESET_NAMES)}")
    args = {
        a.name: a.default
        for v in table.values()
        for a in ((v.lower, v.upper) if isinstance(v, _Band) else (v,))
        if isinstance(a, _Arg)
    }
    return table, args


def _preset_fields(name: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The config fields of preset ``name`` with its tunable arguments set from ``overrides``."""
    table, args = _preset_table(name)
    unknown = sorted(set(overrides) - set(args))
    if unknown:
        raise TypeError(
            f"preset {name!r} got unexpected argument(s) {', '.join(unknown)}; "
            f"its arguments are {', '.join(args) or 'none'}"
        )
    args.update(overrides)
    fields = {}
    for field, value in table.items():
        if isinstance(value, _Band):
            lower = "" if value.lower is None else args[value.lower.name]
            value = f"{lower}_{args[value.upper.name]}"
        fields[field] = args[value.name] if isinstance(value, _Arg) else value
    if fields.get("rollout_rs_threshold_lower") is not None:  # the legacy key needs a legacy name
        legacy = {canonical: old for old, canonical in LEGACY_RS_NAMES.items()}
        fields["rollout_rs"] = legacy.get(fields["rollout_rs"], fields["rollout_rs"])
    return fields


def _preset_method(name: str):
    """``RolloutCorrectionConfig.<name>(**overrides)``, the classmethod form of ``from_name``."""

    def build(cls, **overrides: Any) -> RolloutCorrectionConfig:
        return cls.from_name(name, **overrides)

    section = "9.3" if name in PRESET_ALIASES else "9.2"
    args = ", ".join(f"{k}={v!r}" for k, v in _preset_table(name)[1].items()) or "none"
    build.__name__ = build.__qualname__ = name
    build.__doc__ = (
        f"Preset {name!r} (docs/corrections.md §{section}): {_preset_fields(name, {})}."
        f"\n\nTunable arguments (defaults): {args}."
    )
    return classmethod(build)


for _name in PRESET_NAMES:
    setattr(RolloutCorrectionConfig, _name, _preset_method(_name))
del _name

#: The configuration a loss without ``config`` uses: the PPO objective, no OPSM (§7.7).
_DEFAULT_CONFIG = RolloutCorrectionConfig()


# ============================================================================================
# Helpers: reductions over valid entries, input validation (docs/corrections.md §1, §10)
# ============================================================================================


def _masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """max of x over selected entries (caller guarantees at least one)."""
    return torch.where(mask, x, torch.full((), -math.inf, dtype=x.dtype, device=x.device)).amax()


def _masked_min(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """min of x over selected entries (caller guarantees at least one)."""
    return torch.where(mask, x, torch.full((), math.inf, dtype=x.dtype, device=x.device)).amin()


def _pop_std(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sqrt(max(<x^2> - <x>^2, 0)) over selected entries if N > 1, else 0 (§6.1)."""
    mean = masked_mean(x, mask)
    var = torch.clamp(masked_mean(x * x, mask) - mean * mean, min=0.0)
    return torch.where(mask.sum() > 1, torch.sqrt(var), torch.zeros_like(var))


def _row_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x_bar_i = (1/n_i) sum_t m_it x_it for valid rows, 0 for fully padded rows (§1)."""
    return masked_mean(x, mask, dim=-1)


def _valid_rows(mask: torch.Tensor) -> torch.Tensor:
    """Valid-row indicator n_i > 0 (docs/corrections.md §1)."""
    return mask.any(dim=-1)


def _quantiles(values: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Linear-interpolation quantiles of the selected values (the §6.1 percentile rule).

    With the values sorted x_(0) <= ... <= x_(N-1) and h = q (N-1):
    Q(q) = x_(floor h) + (h - floor h) (x_(ceil h) - x_(floor h)).
    """
    ordered = torch.sort(values[mask]).values
    last = ordered.numel() - 1
    out = {}
    for name, q in (("p25", 0.25), ("p50", 0.50), ("p75", 0.75), ("p95", 0.95), ("p99", 0.99)):
        h = q * last
        lo, hi = math.floor(h), math.ceil(h)
        out[name] = ordered[lo] + (h - lo) * (ordered[hi] - ordered[lo])
    return out


def _fraction(condition: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """<1[condition]>_mask: the share of the selected entries where ``condition`` holds."""
    return masked_mean(condition.to(dtype), mask)


def _seq_metrics(
    row_value: torch.Tensor, rows: torch.Tensor, centre: float, high: torch.Tensor, low: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """The seq_* block shared by the IS and RS metrics (docs/corrections.md §6.1, §6.2), over
    the valid rows: E_V R, sd_V(R), max R, min R, max |R - centre|, E_V 1[high], E_V 1[low]
    (the last only when ``low`` is given).  ``centre`` is the value for identical policies."""
    dt = row_value.dtype
    out = {
        "seq_mean": masked_mean(row_value, rows),
        "seq_std": torch.sqrt(masked_var(row_value, rows, unbiased=True)),
        "seq_max": _masked_max(row_value, rows),
        "seq_min": _masked_min(row_value, rows),
        "seq_max_deviation": _masked_max((row_value - centre).abs(), rows),
        "seq_fraction_high": _fraction(high, rows, dt),
    }
    if low is not None:
        out["seq_fraction_low"] = _fraction(low, rows, dt)
    return out


def _as_bool(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _check_mask_values(mask: torch.Tensor, name: str) -> torch.Tensor:
    """Mask must be bool or hold only 0/1 values (docs/corrections.md §1, §10)."""
    if mask.dtype == torch.bool:
        return mask
    bad = (mask != 0) & (mask != 1)
    if bool(bad.any()):
        examples = torch.unique(mask[bad].detach().float().cpu())[:5].tolist()
        raise ValueError(f"{name} must contain only 0/1 (or bool) values; found {examples!r}")
    return mask != 0


def _validate_inputs(
    response_mask: torch.Tensor,
    finite: Mapping[str, torch.Tensor | None],
    other: Mapping[str, torch.Tensor | None] | None = None,
    *,
    validate: bool = True,
) -> torch.Tensor:
    """Validate per-token inputs and return the original mask as bool (docs/corrections.md §10).

    Checks, in order: 2-D equal shapes (naming both shapes), 0/1 mask values, at least one valid
    token, and finite values of every tensor in ``finite`` at valid positions.  ``validate=False``
    checks nothing (no host sync) and only converts the mask.
    """
    if not validate:
        return _as_bool(response_mask)
    if not isinstance(response_mask, torch.Tensor):
        raise TypeError(f"response_mask must be a torch.Tensor, got {type(response_mask)!r}")
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be 2-D (B, T), got shape {tuple(response_mask.shape)}")
    tensors = {**finite, **(other or {})}
    for name, tensor in tensors.items():
        if tensor is not None and tuple(tensor.shape) != tuple(response_mask.shape):
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but response_mask has shape "
                f"{tuple(response_mask.shape)}; all per-token tensors must have the same shape"
            )
    mask = _check_mask_values(response_mask, "response_mask")
    if not bool(mask.any()):
        raise ValueError("response mask must contain at least one valid token")
    for name, tensor in finite.items():
        if tensor is None:
            continue
        bad = int((mask & ~torch.isfinite(tensor.detach())).sum())
        if bad:
            raise ValueError(
                f"{name} has {bad} non-finite value(s) (NaN or +/-inf) at valid "
                f"positions of response_mask; sanitise it before the correction"
            )
    return mask


def _zero_padding(x: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype | None = None):
    """Replace padded entries by 0 (by selection), so padding cannot leak into values/gradients."""
    x = x if dtype is None else x.to(dtype)
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _prepare_log_probs(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor, *, validate: bool = True
):
    """Validate (§10, unless ``validate=False``) and return (mask as bool, log pi_train, log mu):
    detached, in the work dtype, padding replaced by 0."""
    finite = {"old_log_prob": old_log_prob, "rollout_log_prob": rollout_log_prob}
    mask = _validate_inputs(response_mask, finite, validate=validate)
    dtype = _work_dtype(old_log_prob, rollout_log_prob)
    train = _zero_padding(old_log_prob.detach(), mask, dtype)
    rollout = _zero_padding(rollout_log_prob.detach(), mask, dtype)
    return mask, train, rollout


def _to_floats(metrics: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """Convert a dict of 0-d tensors / floats to Python floats with a single device sync."""
    keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, torch.Tensor)}
    if keys:
        values = torch.stack([metrics[k].detach().reshape(()).to(torch.float64) for k in keys])
        out.update(zip(keys, values.cpu().tolist()))
    return {k: out[k] for k in metrics}


def _work_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """Float dtype used for corrections: the inputs' promoted dtype, at least fp32."""
    dtype = torch.float32
    for t in tensors:
        if t is not None and t.is_floating_point():
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


# Public names (kept at the end so that the formulas come first).
__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "GEOMETRIC_IS_WARNING",
    "IS_LEVELS",
    "KL_ESTIMATORS",
    "LEGACY_RS_NAMES",
    "LOSS_AGG_MODES",
    "PRESETS",
    "PRESET_ALIASES",
    "PRESET_NAMES",
    "ROW_IS_LEVELS",
    "RS_OPTIONS",
    "RS_STATISTICS",
    "SAFETY_BOUND",
    "ISThreshold",
    "RSOption",
    "RolloutCorrectionConfig",
    "agg_loss",
    "batch_normalize_is_weights",
    "check_loss_settings",
    "chi2_divergence",
    "compute_advantage",
    "compute_grpo_outcome_advantage",
    "compute_is_metrics",
    "compute_policy_loss_bypass_mode",
    "compute_policy_loss_reinforce",
    "compute_policy_loss_vanilla",
    "compute_rejection_mask",
    "compute_rollout_correction_and_rejection_mask",
    "compute_rollout_correction_weights",
    "compute_rs_option_metrics",
    "compute_veto_mask",
    "estimate_tv_distance",
    "geometric_log_ratio",
    "icepop_is_weights",
    "k1_statistic",
    "k2_divergence",
    "k3_divergence",
    "kl_penalty",
    "loglinear_alpha",
    "loglinear_proximal_log_prob",
    "mask_split_metrics",
    "masked_mean",
    "mismatch_split_metrics",
    "masked_sum",
    "masked_var",
    "mult_prob_error",
    "parse_is_threshold",
    "parse_rs_options",
    "parse_veto_threshold",
    "ppo_clipped_token_loss",
    "proximal_approximation_errors",
    "raw_is_weights",
    "reinforce_token_loss",
    "rs_aggregate",
    "rs_base_statistic",
    "rs_option_keep_mask",
    "safe_exp",
    "safety_clip",
    "sampled_js_divergence",
    "sequence_log_ratio",
    "token_log_ratio",
    "truncate_is_weights",
]
