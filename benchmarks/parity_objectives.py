"""The objectives against their peers (issue 32, "Checks"; not a test): every objective of rc_core.POLICY_LOSSES
(docs/corrections.md §7.7) that verl 0.9.1 or TRL 1.16 also implements, and M2PO (preset decoupled_m2po, §4.7)
against AReaL 1.0.4, the peer that defines its recipe, computed by both on the same random inputs: the loss, its
gradient with respect to log pi_theta, and the metrics both report. Prints the largest difference per objective;
docs/results.md "Objectives against verl and TRL" records the table.

Each peer lives in its own virtual environment under .bench/ (never the trainer's), created here on first use with
pinned versions. verl's full dependency set (ray[default], vLLM or SGLang extras, wandb, ...) is not needed to call
its losses: verl is installed with --no-deps beside VERL_IMPORT_DEPS, the packages importing
verl.trainer.ppo.core_algos needs (found by importing it in an empty environment until it imported). TRL is
installed with its dependencies (TRL_PINS). Both get this interpreter's torch, pinned to its exact version. The
comparison runs inside the peer's environment: rc_core is pure torch and is imported from this repository. AReaL
1.0.4 is installed with --no-deps (the environment benchmarks/parity_prox.py shares): importing its modules would need
its whole dependency set, so, as parity_prox.py does, the worker parses the installed files and executes only the
definitions it needs -- `_apply_m2po_masking` and `_get_m2po_loss_mask` (areal/trainer/ppo/actor.py), `_check_bounds`,
`RejectionSamplingResult`, `apply_rejection_sampling` and `ppo_actor_loss_fn` (areal/utils/functional/functional.py),
the dataclass `RejectionSamplingConfig` (areal/api/cli_args.py) -- unchanged.

Call conventions (read from the peers' code):
  verl   core_algos.get_policy_loss_fn(mode)(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
         config=ActorConfig(..., policy_loss=PolicyLossConfig(loss_mode=mode, ...)), rollout_is_weights=w)
         -> (loss, {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}); verl's actor passes its
         configured loss_agg_mode (workers/utils/losses.py), so each case names the mode it compares.
  TRL    GRPOTrainer._compute_loss(self, model, inputs) is a method that also runs the model; it is called on a
         trainer object built without __init__ whose per-token log-prob function returns the test's log_prob, with
         one process, no gradient accumulation, no entropy bonus, no vLLM. `vespo` reads the vLLM IS ratio
         (inputs["importance_sampling_ratio"]) into its W even so: its IS-weight row passes our weights there.
  AReaL  what grpo_loss_fn does with the recipe examples/math/gsm8k_m2po.yaml (use_decoupled_loss, m2_threshold 0.04,
         rejection_sampling metric=ratio upper=5.0, eps_clip 0.0, no dual clip): loss_mask = _apply_m2po_masking(
         old_logp=log mu, prox_logp=log pi_old, loss_mask, m2_threshold), then ppo_actor_loss_fn(logprobs=log_prob,
         proximal_logprobs=log pi_old, old_logprobs=log mu, advantages, eps_clip=0.0, loss_mask, c_clip=None,
         rejection_sampling=RejectionSamplingConfig(metric="ratio", upper=5.0), importance_sampling_level="token").
         Its loss divides by the tokens the M2 mask keeps, ours by the valid ones (docs/design-readings.md §31), so
         ours is compared times N_valid / N_M2-kept; its behaviour weight is computed in float32 (`.float()`).
  ours   rc_core.compute_policy_loss_vanilla(old, log_prob, A, mask, loss_agg_mode, clip_low, clip_high, clip_c,
         rollout_is_weights=w, config=RolloutCorrectionConfig(loss_mode=..., ...)) (decoupled mode, pi_prox = pi_old);
         for M2PO w and the keep mask from compute_rollout_correction_and_rejection_mask(old, mu, mask,
         RolloutCorrectionConfig.decoupled_m2po(m2_threshold=tau)), clip 0 / 0 and no dual clip.

Inputs (float64, SEEDS draws per case): B = 16 responses of 1 to 24 tokens (no empty row), p_old uniform in
(0.01, 0.99), log p_theta = log p_old + N(0, 0.3^2) kept below log 0.9999 (DPPO's binary KL needs p < 1), garbage at
the padding, advantages constant per response (GRPO) or per token where the objective allows it, optional IS weights
exp(N(0, 0.2^2)) capped at 2. No rejection mask: verl's response mask is the kept mask, whose denominators differ from
ours by design once tokens are rejected (docs/corrections.md §7.5, §11 item 5).
Randomness: clip_cov draws its tokens with torch.randperm over the same candidates in the same (row-major) order in
verl and rc_core, so torch.manual_seed(case seed) before each call makes the draw identical; kl_cov takes the top-k
covariance tokens (deterministic). Both are also run with a fraction of 0.2 so that many tokens are selected.

Usage:  python -m benchmarks.parity_objectives                   (both peers; environments created on first use)
        python -m benchmarks.parity_objectives --peers verl
        python -m benchmarks.parity_objectives --json out.json   (the raw numbers as well)
        python -m benchmarks.parity_objectives --worker verl     (inside a peer's environment: what the above runs)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import types
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
BENCH = os.path.join(ROOT, ".bench")
VERL_PIN = "verl==0.9.1"
# What `import verl.trainer.ppo.core_algos` needs, no more (verl's own ranges: tensordict >=0.8,<=0.10, !=0.9.0;
# transformers >=5.5.3,<5.11, != 5.6.0 -- 5.9.0 is its CPU extra's pin).
VERL_IMPORT_DEPS = (
    "numpy==2.4.6",
    "omegaconf==2.4.0",
    "packaging==25.0",
    "ray==2.60.0",
    "tensordict==0.10.0",
    "transformers==5.9.0",
    "codetiming==1.4.0",
    "orjson==3.13.0",
)
TRL_PINS = ("trl==1.16.0", "transformers==5.24.0", "accelerate==1.15.0", "datasets==5.2.0")
AREAL_PIN = "areal==1.0.4"  # benchmarks/parity_prox.py: its proximal approximation is pure torch, so --no-deps
PEERS = ("verl", "trl", "areal")
SEEDS = 5
B, T = 16, 24


# ---- the peers' environments -------------------------------------------------------------------------------------
def torch_pin() -> str:
    import torch

    return f"torch=={torch.__version__}"


def _env_and_steps(peer: str) -> tuple[str, list[list[str]]]:
    """The peer's environment folder and its pip install steps."""
    if peer == "verl":
        steps = [[torch_pin(), *VERL_IMPORT_DEPS], ["--no-deps", VERL_PIN]]
    elif peer == "areal":
        steps = [[torch_pin()], ["--no-deps", AREAL_PIN]]
    else:
        steps = [[torch_pin(), *TRL_PINS]]
    return os.path.join(BENCH, f"{peer}-env"), steps


