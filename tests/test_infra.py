"""Unit tests of the plumbing modules on CPU (rc_config, rc_rollout, rc_run): engine placement and sleep order,
metric reduction across ranks (real gloo processes, and an NCCL-like group that serves only CUDA tensors), launcher
settings (DeepSpeed and FSDP1 refused, FSDP2 switched on), gradient accumulation contexts, resume bookkeeping."""

import contextlib
import json
import os
import socket
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import rc_config
import rc_core
import rc_rollout
import rc_run


# ---- Engine placement and memory --------------------------------------------------------------------------
@pytest.mark.parametrize("rank, local_rank, world", [(0, 0, 2), (1, 1, 2), (3, 1, 4), (5, 5, 8)])
def test_each_rank_engine_gets_its_own_gpu(rank, local_rank, world):
    kwargs, env = rc_rollout.engine_placement(True, rank, local_rank, world)
    assert kwargs == {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": 1}
    assert env == {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world)}


@pytest.mark.parametrize("on_gpu, world", [(False, 1), (False, 2), (True, 1)])
def test_cpu_and_single_gpu_keep_the_default_executor(on_gpu, world):
    assert rc_rollout.engine_placement(on_gpu, world - 1, world - 1, world) == ({}, {})


class FakeEngine:
    def __init__(self, log):
        self.log = log

    def wake_up(self, tags):
        self.log.append(("wake", tuple(tags)))

    def sleep(self, level):
        self.log.append(("sleep", level))


def test_engine_wakes_weights_for_a_sync_and_kv_cache_for_generation(monkeypatch):
    log = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: log.append("empty_cache"))
    engine = rc_rollout.EngineMemory(FakeEngine(log), enabled=True, level=2)
    engine.wake("weights", "kv_cache")  # a new engine is awake: nothing to do
    engine.sleep()  # after the rollout, before the update
    engine.wake("weights")  # weight sync
    engine.wake("weights", "kv_cache")  # next rollout: only the KV cache is still asleep
    engine.sleep()
    engine.sleep()  # already asleep: no second call
    assert log == [
        ("sleep", 2),
        "empty_cache",
        ("wake", ("weights",)),
        "empty_cache",
        ("wake", ("kv_cache",)),
        ("sleep", 2),
    ]


def test_engine_never_sleeps_on_cpu(monkeypatch):
    log = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: log.append("empty_cache"))
    engine = rc_rollout.EngineMemory(FakeEngine(log), enabled=False)
    engine.sleep()
    engine.wake("weights", "kv_cache")
    assert log == []


# ---- Metric reduction --------------------------------------------------------------------------------------
def test_metric_reductions_are_declared():
    assert rc_run.reduction("rollout_corr/rollout_is_max") == "max"
    assert rc_run.reduction("rollout_corr/rollout_is_seq_max_deviation") == "max"
    assert rc_run.reduction("rollout_corr/log_ppl_diff_min") == "min"
    assert rc_run.reduction("actor/maximal_thing") == "mean"
    assert rc_run.reduction("response_length/max") == "max"
    # the RS option seq_max_k2's own name does not make its metrics extremes
    assert rc_run.reduction("rollout_corr/rollout_rs_seq_max_k2_masked_fraction") == "mean"
    assert rc_run.reduction("rollout_corr/rollout_rs_seq_max_k3_mean") == "mean"
    assert rc_run.reduction("rollout_corr/rollout_rs_seq_max_k2_seq_min") == "min"
    assert rc_run.reduction("rollout_corr/rollout_rs_seq_max_k3_max") == "max"
    # declared, not read off the name: an undeclared name with a max word in it is a mean
    assert rc_run.reduction("actor/ratio_max") == "mean"


