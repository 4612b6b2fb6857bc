"""The policy's forward passes over a padded batch, made fast without changing their numbers.

What belongs here lays out the trainer's padded batch (make_batch: prompts left-padded, responses right-padded, the
engine's routing and each token's version in the same columns), turns a micro-batch of it into the logits and
log-probs that predict its response tokens, and makes that cheap: micro-batches sorted by length and cut to a token
budget, each trimmed to its own longest prompt and response, each distinct prompt forwarded once
(--share-prompt-prefix), compiled decoder layers (--compile), and the chunked log-prob and entropy kernels. None of it
changes a number beyond float rounding: the plain definition is log_softmax(logits / temperature) of one forward over
the untrimmed rows, and tests/test_forward.py proves sequence_log_probs and no_grad_pass equal to it.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

import rc_run


@dataclass
class ForwardArgs:
    """How the trainer's forward passes run (rc_train.Args inherits these flags; none changes what a step computes)."""

    max_tokens_per_micro_batch: int | None = None
    """also cap a micro-batch at this many padded tokens (verl's dynamic batch size); None = by count only"""
    share_prompt_prefix: bool = True
    """forward each distinct prompt of a micro-batch once, its responses on its KV cache (shares_prefix)"""
    gradient_checkpointing: bool = False
    """trade compute for memory in the trainer's forward"""
    compile: bool = False
    """torch.compile every decoder layer (compile_layers; docs/gpus.md "Compiled layers"); not with --fsdp or MoE"""
    fsdp: bool = False
    """shard parameters, gradients and optimizer state over the ranks with FSDP2 (fully_shard; docs/gpus.md)"""


def make_batch(prompt_ids, responses, pad_id, group_ids=None):
    """Left-pad prompts and right-pad responses so that every response starts at column P."""
    P = max(len(p) for p in prompt_ids)
    T = max(1, max(len(r[0]) for r in responses))
    B = len(responses)
    input_ids = torch.full((B, P + T), pad_id, dtype=torch.long)
    attention = torch.zeros((B, P + T), dtype=torch.long)
    rollout_lp = torch.zeros((B, T), dtype=torch.float32)
    mask = torch.zeros((B, T), dtype=torch.float32)
    for i, (p, (ids, lps, *_)) in enumerate(zip(prompt_ids, responses)):
        input_ids[i, P - len(p) : P] = torch.tensor(p)
        attention[i, P - len(p) : P] = 1
        if ids:
            input_ids[i, P : P + len(ids)] = torch.tensor(ids)
            attention[i, P : P + len(ids)] = 1
            rollout_lp[i, : len(ids)] = torch.tensor(lps, dtype=torch.float32)
            mask[i, : len(ids)] = 1.0
    batch = dict(
        input_ids=input_ids,
        attention_mask=attention,
        rollout_log_prob=rollout_lp,
        response_mask=mask,
        prompt_len=attention[:, :P].sum(-1),
        response_len=attention[:, P:].sum(-1),
        group=torch.tensor(range(B) if group_ids is None else group_ids, dtype=torch.long),
    )
    routing = batch_routing(prompt_ids, responses, P, T)  # an MoE's engine routing; None for a dense model
    if routing is not None:
        batch["rollout_routing"] = routing
    if any(getattr(r, "versions", None) for r in responses):  # --partial-rollout: each token's version
        batch["token_version"] = torch.zeros((B, T), dtype=torch.long)
        for i, r in enumerate(responses):
            batch["token_version"][i, : len(r.versions)] = torch.tensor(r.versions, dtype=torch.long)
    return batch


def batch_routing(prompt_ids: list, responses: list, P: int, T: int) -> torch.Tensor | None:
    """The engine's routing of a batch laid out as make_batch lays out its tokens (prompts left-padded to P
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


def shares_prefix(args) -> bool:
    """Whether a micro-batch's distinct prompts are forwarded once (--share-prompt-prefix), and when not."""
    return args.share_prompt_prefix and not (
        args.gradient_checkpointing  # no KV cache under checkpointing
        or args.fsdp  # one or two forwards by length: the ranks' sharded forwards (collectives) could differ
        or args.routing_replay != "none"  # each sample's prompt carries its own routing: one shared pass cannot
        or args.routing_metrics  # replay or record it
    )