def peer_ready(peer: str) -> str | None:
    """The peer's environment's python if it exists with exactly these pins (its stamp file), else None."""
    env, steps = _env_and_steps(peer)
    stamp = os.path.join(env, "installed.txt")
    pins = " ".join(" ".join(s) for s in steps)
    if os.path.exists(stamp) and open(stamp).read().strip() == pins:
        return os.path.join(env, "bin", "python")
    return None


def peer_python(peer: str) -> str:
    """The peer's environment's python, created on first use (a stamp file holds the pins it was built with)."""
    python = peer_ready(peer)
    if python:
        return python
    env, steps = _env_and_steps(peer)
    python = os.path.join(env, "bin", "python")
    pins = " ".join(" ".join(s) for s in steps)
    print(f"[{peer}] creating {env}: {pins} (minutes, once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", env], check=True)
    for step in steps:
        subprocess.run([python, "-m", "pip", "install", "-q", *step], check=True)
    with open(os.path.join(env, "installed.txt"), "w") as f:
        f.write(pins + "\n")
    return python


def run_worker(peer: str, python: str, out: str) -> dict:
    """Run this module's worker for `peer` in the peer's environment; its result (rows, versions)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [python, "-m", "benchmarks.parity_objectives", "--worker", peer, "--out", out]
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    with open(out) as f:
        return json.load(f)


# ---- inputs ------------------------------------------------------------------------------------------------------
def make_inputs(seed: int, token_advantages: bool, is_weights: bool):
    """(old_log_prob, log_prob, advantages, mask, weights or None), float64 (B, T); see the module docstring."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    old = torch.log(torch.rand((B, T), generator=g, dtype=torch.float64) * 0.98 + 0.01)
    new = torch.clamp(old + 0.3 * torch.randn((B, T), generator=g, dtype=torch.float64), max=math.log(0.9999))
    garbage = -5.0 * torch.rand((B, T), generator=g, dtype=torch.float64)
    old, new = torch.where(mask, old, garbage), torch.where(mask, new, garbage)
    shape = (B, T) if token_advantages else (B, 1)
    adv = torch.randn(shape, generator=g, dtype=torch.float64).expand(B, T).clone()
    weights = None
    if is_weights:
        weights = torch.clamp(torch.exp(0.2 * torch.randn((B, T), generator=g, dtype=torch.float64)), max=2.0) * mask
    return old, new, adv, mask, weights