def test_metric_reductions_cover_every_rs_option():
    # the registry's <option> names expand over every option rc_core defines (a new option is covered at once)
    for option in rc_core.RS_OPTIONS:
        assert rc_run.reduction(f"rollout_corr/rollout_rs_{option}_masked_fraction") == "mean", option
        assert rc_run.reduction(f"rollout_corr/rollout_rs_{option}_max") == "max", option
        assert rc_run.reduction(f"rollout_corr/rollout_rs_{option}_seq_min") == "min", option


def test_local_sums_are_token_weighted():
    acc = rc_run.MetricSum()
    acc.add({"actor/entropy": 1.0, "rollout_corr/rollout_is_max": 2.0}, weight=30)
    acc.add({"actor/entropy": 4.0, "rollout_corr/rollout_is_max": 1.5}, weight=10)
    acc.add({}, weight=50)  # a micro-batch whose responses were all dropped reports nothing
    out = rc_run.reduce_metrics(acc, rc_run.HostGroup(1))
    assert out == {"actor/entropy": pytest.approx((30 * 1.0 + 10 * 4.0) / 40), "rollout_corr/rollout_is_max": 2.0}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reduce_worker(rank, world, port, results, backend="gloo"):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world)
    host = rc_run.HostGroup(world)  # made at start, as rc_train.py makes it
    if backend == "cuda:gloo":  # the emulation bites: the default group refuses a CPU tensor, as NCCL does
        try:
            dist.all_reduce(torch.zeros(1))
            results[f"plain{rank}"] = "accepted"
        except RuntimeError as e:
            results[f"plain{rank}"] = str(e)
    acc = rc_run.MetricSum()
    if rank == 0:  # 3 tokens with entropy 1, a maximum of 5, and a key only this rank has
        acc.add({"actor/entropy": 1.0, "rollout_corr/rollout_is_max": 5.0, "only/rank0": 7.0}, weight=3)
    else:  # 1 token with entropy 5; a second micro-batch with every response dropped
        acc.add(
            {"actor/entropy": 5.0, "rollout_corr/rollout_is_max": 2.0, "rollout_corr/log_ppl_diff_min": -1.0}, weight=1
        )
        acc.add({}, weight=0)
    results[rank] = rc_run.reduce_metrics(acc, host)
    results[f"sum{rank}"] = host.sum([1.0, float(rank)])  # the loss denominators' path
    results[f"gather{rank}"] = host.gather({"rank": rank})  # the evaluation samples' path
    dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["gloo", "cuda:gloo"])
def test_reduction_across_unequal_ranks_with_unequal_keys(backend):
    """'cuda:gloo' emulates the NCCL default group of a GPU job on CPU: its only backend serves the cuda device type,
    so a CPU tensor handed to a collective on it fails ("No backend type associated with device type cpu"). Every
    collective of the trainer's own (metric reduction, loss denominators, evaluation samples) must pass there."""
    results = mp.Manager().dict()
    mp.spawn(_reduce_worker, args=(2, _free_port(), results, backend), nprocs=2, join=True)
    if backend == "cuda:gloo":
        assert "No backend type associated with device type cpu" in results["plain0"]
    assert results[0] == results[1]  # every rank ends with the same metrics, no hang
    assert results["sum0"] == results["sum1"] == [2.0, 1.0]
    assert results["gather0"] == results["gather1"] == [{"rank": 0}, {"rank": 1}]
    out = results[0]
    assert out["actor/entropy"] == pytest.approx((3 * 1.0 + 1 * 5.0) / 4)  # token-weighted, not (1 + 5) / 2
    assert out["rollout_corr/rollout_is_max"] == 5.0 and out["rollout_corr/log_ppl_diff_min"] == -1.0
    assert out["only/rank0"] == 7.0  # a key one rank lacks is the other ranks' weighted mean


# ---- Launchers, sharding, gradient accumulation ----------------------------------------------------------------
def _accelerator(kind, processes=2):
    from accelerate.utils import DistributedType

    return types.SimpleNamespace(
        distributed_type=getattr(DistributedType, kind),
        num_processes=processes,
        no_sync=lambda model: ("no_sync", model),
    )