def compile_layers(model, backend: str = "inductor"):
    """--compile: torch.compile each transformer block's forward in place (PyTorch's regional compilation): all blocks
    share the compiled graphs, module and parameter names stay (weight sync, checkpoints), shapes are dynamic
    (micro-batches differ in rows and length). Embeddings, final norm, lm_head and the log-prob kernels stay eager.

    The shared-prompt pass (shared_prefix_logits) hands every layer the model's KV cache, which the layer indexes by
    its own layer_idx: an integer a compiled graph holds as a constant, so each layer would compile its own. Hence the
    forward alone is compiled, and a pre-hook, eager, hands each layer its own layer of a DynamicCache instead (a
    DynamicLayer, whose update takes no index). The blocks then run the same few graphs whatever the depth, one for
    each combination of: prompt or response pass, masked or causal, one row or more, one query or more, with
    gradients or not; each compiled once (tests/test_forward.py). They can outnumber Dynamo's default limit of 8
    graphs per function (past it, a call runs eager): raised to 32."""
    import inspect

    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    takes = inspect.signature(DynamicLayer.update).parameters.values()  # the attention passes its layer_idx on
    if not any(p.kind is p.VAR_POSITIONAL for p in takes):
        raise RuntimeError("--compile: this transformers' DynamicLayer.update takes no layer index (compile_layers)")
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)

    def own_cache_layer(block, args, kwargs):
        cache = kwargs.get("past_key_values")
        if isinstance(cache, DynamicCache):
            kwargs["past_key_values"] = cache.layers[block.self_attn.layer_idx]
        return args, kwargs

    for block in rc_run.transformer_blocks(model, "--compile"):
        block.forward = torch.compile(block.forward, dynamic=True, backend=backend)
        block.register_forward_pre_hook(own_cache_layer, with_kwargs=True)
    return model


# ---------------------------------------------------------------------------------------------
# Micro-batches: sorted by length, cut by count and token budget, trimmed
# ---------------------------------------------------------------------------------------------
def micro_batches(rows: torch.Tensor, batch: dict, args, host: rc_run.HostGroup | None = None) -> list[torch.Tensor]:
    """The trainer's cut of one minibatch's rows (cut_micro_batches with the run's settings). Under DDP with a token
    budget every rank splits its cut up to the largest count over the ranks (split_to_count): each micro-batch's
    forward and backward are collectives, and the budget cuts each rank's rows by their own lengths."""
    size, budget = args.micro_batch_size, args.max_tokens_per_micro_batch
    groups = cut_micro_batches(rows, batch, size, budget, shares_prefix(args))
    if host is not None and host.world > 1 and budget:
        groups = split_to_count(groups, batch, int(host.extreme([len(groups)], "max")[0]))
    return groups


def cut_micro_batches(
    rows: torch.Tensor, batch: dict, size: int, max_tokens: int | None, by_group: bool = False
) -> list[torch.Tensor]:
    """`rows` sorted by length (by prompt group, then length, with `by_group`) and cut into micro-batches of at most
    `size` rows and, with `max_tokens`, at most that many padded tokens (a longer row goes alone). The loss has
    global denominators, so the grouping does not change it (tests/test_forward.py)."""
    p, t = batch["prompt_len"][rows], batch["response_len"][rows]
    key = batch["group"][rows] * (int(t.max()) + 1) + t if by_group else p + t  # few distinct prompts per cut
    order = torch.argsort(key, stable=True)
    rows, p, t = rows[order], p[order], t[order]
    groups, start = [], 0
    while start < len(rows):
        end = min(start + size, len(rows))
        if max_tokens:  # the longest run whose padded size, n x (longest prompt + longest response), fits
            n = torch.arange(1, end - start + 1)
            padded = n * (torch.cummax(p[start:end], 0).values + torch.cummax(t[start:end], 0).values)
            end = start + max(1, int((padded <= max_tokens).sum()))
        groups.append(rows[start:end])
        start = end
    return groups


def split_to_count(groups: list[torch.Tensor], batch: dict, count: int) -> list[torch.Tensor]:
    """`groups` split until there are `count`, each time the one with the most padded tokens into the halves of its
    sorted rows. Split rather than padded with empty micro-batches: padding costs a forward and backward for nothing
    (and 0 x a non-finite log-prob is NaN); regrouping changes the gradient by float rounding only."""
    groups = list(groups)
    while len(groups) < count:
        padded = [len(g) * int(batch["prompt_len"][g].max() + batch["response_len"][g].max()) for g in groups]
        i = max((i for i in range(len(groups)) if len(groups[i]) > 1), key=padded.__getitem__, default=None)
        if i is None:  # every rank holds as many rows (validate_args), so the largest count is within reach
            raise RuntimeError(f"cannot split {len(groups)} micro-batches of one row each into {count}")
        half = (len(groups[i]) + 1) // 2
        groups[i : i + 1] = [groups[i][:half], groups[i][half:]]
    return groups


