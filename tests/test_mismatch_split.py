"""The mismatch split into numerics and staleness (issue 50 item 1, docs/corrections.md §6.9): the metrics by hand, the
weights kept by version, each row scored at the weights that sampled it, --prox-logp sampling (slime's
--keep-old-actor) and its bad input. The end-to-end run, its identity and its exact resume: tests/test_train.py
(STALE_RUN carries --mismatch-split)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import rc_config
import rc_core
import rc_forward
import rc_rollout
import rc_train
from benchmarks import bench_gpu_step as bench


# ---- the metrics -------------------------------------------------------------------------------------------------
def test_split_metrics_by_hand_and_the_identity():
    mu = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 5.0, 5.0]], dtype=torch.float64)  # padding: garbage
    v = torch.tensor([[-1.1, -1.9, 0.0], [-0.5, 0.0, 0.0]], dtype=torch.float64)
    t = torch.tensor([[-1.4, -1.5, 7.0], [-0.2, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    got = rc_core.mismatch_split_metrics(t, v, mu, mask)
    num, stale = [-0.1, 0.1, 0.0], [-0.3, 0.4, 0.3]  # log pi_v - log mu, log pi_t - log pi_v on the 3 valid tokens
    k3 = lambda x: math.exp(x) - x - 1  # noqa: E731
    assert got["rollout_corr/numerics_log_ratio"] == pytest.approx(sum(num) / 3, abs=1e-15)
    assert got["rollout_corr/staleness_log_ratio"] == pytest.approx(sum(stale) / 3)
    assert got["rollout_corr/numerics_k3_kl"] == pytest.approx(sum(map(k3, num)) / 3)
    assert got["rollout_corr/staleness_k3_kl"] == pytest.approx(sum(map(k3, stale)) / 3)
    rho_v = [math.exp(x) for x in num]
    rho_t = [math.exp(a + b) for a, b in zip(num, stale)]
    assert got["rollout_corr/numerics_tv"] == pytest.approx(sum(abs(r - 1) for r in rho_v) / 6)
    assert got["rollout_corr/staleness_tv"] == pytest.approx(sum(abs(a - b) for a, b in zip(rho_t, rho_v)) / 6)
    # the identity with today's totals, from the correction entry point on pi_old = pi_t
    totals = rc_core.compute_rollout_correction_and_rejection_mask(t, mu, mask, rc_core.RolloutCorrectionConfig())[2]
    parts = got["rollout_corr/numerics_log_ratio"] + got["rollout_corr/staleness_log_ratio"]
    assert parts == pytest.approx(-totals["rollout_corr/kl"], abs=1e-15)
    assert totals["rollout_corr/tv_mismatch"] <= got["rollout_corr/numerics_tv"] + got["rollout_corr/staleness_tv"]


def test_the_parts_vanish_where_they_should():
    g = torch.Generator().manual_seed(0)
    mu, v = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    mask = torch.ones(4, 6)
    same_weights = rc_core.mismatch_split_metrics(v, v, mu, mask)  # every row sampled by the current version
    assert same_weights["rollout_corr/staleness_tv"] == 0 and same_weights["rollout_corr/staleness_log_ratio"] == 0
    exact_engine = rc_core.mismatch_split_metrics(v, mu, mu, mask)  # the engine computes what the trainer does
    assert exact_engine["rollout_corr/numerics_tv"] == 0 and exact_engine["rollout_corr/numerics_k3_kl"] == 0


# ---- the kept versions -------------------------------------------------------------------------------------------
def _tiny():
    plan = bench.parse_plan(["--tiny", "--config", "configs/gsm8k_qwen0.5b_token_tis.yaml"])
    return plan, bench.setup(plan)


def test_kept_versions_keep_the_bound_copy_a_tied_head_once_and_restore_bit_for_bit():
    _, b = _tiny()
    model = b.learner.accelerator.unwrap_model(b.learner.model)
    kept = rc_rollout.KeptVersions(depth=1)
    before = {k: t.clone() for k, t in model.state_dict().items()}
    kept.keep(0, model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    kept.keep(1, model)
    kept.keep(2, model)
    assert sorted(kept.weights) == [1, 2]  # version 0 is more than depth 1 behind 2
    per_copy = rc_rollout.KeptVersions.copy_bytes(model) / 2**30
    assert kept.metrics()["perf/kept_versions_gib"] == pytest.approx(2 * per_copy)
    if model.config.tie_word_embeddings:  # one storage for the embedding and the head
        w = kept.weights[2]
        assert w["lm_head.weight"].data_ptr() == w["model.embed_tokens.weight"].data_ptr()
    current = {k: t.clone() for k, t in model.state_dict().items()}
    kept.keep(0, model)  # (re-keep an old version's slot with other weights: the restore must use the current one)
    kept.weights[0] = {k: t.clone() for k, t in before.items()}
    with kept.loaded(model, 0, current=2):
        assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)
    assert all(torch.equal(model.state_dict()[k], current[k]) for k in current)
    with pytest.raises(RuntimeError, match="version 5 is not kept"):
        with kept.loaded(model, 5, current=2):
            pass


def test_each_row_is_scored_at_the_weights_that_sampled_it():
    """Rows of version t - 1 at the kept weights of t - 1, rows of version t at the current ones: equal to a pass of a
    model holding each, and the current weights untouched afterwards."""
    plan, b = _tiny()
    args = dataclasses.replace(rc_train.load_yaml_defaults(plan.config_path), **bench.TINY_ARGS)
    model = b.learner.accelerator.unwrap_model(b.learner.model)
    step, n = 3, len(b.batch["group"])
    b.batch["version"] = torch.tensor([step - 1 if i % 2 else step for i in range(n)])
    kept = rc_rollout.KeptVersions(depth=1)
    old = rc_forward.no_grad_pass(model, b.batch, args)[0]
    kept.keep(step - 1, model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.05)
    new = rc_forward.no_grad_pass(model, b.batch, args)[0]
    kept.keep(step, model)
    current = {k: t.clone() for k, t in model.state_dict().items()}
    got, _ = kept.log_probs(args, model, b.batch, step)
    odd, valid = torch.arange(n) % 2 == 1, b.batch["response_mask"] > 0  # (padding: whatever each pass left)
    assert torch.allclose(got[odd][valid[odd]], old[odd][valid[odd]], atol=1e-5)
    assert torch.allclose(got[~odd][valid[~odd]], new[~odd][valid[~odd]], atol=1e-5)
    assert not torch.allclose(old[valid], new[valid], atol=1e-3)
    assert all(torch.equal(model.state_dict()[k], current[k]) for k in current)
    tensors = {"sampling_log_prob": got, "response_mask": b.batch["response_mask"]}
    tensors["rollout_log_prob"] = b.batch["rollout_log_prob"]
    split, _ = kept.mismatch_split(dataclasses.replace(args, prox_logp="sampling"), model, b.batch, tensors, step)
    by_hand = rc_core.mismatch_split_metrics(new, got, b.batch["rollout_log_prob"], b.batch["response_mask"])
    assert split == pytest.approx(by_hand, abs=1e-6)


# ---- bad input ---------------------------------------------------------------------------------------------------
def _hf_config():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip


def test_the_budget_must_hold_the_bound():
    args = dataclasses.replace(rc_train.Args(), max_staleness=3, mismatch_split=True)
    assert rc_rollout.KeptVersions.check_budget(dataclasses.replace(args, mismatch_split=False), _hf_config()) is None
    assert rc_rollout.KeptVersions.check_budget(args, _hf_config()) == 3
    with pytest.raises(ValueError, match=r"--kept-versions-gib 1e-06 cannot hold the 4 versions") as e:
        rc_rollout.KeptVersions.check_budget(dataclasses.replace(args, kept_versions_gib=1e-6), _hf_config())
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="--sync-every 0"):
        rc_rollout.KeptVersions.check_budget(dataclasses.replace(args, sync_every=0, max_staleness=0), _hf_config())


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"prox_logp": "sampling", "max_staleness": 0}, "every sample is current (the sampling weights"),
        ({"prox_logp": "sampling", "rc": "bypass_ppo_clip"}, "is bypass"),
        ({"mismatch_split": True, "fsdp": True}, "--mismatch-split with --fsdp"),
        ({"prox_logp": "sampling", "routing_replay": "r3"}, "--prox-logp sampling with --routing-replay r3"),
    ],
)
def test_refused_in_one_line(changes, named):
    preset = changes.pop("rc", "decoupled_token_is")
    args = dataclasses.replace(rc_train.Args(), **{"max_staleness": 1, **changes})
    args.rc = dataclasses.replace(args.rc, preset=preset)
    with pytest.raises(ValueError, match=named.replace("(", r"\(")) as e:
        rc_config.check_prox_logp(args, rc_config.build_correction_config(args.rc))
    assert "\n" not in str(e.value)


def test_prox_logp_sampling_trains_on_pi_v_as_pi_old(monkeypatch):
    """--prox-logp sampling: decoupled_correction takes the rows' pi_v as pi_old (no pass of its own), its IS weights
    are pi_v / mu, and every micro-batch's loss sees that pi_old, not an interpolation."""
    plan, b = _tiny()
    args = dataclasses.replace(rc_train.load_yaml_defaults(plan.config_path), **bench.TINY_ARGS, prox_logp="sampling")
    args = dataclasses.replace(args, ppo_epochs=1, num_minibatches=2, max_staleness=1)
    model = b.learner.accelerator.unwrap_model(b.learner.model)
    step = 2
    b.batch["version"] = torch.full((len(b.batch["group"]),), step - 1)
    pi_v = b.batch["rollout_log_prob"] + 0.01 * torch.randn(b.batch["rollout_log_prob"].shape)
    tensors = {k: b.batch[k] for k in ("response_mask", "advantages", "rollout_log_prob")}
    tensors["sampling_log_prob"] = pi_v
    metrics, size = rc_train.decoupled_correction(args, plan.correction, model, b.batch, tensors)
    assert tensors["old_log_prob"] is pi_v and not size  # no pass
    seen = []
    real = rc_core.compute_policy_loss_vanilla

    def record(**kw):
        seen.append(kw["old_log_prob"].detach().clone())
        return real(**kw)

    monkeypatch.setattr(rc_core, "compute_policy_loss_vanilla", record)
    learner = rc_train.Learner(**vars(b.learner))
    generator = torch.Generator().manual_seed(0)
    rc_train.update_policy(
        args, plan.correction, learner, b.batch, tensors, generator=generator, batch_correction=metrics, step=step
    )
    assert seen and sum(len(x) for x in seen) == len(pi_v)
    assert all(any(torch.equal(row, ref) for ref in pi_v) for x in seen for row in x)