def _args(**kw):
    return types.SimpleNamespace(**{"fsdp": False, "max_tokens_per_micro_batch": None, **kw})


@pytest.mark.parametrize(
    "env, refused",
    [
        ({"ACCELERATE_USE_DEEPSPEED": "true"}, "DeepSpeed is not supported"),
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, "FSDP version 1"),
        ({"ACCELERATE_USE_FSDP": "true"}, "FSDP version 1"),  # Accelerate's default version is 1
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "true"}, "fsdp_offload_params"),
    ],
)
def test_launcher_settings_refuse_what_cannot_work(env, refused):
    with pytest.raises(ValueError, match=refused):
        rc_config.launcher_settings(_args(), dict(env))


def test_an_accelerate_fsdp2_config_switches_on_the_trainers_own_sharding():
    env, args = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "false"}, _args()
    rc_config.launcher_settings(args, env)
    assert args.fsdp and "ACCELERATE_USE_FSDP" not in env  # Accelerate then sets up plain data parallelism
    args = _args()
    rc_config.launcher_settings(args, {})
    assert not args.fsdp


@pytest.mark.parametrize(
    "kind, processes, args, refused",
    [
        ("DEEPSPEED", 2, _args(), "DeepSpeed"),
        ("FSDP", 2, _args(), "fully_shard"),
        ("NO", 1, _args(fsdp=True), "has 1"),
        ("MULTI_CPU", 2, _args(fsdp=True, max_tokens_per_micro_batch=512), "512"),
        ("MULTI_CPU", 2, _args(fsdp=True), None),
        ("MULTI_GPU", 2, _args(), None),
        ("NO", 1, _args(), None),
    ],
)
def test_check_distributed(kind, processes, args, refused):
    if refused:
        with pytest.raises(ValueError, match=refused):
            rc_config.check_distributed(_accelerator(kind, processes), args)
    else:
        rc_config.check_distributed(_accelerator(kind, processes), args)


def test_micro_batches_accumulate_without_all_reduce_except_the_last():
    assert rc_run.accumulating(_accelerator("MULTI_GPU"), "m", False, fsdp=False) == ("no_sync", "m")
    assert isinstance(rc_run.accumulating(_accelerator("MULTI_GPU"), "m", True, fsdp=False), contextlib.nullcontext)
    assert isinstance(rc_run.accumulating(_accelerator("NO", 1), "m", False, fsdp=False), contextlib.nullcontext)
    calls = []
    model = types.SimpleNamespace(set_requires_gradient_sync=calls.append)
    for last in (False, False, True):  # FSDP2: no reduce-scatter until the last micro-batch
        assert isinstance(
            rc_run.accumulating(_accelerator("MULTI_GPU"), model, last, fsdp=True), contextlib.nullcontext
        )
    assert calls == [False, False, True]


def test_weight_fingerprint_sees_every_bit():
    weights = {"a": torch.randn(4, 3), "b": torch.randn(5).to(torch.bfloat16), "c": torch.randn(2).double()}
    base = rc_run.weights_sha256(weights.items())
    assert base == rc_run.weights_sha256(reversed(list(weights.items())))  # name order, not iteration order
    for name in weights:
        flipped = dict(weights)
        t = weights[name].clone()
        t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).view(-1)[-1] ^= 1  # lowest bit
        flipped[name] = t
        assert rc_run.weights_sha256(flipped.items()) != base


# ---- Resume bookkeeping ------------------------------------------------------------------------------------
def test_wandb_run_id_survives_resume(tmp_path):
    first = rc_run.wandb_run_id(str(tmp_path), resume=False)
    assert rc_run.wandb_run_id(str(tmp_path), resume=True) == first
    assert rc_run.wandb_run_id(str(tmp_path), resume=False) != first  # a fresh run gets a fresh id


