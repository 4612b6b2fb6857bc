"""MoE routing in the trainer: which models are Mixture-of-Experts, routing replay in the forward, routing metrics.

What belongs here touches the trainer's side of an MoE model's routing: which architectures are supported, the hook
on transformers' router that replays a recorded routing or records the trainer's own, the routing a batch carries
(the engine's, aligned with the batch's columns) and the trainer-engine agreement metrics. The engine's side (the
capture in vLLM, the expert prepack after a weight push) is in rc_rollout.py, which holds everything that talks to
vLLM. docs/moe.md has the semantics and the measurements.

Replay (the three-policy note, "MoE routing replay"; Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by
Aligning Training and Inference Routers", arXiv 2510.11370). With M(s) the recorded top-k experts of a position s,
the replayed forward routes s to M(s) with the gate weights

    omega^R3(z | s) = omega_theta(z | s) 1{z in M(s)} / sum_{z' in M(s)} omega_theta(z' | s)

where omega_theta is the trainer's current router softmax: the experts are forced, their weights stay a function of
the router's logits, so the router keeps its gradient. (Qwen3-MoE renormalises its top-k weights, norm_topk_prob, so
the renormalisation is the model's own; a model that does not renormalise keeps the gathered softmax.) A position
without a recording (the last token, padding, anything the engine did not compute) takes the trainer's own top-k.
r3 replays the engine's routing M_mu; reference replays pi_old's own routing, recorded in the pi_old pass.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from typing import Literal

import torch

import rc_config
import rc_core
import rc_forward
import rc_rollout


@dataclass
class MoEArgs:
    """Mixture-of-Experts settings (rc_train.Args inherits these flags; docs/moe.md)."""

    moe_router_scale: float = 0.02
    """--model tiny-moe: std of the router weights at initialisation (> 0; hashed into the cached model's name)"""
    routing_replay: Literal["none", "r3", "reference"] = "none"
    """replay a recorded routing in the policy passes: r3 the engine's (CPU engine), reference pi_old's (decoupled)"""
    routing_metrics: bool | None = None
    """capture the engine's routing and log the routing agreement and unreplayed mismatch; None = on for an MoE
    model on the CPU engine (not --compile)"""


SUPPORTED = ("qwen3_moe",)
"""model_type values whose router this module hooks (transformers' Qwen3MoeTopKRouter) and whose weight push is
verified on vLLM's CPU build (docs/moe.md)."""
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")  # config fields of MoEs
LAYER = "_rc_moe_layer"  # the attribute install() sets on each hooked router: its MoE layer index


def check_model(args, config, bypass_mode: bool, on_gpu: bool) -> None:
    """The settings that need the model's Hugging Face `config`, before the engine starts: replay or routing metrics
    need an MoE model, an MoE model needs a supported architecture (SUPPORTED) and the vLLM and transformers
    internals its weight push, capture and replay rely on, and no --compile on a GPU (not verified); reference replay
    needs decoupled mode. Resolves --routing-metrics None: on for an MoE model on the CPU engine, unless --compile."""
    kind, replay = moe_type(config), args.routing_replay
    model = f"--model {args.model} ({config.model_type})"
    if kind is None:
        rc_config.need(
            replay == "none", f"--routing-replay {replay} needs a Mixture-of-Experts model; {model} is dense"
        )
        rc_config.need(
            not args.routing_metrics, f"--routing-metrics needs a Mixture-of-Experts model; {model} is dense"
        )
        args.routing_metrics = False
        return
    rc_config.need(
        kind in SUPPORTED,
        f"{model}: the MoE architecture {kind!r} is not supported (weight push, capture and replay are written and "
        f"verified for {', '.join(SUPPORTED)}; docs/moe.md)",
    )
    rc_config.need(  # the model's config says MoE only here, so this check lives here rather than in validate_args
        not (args.compile and on_gpu),
        f"--compile with an MoE model ({model}) on a GPU: the compiled expert layers are neither built nor verified "
        f"there (docs/moe.md); drop --compile (--compile false in a YAML config)",
    )
    rc_config.need(
        replay != "reference" or not bypass_mode,
        "--routing-replay reference replays pi_old's routing, and bypass mode has no pi_old pass (pi_old is the "
        "rollout policy): use --routing-replay r3, or a decoupled preset",
    )
    try:
        check_transformers()
        if not on_gpu:
            rc_rollout.check_vllm_moe_internals()
    except RuntimeError as e:
        raise ValueError(f"{model}: {e}") from None
    if args.routing_metrics is None:  # not under --compile, whose traced layers cannot hold the router hooks
        args.routing_metrics = not on_gpu and not args.compile


def moe_type(config) -> str | None:
    """The model_type of a Hugging Face config when the model is a Mixture-of-Experts (a field counting its experts
    is > 0), else None (dense)."""
    text = getattr(config, "get_text_config", lambda: config)()
    return config.model_type if any((getattr(text, k, 0) or 0) > 0 for k in EXPERT_KEYS) else None


def check_transformers() -> None:
    """Raise RuntimeError unless transformers' Qwen3-MoE has what the hook relies on: a sparse block whose `gate`
    (Qwen3MoeTopKRouter, with top_k and norm_topk_prob) returns (router logits, top-k weights, top-k ids). Checked on
    a 2-expert router built here (before the model or the engine is loaded)."""
    import transformers
    from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen3

    config = transformers.Qwen3MoeConfig(hidden_size=8, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
    try:
        block = qwen3.Qwen3MoeSparseMoeBlock(config)
        router = block.gate
        out = router(torch.randn(3, 8))
        ok = (
            isinstance(router, qwen3.Qwen3MoeTopKRouter)
            and (router.top_k, router.norm_topk_prob) == (2, True)
            and len(out) == 3
            and [tuple(t.shape) for t in out] == [(3, 4), (3, 2), (3, 2)]
        )
    except (AttributeError, TypeError, ValueError) as e:
        ok, why = False, f" ({type(e).__name__}: {e})"
    else:
        why = ""
    if not ok:
        raise RuntimeError(
            f"transformers {transformers.__version__}: Qwen3MoeSparseMoeBlock.gate no longer returns (logits, top-k "
            f"weights, top-k ids) as in transformers 5.19{why}: the routing replay hook cannot work (docs/moe.md)"
        )


def install(model) -> int:
    """Hook the router of every sparse block of a Qwen3-MoE (transformers' Qwen3MoeTopKRouter): from then on the
    `routing` context can replay or record through it (outside the context it changes nothing). Returns the number of
    MoE layers. Raises ValueError for a model without them."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    blocks = [m for m in model.modules() if isinstance(m, Qwen3MoeSparseMoeBlock)]
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no Qwen3-MoE sparse block to replay the routing of")
    for index, block in enumerate(blocks):  # modules() walks the layers in order
        if not hasattr(block.gate, LAYER):
            block.gate.register_forward_hook(_router_hook)
        setattr(block.gate, LAYER, index)
        block.gate._rc_plan = None
    return len(blocks)


class Plan:
    """What the hooked routers do in one `routing` block: replay (rows, layers, k) expert ids (-1: the router's own
    choice) and/or record the routers' own choice into `recorded` (rows, layers, k)."""

    def __init__(self, replay: torch.Tensor | None, record: bool, layers: int):
        self.replay, self.record, self.layers = replay, record, layers
        self.recorded: torch.Tensor | None = None


@contextlib.contextmanager
def routing(net, replay: torch.Tensor | None = None, record: bool = False):
    """Within the block, the forward passes of `net` (a model after install(), or its DDP/FSDP wrapper) replay
    `replay` (batch, columns, layers, k: the input's shape, -1 = own choice) and, with `record`, record the routers'
    own top-k into plan.recorded (batch x columns, layers, k). A model without hooked routers (the reference model) is
    left alone. Yields the Plan."""
    routers = [m for m in net.modules() if hasattr(m, LAYER)]
    plan = Plan(None if replay is None else replay.reshape(-1, *replay.shape[-2:]).long(), record, len(routers))
    for r in routers:
        r._rc_plan = plan
    try:
        yield plan
    finally:
        for r in routers:
            r._rc_plan = None


def _router_hook(router, args, output):
    """Forward hook of a Qwen3MoeTopKRouter: output = (logits, top-k weights, top-k ids) of the block's rows."""
    plan = router._rc_plan
    if plan is None:
        return None
    logits, weights, ids = output
    layer = getattr(router, LAYER)
    if plan.record:
        if plan.recorded is None:
            plan.recorded = torch.full((len(ids), plan.layers, ids.shape[-1]), -1, dtype=torch.long, device=ids.device)
        plan.recorded[:, layer] = ids.detach()
    if plan.replay is None:
        return None
    if plan.replay.shape[0] != ids.shape[0]:
        raise RuntimeError(f"routing replay: {plan.replay.shape[0]} recorded rows for a forward of {ids.shape[0]}")
    forced = plan.replay[:, layer].to(ids.device)
    # Replay where a recording exists and names other experts than the router's own choice; elsewhere the router's own
    # output is kept as it is, so replaying the trainer's own routing is the unreplayed forward, bit for bit.
    differs = (forced.sort(-1).values != ids.sort(-1).values).any(-1)
    use = (forced >= 0).all(-1) & differs
    if not use.any():
        return None
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)  # omega_theta over all experts, as the router computes
    chosen = probs.gather(-1, forced.clamp(min=0))
    if router.norm_topk_prob:
        chosen = chosen / chosen.sum(-1, keepdim=True)
    use = use[:, None]
    return logits, torch.where(use, chosen.to(weights.dtype), weights), torch.where(use, forced, ids)


# ---------------------------------------------------------------------------------------------
# The routing a batch carries
# ---------------------------------------------------------------------------------------------
class StepRouting:
    """The MoE routing of one step's batch (B, P + T, layers, k), -1 where nothing is recorded: `rollout` the engine's
    (None with capture off), `replay` what the policy passes replay (None: their own), `record` a buffer the passes
    record their own routing into (None: no recording)."""

    def __init__(self, batch: dict):
        self.rollout = batch.get("rollout_routing")
        self.replay: torch.Tensor | None = None
        self.record: torch.Tensor | None = None
        self.attention_mask = batch["attention_mask"]
        self.P = int(batch["prompt_len"].max())  # every prompt left-padded to the longest (rc_forward.make_batch)

    @contextlib.contextmanager
    def forward(self, net, micro):
        """Around the forward of a trimmed micro-batch (rc_forward.Micro): replay self.replay on its columns and
        record the routers' own choice into self.record (its padding left at -1)."""
        if self.replay is None and self.record is None:
            yield
            return
        rows, shape = micro.rows, micro.input_ids.shape
        cols = slice(self.P - (shape[1] - micro.T), self.P + micro.T)
        with routing(net, None if self.replay is None else self.replay[rows][:, cols], self.record is not None) as plan:
            yield
        if self.record is not None:
            recorded = plan.recorded.view(*shape, *plan.recorded.shape[1:]).to("cpu", self.record.dtype)
            recorded[self.attention_mask[rows][:, cols] == 0] = -1
            view = self.record[:, cols]  # a view: the rows are written into the step's buffer
            view[rows] = recorded

    def buffer(self, net) -> torch.Tensor:
        """An int16 (B, P + T, layers, k) buffer of -1: the batch's shape, the hooked routers' count and top-k."""
        routers = [m for m in net.modules() if hasattr(m, LAYER)]
        return torch.full((*self.attention_mask.shape, len(routers), routers[0].top_k), -1, dtype=torch.int16)


def plan(args, bypass_mode: bool, model, batch: dict) -> StepRouting:
    """Which policy passes of the step replay or record a routing (docs/moe.md). r3: every pass replays the engine's
    routing, pi_old's and pi_theta's alike. The trainer's own routing (reference replay, the routing metrics) is
    recorded by decoupled mode's pi_old pass when it runs unreplayed; otherwise routing_pass runs a pass of its own."""
    step = StepRouting(batch)
    if args.routing_replay == "r3":
        step.replay = step.rollout
    elif not bypass_mode and (args.routing_replay == "reference" or args.routing_metrics):
        step.record = step.buffer(model)
    return step


def routing_pass(args, model, batch: dict, tensors: dict, step: StepRouting) -> tuple[dict, Counter]:
    """After the correction, the trainer's own routing of the batch: recorded by the pi_old pass (plan), or by one
    more unreplayed no-grad pass (rc_forward.no_grad_pass), whose log-probs also give the mismatch that replay
    hides from the loss (rollout_corr/unreplayed_*: replay rewrites the surrogate, it does not shrink the mismatch).
    reference: the update's pi_theta passes replay it from here on. Returns the routing metrics (none without the
    engine's routing) and the size of the extra pass. `model`: the unwrapped policy (no gradient, no collective)."""
    size, own, own_log_prob = Counter(), step.record, tensors.get("old_log_prob")
    step.record = None
    if own is None:  # r3 replayed pi_old, or bypass mode: the extra pass
        replay, step.replay, step.record = step.replay, None, step.buffer(model)
        model.eval()
        own_log_prob, size = rc_forward.no_grad_pass(model, batch, args, step)
        own, step.record, step.replay = step.record, None, replay
    if args.routing_replay == "reference":
        step.replay = own
    if step.rollout is None:
        return {}, size
    mask = tensors["response_mask"]
    ell = rc_core.safety_clip(own_log_prob - tensors["rollout_log_prob"])
    return {
        **routing_metrics(own, step.rollout, mask),
        "rollout_corr/unreplayed_k3_kl": float(rc_core.masked_mean(rc_core.k3_divergence(ell), mask)),
        "rollout_corr/unreplayed_tv_mismatch": float(rc_core.estimate_tv_distance(ell, None, mask)),
    }, size


# ---------------------------------------------------------------------------------------------
# Metrics (docs/metrics.md, rollout_corr/routing_*)
# ---------------------------------------------------------------------------------------------
def routing_metrics(trainer: torch.Tensor, engine: torch.Tensor, response_mask: torch.Tensor) -> dict:
    """Trainer-engine routing agreement of a batch, both (B, P + T, layers, k) with -1 where unrecorded, ids sorted.

    rollout_corr/routing_agreement: share of the (position, layer) pairs recorded by both, over the rows with a valid
    response, where the trainer's own top-k set equals the engine's; per layer rollout_corr/routing_agreement_layer<l>.
    rollout_corr/routing_flip_token_fraction: share of the valid response tokens whose own position (the one that
    predicts them: the token before) was routed differently in at least one layer."""
    trainer, engine = trainer.long().sort(-1).values, engine.long().sort(-1).values
    T = response_mask.shape[1]
    rows = (response_mask.sum(-1) > 0)[:, None, None]
    both = (trainer >= 0).all(-1) & (engine >= 0).all(-1) & rows  # (B, P + T, layers)
    agree = (trainer == engine).all(-1)
    per_layer = (agree & both).sum((0, 1)).double() / both.sum((0, 1)).clamp(min=1)
    flipped = (~agree & both).any(-1)[:, -T - 1 : -1]  # the position before each response token
    mask = response_mask > 0
    metrics = {
        "rollout_corr/routing_agreement": float((agree & both).sum()) / max(float(both.sum()), 1.0),
        "rollout_corr/routing_flip_token_fraction": float((flipped & mask).sum()) / max(float(mask.sum()), 1.0),
    }
    metrics.update({f"rollout_corr/routing_agreement_layer{i}": float(a) for i, a in enumerate(per_layer)})
    return metrics