def response_width(batch: dict) -> int:
    """T, the batch's response columns (make_batch left-pads every prompt to the longest, P columns)."""
    return batch["input_ids"].shape[1] - int(batch["prompt_len"].max())


def trimmed_inputs(batch: dict, rows: torch.Tensor):
    """input_ids and attention_mask of `rows`, cut to their own longest prompt and response; and that response width."""
    P = batch["input_ids"].shape[1] - response_width(batch)
    p, t = int(batch["prompt_len"][rows].max()), max(1, int(batch["response_len"][rows].max()))
    cols = slice(P - p, P + t)
    return batch["input_ids"][rows][:, cols], batch["attention_mask"][rows][:, cols], t


class Micro(NamedTuple):
    """One micro-batch as its forward sees it: `rows` of the batch trimmed (trimmed_inputs), on the model's device."""

    rows: torch.Tensor
    input_ids: torch.Tensor  # (rows, p + T)
    attention_mask: torch.Tensor
    T: int  # response columns kept
    width: int  # the batch's response columns: the log-probs are padded back to it
    group: torch.Tensor | None  # each row's prompt group when its prompt is forwarded once (shares_prefix)
    size: Counter  # positions computed and real tokens among them (perf/*; a shared prompt counts once)

    def pad(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """A (rows, T) tensor padded with zeros to the batch's width."""
        return None if x is None else torch.nn.functional.pad(x, (0, self.width - self.T))


def micro_inputs(batch: dict, rows: torch.Tensor, share: bool, device) -> Micro:
    """The Micro of `rows`: trimmed, with the prompt groups when `share`, and the pass's size."""
    input_ids, attention, t = trimmed_inputs(batch, rows)
    group = batch["group"][rows] if share else None
    p, once = input_ids.shape[1] - t, slice(None)
    if group is not None:
        once = torch.as_tensor(np.unique(group.numpy(), return_index=True)[1])
    size = Counter(
        positions=len(attention[once]) * p + input_ids.shape[0] * t,
        tokens=int(attention[once, :p].sum() + attention[:, p:].sum()),
    )
    width = response_width(batch)
    group = None if group is None else group.to(device)
    return Micro(rows, input_ids.to(device), attention.to(device), t, width, group, size)


# ---------------------------------------------------------------------------------------------
# Logits: one forward, or each distinct prompt once and the responses on its KV cache
# ---------------------------------------------------------------------------------------------
def response_logits(model, micro: Micro, dtype: str) -> torch.Tensor:
    """(rows, T, vocab) logits whose position t predicts response token t, under autocast to `dtype`."""
    input_ids, attention_mask, T = micro.input_ids, micro.attention_mask, micro.T
    autocast = torch.autocast(input_ids.device.type, dtype=getattr(torch, dtype), enabled=dtype != "float32")
    with autocast:
        if micro.group is not None:
            return shared_prefix_logits(model, input_ids, attention_mask, T, micro.group)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            logits_to_keep=T + 1,
            use_cache=False,
        )
        return out.logits[:, :-1]


def shared_prefix_logits(model, input_ids, attention_mask, T: int, group: torch.Tensor) -> torch.Tensor:
    """The logits that predict the last T tokens, each distinct prompt forwarded once: pass 1 runs the distinct
    prompts and keeps their KV cache, each row indexes its prompt's (so its gradients add up there), pass 2 runs the
    responses on it. Same positions and masks as one pass over [prompt | response] (tests/test_forward.py).
    Compiled layers (--compile) each take their own layer of the cache (compile_layers)."""
    P = input_ids.shape[1] - T
    distinct, row_prompt = torch.unique(group, return_inverse=True)
    first = torch.empty(len(distinct), dtype=torch.long, device=group.device)
    first[row_prompt] = torch.arange(len(group), device=group.device)  # any row of each prompt: they are identical
    prompt_mask = attention_mask[first, :P]
    # DDP must see one forward per backward: pass 1 calls the inner module when pass 2 follows
    out = (getattr(model, "module", model) if T > 1 else model)(
        input_ids=input_ids[first, :P],
        attention_mask=prompt_mask,
        logits_to_keep=1,
        use_cache=True,
        position_ids=(prompt_mask.cumsum(-1) - 1).clamp(min=0),
    )
    cache = out.past_key_values
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[row_prompt], layer.values[row_prompt]
    if T == 1:
        return out.logits[row_prompt]
    position_ids = prompt_mask.sum(-1)[row_prompt, None] + torch.arange(T - 1, device=input_ids.device)
    logits = model(
        input_ids=input_ids[:, P:-1],
        attention_mask=attention_mask[:, :-1],
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=True,
    ).logits
    return torch.cat([out.logits[row_prompt], logits], 1)