def test_restore_rng_after_an_engine_reseeds(tmp_path):
    import random

    import numpy as np

    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    torch.save(
        {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        tmp_path / "rng_rank0.pt",
    )
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(1)  # what vLLM's start-up does to the global generators
    rc_run.restore_rng(str(tmp_path), 0)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    assert np.random.rand() == expected[2]


def test_engine_awake_sleeps_only_after_a_rollout(monkeypatch):
    log = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    engine = rc_rollout.EngineMemory(FakeEngine(log), enabled=True, level=1)
    with rc_rollout.engine_awake(engine, "weights", "kv_cache", sleep_after=True):  # rollout, then the update
        log.append("generate")
    with rc_rollout.engine_awake(engine, "weights"):  # weight sync: the KV cache sleeps on
        log.append("sync")
    assert log == ["generate", ("sleep", 1), ("wake", ("weights",)), "sync"]
    assert engine.awake == {"weights"}


# ---- Configuration files ---------------------------------------------------------------------------------------
def test_yaml_numbers_are_numbers_and_bounds_stay_text(tmp_path):
    import dataclasses

    @dataclasses.dataclass
    class Inner:
        threshold: object = None
        veto: object = None

    @dataclasses.dataclass
    class Outer:
        rate: float = 1.0
        steps: int = 1
        inner: Inner = dataclasses.field(default_factory=Inner)

    path = tmp_path / "c.yaml"
    path.write_text("rate: 1e-4\nsteps: 3\ninner:\n  threshold: 0.5_5\n  veto: 1.0e-4\n")
    assert rc_config.load_yaml_defaults(Outer, str(path)) == Outer(1e-4, 3, Inner("0.5_5", 1e-4))
    path.write_text("inner:\n  threshold: 2\n  veto: none\n")
    assert rc_config.load_yaml_defaults(Outer, str(path)) == Outer(inner=Inner(2, "none"))
    path.write_text("rate: 1.0\ninner:\n  thresold: 2\n")
    with pytest.raises(ValueError, match="inner.thresold"):
        rc_config.load_yaml_defaults(Outer, str(path))


def test_resume_with_another_number_of_processes_is_refused(tmp_path):
    import json

    ckpt = tmp_path / "checkpoints" / "step_000001"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 1, "position": 8, "world_size": 1}))
    assert rc_run.check_run_dir(str(tmp_path), resume=True, overwrite=False, world=1) is False
    with pytest.raises(ValueError, match="written by 1 process.*this run has 2"):
        rc_run.check_run_dir(str(tmp_path), resume=True, overwrite=False, world=2)


def test_resume_with_another_staleness_bound_is_refused(tmp_path):
    """The batches in flight of a --max-staleness k checkpoint were sampled for that schedule; an older checkpoint
    (no max_staleness recorded) was written by the synchronous loop, k = 0."""
    import json

    ckpt = tmp_path / "checkpoints" / "step_000001"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(
        json.dumps({"step": 1, "position": 8, "world_size": 1, "max_staleness": 2})
    )
    assert rc_run.check_run_dir(str(tmp_path), resume=True, overwrite=False, max_staleness=2) is False
    with pytest.raises(ValueError, match="--max-staleness 2, this run has --max-staleness 1"):
        rc_run.check_run_dir(str(tmp_path), resume=True, overwrite=False, max_staleness=1)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 1, "position": 8, "world_size": 1}))
    with pytest.raises(ValueError, match="--max-staleness 0, this run has --max-staleness 1"):
        rc_run.check_run_dir(str(tmp_path), resume=True, overwrite=False, max_staleness=1)


