"""The replay buffer (issue 34, rc_rollout.ReplayBuffer, docs/async.md §8): a batch of whole groups from several
policy versions, each sample with its own mu and version; f = 0 is today's run bit for bit; a resumed or continued
run equals the uninterrupted one; bad settings are one line before the engine starts.

Unit tests drive ReplayBuffer directly; the end-to-end ones run the real script on the one-token fixture."""

import dataclasses
import re

import pytest

import rc_config
import rc_plot
import rc_rollout
import rc_run
import rc_train
from tests.test_run_record import record, refused
from tests.test_train import ENGINE_STARTED, QUICK, _same_metrics, run_train

REPLAY = ["--replay-window", "2", "--replay-fraction", "0.5"]
FLAGS = [*QUICK, "--max-staleness", "1", "--checkpoint-every", "2", "--eval-every", "2"]
REPLAY_KEYS = {"rollout/replayed_fraction", "rollout/replay_buffer_samples", "rollout/replay_evicted_samples"}


def _buffer(window=2, fraction=0.5, per_rank=4, seed=1):
    args = dataclasses.replace(
        rc_train.Args(), replay_window=window, replay_fraction=fraction, seed=seed, num_prompts_per_step=per_rank
    )
    return rc_rollout.ReplayBuffer(args, per_rank, rc_config.replay_groups(args, 1), rank=0)


def _group(step, row, n=2):
    """n responses whose log-probs name their step and row: what a drawn group must carry back unchanged."""
    return [rc_rollout.Response([row], [-0.001 * step - row], f"s{step}r{row}", None) for _ in range(n)]


def _simulate(buffer, steps, k=1):
    """Run the buffer as rc_train.py does (draw, then add the fresh groups sampled by version max(0, t - k))."""
    drawn = []
    for t in range(steps):
        rows = [100 * t + i for i in range(buffer.fresh(t))]
        got = buffer.draw(t)
        buffer.add(t, max(0, t - k), rows, [_group(t, r) for r in rows])
        drawn.append(got)
    return drawn


def test_schedule_buffer_and_window_agree():
    """Every step trains per_rank groups: min(round(f x per_rank), held) replayed, the rest fresh; a replayed group
    comes from one of the last W steps with its own version and responses (its mu), never this step's; the draw is
    seeded and the same twice."""
    for window, fraction, per_rank in [(1, 0.5, 4), (2, 0.75, 4), (3, 0.25, 8), (1, 0.75, 4), (4, 0.5, 2)]:
        buffer = _buffer(window, fraction, per_rank)
        drawn = _simulate(buffer, 12)
        assert drawn == _simulate(_buffer(window, fraction, per_rank), 12)  # deterministic
        assert drawn[0] == []  # nothing to replay at the first step
        for t, groups in enumerate(drawn):
            assert len(groups) + buffer.fresh(t) == per_rank
            assert len(groups) == min(buffer.count, sum(buffer.fresh(s) for s in range(max(0, t - window), t)))
            for row, version, group in groups:
                step = row // 100
                assert t - window <= step < t and version == max(0, step - 1)
                assert group == _group(step, row)
        assert buffer.fresh(11) < per_rank  # a steady state with replay
    other = _simulate(_buffer(seed=2), 12)
    assert other != _simulate(_buffer(seed=1), 12)  # the seed decides the draw


def test_eviction_counts_and_state_round_trip():
    buffer = _buffer(window=2, fraction=0.5, per_rank=4)
    evicted = []
    for t in range(4):
        rows = list(range(buffer.fresh(t)))
        buffer.draw(t)
        evicted.append(buffer.add(t, t, rows, [_group(t, r) for r in rows]))
    # fresh groups 4, 2, 2, 2 of 2 samples; the window keeps two steps: step 0 leaves at step 2, step 1 at step 3
    assert [buffer.fresh(t) for t in range(4)] == [4, 2, 2, 2]
    assert evicted == [0, 0, 8, 4] and buffer.samples() == 8
    args = dataclasses.replace(rc_train.Args(), replay_window=2, replay_fraction=0.5, seed=1)
    again = rc_rollout.ReplayBuffer(args, 4, 2, 0, buffer.state())
    assert again.entries == buffer.entries and all(isinstance(r, rc_rollout.Response) for r in again.entries[0][3][0])
    assert again.draw(4) == buffer.draw(4)
    assert rc_run.replay_metrics(4, 8, 8, 4) == {
        "rollout/replayed_fraction": 0.5,
        "rollout/replay_buffer_samples": 8.0,
        "rollout/replay_evicted_samples": 4.0,
    }


def test_the_bound_grows_by_the_window_only_with_replay():
    args = dataclasses.replace(rc_train.Args(), max_staleness=1, replay_window=3)
    assert rc_rollout.staleness_bound(args) == 1
    assert rc_rollout.staleness_bound(dataclasses.replace(args, replay_fraction=0.5)) == 4