# ---------------------------------------------------------------------------------------------
# Kernels: per-token log-probability and entropy from logits, chunked over rows
# ---------------------------------------------------------------------------------------------


def sequence_log_probs(model, batch: dict, rows, args, with_grad: bool, with_entropy=False, routing=None):
    """log pi(y_t | y_<t) of `rows`' responses at the sampling temperature (docs/corrections.md §1), their entropy,
    and the pass's size. `routing` (rc_moe.StepRouting) replays or records an MoE's routing during the forward."""
    micro = micro_inputs(batch, rows, shares_prefix(args), next(model.parameters()).device)
    with torch.set_grad_enabled(with_grad), routing.forward(model, micro) if routing else contextlib.nullcontext():
        logits = response_logits(model, micro, args.train_dtype)  # logits[:, t] predicts y_t
        log_prob = log_probs_from_logits(logits, micro.input_ids[:, -micro.T :], args.temperature)
        entropy = entropy_from_logits(logits, args.temperature) if with_entropy else None  # no grad
    return micro.pad(log_prob), micro.pad(entropy), micro.size


def no_grad_pass(model, batch: dict, args, routing=None, rows=None) -> tuple[torch.Tensor, Counter]:
    """Log-probs of every row (or of `rows`, the others 0) without gradients (pi_old, the reference model), on the
    host."""
    out, size = torch.zeros(len(batch["group"]), response_width(batch)), Counter()
    for micro in micro_batches(torch.arange(out.shape[0]) if rows is None else rows, batch, args):
        log_prob, _, micro_size = sequence_log_probs(model, batch, micro, args, False, routing=routing)
        out[micro], size = log_prob.cpu(), size + micro_size
    return out, size


def log_probs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, chunk_size: int = 256
) -> torch.Tensor:
    """Per-token log-probability of ``labels`` under softmax(logits / temperature).

    log p(y) = x_y / tau - log sum_v exp(x_v / tau)   (gather minus logsumexp).

    ``logits`` (..., V) of any float dtype, ``labels`` (...) integer; returns (...) in fp32
    (fp64 for fp64 logits).  Rows are processed ``chunk_size`` at a time in fp32, so a
    151,936-vocabulary x 8k-token input never materialises a full-vocabulary log-softmax copy;
    the backward pass recomputes the softmax per chunk and writes the logits gradient directly.
    The temperature must be the sampling temperature so that the result describes the processed
    distribution that sampled the tokens (docs/corrections.md §1, "Policies").
    """
    if tuple(logits.shape[:-1]) != tuple(labels.shape):
        raise ValueError(
            f"logits shape {tuple(logits.shape)} does not match labels shape "
            f"{tuple(labels.shape)}: logits must be labels.shape + (vocab,)"
        )
    if isinstance(temperature, bool) or not temperature > 0:
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    if isinstance(chunk_size, bool) or int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    if logits.dim() > 2:
        try:
            flat = logits.view(-1, logits.shape[-1])
        except RuntimeError:  # a non-viewable slice (logits[:, :-1]): chunked in place, see _row_chunks
            flat = None
        if flat is not None:
            return log_probs_from_logits(flat, labels.reshape(-1), temperature, chunk_size).view(labels.shape)
    if logits.dim() == 1:
        return log_probs_from_logits(logits.unsqueeze(0), labels.reshape(1), temperature, chunk_size).reshape(())
    labels = labels.long()
    if logits.requires_grad and torch.is_grad_enabled():
        return _ChunkedTokenLogProb.apply(logits, labels, float(temperature), int(chunk_size))
    return _token_log_prob_chunks(logits, labels, float(temperature), int(chunk_size))


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0, chunk_size: int = 256) -> torch.Tensor:
    """Token entropy of softmax(logits / temperature), a diagnostic (no gradient):

    H = -sum_v q_v log q_v = log Z - (sum_v e^{x'_v} x'_v) / Z,   x' = x / tau - max_v x_v / tau,  Z = sum_v e^{x'_v}.

    ``logits`` (..., V), contiguous or a slice; returns (...) in fp32 (fp64 for fp64 logits). Chunked over rows
    like :func:`log_probs_from_logits`, so at the 151,936-token vocabulary no full-size fp32 copy of the logits
    exists: two temporaries of one chunk's size."""
    if isinstance(temperature, bool) or not temperature > 0:
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    work = torch.promote_types(logits.dtype, torch.float32)
    x = logits.detach()
    x = x.unsqueeze(0) if x.dim() == 1 else x
    out = torch.empty(x.shape[:-1], dtype=work, device=x.device)
    with torch.no_grad():
        for idx in _row_chunks(x.shape, int(chunk_size)):
            shifted = _scaled_chunk(x[idx], temperature, work)
            shifted.sub_(shifted.amax(dim=-1, keepdim=True))
            weights = shifted.exp()
            z = weights.sum(dim=-1)
            out[idx] = z.log() - weights.mul_(shifted).sum(dim=-1) / z
    return out.reshape(logits.shape[:-1])