def test_stale_rows_and_the_bound():
    """A sample is dropped exactly when trainer version - sample version exceeds the bound; the bound is
    --max-staleness, or --sync-every - 1 for the synchronous loop's lagged engine, or none when it is never synced."""
    import dataclasses

    import rc_rollout
    import rc_train

    versions = torch.tensor([5, 4, 3, 2, 5])
    assert rc_rollout.stale_rows(versions, 5, 2).tolist() == [False, False, False, True, False]
    assert rc_rollout.stale_rows(versions, 5, 0).tolist() == [False, True, True, True, False]
    assert not rc_rollout.stale_rows(versions, 5, None).any()
    bound = [
        rc_rollout.staleness_bound(dataclasses.replace(rc_train.Args(), **c))
        for c in (
            dict(max_staleness=0),
            dict(max_staleness=3),
            dict(max_staleness=0, sync_every=4),
            dict(max_staleness=0, sync_every=0),
        )
    ]
    assert bound == [0, 3, 3, None]


def test_max_staleness_default_by_device_dial_and_checkpoint(tmp_path):
    """--max-staleness None: 1 on a CPU, 0 on GPUs or with the synchronous loop's --sync-every dial, and on --resume
    the bound its checkpoint was written with; a value given is kept."""
    import dataclasses

    import rc_train

    args = rc_train.Args()
    assert args.max_staleness is None
    assert rc_config.resolve_max_staleness(args, False, str(tmp_path)) == 1
    assert rc_config.resolve_max_staleness(args, True, str(tmp_path)) == 0
    assert rc_config.resolve_max_staleness(dataclasses.replace(args, sync_every=4), False, str(tmp_path)) == 0
    assert rc_config.resolve_max_staleness(dataclasses.replace(args, max_staleness=3), True, str(tmp_path)) == 3
    (tmp_path / "checkpoints" / "step_4").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_4" / "trainer_state.json").write_text(json.dumps({"max_staleness": 0}))
    resuming = dataclasses.replace(args, resume=True)
    assert rc_config.resolve_max_staleness(resuming, False, str(tmp_path)) == 0
    assert rc_config.resolve_max_staleness(dataclasses.replace(resuming, max_staleness=2), False, str(tmp_path)) == 2


class FifoEngine:
    """Serves requests in order like the rollout worker: a generation is sampled by the last load queued before it."""

    def __init__(self):
        self.ops, self.version, self.done = [], 0, {}

    def load(self, version, weights):
        self.ops.append(("load", version, len(list(weights))))
        self.version = version

    def submit(self, tag, request):
        self.ops.append(("submit", tag))
        response = rc_rollout.Response([1], [0.0], "x")
        self.done[tag] = rc_rollout.Result(self.version, [[response]] * len(request.prompts), 0.0, 0.0)

    def result(self, tag, keep=False):
        return (self.done[tag] if keep else self.done.pop(tag)), 0.0

    def restore(self, tag, result):
        self.done[tag] = result

    def close(self):
        pass


@pytest.mark.parametrize("k", [0, 1, 3])
def test_the_schedule_samples_step_t_with_version_t_minus_k(k):
    """rc_rollout.Rollouts driven as rc_train.py drives it: take, sync, evaluate now and then, request k ahead. Every
    batch comes from version max(0, t - k), one load per update, and evaluation never changes a batch's version."""
    import dataclasses

    import rc_rollout
    import rc_train

    args = dataclasses.replace(rc_train.Args(), max_staleness=k, num_steps=7)
    engine = FifoEngine()
    rollouts = rc_rollout.Rollouts(args, engine, torch.nn.Linear(2, 2), lambda step: ([[step]], 0))
    rollouts.begin(0)
    assert engine.ops == [("submit", t) for t in range(k + 1)]  # no load: the engine starts with version 0
    versions = []
    for step in range(args.num_steps):
        versions.append(rollouts.take(step)[1])
        rollouts.sync(step)
        if step % 3 == 2:
            rollouts.evaluate([[0]], step + 1)
        rollouts.request(step + 1 + k)
    assert versions == [max(0, t - k) for t in range(args.num_steps)]
    assert rollouts.sync_count == args.num_steps
    assert [op for op in engine.ops if op[0] == "submit" and op[1] != "eval"] == [("submit", t) for t in range(7)]