def rc_loss(old, new, adv, mask, weights, agg, clips, settings, seed, rollout=None):
    """rc_core's loss, gradient w.r.t. log_prob and metrics (decoupled mode, pi_prox = old)."""
    import torch

    import rc_core

    config = rc_core.RolloutCorrectionConfig(**settings)
    log_prob = new.clone().requires_grad_()
    torch.manual_seed(seed)
    loss, metrics = rc_core.compute_policy_loss_vanilla(
        old,
        log_prob,
        adv,
        mask.to(torch.float64),
        agg,
        *clips,
        rollout_is_weights=weights,
        rollout_log_prob=rollout,
        config=config,
    )
    loss.backward()
    return float(loss.detach()), log_prob.grad, metrics


def compare(ours, theirs, metric_pairs, mask):
    """Largest |difference| of the loss, of the gradient (valid positions; padding must be 0 in both) and of each
    metric pair (ours name, theirs name)."""
    (loss_a, grad_a, met_a), (loss_b, grad_b, met_b) = ours, theirs
    grad_b = grad_b if grad_b is not None else grad_a * 0
    out = {"loss": abs(loss_a - loss_b), "grad": float((grad_a - grad_b).abs().max()), "scale": abs(loss_b)}
    out["grad_padding"] = float(grad_a[~mask].abs().max().item() if (~mask).any() else 0.0)
    out["grad_padding"] = max(out["grad_padding"], float(grad_b[~mask].abs().max()) if (~mask).any() else 0.0)
    for ours_name, theirs_name in metric_pairs:
        out[f"metric {ours_name}"] = abs(float(met_a[ours_name]) - float(met_b[theirs_name]))
    return out


# ---- verl --------------------------------------------------------------------------------------------------------
# (label, verl loss mode, our loss mode, loss_agg_mode, advantages per token?, settings, note)
_FRACTION = {"clip_cov_ratio": 0.03, "kl_cov_ratio": 0.2}
VERL_CASES = (
    ("vanilla", "vanilla", "vanilla", "token-mean", True, {}, ""),
    ("vanilla", "vanilla", "vanilla", "seq-mean-token-sum", True, {}, ""),
    ("gspo_token", "gspo", "gspo_token", "seq-mean-token-mean", True, {}, "verl's gspo"),
    ("gspo", "gspo", "gspo", "seq-mean-token-mean", False, {}, "verl's gspo, GRPO advantages"),
    ("cispo_verl", "cispo", "cispo_verl", "token-mean", True, {}, "verl's cispo: the weight clamped on both sides"),
    ("sapo", "sapo", "sapo", "seq-mean-token-mean", True, {}, ""),
    ("geo_mean", "geo_mean", "geo_mean", "token-mean", False, {}, "sequence advantages (verl's condition)"),
    ("dppo_tv", "dppo_tv", "dppo_tv", "token-mean", True, {}, ""),
    ("dppo_kl", "dppo_kl", "dppo_kl", "token-mean", True, {}, ""),
    ("clip_cov", "clip_cov", "clip_cov", "token-mean", True, {}, "default fraction 0.0002: 1 token of 7-14 drawn"),
    ("clip_cov", "clip_cov", "clip_cov", "token-mean", True, _FRACTION, "fraction 0.03: 5-6 tokens of 7-14 drawn"),
    ("kl_cov", "kl_cov", "kl_cov", "token-mean", True, {}, "default fraction 0.0002: one token"),
    ("kl_cov", "kl_cov", "kl_cov", "token-mean", True, _FRACTION, "fraction 0.2"),
    ("dro", "dro", "dro", "token-mean", True, {"dro_beta": 0.5}, "dro_beta 0.5"),
    ("gpg", "gpg", "gpg", "token-mean", True, {}, ""),
)
CLIPS = (0.2, 0.28, 3.0)  # clip_ratio_low, clip_ratio_high (DAPO's clip-higher), clip_ratio_c
# The metrics both report, by name; verl's constant-0.0 placeholders (e.g. gspo's pg_clipfrac_lower) have no
# counterpart here and are not compared. kl_cov's actor/ppo_kl is <|log r|> in verl and <-log r> here (§7.7).
VERL_METRICS = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")


