"""--partial-rollout (docs/async.md §9): responses that span weight updates, each token with its version and log mu.

The pool's rules run here on a fake engine (fast, exact); tests/test_train.py runs the real script: the exact resume
with unfinished responses in flight and the metrics of responses that span versions."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import rc_config
import rc_rollout
import rc_train


class FakeLLM:
    """An engine whose prompt [goal, ...] answers with goal - (prompt length - 1) tokens in all (its EOS comes then):
    token = 100 + position, log mu = -position / 10, every sample of a prompt alike. Records every call's (prompt,
    n, max tokens, seed)."""

    def __init__(self):
        self.calls = []

    def get_tokenizer(self):
        return SimpleNamespace(decode=lambda ids, skip_special_tokens: "x" * len(ids))

    def generate(self, prompts, params, use_tqdm=False):
        self.calls.append(
            [(list(p["prompt_token_ids"]), sp.n, sp.max_tokens, sp.seed) for p, sp in zip(prompts, params)]
        )
        outs = []
        for p, sp in zip(prompts, params):
            ids = p["prompt_token_ids"]
            done, left = len(ids) - 1, ids[0] - (len(ids) - 1)
            new = [100 + done + i for i in range(min(sp.max_tokens, left))]
            logprobs = [{t: SimpleNamespace(logprob=-(done + i) / 10)} for i, t in enumerate(new)]
            samples = [SimpleNamespace(index=k, token_ids=new, logprobs=logprobs) for k in reversed(range(sp.n))]
            outs.append(SimpleNamespace(outputs=samples))
        return outs


def _args(**changes):
    settings = dict(partial_rollout=True, partial_rollout_tokens=3, max_response_length=8, num_prompts_per_step=2)
    return dataclasses.replace(rc_train.Args(), **{**settings, "num_samples_per_prompt": 2, **changes})


def _request(goals, rows, step):
    keys = tuple((1, step, 0, i) for i in range(len(goals)))
    return rc_rollout.Request([[g] for g in goals], 2, rows=tuple(rows), keys=keys)


def test_a_request_ends_with_its_groups_complete_and_the_rest_continue_under_the_next_version():
    args, llm = _args(), FakeLLM()
    pool = rc_rollout.PartialRollouts(per_rank=2)
    # the first request admits two steps' prompts: responses of 3, 6, 8 and 8 tokens (8: the longest allowed), which
    # rounds of 3 tokens complete in rounds 1, 2, 3 and 3: two groups are complete after round 2, so 6 new tokens kept
    groups, rows = pool.serve(llm, _request([3, 6, 9, 9], [10, 11, 12, 13], 0), version=0, args=args)
    assert len(llm.calls) == 1 and [(n, limit) for _, n, limit, _ in llm.calls[0]] == [(2, 8)] * 4  # fresh groups
    assert rows == [10, 11] and [len(r.token_ids) for g in groups for r in g] == [3, 3, 6, 6]
    assert all(r.versions == [0] * len(r.token_ids) for g in groups for r in g)
    assert [[len(r[0]) for r in g[3]] for g in pool.groups] == [[6, 6], [6, 6]]  # cut after round 2: unfinished
    assert not any(r[3] for g in pool.groups for r in g[3])
    # the next request (version 1) admits step 2's prompts; the unfinished ones continue from their prefixes
    groups, rows = pool.serve(llm, _request([2, 2], [14, 15], 2), version=1, args=args)
    assert [(p, n, limit) for p, n, limit, _ in llm.calls[1][:2]] == [([9] + list(range(100, 106)), 1, 2)] * 2
    assert rows == [12, 13]
    spanning = groups[0][0]
    assert spanning.token_ids == [100 + i for i in range(8)]
    assert spanning.versions == [0] * 6 + [1] * 2  # its earlier tokens keep their version ...
    assert spanning.log_probs == pytest.approx([-i / 10 for i in range(8)])  # ... and their log mu
    assert spanning.text == "x" * 8
    assert [g[0] for g in pool.groups] == [14, 15]  # complete in this request too: they wait for the next


def test_a_request_runs_one_round_at_least():
    """A pool that starts a request with its groups complete still gives every unfinished response L tokens."""
    args, llm = _args(), FakeLLM()
    pool = rc_rollout.PartialRollouts(per_rank=1)
    pool.serve(llm, _request([2, 9], [0, 1], 0), version=0, args=args)  # group 0 ends in round 1: group 1 cut at 3
    assert [len(r[0]) for r in pool.groups[0][3]] == [3, 3]
    groups, rows = pool.serve(llm, _request([9], [2], 1), version=1, args=args)
    assert rows == [1] and groups[0][0].versions == [0] * 3 + [1] * 5  # ends in round 2 of this request
    assert [len(r[0]) for r in pool.groups[0][3]] == [6, 6]  # the fresh group, cut with it


def test_the_checkpointed_state_continues_exactly_as_the_uninterrupted_pool():
    args = _args()
    requests = [_request([9, 4, 9, 7], [0, 1, 2, 3], 0), _request([8, 3], [4, 5], 2), _request([9, 9], [6, 7], 3)]
    whole = rc_rollout.PartialRollouts(2)
    out = [whole.serve(FakeLLM(), r, v, args) for v, r in enumerate(requests)]
    first = rc_rollout.PartialRollouts(2)
    first.serve(FakeLLM(), requests[0], 0, args)
    state = first.state()
    state_copy = [
        [g[0], list(g[1]), g[2], [[list(x) if isinstance(x, list) else x for x in r] for r in g[3]]] for g in state
    ]
    resumed = rc_rollout.PartialRollouts(2, state)
    assert state == state_copy and resumed.state() == state
    assert [resumed.serve(FakeLLM(), r, v + 1, args) for v, r in enumerate(requests[1:])] == out[1:]
    resumed.serve(FakeLLM(), _request([9, 9], [8, 9], 4), 3, args)
    assert state == state_copy  # the saved state is a copy: continuing never changes it


def test_seeds_follow_the_prompt_the_sample_and_the_length_so_far():
    args, llm = _args(), FakeLLM()
    pool = rc_rollout.PartialRollouts(1)
    pool.serve(llm, _request([3, 9], [0, 1], 0), 0, args)  # group 1 cut at 3 tokens
    pool.serve(llm, _request([9], [2], 1), 1, args)
    assert [s for *_, s in llm.calls[0]] == [rc_rollout.sampling_seed(1, 0, 0, i) for i in range(2)]  # fresh groups
    continued = [s for p, n, _, s in llm.calls[1] if n == 1]
    assert continued == [rc_rollout.sampling_seed(1, 0, 0, 1, j, 3) for j in range(2)]


def test_the_request_admits_the_next_steps_prompts():
    submitted = []

    class Engine:
        def submit(self, tag, request):
            submitted.append((tag, request))

    def prompts_of(step):
        return [[step * 10 + 1], [step * 10 + 2]], 4, [step * 2, step * 2 + 1]

    args = _args(num_steps=5, max_staleness=0)
    rollouts = rc_rollout.Rollouts(args, Engine(), torch.nn.Linear(2, 2), prompts_of)
    for step in range(3):
        rollouts.request(step)
    (t0, r0), (t1, r1), (t2, r2) = submitted
    assert r0.rows == (0, 1, 2, 3) and r0.prompts == [[1], [2], [11], [12]]  # steps 0 and 1 at the first request
    assert r0.keys == ((args.seed, 0, 0, 4), (args.seed, 0, 0, 5), (args.seed, 1, 0, 4), (args.seed, 1, 0, 5))
    assert r1.rows == (4, 5) and r2.rows == (6, 7) and r2.keys[0] == (args.seed, 3, 0, 4)
    plain = rc_rollout.Rollouts(dataclasses.replace(args, partial_rollout=False), Engine(), None, prompts_of)
    plain.request(0)
    assert submitted[-1][1] == rc_rollout.Request([[1], [2]], 2, (args.seed, 0, 0), 4)  # off: today's request


def test_tokens_beyond_the_bound_are_masked_and_counted():
    batch = {"token_version": torch.tensor([[3, 3, 4, 0], [4, 4, 4, 4], [2, 3, 0, 0]])}
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    metrics = rc_rollout.mask_stale_tokens(batch, mask, step=5, bound=2)
    assert mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [0, 1, 0, 0]]  # version 2 is 3 behind step 5
    assert metrics == {
        "rollout/token_staleness_mean": pytest.approx((2 + 2 + 1 + 4 * 1 + 3 + 2) / 9),
        "rollout/token_staleness_max": 3.0,
        "rollout/spanning_responses": pytest.approx(2 / 3),
        "rollout/versions_per_response": pytest.approx(5 / 3),
        "rollout/masked_stale_tokens": 1.0,
    }
    assert rc_rollout.mask_stale_tokens({}, mask, 5, 2) == {}  # whole responses: nothing


def test_the_bound_per_token_is_the_schedules_plus_one_unless_given():
    assert rc_rollout.staleness_bound(_args(max_staleness=0)) == 1
    assert rc_rollout.staleness_bound(_args(max_staleness=2)) == 3
    assert rc_rollout.staleness_bound(_args(max_staleness=2, partial_rollout_max_staleness=5)) == 5
    assert rc_rollout.staleness_bound(_args(max_staleness=2, partial_rollout=False)) == 2


@pytest.mark.parametrize(
    "changes, needle",
    [
        (dict(partial_rollout_tokens=0), "--partial-rollout-tokens must be >= 1"),
        (dict(max_staleness=2, partial_rollout_max_staleness=1), "--partial-rollout-max-staleness 1 is below"),
        (dict(replay_window=2, replay_fraction=0.5), "--partial-rollout with --replay-fraction > 0"),
        (dict(mismatch_split=True, max_staleness=1), "--partial-rollout with --mismatch-split"),
        (dict(prox_logp="loglinear", max_staleness=1), "--partial-rollout with --prox-logp loglinear"),
    ],
)
def test_bad_partial_settings_are_one_line_naming_the_value(changes, needle):
    with pytest.raises(ValueError, match=None) as e:
        rc_config._check_partial_rollout(_args(**changes))
    assert needle in str(e.value) and "\n" not in str(e.value)