def test_a_resumed_schedule_takes_the_saved_batches_first():
    """After a checkpoint at step 2 (k = 2): the batches of steps 3 and 4 (versions 1 and 2) come from the checkpoint;
    the engine gets version 3 (the checkpoint's weights) and samples step 5 with it."""
    import dataclasses

    import rc_rollout
    import rc_train

    args = dataclasses.replace(rc_train.Args(), max_staleness=2, num_steps=8)
    saved = {3: (1, [["a"]], 0.5, 0.1), 4: (2, [["b"]], 0.5, 0.1)}
    engine = FifoEngine()
    rollouts = rc_rollout.Rollouts(args, engine, torch.nn.Linear(2, 2), lambda step: ([[step]], 0), sync_count=3)
    rollouts.begin(3, saved)
    assert [op[:2] for op in engine.ops] == [("load", 3), ("submit", 5)]
    assert [rollouts.take(t)[:2] for t in (3, 4)] == [([["a"]], 1), ([["b"]], 2)]
    assert rollouts.sync_count == 3  # the resume's load brings no new version
    assert rollouts.take(5)[1] == 3


@pytest.mark.parametrize("k", [1, 2])
def test_a_run_continued_past_its_end_samples_what_the_uninterrupted_run_samples(k):
    """A run of 3 steps with a checkpoint after each: the checkpoint at its end holds the batches of steps 3..2+k,
    sampled by versions 3-k.., as the uninterrupted run samples them; resumed with --num-steps 7, every batch comes
    from version max(0, t - k), like the 7 steps run at once. A run without checkpoints samples nothing past its
    end."""
    import dataclasses

    import rc_rollout
    import rc_train

    def drive(rollouts, start, stop):
        versions = []
        for step in range(start, stop):
            versions.append(rollouts.take(step)[1])
            rollouts.sync(step)
            rollouts.request(step + 1 + k)
            saved = rollouts.in_flight(step)
        return versions, saved

    short = dataclasses.replace(rc_train.Args(), max_staleness=k, num_steps=3, checkpoint_every=1)
    rollouts = rc_rollout.Rollouts(short, FifoEngine(), torch.nn.Linear(2, 2), lambda step: ([[step]], 0))
    rollouts.begin(0)
    first, saved = drive(rollouts, 0, 3)
    assert {t: r.version for t, r in saved.items()} == {t: t - k for t in range(3, 3 + k)}
    longer = dataclasses.replace(short, num_steps=7)
    resumed = rc_rollout.Rollouts(longer, FifoEngine(), torch.nn.Linear(2, 2), lambda step: ([[step]], 0), 3)
    resumed.begin(3, saved)
    rest, _ = drive(resumed, 3, 7)
    assert first + rest == [max(0, t - k) for t in range(7)]
    plain = dataclasses.replace(short, checkpoint_every=0)
    engine = FifoEngine()
    rollouts = rc_rollout.Rollouts(plain, engine, torch.nn.Linear(2, 2), lambda step: ([[step]], 0))
    rollouts.begin(0)
    drive(rollouts, 0, 3)
    assert max(op[1] for op in engine.ops if op[0] == "submit") == 2


def test_torch_threads_follow_the_mode_unless_omp_num_threads_is_set(monkeypatch):
    """k = 0: rollout and update take turns, each gets every core; k >= 1: trainer and worker side by side, half each.
    OMP_NUM_THREADS, when set, wins (the tests and the lab set it to 1)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert rc_config.torch_threads(0, environ={}) == 4
    assert (
        rc_config.torch_threads(1, environ={}) == 2 and rc_config.torch_threads(3, environ={"OMP_NUM_THREADS": ""}) == 2
    )
    assert rc_config.torch_threads(0, environ={"OMP_NUM_THREADS": "1"}) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert rc_config.torch_threads(1, environ={}) == 1