def verl_worker() -> list[dict]:
    import torch
    from verl.trainer.ppo import core_algos
    from verl.workers.config import ActorConfig, PolicyLossConfig

    import rc_core

    rows = []
    for label, theirs, ours, agg, token_adv, settings, note in VERL_CASES:
        for with_weights in (False, True):
            worst = defaultdict(float)
            for seed in range(SEEDS):
                old, new, adv, mask, weights = make_inputs(seed, token_adv, with_weights)
                params = {k: settings.get(k, getattr(rc_core.RolloutCorrectionConfig, k)) for k in PARAMS}
                config = ActorConfig(
                    strategy="fsdp",
                    rollout_n=1,
                    ppo_micro_batch_size_per_gpu=1,
                    clip_ratio=CLIPS[0],
                    clip_ratio_low=CLIPS[0],
                    clip_ratio_high=CLIPS[1],
                    clip_ratio_c=CLIPS[2],
                    tau_pos=params["tau_pos"],
                    tau_neg=params["tau_neg"],
                    loss_agg_mode=agg,
                    policy_loss=PolicyLossConfig(
                        loss_mode=theirs, **{k: v for k, v in params.items() if not k.startswith("tau")}
                    ),
                )
                log_prob = new.clone().requires_grad_()
                torch.manual_seed(seed)
                loss, metrics = core_algos.get_policy_loss_fn(theirs)(
                    old, log_prob, adv, mask, agg, config=config, rollout_is_weights=weights
                )
                loss.backward()
                ours_out = rc_loss(old, new, adv, mask, weights, agg, CLIPS, {"loss_mode": ours, **params}, seed)
                pairs = [(m, m) for m in VERL_METRICS if m in metrics and m in ours_out[2]]
                if ours == "kl_cov":
                    pairs = [p for p in pairs if p[0] != "actor/ppo_kl"]
                diff = compare(ours_out, (float(loss.detach()), log_prob.grad, metrics), pairs, mask)
                if theirs == "clip_cov":  # control: another draw on verl's side must show, or the draw is untested
                    torch.manual_seed(seed + 1000)
                    other = core_algos.get_policy_loss_fn(theirs)(
                        old, new.clone().requires_grad_(), adv, mask, agg, config=config, rollout_is_weights=weights
                    )[0]
                    diff["control: another seed for verl"] = abs(float(other.detach()) - ours_out[0])
                for k, v in diff.items():
                    worst[k] = max(worst[k], v)
            if ours == "gspo" and with_weights:  # docs/corrections.md §7.7: the row's mean weight, by design
                note = "token IS weights reach our sequence form through their row mean: same loss, another gradient"
            rows.append(
                {
                    "peer": "verl",
                    "objective": label,
                    "peer_name": f"core_algos loss_mode={theirs}",
                    "agg": agg,
                    "is_weights": with_weights,
                    "note": note,
                    **worst,
                }
            )
    return rows


PARAMS = (
    "clip_cov_ratio",
    "clip_cov_lb",
    "clip_cov_ub",
    "kl_cov_ratio",
    "ppo_kl_coef",
    "dro_beta",
    "tau_pos",
    "tau_neg",
)