def _row_chunks(shape: torch.Size, chunk_size: int):
    """Index tuples that cover the rows of a (..., rows, V) tensor ``chunk_size`` rows at a time. A 2-D tensor gives
    plain row slices; with more leading dims (a non-viewable slice such as logits[:, :-1]) each chunk stays inside
    one leading index, so no reshape (and no copy) is needed and the loop is over chunks, never over rows."""

    *outer, rows = shape[:-1]
    for lead in itertools.product(*map(range, outer)):
        for start in range(0, rows, chunk_size):
            yield (*lead, slice(start, start + chunk_size))


def _scaled_chunk(chunk: torch.Tensor, temperature: float, work: torch.dtype) -> torch.Tensor:
    """x / tau in the working dtype as a fresh tensor that may be modified in place."""
    x = chunk.to(work, copy=True)
    return x.div_(temperature) if temperature != 1.0 else x


def _chunk_log_normaliser(x: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dim, computed *in place* on ``x`` (x is overwritten by
    exp(x - max)), so a chunk costs one temporary of its own size."""
    top = x.amax(dim=-1, keepdim=True)
    return x.sub_(top).exp_().sum(dim=-1).log_().add_(top.squeeze(-1))


class _ChunkedTokenLogProb(torch.autograd.Function):
    """log p(label) = x_label / tau - logsumexp(x / tau), chunked over rows, with a backward
    that recomputes softmax per chunk, so neither pass holds a full-vocabulary copy."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, chunk_size):
        ctx.save_for_backward(logits, labels)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return _token_log_prob_chunks(logits, labels, temperature, chunk_size)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        logits, labels = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        tau, step = ctx.temperature, ctx.chunk_size
        work = torch.promote_types(logits.dtype, torch.float32)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for idx in _row_chunks(logits.shape, step):
            x = _scaled_chunk(logits[idx], tau, work)
            g = grad_out[idx].to(work).unsqueeze(-1)
            # d/dx [x_y - logsumexp(x)] = onehot(y) - softmax(x); chain rule through x / tau.
            top = x.amax(dim=-1, keepdim=True)
            probs = x.sub_(top).exp_()
            probs.div_(probs.sum(dim=-1, keepdim=True)).mul_(-g)
            probs.scatter_add_(-1, labels[idx].unsqueeze(-1), g)
            if tau != 1.0:
                probs.div_(tau)
            grad[idx] = probs
        return grad, None, None, None


def _token_log_prob_chunks(logits, labels, temperature, chunk_size):
    """Forward pass of :func:`log_probs_from_logits` on a (..., rows, V) tensor, chunk by chunk."""
    work = torch.promote_types(logits.dtype, torch.float32)
    out = torch.empty(labels.shape, dtype=work, device=logits.device)
    with torch.no_grad():
        for idx in _row_chunks(logits.shape, chunk_size):
            chunk = logits[idx]
            picked = chunk.gather(-1, labels[idx].unsqueeze(-1)).squeeze(-1).to(work) / temperature
            out[idx] = picked - _chunk_log_normaliser(_scaled_chunk(chunk, temperature, work))
    return out
