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

import numpy as np
import torch

SUPPORTED = ("qwen3_moe",)
"""model_type values whose router this module hooks (transformers' Qwen3MoeTopKRouter) and whose weight push is
verified on vLLM's CPU build (docs/moe.md)."""
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")  # config fields of MoEs
LAYER = "_rc_moe_layer"  # the attribute install() sets on each hooked router: its MoE layer index


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
def batch_routing(prompt_ids: list, responses: list, P: int, T: int) -> torch.Tensor | None:
    """The engine's routing of a batch laid out as rc_train.make_batch lays out its tokens (prompts left-padded to P
    columns, responses right-padded to T): int16 (B, P + T, layers, k), -1 where nothing was recorded (padding, the
    last token). None when the responses carry no routing (dense model, capture off)."""
    routed = [getattr(r, "routed_experts", None) for r in responses]
    if all(r is None for r in routed):
        return None
    if any(r is None for r in routed):
        raise ValueError("some responses of the batch carry their routing and others do not")
    layers, k = routed[0].shape[1:]
    out = torch.full((len(responses), P + T, layers, k), -1, dtype=torch.int16)
    for i, (p, r) in enumerate(zip(prompt_ids, routed)):
        out[i, P - len(p) : P - len(p) + len(r)] = torch.from_numpy(np.ascontiguousarray(r))
    return out


@contextlib.contextmanager
def forward_routing(net, batch: dict, rows: torch.Tensor, input_ids: torch.Tensor, T: int):
    """Around the forward of a trimmed micro-batch (rc_train.forward_log_probs: `rows` of the batch, `input_ids` its
    last T response columns and the prompt columns before them): replay batch['replay_routing'] there and record the
    routers' own choice into batch['record_routing'] (its padding left at -1), when the batch holds them."""
    replay, record = batch.get("replay_routing"), batch.get("record_routing")
    if replay is None and record is None:
        yield
        return
    P = batch["input_ids"].shape[1] - batch["response_mask"].shape[1]
    cols = slice(P - (input_ids.shape[1] - T), P + T)
    with routing(net, None if replay is None else replay[rows][:, cols], record is not None) as plan:
        yield
    if record is not None:
        recorded = plan.recorded.view(*input_ids.shape, *plan.recorded.shape[1:]).to("cpu", record.dtype)
        recorded[batch["attention_mask"][rows][:, cols] == 0] = -1
        view = record[:, cols]  # a view: the rows are written into the batch's buffer
        view[rows] = recorded


def record_buffer(net, batch: dict) -> torch.Tensor:
    """An int16 (B, P + T, layers, k) buffer of -1 for batch['record_routing']: the batch's shape, the hooked
    routers' count and top-k."""
    routers = [m for m in net.modules() if hasattr(m, LAYER)]
    return torch.full((*batch["input_ids"].shape, len(routers), routers[0].top_k), -1, dtype=torch.int16)


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