# ---- TRL ---------------------------------------------------------------------------------------------------------
def trl_trainer(loss_type: str, level: str, eps_low: float, eps_high: float, **args):
    """A GRPOTrainer without __init__: what _compute_loss reads, for one process, no accumulation, no vLLM."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    t = object.__new__(GRPOTrainer)
    t.loss_type, t.importance_sampling_level = loss_type, level
    t.epsilon_low, t.epsilon_high = eps_low, eps_high
    t.beta = args.pop("beta", 0.0)
    t.off_policy_mask_threshold = args.pop("off_policy_mask_threshold", None)
    t.top_entropy_quantile, t.use_vllm, t.vllm_importance_sampling_correction = 1.0, False, False
    t.aux_loss_enabled, t._entropy_bonus_enabled = False, False
    t.current_gradient_accumulation_steps = 1
    t.model = types.SimpleNamespace(training=True)
    t.accelerator = types.SimpleNamespace(
        num_processes=1,
        gather=lambda x: x,
        gather_for_metrics=lambda x: x,
        reduce=lambda x, reduction="sum": x,
        sync_gradients=True,
    )
    defaults = dict(sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, delta=None, use_bias_correction_kl=False)
    defaults.update(vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0)  # TRL's defaults
    t.args = types.SimpleNamespace(**{**defaults, **args}, steps_per_generation=1)
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    return t


def trl_loss(trainer, old, new, adv_rows, mask, rollout=None, ref=None, is_ratio=None):
    """TRL's loss, gradient w.r.t. the per-token log-probs, and its logged metrics (last value of each).
    `is_ratio` is the vLLM IS ratio pi_old/mu, which only `vespo` reads without vLLM (into its W)."""
    import torch
    from trl.trainer.grpo_trainer import GRPOTrainer

    log_prob = new.clone().requires_grad_()
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (log_prob, torch.zeros_like(log_prob), None)
    m = mask.to(torch.float64)
    inputs = {
        "prompt_ids": torch.zeros((B, 1), dtype=torch.long),
        "prompt_mask": torch.ones((B, 1), dtype=torch.long),
        "completion_ids": torch.zeros((B, T), dtype=torch.long),
        "completion_mask": m,
        "advantages": adv_rows,
        "old_per_token_logps": old,
        "num_items_in_batch": m.sum(),
    }
    if rollout is not None:
        inputs["sampling_per_token_logps"] = rollout
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    return float(loss.detach()), log_prob.grad, {k: v[-1] for k, v in trainer._metrics["train"].items()}


def trl_worker() -> list[dict]:
    import torch
    from trl.trainer.grpo_trainer import GRPOTrainer

    import rc_core

    no_dual = 1e9  # TRL's PPO clip has no dual clip; ours is switched off by an unreachable clip_ratio_c
    rows = []

    def record(label, trl_name, agg, note, diffs, is_weights=False):
        worst = defaultdict(float)
        for d in diffs:
            for k, v in d.items():
                worst[k] = max(worst[k], v)
        rows.append({"peer": "trl", "objective": label, "peer_name": trl_name, "agg": agg, "is_weights": is_weights})
        rows[-1].update(note=note, **worst)

    def run(label, trl_name, agg, note, make_trainer, clips, settings, token_adv=False, extra=None, weights=False):
        diffs = []
        for seed in range(SEEDS):
            old, new, adv, mask, w = make_inputs(seed, token_adv, weights)
            # TRL sums log w over every position (vespo): padding carries w = 1 there, our padding weight is 0
            is_ratio = None if w is None else torch.where(mask, w, torch.ones_like(w))
            rollout = None
            if extra == "opsm":
                rollout = torch.where(mask, old + 0.1 * torch.randn_like(old), old)
            adv_rows = adv if token_adv else adv[:, 0]
            theirs = trl_loss(make_trainer(), old, new, adv_rows, mask, rollout=rollout, is_ratio=is_ratio)
            ours = rc_loss(old, new, adv, mask, w, agg, clips, settings, seed, rollout=rollout)
            pairs = [("actor/pg_clipfrac", "clip_ratio/region_mean")] if extra == "region" else []
            if extra == "gate":  # TRL's is a token mean only with token advantages (else one value per row)
                pairs = [("actor/vespo_gate_mean", "vespo/phi_seq_mean")]
            if extra == "opsm":
                keep_theirs = GRPOTrainer.get_off_policy_mask(adv[:, :1], new, rollout, mask.to(torch.float64), 0.05)
                keep_ours, _ = rc_core.compute_opsm_mask(new, rollout, adv * mask, mask, 0.05)
                dropped = int((keep_theirs[:, 0] == 0).sum())
                assert dropped > 0, "no row dropped: the mask is not exercised"
                ours[2]["opsm_rows"] = float((keep_ours.any(-1) | ~mask.any(-1)).sum())
                theirs[2]["opsm_rows"] = float(keep_theirs.sum())
                pairs = [("opsm_rows", "opsm_rows")]
            diffs.append(compare(ours, theirs, pairs, mask))
        record(label, trl_name, agg, note, diffs, weights)

    grpo = "loss_type='grpo'"
    run(
        "vanilla",
        f"{grpo}, token IS",
        "seq-mean-token-mean",
        "no dual clip on either side",
        lambda: trl_trainer("grpo", "token", 0.2, 0.28),
        (0.2, 0.28, no_dual),
        {},
        token_adv=True,
        extra="region",
    )
    for eps, note in (((0.2, 0.28), "clip 0.2 / 0.28"), ((3e-4, 4e-4), "GSPO paper's clip 3e-4 / 4e-4")):
        run(
            "gspo",
            f"{grpo}, importance_sampling_level='sequence'",
            "seq-mean-token-mean",
            note,
            lambda eps=eps: trl_trainer("grpo", "sequence", *eps),
            (*eps, 3.0),
            {"loss_mode": "gspo"},
        )
    run(
        "cispo",
        "loss_type='cispo', epsilon_high=5",
        "token-mean",
        "TRL caps the ratio at 5 from above only, as our cispo does with clip_ratio_high 4.0",
        lambda: trl_trainer("cispo", "token", 0.2, 5.0),
        (0.2, 4.0, 3.0),
        {"loss_mode": "cispo"},
        token_adv=True,
    )
    run(
        "sapo",
        "loss_type='sapo'",
        "seq-mean-token-mean",
        "temperatures 1.0 / 1.05",
        lambda: trl_trainer("sapo", "token", 0.2, 0.28),
        (0.2, 0.28, 3.0),
        {"loss_mode": "sapo"},
        token_adv=True,
    )
    run(
        "luspo",
        "loss_type='luspo', importance_sampling_level='sequence'",
        "seq-mean-token-sum",
        "GRPO advantages; no empty row, so TRL's mean over B rows is ours over V",
        lambda: trl_trainer("luspo", "sequence", 0.2, 0.28),
        (0.2, 0.28, 3.0),
        {"loss_mode": "luspo"},
    )
    for token_adv, weights, note in (
        (False, False, "GRPO advantages, k, lambda = 2, 3 / 3, 2"),
        (True, False, "token advantages; also the mean gate"),
        (False, True, "IS weights pi_old/mu: TRL's importance_sampling_ratio, folded into W on both sides"),
    ):
        run(
            "vespo",
            "loss_type='vespo'",
            "token-mean",
            note,
            lambda: trl_trainer("vespo", "token", 0.2, 0.28),
            (0.2, 0.28, 3.0),
            {"loss_mode": "vespo"},
            token_adv=token_adv,
            extra="gate" if token_adv else None,
            weights=weights,
        )
    run(
        "OPSM (vanilla + mask)",
        f"{grpo}, off_policy_mask_threshold=0.05",
        "seq-mean-token-mean",
        "mu = p_old x exp(N(0, 0.1^2)); also the kept rows of get_off_policy_mask",
        lambda: trl_trainer("grpo", "token", 0.2, 0.28, off_policy_mask_threshold=0.05),
        (0.2, 0.28, no_dual),
        {"rollout_opsm_threshold": 0.05},
        extra="opsm",
    )
    rows.append(trl_kl_row())
    return rows


def trl_kl_row() -> dict:
    """The IS-corrected k3 penalty (use_bias_correction_kl): TRL's loss with beta minus without, against
    beta * agg(rc_core.kl_penalty(..., old_log_prob=)) with TRL's aggregation; and TRL's "kl" metric (token mean)."""
    import torch

    import rc_core

    beta, worst = 0.04, defaultdict(float)
    for seed in range(SEEDS):
        old, new, adv, mask, _ = make_inputs(seed, False, False)
        ref = torch.where(mask, old + 0.2 * torch.randn_like(old), old)
        with_kl = trl_loss(
            trl_trainer("grpo", "token", 0.2, 0.28, beta=beta, use_bias_correction_kl=True),
            old,
            new,
            adv[:, 0],
            mask,
            ref=ref,
        )
        without = trl_loss(trl_trainer("grpo", "token", 0.2, 0.28), old, new, adv[:, 0], mask)
        log_prob = new.clone().requires_grad_()
        kl = rc_core.kl_penalty(log_prob, ref, "low_var_kl", old_log_prob=old)
        term = beta * rc_core.agg_loss(kl, mask, "seq-mean-token-mean")
        term.backward()
        ours = (float(term.detach()), log_prob.grad, {"kl": float(rc_core.masked_mean(kl.detach(), mask))})
        theirs = (with_kl[0] - without[0], with_kl[1] - without[1], {"kl": with_kl[2]["kl"]})
        for k, v in compare(ours, theirs, [("kl", "kl")], mask).items():
            worst[k] = max(worst[k], v)
    note = "beta 0.04, pi_ref = pi_old x exp(N(0, 0.2^2)); our term is the trainer's --kl-is-corrected penalty"
    row = {"peer": "trl", "objective": "IS-corrected KL", "peer_name": "beta>0, use_bias_correction_kl=True"}
    return {**row, "agg": "seq-mean-token-mean", "is_weights": False, "note": note, **worst}


# ---- AReaL -------------------------------------------------------------------------------------------------------
AREAL_DEFINITIONS = {  # file under areal/ -> the definitions executed from it, in this order
    "api/cli_args.py": ("RejectionSamplingConfig",),
    "utils/functional/functional.py": (
        "_check_bounds",
        "RejectionSamplingResult",
        "apply_rejection_sampling",
        "ppo_actor_loss_fn",
    ),
    "trainer/ppo/actor.py": ("_apply_m2po_masking", "_get_m2po_loss_mask"),
}
M2PO_TAUS = (
    (0.04, "the recipe's tau 0.04: the M2 mask removes the tokens over 5 itself"),
    (0.15, "tau 0.15: the ratio mask also drops tokens the M2 mask keeps"),
)


def areal_definitions() -> dict:
    """AReaL's M2PO mask, decoupled loss and rejection-sampling config, executed from the installed files."""
    import ast
    import dataclasses
    import importlib.util
    import typing
    import warnings

    import torch

    root = importlib.util.find_spec("areal").submodule_search_locations[0]  # finds, does not import, the package
    namespace = {"torch": torch, "dataclass": dataclasses.dataclass, "field": dataclasses.field}
    namespace.update(Any=typing.Any, warnings=warnings)
    for name, wanted in AREAL_DEFINITIONS.items():
        path = os.path.join(root, *name.split("/"))
        tree = ast.parse(open(path).read(), path)
        keep = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in wanted]
        if sorted(n.name for n in keep) != sorted(wanted):
            raise SystemExit(f"{path}: expected {wanted}, found {[n.name for n in keep]}: AReaL's layout changed")
        exec(compile(ast.Module(keep, []), path, "exec"), namespace)
    return namespace