@pytest.mark.parametrize(
    "changes, needle",
    [
        (dict(replay_fraction=0.5), "--replay-fraction 0.5 needs --replay-window >= 1"),
        (dict(replay_window=2, replay_fraction=1.0), "--replay-fraction must be in [0, 1)"),
        (dict(replay_window=2, replay_fraction=-0.1), "got -0.1"),
        (dict(replay_window=-1), "--replay-window must be >= 0"),
        (dict(replay_window=2, replay_fraction=0.05), "= 0 whole groups"),
        (dict(replay_window=2, replay_fraction=0.95), "leaving no fresh group"),
    ],
)
def test_bad_replay_settings_are_refused_by_name(changes, needle):
    args = dataclasses.replace(rc_train.Args(), num_prompts_per_step=8, **changes)
    with pytest.raises(ValueError, match=re.escape(needle)):
        rc_config.validate_args(args, world_size=1)
    rc_config.validate_args(dataclasses.replace(rc_train.Args(), num_prompts_per_step=8), world_size=1)  # no replay: ok


def test_a_bad_replay_setting_is_one_line_before_the_engine(tmp_path):
    _, proc = run_train(tmp_path, *QUICK, "--num-steps", "2", "--replay-fraction", "0.5", check=False, timeout=300)
    refused(proc, "--replay-fraction 0.5 needs --replay-window >= 1")
    assert ENGINE_STARTED not in proc.stdout + proc.stderr
    assert not (tmp_path / "run").exists()


def test_no_replay_fraction_is_todays_run_bit_for_bit(tmp_path):
    """--replay-window 2 --replay-fraction 0 keeps a buffer and draws nothing: every metric of the run without one,
    plus the buffer's own."""
    plain, _ = run_train(tmp_path, *FLAGS, "--num-steps", "2", name="plain")
    kept, _ = run_train(
        tmp_path, *FLAGS, "--num-steps", "2", "--replay-window", "2", "--replay-fraction", "0", name="kept"
    )
    for a, b in zip(plain, kept):
        assert set(b) - set(a) == REPLAY_KEYS and b["rollout/replayed_fraction"] == 0
        assert _same_metrics(a, {k: b[k] for k in a}), a["step"]
    assert [r["rollout/replay_buffer_samples"] for r in kept] == [64, 128]  # 8 groups of 8, two steps kept


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    """Four steps at k = 1 with half of every batch replayed from the last two steps: the reference."""
    root = tmp_path_factory.mktemp("replayed")
    rows, _ = run_train(root, *FLAGS, *REPLAY, "--num-steps", "4", name="reference")
    return root, rows


def test_a_replayed_batch_mixes_versions(replayed):
    """Staleness up to W + k, the replayed share, evictions, and the corrections computed over the mixture."""
    _, rows = replayed
    assert [r["rollout/replayed_fraction"] for r in rows] == [0, 0.5, 0.5, 0.5]
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 2, 3]  # W + k = 3 at step 3
    assert [r["rollout/policy_version"] for r in rows] == [0, 0, 1, 2]  # the fresh samples' version
    assert [r["rollout/dropped_samples"] for r in rows] == [0, 0, 0, 0]  # the bound allows the window
    assert [r["rollout/replay_evicted_samples"] for r in rows] == [0, 0, 64, 32]
    assert all("rollout_corr/k3_kl" in r for r in rows)
    replay_panels = [p for p in rc_plot.PANELS if p.needs == "replay"]  # the dashboard draws them from this run
    assert replay_panels and all(s.key in rows[-1] for p in replay_panels for s in p.series)


def test_a_continued_run_with_a_buffer_equals_the_uninterrupted_one(replayed, tmp_path):
    """Two steps (a checkpoint holding the buffer at the end), then --resume --num-steps 4: the reference bit for
    bit. A resume with another window is refused before the engine starts, touching nothing."""
    _, reference = replayed
    run_train(tmp_path, *FLAGS, *REPLAY, "--num-steps", "2", name="run")
    before = record(tmp_path / "run")
    flags = [*FLAGS, "--replay-window", "3", "--replay-fraction", "0.5", "--num-steps", "4", "--resume"]
    _, proc = run_train(tmp_path, *flags, name="run", check=False, timeout=300)
    refused(proc, "--replay-window is 2 in the checkpoint, 3 now")
    assert ENGINE_STARTED not in proc.stdout + proc.stderr and record(tmp_path / "run") == before
    rows, _ = run_train(tmp_path, *FLAGS, *REPLAY, "--num-steps", "4", "--resume", name="run")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for a, b in zip(rows, reference):
        assert _same_metrics(a, b), (a["step"], {k: (a[k], b[k]) for k in a if k in b and a[k] != b[k]})
