"""rc_forward's passes equal the plain definition of the policy's log-probs: one forward over the untrimmed,
left-padded rows, then log_softmax(logits / temperature) gathered at the response tokens.

What the trainer does to make that pass cheap -- micro-batches sorted by length and cut to a token budget
(cut_micro_batches, split_to_count), each trimmed to its own longest prompt and response (trimmed_inputs), each
distinct prompt forwarded once (shared_prefix_logits), compiled decoder layers (compile_layers), the chunked log-prob
and entropy kernels (log_probs_from_logits, entropy_from_logits) -- changes no number beyond float rounding: the
log-probs, entropies, loss and gradients here agree with the plain computation, in float64 on a tiny Qwen2
(tasks.make_qwen2; the compiled layers in float32). Runs on a CPU in seconds (the two compiled-layers tests: up to
a minute each), no engine.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections import Counter

import pytest
import torch

import rc_core
import rc_forward
import rc_train
import tasks
from tests.test_infra import _rank_batch

F64 = torch.float64


def approx(x, rel=1e-9, abs_=1e-12):
    return pytest.approx(x, rel=rel, abs=abs_)


def response_log_probs(model, input_ids, attention_mask, T: int, temperature: float = 1.0, group=None):
    """log pi of each row's last T tokens: rc_forward.response_logits (one plain forward; with `group`, each distinct
    prompt once) and the chunked kernel, without trimming or micro-batches of its own."""
    micro = rc_forward.Micro(None, input_ids, attention_mask, T, T, group, Counter())
    logits = rc_forward.response_logits(model, micro, "float32")
    return rc_forward.log_probs_from_logits(logits, input_ids[:, -T:], temperature)


# ---- the trainer's pass against the definition ----------------------------------------------------------------------
def test_the_trainers_log_probs_are_one_plain_forward_at_the_temperature():
    """rc_forward.sequence_log_probs as the trainer runs it over a whole batch -- micro-batches cut from the Args
    (rc_forward.micro_batches: by prompt group, at most 5 rows and 60 padded tokens), each trimmed, each distinct
    prompt forwarded once, the chunked kernels -- against the definition: one forward of the float64 model over the
    untrimmed batch, log_softmax(logits / 0.7) gathered at the response tokens, and the entropy of that softmax. Equal
    to float64 rounding, with gradients and without."""
    model = tasks.make_qwen2(vocab_size=50, eos=0, hidden=64, layers=2, intermediate=64, seed=0).double()
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(3, 12, (4,), generator=gen)
    prompts = [torch.randint(1, 50, (int(k),), generator=gen).tolist() for k in lengths]
    flat_prompts, responses, group_ids = [], [], []
    for g, prompt in enumerate(prompts):
        for length in torch.randint(1, 9, (3,), generator=gen):
            ids = torch.randint(1, 50, (int(length),), generator=gen).tolist()
            flat_prompts.append(prompt)
            responses.append((ids, [-1.0] * len(ids), ""))
            group_ids.append(g)
    batch = rc_forward.make_batch(flat_prompts, responses, 0, group_ids)
    temperature = 0.7
    args = dataclasses.replace(
        rc_train.Args(), temperature=temperature, micro_batch_size=5, max_tokens_per_micro_batch=60
    )
    (B, T), width = batch["response_mask"].shape, batch["input_ids"].shape[1]
    micro = rc_forward.micro_batches(torch.arange(B), batch, args)
    # the fast path is the one measured: several micro-batches, some trimmed, some forwarding a prompt once
    assert rc_forward.shares_prefix(args) and len(micro) > 1
    assert sorted(torch.cat(micro).tolist()) == list(range(B))
    assert any(rc_forward.trimmed_inputs(batch, rows)[0].shape[1] < width for rows in micro)
    assert any(len(set(batch["group"][rows].tolist())) < len(rows) for rows in micro)

    with torch.no_grad():  # the definition
        attention = batch["attention_mask"]
        position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=batch["input_ids"], attention_mask=attention, position_ids=position_ids).logits
        log_softmax = torch.log_softmax(logits[:, width - T - 1 : -1] / temperature, -1)  # position t predicts y_t
        want = log_softmax.gather(-1, batch["input_ids"][:, width - T :, None])[..., 0]
        want_entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    mask = batch["response_mask"] > 0  # beyond its response a row's log-probs are padding
    for with_grad in (False, True):
        got, entropy, positions = torch.zeros(B, T, dtype=F64), torch.zeros(B, T, dtype=F64), 0
        for rows in micro:
            log_prob, ent, size = rc_forward.sequence_log_probs(model, batch, rows, args, with_grad, with_entropy=True)
            assert log_prob.shape == ent.shape == (len(rows), T) and log_prob.requires_grad == with_grad
            got[rows], entropy[rows], positions = log_prob.detach(), ent, positions + size["positions"]
        torch.testing.assert_close(got[mask], want[mask], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(entropy[mask], want_entropy[mask], rtol=1e-10, atol=1e-12)
        assert positions < B * width  # trimmed, and a shared prompt computed once


# ---- micro-batches, trimming, the shared prompt, compiled layers ----------------------------------------------------
def test_length_batching_gives_the_same_loss_and_gradients():
    # One optimizer step over a minibatch of mixed lengths: (a) the whole batch width, micro-batches in row order
    # (the trainer before length batching); (b) sorted by length, cut by a token budget, each micro-batch trimmed.
    # The loss has global denominators, so (a) and (b) are the same sum: same loss, same gradients.
    torch.manual_seed(0)
    model = tasks.make_qwen2(vocab_size=50, eos=0, hidden=64, layers=2, intermediate=64, seed=0).double()
    gen = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(1, 50, (int(n),), generator=gen).tolist() for n in torch.randint(3, 12, (10,), generator=gen)
    ]
    responses = []
    for n in torch.randint(1, 9, (10,), generator=gen):
        ids = torch.randint(1, 50, (int(n),), generator=gen).tolist()
        responses.append((ids, (-torch.rand(int(n), generator=gen)).tolist(), ""))
    batch = rc_forward.make_batch(prompts, responses, pad_id=0)
    mask, rollout = batch["response_mask"].double(), batch["rollout_log_prob"].double()
    advantages = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    config = rc_core.RolloutCorrectionConfig.from_name("bypass_ppo_clip")
    counts = dict(global_token_count=float(mask.sum()), global_seq_count=10.0, loss_scale_factor=8.0)

    def one_step(groups, trim):
        model.zero_grad()
        total = 0.0
        for rows in groups:
            if trim:
                ids, att, t = rc_forward.trimmed_inputs(batch, rows)
            else:
                ids, att, t = batch["input_ids"][rows], batch["attention_mask"][rows], mask.shape[1]
            lp = response_log_probs(model, ids, att, t)
            lp = torch.nn.functional.pad(lp, (0, mask.shape[1] - t))
            loss, _ = rc_core.compute_policy_loss_bypass_mode(
                lp, rollout[rows], advantages[rows], mask[rows], config, **counts
            )
            loss.backward()
            total += float(loss.detach())
        return total, {n: p.grad.clone() for n, p in model.named_parameters()}

    rows = torch.arange(10)
    plain = one_step([rows[:4], rows[4:8], rows[8:]], trim=False)
    groups = rc_forward.cut_micro_batches(rows, batch, size=4, max_tokens=40)
    assert len(groups) > 3 and sorted(torch.cat(groups).tolist()) == list(range(10))  # every row once
    widths = [int(batch["prompt_len"][g].max() + batch["response_len"][g].max()) for g in groups]
    assert all(len(g) * w <= 40 or len(g) == 1 for g, w in zip(groups, widths))  # the budget holds
    trimmed = one_step(groups, trim=True)
    assert trimmed[0] == pytest.approx(plain[0], rel=1e-10, abs=1e-12)
    for name, grad in plain[1].items():
        torch.testing.assert_close(trimmed[1][name], grad, rtol=1e-9, atol=1e-12)


def test_shared_prompt_prefix_gives_the_same_loss_and_gradients():
    # GRPO's n responses of a prompt share it: --share-prompt-prefix forwards each distinct prompt of a micro-batch
    # once and runs the responses on its KV cache. Against one pass over every full row: same log-probs, loss and
    # gradients (float64), with micro-batches grouped by prompt, for the policy and for a no-grad pass.
    model = tasks.make_qwen2(vocab_size=50, eos=0, hidden=64, layers=2, intermediate=64, seed=0).double()
    gen = torch.Generator().manual_seed(2)
    n_prompts, n = 4, 3
    prompts = [
        torch.randint(1, 50, (int(k),), generator=gen).tolist()
        for k in torch.randint(3, 12, (n_prompts,), generator=gen)
    ]
    flat_prompts, responses, group_ids = [], [], []
    for g, prompt in enumerate(prompts):
        for length in torch.randint(1, 9, (n,), generator=gen):
            ids = torch.randint(1, 50, (int(length),), generator=gen).tolist()
            flat_prompts.append(prompt)
            responses.append((ids, (-torch.rand(int(length), generator=gen)).tolist(), ""))
            group_ids.append(g)
    batch = rc_forward.make_batch(flat_prompts, responses, 0, group_ids)
    mask, rollout = batch["response_mask"].double(), batch["rollout_log_prob"].double()
    advantages = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    config = rc_core.RolloutCorrectionConfig.from_name("bypass_ppo_clip")
    counts = dict(global_token_count=float(mask.sum()), global_seq_count=float(len(group_ids)), loss_scale_factor=8.0)

    def one_step(micro, shared):
        model.zero_grad()
        total, log_probs = 0.0, torch.zeros(mask.shape, dtype=torch.float64)
        for rows in micro:
            ids, att, t = rc_forward.trimmed_inputs(batch, rows)
            lp = response_log_probs(model, ids, att, t, group=batch["group"][rows] if shared else None)
            lp = torch.nn.functional.pad(lp, (0, mask.shape[1] - t))
            loss, _ = rc_core.compute_policy_loss_bypass_mode(
                lp, rollout[rows], advantages[rows], mask[rows], config, **counts
            )
            loss.backward()
            total += float(loss.detach())
            log_probs[rows] = lp.detach() * mask[rows]
        return total, log_probs, {name: p.grad.clone() for name, p in model.named_parameters()}

    rows = torch.arange(len(group_ids))
    plain = one_step([rows[:5], rows[5:]], shared=False)
    micro = rc_forward.cut_micro_batches(rows, batch, size=5, max_tokens=None, by_group=True)
    assert sorted(torch.cat(micro).tolist()) == rows.tolist()
    assert any(len(set(batch["group"][m].tolist())) < len(m) for m in micro)  # a prompt really is shared
    shared = one_step(micro, shared=True)
    torch.testing.assert_close(shared[1], plain[1], rtol=1e-10, atol=1e-12)
    assert shared[0] == pytest.approx(plain[0], rel=1e-10, abs=1e-12)
    # The forward is the same to float64 rounding. The gradients are the same sum in another order: a shared prompt
    # gets its responses' gradients added before (not after) the backward of the attention softmax, which
    # transformers computes in float32 even for a float64 model, so they agree to float32 rounding.
    for name, grad in plain[2].items():
        torch.testing.assert_close(shared[2][name], grad, rtol=1e-5, atol=1e-9)
    # one-token responses: the prompt pass alone gives every logit
    one = rc_forward.make_batch(flat_prompts[:3], [(r[0][:1], r[1][:1], "") for r in responses[:3]], 0, group_ids[:3])
    ids, att, t = rc_forward.trimmed_inputs(one, torch.arange(3))
    with torch.no_grad():
        a = response_log_probs(model, ids, att, t)
        b = response_log_probs(model, ids, att, t, group=one["group"])
    torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


def test_compiled_layers_give_the_same_log_probs_and_gradients():
    # --compile (rc_forward.compile_layers): every decoder layer torch.compiled in place. Against the eager model: the
    # same log-probs and gradients, padded and unpadded micro-batches, with and without gradients; the parameter
    # names unchanged (weight sync and checkpoints read them); one set of graphs for all the layers. Each row its own
    # prompt (the shared prompt: the next test). Inductor, as --compile runs it (its CPU code here; the next test and
    # tests/test_bench_gpu_step.py check aot_eager).
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    eager = tasks.make_qwen2(vocab_size=50, eos=0, hidden=64, layers=2, intermediate=64, seed=0)
    compiled = copy.deepcopy(eager)
    names = list(eager.state_dict())
    assert rc_forward.compile_layers(compiled) is compiled
    assert list(compiled.state_dict()) == names
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 50, (k,), generator=gen).tolist() for k in (5, 7, 9, 7)]
    responses = [torch.randint(1, 50, (k,), generator=gen).tolist() for k in (4, 6, 3, 6)]
    batch = rc_forward.make_batch(prompts, [(r, [-1.0] * len(r), "") for r in responses], 0, [0, 1, 2, 3])

    def run(model, rows, with_grad):
        model.zero_grad()
        ids, att, t = rc_forward.trimmed_inputs(batch, rows)
        with torch.set_grad_enabled(with_grad):
            lp = response_log_probs(model, ids, att, t)
        lp = lp * batch["response_mask"][rows, :t]
        if not with_grad:
            return lp, {}
        (lp.sum() * 0.1).backward()
        return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    graphs = counters["stats"]["unique_graphs"]
    for rows in (torch.tensor([0, 1, 2, 3]), torch.tensor([1, 3])):  # padded; rows 1 and 3 are not (7 + 6 tokens)
        for with_grad in (True, False):
            (lp, grads), (want_lp, want_grads) = run(compiled, rows, with_grad), run(eager, rows, with_grad)
            torch.testing.assert_close(lp, want_lp, rtol=1e-5, atol=1e-5)
            for name, grad in want_grads.items():
                torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
    compiled_graphs = counters["stats"]["unique_graphs"] - graphs
    assert 1 <= compiled_graphs <= 4, compiled_graphs  # a graph per layer would be twice as many


def _grouped_batch(groups, seed: int = 0):
    """A padded batch of GRPO groups: [(prompt length, [response lengths])], random tokens."""
    gen = torch.Generator().manual_seed(seed)
    prompts, responses, group_ids = [], [], []
    for g, (p, lengths) in enumerate(groups):
        prompt = torch.randint(1, 50, (p,), generator=gen).tolist()
        for k in lengths:
            ids = torch.randint(1, 50, (k,), generator=gen).tolist()
            prompts.append(prompt)
            responses.append((ids, [-1.0] * k, ""))
            group_ids.append(g)
    return rc_forward.make_batch(prompts, responses, 0, group_ids)


def test_compiled_layers_share_the_prompt_with_the_same_graphs_for_every_layer():
    # --compile with the shared-prompt pass: compile_layers hands each compiled layer its own layer of the KV cache,
    # so the layers share their graphs. Micro-batches of several groups (prompts of different lengths, left-padded),
    # of one group, of one row: log-probs and gradients as the eager model's with the shared prompt and without it
    # (float32); with and without gradients, as many graphs for 1 layer as for 3; then other shapes compile nothing.
    # aot_eager: Dynamo's capture and AOT autograd without code generation (inductor: the test above).
    from torch._dynamo.utils import counters

    assert rc_forward.shares_prefix(dataclasses.replace(rc_train.Args(), compile=True))
    warm = _grouped_batch([(5, [4, 6, 3]), (9, [5, 3, 7]), (7, [6, 3, 4]), (4, [3, 5])])
    other = _grouped_batch([(3, [8, 4]), (6, [3, 9]), (10, [5, 6, 4]), (8, [7])], seed=1)

    def run(model, batch, rows, shared, with_grad=True):
        model.zero_grad()
        ids, att, t = rc_forward.trimmed_inputs(batch, rows)
        with torch.set_grad_enabled(with_grad):
            lp = response_log_probs(model, ids, att, t, group=batch["group"][rows] if shared else None)
        lp = lp * batch["response_mask"][rows, :t]
        if with_grad:
            (lp.sum() * 0.1).backward()
        return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if with_grad}

    def calls(batch):  # the micro-batches the trainer cuts (several groups each), one group, one row
        micro = rc_forward.cut_micro_batches(torch.arange(len(batch["group"])), batch, 5, None, by_group=True)
        assert any(len(set(batch["group"][m].tolist())) > 1 for m in micro)
        return [*micro, torch.nonzero(batch["group"] == 2)[:, 0], torch.tensor([1])]

    graphs = {}
    for layers in (1, 3):
        torch._dynamo.reset()
        start = counters["stats"]["unique_graphs"]
        eager = tasks.make_qwen2(vocab_size=50, eos=0, hidden=64, layers=layers, intermediate=64, seed=0)
        compiled = rc_forward.compile_layers(copy.deepcopy(eager), backend="aot_eager")
        for rows in calls(warm):
            for with_grad in (True, False):
                lp, grads = run(compiled, warm, rows, True, with_grad)
                for want in (run(eager, warm, rows, True, with_grad), run(eager, warm, rows, False, with_grad)):
                    torch.testing.assert_close(lp, want[0], rtol=1e-5, atol=1e-6)
                    for name, grad in want[1].items():
                        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
        graphs[layers] = counters["stats"]["unique_graphs"] - start
    assert graphs[1] == graphs[3] < torch._dynamo.config.recompile_limit, graphs  # not one set per layer
    with torch._dynamo.config.patch(error_on_recompile=True):
        for rows in calls(other):
            for with_grad in (True, False):
                run(compiled, other, rows, True, with_grad)


def test_split_to_count_halves_the_largest_micro_batch():
    batch, _ = _rank_batch(0, 8, long=False)  # 8 sequences of 3 + 1 tokens
    batch["response_len"][torch.tensor([0, 1])] = 4  # rows 0 and 1 are longer (their padded size counts)
    groups = [torch.tensor([2, 3, 4, 5, 6, 7]), torch.tensor([0, 1])]
    assert rc_forward.split_to_count(groups, batch, 2) == groups  # already as many
    split = rc_forward.split_to_count(groups, batch, 4)
    # 6 x 4 = 24 padded tokens, then 3 x 4 = 12 against 2 x 7 = 14: the second split is the long pair's
    assert [g.tolist() for g in split] == [[2, 3, 4], [5, 6, 7], [0], [1]]
    assert len(rc_forward.split_to_count(groups, batch, 8)) == 8
    with pytest.raises(RuntimeError, match="into 9"):
        rc_forward.split_to_count(groups, batch, 9)


# ---- the kernels: log-prob and entropy from logits, chunked over rows -----------------------------------------------
def test_log_probs_from_logits_hand_value():
    logits = torch.tensor([[0.0, math.log(3.0)]], dtype=F64)
    out = rc_forward.log_probs_from_logits(logits, torch.tensor([1]))
    assert out.item() == approx(math.log(0.75))
    # temperature 2: softmax([0, log3 / 2]) -> p(1) = sqrt3 / (1 + sqrt3)
    out = rc_forward.log_probs_from_logits(logits, torch.tensor([1]), temperature=2.0)
    assert out.item() == approx(math.log(math.sqrt(3) / (1 + math.sqrt(3))))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 4, 1024])
def test_log_probs_from_logits_matches_log_softmax_and_gradient(temperature, chunk):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn((3, 5, 11), generator=gen, dtype=F64) * 3
    labels = torch.randint(0, 11, (3, 5), generator=gen)
    upstream = torch.randn((3, 5), generator=gen, dtype=F64)
    ours_in = logits.clone().requires_grad_()
    ref_in = logits.clone().requires_grad_()
    ours = rc_forward.log_probs_from_logits(ours_in, labels, temperature=temperature, chunk_size=chunk)
    ref = torch.log_softmax(ref_in / temperature, -1).gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    (ours * upstream).sum().backward()
    (ref * upstream).sum().backward()
    torch.testing.assert_close(ours_in.grad, ref_in.grad, rtol=1e-10, atol=1e-12)


def test_log_probs_from_logits_low_precision_noncontiguous_and_nograd():
    gen = torch.Generator().manual_seed(1)
    full = torch.randn((2, 7, 13), generator=gen).to(torch.bfloat16)
    logits = full[:, :-1, :]  # non-contiguous slice, as the trainer takes it
    labels = torch.randint(0, 13, (2, 6), generator=gen)
    ref = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None])[..., 0]
    with torch.no_grad():
        out = rc_forward.log_probs_from_logits(logits, labels, chunk_size=3)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    leaf = full.clone().requires_grad_()
    out = rc_forward.log_probs_from_logits(leaf[:, :-1, :], labels, chunk_size=5)
    out.sum().backward()
    ref_leaf = full.float().clone().requires_grad_()
    torch.log_softmax(ref_leaf[:, :-1, :], -1).gather(-1, labels[..., None]).sum().backward()
    assert leaf.grad.dtype == torch.bfloat16
    torch.testing.assert_close(leaf.grad.float(), ref_leaf.grad, rtol=2e-2, atol=1e-2)
    assert leaf.grad[:, -1].abs().sum().item() == 0.0  # the dropped position gets no gradient


@pytest.mark.parametrize("shape, chunk", [((3, 9, 17), 4), ((2, 3, 6, 11), 5), ((4, 40, 7), 256)])
def test_noncontiguous_slice_equals_its_contiguous_copy(shape, chunk):
    # The trainer hands logits[:, :-1] (not viewable as 2-D) to log_probs_from_logits: same values and same
    # gradients as a contiguous copy, in fp64 to the last bits, without a loop over rows (chunks stay inside one
    # leading index: _row_chunks).
    gen = torch.Generator().manual_seed(2)
    full = torch.randn(shape, generator=gen, dtype=F64)
    labels = torch.randint(0, shape[-1], (*shape[:-2], shape[-2] - 1), generator=gen)
    upstream = torch.randn(labels.shape, generator=gen, dtype=F64)
    sliced_in, copy_in = full.clone().requires_grad_(), full.clone().requires_grad_()
    sliced = rc_forward.log_probs_from_logits(sliced_in[..., :-1, :], labels, temperature=0.9, chunk_size=chunk)
    copy = rc_forward.log_probs_from_logits(
        copy_in[..., :-1, :].contiguous(), labels, temperature=0.9, chunk_size=chunk
    )
    assert not sliced_in[..., :-1, :].is_contiguous()
    torch.testing.assert_close(sliced, copy, rtol=0, atol=1e-14)
    (sliced * upstream).sum().backward()
    (copy * upstream).sum().backward()
    torch.testing.assert_close(sliced_in.grad, copy_in.grad, rtol=0, atol=1e-14)
    chunks = list(rc_forward._row_chunks(sliced_in[..., :-1, :].shape, chunk))
    assert len(chunks) == math.prod(shape[:-2]) * math.ceil((shape[-2] - 1) / chunk)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_entropy_from_logits_matches_the_definition(temperature):
    gen = torch.Generator().manual_seed(3)
    full = torch.randn((3, 8, 29), generator=gen, dtype=F64) * 4
    q = torch.softmax(full[:, :-1] / temperature, -1)
    ref = -(q * q.log()).sum(-1)
    for chunk in (1, 5, 256):
        out = rc_forward.entropy_from_logits(full[:, :-1], temperature, chunk_size=chunk)  # a non-contiguous slice
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert rc_forward.entropy_from_logits(torch.zeros(5, dtype=F64)).item() == approx(math.log(5))  # uniform: log V
    low = rc_forward.entropy_from_logits(full.to(torch.bfloat16), temperature)
    assert low.dtype == torch.float32
    torch.testing.assert_close(low[:, :-1].double(), ref, rtol=0, atol=0.05)
    with pytest.raises(ValueError, match="temperature"):
        rc_forward.entropy_from_logits(full, 0.0)


def test_log_probs_from_logits_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"\(2, 3, 5\).*\(2, 4\)"):
        rc_forward.log_probs_from_logits(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="0.0"):
        rc_forward.log_probs_from_logits(torch.zeros(2, 5), torch.zeros(2, dtype=torch.long), 0.0)