def _m2po_loss(old, new, adv, mask, w, keep, scale):
    """Our M2PO loss (clip 0 / 0, no dual clip) and its gradient w.r.t. log pi_theta, both times `scale`."""
    import rc_core

    log_prob = new.clone().requires_grad_()
    loss, _ = rc_core.compute_policy_loss_vanilla(
        old, log_prob, adv, mask.double(), "token-mean", 0.0, 0.0, 1e9, rollout_is_weights=w, keep_mask=keep
    )
    loss.backward()
    return float(loss.detach()) * scale, log_prob.grad * scale, {}


def areal_worker() -> list[dict]:
    import torch

    import rc_core

    areal = areal_definitions()
    config = areal["RejectionSamplingConfig"](metric="ratio", upper=5.0)  # the recipe's; level token, action mask
    rows = []
    for tau, note in M2PO_TAUS:
        for at_old in (False, True):
            worst, exercised = defaultdict(float), defaultdict(int)
            for seed in range(SEEDS):
                old, new, adv, mask, _ = make_inputs(seed, False, False)
                g = torch.Generator().manual_seed(seed + 500)
                # l = log pi_old - log mu: N(0, 0.25^2) with 4 % of the tokens moved by +-2 (ratios e^+-2)
                ell = 0.25 * torch.randn((B, T), generator=g, dtype=torch.float64)
                ell += 2.0 * torch.sign(torch.randn((B, T), generator=g)) * (torch.rand((B, T), generator=g) < 0.04)
                mu = torch.where(mask, old - ell, old)
                new = old.clone() if at_old else new
                w, keep, _ = rc_core.compute_rollout_correction_and_rejection_mask(
                    old, mu, mask.double(), rc_core.RolloutCorrectionConfig.decoupled_m2po(m2_threshold=tau)
                )
                m2_ours, _ = rc_core.compute_m2_mask(old - mu, mask, tau)
                m2_theirs = areal["_apply_m2po_masking"](mu, old, mask, tau)
                scale = int(mask.sum()) / int(m2_theirs.sum())  # their denominator is the M2-kept count
                ours = _m2po_loss(old, new, adv, mask, w, keep, scale)
                log_prob = new.clone().requires_grad_()
                their_loss, stat = areal["ppo_actor_loss_fn"](
                    logprobs=log_prob,
                    proximal_logprobs=old,
                    old_logprobs=mu,
                    advantages=adv,
                    eps_clip=0.0,
                    loss_mask=m2_theirs,
                    c_clip=None,
                    rejection_sampling=config,
                    importance_sampling_level="token",
                )
                their_loss.backward()
                kept = stat["behave_mask"]
                theirs = (float(their_loss.detach()), log_prob.grad, {"w": stat["behave_imp_weight"].double()})
                diff = compare(ours, theirs, [], mask)
                diff["metric M2-mask tokens differing"] = float((m2_ours != m2_theirs).sum())
                diff["metric kept tokens differing"] = float((keep.bool() != kept).sum())
                relative = (w / theirs[2]["w"] - 1.0)[kept].abs().max()
                diff["metric behaviour weight, relative (theirs float32)"] = float(relative)
                with_theirs = _m2po_loss(old, new, adv, mask, theirs[2]["w"], keep, scale)  # ours, their weights
                diff["metric loss with their float32 weights"] = abs(with_theirs[0] - theirs[0])
                diff["metric grad with their float32 weights"] = float((with_theirs[1] - theirs[1]).abs().max())
                for k, v in diff.items():
                    worst[k] = max(worst[k], v)
                exercised["M2"] += int((mask & ~m2_theirs).sum())
                exercised["ratio"] += int((m2_theirs & ~kept).sum())
            if not exercised["M2"] or (tau > 0.04 and not exercised["ratio"]):
                raise SystemExit(f"M2PO tau {tau}: a mask is not exercised ({dict(exercised)})")
            where = "pi_theta = pi_old (the recipe's one update per batch)" if at_old else "pi_theta != pi_old"
            masked = f"{exercised['M2']} M2-masked, {exercised['ratio']} ratio-masked tokens over the seeds"
            rows.append(
                {
                    "peer": "areal",
                    "objective": "M2PO (decoupled_m2po)",
                    "peer_name": "grpo_loss_fn's M2 mask + ppo_actor_loss_fn, gsm8k_m2po.yaml",
                    "agg": "token-mean",
                    "is_weights": True,
                    "note": f"{note}; {where}; {masked}; ours x N/N_M2",
                    **worst,
                }
            )
    return rows


# ---- report ------------------------------------------------------------------------------------------------------
def report(rows: list[dict], versions: dict) -> str:
    lines = [f"peers: {', '.join(f'{k} {v}' for k, v in versions.items())}; float64, {SEEDS} seeds per row", ""]
    head = "| objective | peer | peer's setting | loss agg | IS w | max abs dloss (scale) | max abs dgrad | metrics |"
    lines += [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        metrics = ", ".join(f"{k.split(' ', 1)[1]} {v:.1e}" for k, v in r.items() if k.startswith("metric ")) or "-"
        if "control: another seed for verl" in r:
            metrics += f"; control, verl drawing with another seed: dloss {r['control: another seed for verl']:.1e}"
        lines.append(
            f"| {r['objective']} | {r['peer']} | {r['peer_name']}{' (' + r['note'] + ')' if r['note'] else ''} | "
            f"{r['agg']} | {'yes' if r['is_weights'] else 'no'} | {r['loss']:.1e} ({r['scale']:.2g}) | "
            f"{r['grad']:.1e} | {metrics} |"
        )
    padding = max(r["grad_padding"] for r in rows)
    lines += ["", f"largest gradient at a padding position, either side: {padding:.1e}"]
    return "\n".join(lines)


def worker(peer: str) -> dict:
    sys.path.insert(0, ROOT)  # rc_core from this repository
    import torch

    torch.set_num_threads(1)
    if peer == "verl":
        import verl

        rows, version = verl_worker(), verl.__version__
    elif peer == "areal":
        from importlib.metadata import version as installed

        rows, version = areal_worker(), installed("areal")
    else:
        import trl

        rows, version = trl_worker(), trl.__version__
    return {"rows": rows, "versions": {peer: version, "torch": torch.__version__}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", default=",".join(PEERS), help="comma-separated: verl, trl, areal")
    p.add_argument("--json", default=None, help="also write the raw numbers here")
    p.add_argument("--worker", choices=PEERS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        result = worker(args.worker)
        with open(args.out, "w") as f:
            json.dump(result, f)
        return 0
    peers = [x.strip() for x in args.peers.split(",") if x.strip()]
    bad = [x for x in peers if x not in PEERS]
    if bad:
        p.error(f"--peers: unknown {bad}; choose from {', '.join(PEERS)}")
    rows, versions = [], {}
    os.makedirs(BENCH, exist_ok=True)
    for peer in peers:
        result = run_worker(peer, peer_python(peer), os.path.join(BENCH, f"parity-{peer}.json"))
        rows += result["rows"]
        versions.update(result["versions"])
    print(report(rows, versions))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "versions": versions}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
