"""Unit tests of the plumbing modules on CPU (rc_config, rc_rollout, rc_run, rc_checkpoint): engine placement and
sleep order, metric reduction across ranks (real gloo processes, and an NCCL-like group that serves only CUDA tensors),
launcher settings (DeepSpeed and FSDP1 refused, FSDP2 switched on), gradient accumulation contexts, resume
bookkeeping."""

import contextlib
import dataclasses
import json
import os
import socket
import time
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import rc_checkpoint
import rc_config
import rc_core
import rc_forward
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


def test_sleep_level_is_2_where_every_rollout_follows_a_fresh_push():
    """--vllm-sleep-level None: 2 (weights discarded) at --sync-every 1 on a dense model, 1 otherwise; an explicit
    level wins; an explicit 2 where a rollout could follow a sleep without a push is refused at start."""
    import rc_train

    def level(moe=False, **changes):
        args = dataclasses.replace(rc_train.Args(), **changes)
        rc_config.validate_args(args, world_size=1)
        return rc_rollout.sleep_level(args, moe)

    assert rc_train.Args().vllm_sleep_level is None
    assert level() == 2 and level(max_staleness=0) == 2 and level(rollout_weight_noise=0.1) == 2  # dials push too
    assert level(sync_every=2, max_staleness=0) == 1 and level(sync_every=0, max_staleness=0) == 1
    assert level(moe=True) == 1  # the MoE engine's GPU update path is not verified
    assert level(vllm_sleep_level=1) == 1 and level(moe=True, vllm_sleep_level=2) == 2  # asked for
    assert level(vllm_sleep_level=1, sync_every=2, max_staleness=0) == 1
    for changes, words in (
        (dict(vllm_sleep_level=2, sync_every=2, max_staleness=0), "--sync-every 2"),
        (dict(vllm_sleep_level=2, sync_every=0, max_staleness=0), "--sync-every 0"),
        (dict(vllm_sleep_level=3), "got 3"),
        (dict(vllm_sleep_level=0), "got 0"),
    ):
        with pytest.raises(ValueError, match=words):
            level(**changes)


class _SleepingLLM:
    """An engine that forgets its weights in a level-2 sleep (a wake-up then holds garbage until the next push) and
    checks every generation against that, for the trainer's schedule of loads, rollouts and evaluations."""

    def __init__(self, level: int):
        self.level, self.weights, self.log = level, "model", []

    def sleep(self, level):
        assert level == self.level
        self.weights = None if level == 2 else self.weights
        self.log.append("sleep")

    def wake_up(self, tags):
        self.log.append(("wake", *tags))

    def collective_rpc(self, method, kwargs):
        assert method == "reload_weights"
        list(kwargs["weights_iterator"])
        self.weights = "pushed"
        self.log.append("push")

    def reset_prefix_cache(self):
        pass


def _generate_on_live_weights(llm, request, args):
    assert llm.weights is not None, f"a generation on discarded weights: {llm.log}"
    llm.log.append("eval" if request.greedy else "rollout")
    return [[rc_rollout.Response([1], [] if request.greedy else [-0.5], "1")] * request.n for _ in request.prompts]


def _trainer_schedule(args, level: int, start_step: int = 0) -> list:
    """rc_train.py's order of engine calls (an engine in the trainer's process, --max-staleness 0) on a sleeping
    engine: the first evaluation, Rollouts.begin, then per step the rollout, the update, the sync, the evaluation
    every --eval-every steps and at the end, the next request; start_step > 0 is a resumed run (a new engine)."""
    llm = _SleepingLLM(level)
    memory = rc_rollout.EngineMemory(llm, enabled=True, level=level)
    engine = rc_rollout.LocalEngine(llm, memory, _generate_on_live_weights, args)
    model = torch.nn.Linear(3, 2)
    rollouts = rc_rollout.Rollouts(args, engine, model, lambda step: ([[1, 2]], 0))
    eval_prompts = [[3, 4]]
    if args.eval_before and not start_step:
        rollouts.evaluate(eval_prompts, 0)
    rollouts.begin(start_step)
    for step in range(start_step, args.num_steps):
        rollouts.take(step)
        with torch.no_grad():  # the update
            model.weight.add_(0.1)
        rollouts.sync(step)
        last = step == args.num_steps - 1
        if last or (args.eval_every and (step + 1) % args.eval_every == 0):
            rollouts.wait_queued(step)
            rollouts.evaluate(eval_prompts, step + 1, restore=not last)
        rollouts.request(step + 1 + args.max_staleness)
    return llm.log


def test_no_generation_runs_on_weights_a_level_2_sleep_discarded(monkeypatch):
    """The rule of rc_rollout.sleep_level, checked on the trainer's own schedule: at --sync-every 1 every rollout and
    every evaluation after a sleep follows a push, with and without a weight dial (evaluated on the unperturbed weights,
    then the perturbed ones back), in a fresh run and a resumed one. A level-2 sleep at --sync-every 2 would
    generate on discarded weights, which is why level 2 needs --sync-every 1."""
    import rc_train

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    base = dict(num_steps=5, eval_every=2, max_staleness=0)
    for changes in ({}, dict(rollout_weight_noise=0.1), dict(eval_before=False)):
        args = dataclasses.replace(rc_train.Args(), **base, **changes)
        level = rc_rollout.sleep_level(args)
        assert level == 2
        log = _trainer_schedule(args, level)
        assert log.count("rollout") == 5 and log.count("sleep") == 5 and log.count("eval") >= 3, log
        assert _trainer_schedule(args, level, start_step=3).count("rollout") == 2
    args = dataclasses.replace(rc_train.Args(), **base, sync_every=2)
    assert rc_rollout.sleep_level(args) == 1
    assert _trainer_schedule(args, 1).count("rollout") == 5
    with pytest.raises(AssertionError, match="discarded weights"):
        _trainer_schedule(args, 2)


def test_make_engine_sleeps_at_the_level_of_the_rule(monkeypatch, tmp_path):
    """make_engine builds the GPU engine's EngineMemory at rc_rollout.sleep_level (the engine's config says MoE or
    not) and says the level in the run's engine log; no engine is started here."""
    import logging

    import rc_train

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    accelerator = types.SimpleNamespace(process_index=0, num_processes=1, local_process_index=0)
    said, log = [], logging.getLogger("vllm.rc_rollout")
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    log.addHandler(handler)
    log.setLevel(logging.INFO)  # as the "vllm" logger is once an engine starts (rc_rollout.engine_output_to)
    try:
        for moe, changes, level in (
            (False, {}, 2),
            (True, {}, 1),
            (False, dict(sync_every=3), 1),
            (False, dict(vllm_sleep_level=1), 1),
        ):
            config = types.SimpleNamespace(is_moe=moe)
            llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(model_config=config))
            monkeypatch.setattr(rc_rollout, "start_engine", lambda *a, llm=llm: llm)
            args = dataclasses.replace(rc_train.Args(), max_staleness=0, **changes)
            engine = rc_rollout.make_engine(args, "model", str(tmp_path), [[1, 2, 3]], accelerator)
            assert engine.memory.enabled and engine.memory.level == level, (moe, changes)
            assert said[-1].startswith(f"sleep level {level} "), said
    finally:
        log.removeHandler(handler)
        log.setLevel(logging.NOTSET)


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


def test_a_token_budget_must_hold_the_longest_sequence():
    args = types.SimpleNamespace(max_tokens_per_micro_batch=99, max_response_length=64)
    with pytest.raises(ValueError, match=r"^--max-tokens-per-micro-batch 99 is below .*\(36 tokens\).* = 100$"):
        rc_config.check_token_budget(args, 36)
    rc_config.check_token_budget(args, 35)  # 35 + 64 fits
    rc_config.check_token_budget(types.SimpleNamespace(max_tokens_per_micro_batch=None, max_response_length=64), 999)


# ---- Data-parallel updates: gradient reductions per optimizer step, token budgets across ranks ---------------------
def _rank_batch(rank, rows, long):
    """A rollout batch of `rows` sequences (groups of 2 sharing a prompt) for one rank: `long` ones (prompts of 10,
    responses of 8 tokens) or short ones (3 and 1), so a token budget cuts the ranks into different counts."""

    gen = torch.Generator().manual_seed(100 + rank)
    p_len, t_len = (10, 8) if long else (3, 1)
    prompts, responses, groups = [], [], []
    for g in range(rows // 2):
        prompt = torch.randint(1, 50, (p_len,), generator=gen).tolist()
        for _ in range(2):
            prompts.append(prompt)
            ids = torch.randint(1, 50, (t_len,), generator=gen).tolist()
            responses.append((ids, (-torch.rand(t_len, generator=gen)).tolist(), ""))
            groups.append(g)
    batch = rc_forward.make_batch(prompts, responses, 0, groups)
    mask = batch["response_mask"].double()
    tensors = dict(
        response_mask=mask,
        advantages=torch.randn(mask.shape, generator=gen, dtype=torch.float64) * mask,
        rollout_log_prob=batch["rollout_log_prob"].double(),
    )
    return batch, tensors


def _ddp_update_worker(rank, world, port, results, runs, long_rank):
    """One data-parallel rank (gloo) through rc_train.update_policy, the model prepared as rc_train.py prepares it
    (Accelerate's DDP, or rc_run.shard_model with fsdp=True). For each of `runs` (name, Args overrides), from the same
    initial weights: the gradient reductions of each optimizer step are counted (DDP: a comm hook, one round per
    backward that reduces, ending with its last bucket; FSDP2: its reduce-scatters, one per sharded module), and SGD
    at lr 1 makes the weight change the gradient."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    os.environ.update(LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from accelerate import Accelerator
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import rc_train
    import tasks

    accelerator = Accelerator(cpu=True)
    host = rc_run.HostGroup(world)
    batch, tensors = _rank_batch(rank, 8, long=rank == long_rank)
    initial = tasks.make_qwen2(vocab_size=50, eos=0, hidden=64, layers=2, intermediate=64, seed=0).double()
    correction = rc_core.RolloutCorrectionConfig.from_name("bypass_ppo_clip")
    rounds = [0]
    reduce_scatter = dist.reduce_scatter_single

    def counting_reduce_scatter(*a, **kw):  # FSDP2 calls dist.reduce_scatter_single once per module and backward
        rounds[0] += 1
        return reduce_scatter(*a, **kw)

    dist.reduce_scatter_single = counting_reduce_scatter
    for name, overrides in runs:
        model = initial.__class__(initial.config).double()
        model.load_state_dict(initial.state_dict())
        if overrides.get("fsdp"):
            model = rc_run.shard_model(model, "cpu")
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        rounds[0], per_step = 0, []
        optimizer.register_step_pre_hook(lambda *_, steps=per_step: steps.append(rounds[0] - sum(steps)))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        if not overrides.get("fsdp"):
            model, optimizer = accelerator.prepare(model, optimizer)

            def counting_hook(state, bucket):
                rounds[0] += bucket.is_last()  # one round of reduction per backward that reduces, whatever its buckets
                return default_hooks.allreduce_hook(None, bucket)

            model.register_comm_hook(None, counting_hook)
        args = rc_train.Args(
            num_minibatches=1, ppo_epochs=2, max_grad_norm=1e9, max_response_length=8, **dict(overrides)
        )
        learner = rc_train.Learner(accelerator, host, model, optimizer, scheduler)
        _, actor, _ = rc_train.update_policy(
            args=args,
            correction=correction,
            learner=learner,
            batch=batch,
            tensors=dict(tensors),
            generator=torch.Generator().manual_seed(rank),
            batch_correction={},
        )
        weights = dict(rc_run.full_weights(accelerator.unwrap_model(model)))
        results[(name, rank)] = {
            "per_step": per_step,
            "pg_loss": actor["actor/pg_loss"],
            "grad_norm": actor["actor/grad_norm"],
            "delta": {k: (weights[k] - v).clone() for k, v in initial.state_dict().items()},
        }
    dist.destroy_process_group()


def _spawn_or_fail(worker, args, timeout):
    """Run `worker` on 2 processes; a run that does not end within `timeout` s (a hung collective) is killed and
    fails the test."""
    context = mp.spawn(worker, args=args, nprocs=2, join=False)
    deadline = time.time() + timeout
    while not context.join(timeout=max(0.1, deadline - time.time())):
        if time.time() > deadline:
            for p in context.processes:
                p.kill()
            pytest.fail(f"the 2 ranks did not finish within {timeout} s: a collective hung")


@pytest.mark.parametrize("share_prompt_prefix", [False, True])
def test_ddp_reduces_gradients_once_per_optimizer_step(share_prompt_prefix):
    """DDP decides at forward time whether a backward all-reduces (DistributedDataParallel.no_sync), so every
    non-final micro-batch must run its forward, loss and backward under no_sync: 4 micro-batches per optimizer step,
    2 optimizer steps, exactly one reduction round in each."""
    results = mp.Manager().dict()
    runs = [("count", {"micro_batch_size": 2, "share_prompt_prefix": share_prompt_prefix})]
    _spawn_or_fail(_ddp_update_worker, (2, _free_port(), results, runs, None), timeout=300)
    for rank in (0, 1):
        assert results[("count", rank)]["per_step"] == [1, 1], results[("count", rank)]["per_step"]


def test_fsdp2_reduce_scatters_once_per_optimizer_step():
    """FSDP2 (rc_run.accumulating: set_requires_gradient_sync) reduce-scatters each sharded module's gradients on
    the last micro-batch only: 4 micro-batches per optimizer step reduce as often as 1."""
    results = mp.Manager().dict()
    runs = [("four", {"micro_batch_size": 2, "fsdp": True}), ("one", {"micro_batch_size": 8, "fsdp": True})]
    _spawn_or_fail(_ddp_update_worker, (2, _free_port(), results, runs, None), timeout=300)
    for rank in (0, 1):
        four, one = results[("four", rank)]["per_step"], results[("one", rank)]["per_step"]
        assert four == one and one[0] == one[1] > 0, (four, one)
        assert results[("four", rank)]["grad_norm"] == pytest.approx(results[("one", rank)]["grad_norm"], rel=1e-6)


def test_a_token_budget_under_ddp_neither_hangs_nor_changes_the_update():
    """Rank 1's sequences are long and rank 0's short: a token budget of 20 cuts rank 1's minibatch into 8
    micro-batches and rank 0's into 2. Every rank must run as many (each reduction and buffer broadcast is a
    collective); the loss has global denominators, so the update equals the one without a budget."""
    import rc_forward

    for rank, count in ((0, 2), (1, 8)):  # what the budget alone cuts on each rank
        batch, _ = _rank_batch(rank, 8, long=rank == 1)
        assert len(rc_forward.cut_micro_batches(torch.arange(8), batch, 8, 20, by_group=True)) == count
    results = mp.Manager().dict()
    runs = [("budget", {"micro_batch_size": 8, "max_tokens_per_micro_batch": 20}), ("plain", {"micro_batch_size": 8})]
    _spawn_or_fail(_ddp_update_worker, (2, _free_port(), results, runs, 1), timeout=120)
    for rank in (0, 1):
        budget, plain = results[("budget", rank)], results[("plain", rank)]
        assert budget["per_step"] == plain["per_step"] == [1, 1]
        # float64 weights, float32 log-probs (rc_forward.log_probs_from_logits): another grouping rounds them otherwise
        # in their last bit (measured: 7.5e-8 of the largest weight change after 2 steps); a micro-batch lost or
        # counted twice would move them by ~1/8
        assert budget["pg_loss"] == pytest.approx(plain["pg_loss"], rel=1e-8)
        assert budget["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-6)
        for name, delta in plain["delta"].items():
            torch.testing.assert_close(budget["delta"][name], delta, rtol=0, atol=1e-6 * float(delta.abs().max()))
    for name in plain["delta"]:  # the replicas agree
        assert torch.equal(results[("budget", 0)]["delta"][name], results[("budget", 1)]["delta"][name])


# ---- final/: the base model's dtype, streamed shard by shard ----------------------------------------------------
class _Tokenizer:
    def save_pretrained(self, path):
        with open(os.path.join(path, "tokenizer.json"), "w") as f:
            f.write("{}")


def _trained_from_a_bf16_base(base_dir):
    """A bf16 checkpoint loaded as rc_train.py loads it (dtype="auto", then fp32 master weights), then 'trained':
    moved off bf16's grid, so that the cast to bf16 at the save is a real rounding."""
    from transformers import AutoModelForCausalLM

    import tasks

    if not os.path.isdir(base_dir):
        tasks.make_qwen2(vocab_size=50, eos=0, hidden=64, layers=2, intermediate=64, seed=0).to(
            torch.bfloat16
        ).save_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype="auto").float()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 1e-3)
    return model


def _check_final(final, trained):
    from transformers import AutoModelForCausalLM

    config = json.loads((final / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["architectures"] == ["Qwen2ForCausalLM"]
    loaded = AutoModelForCausalLM.from_pretrained(final, dtype="auto")
    assert loaded.dtype == torch.bfloat16
    expected = {k: v.to(torch.bfloat16) for k, v in trained.state_dict().items()}
    got = loaded.state_dict()
    assert got.keys() == expected.keys()
    for name, value in expected.items():  # the trained weights cast to the base dtype, bit for bit
        assert torch.equal(got[name], value), name
    assert any(not torch.equal(v.float(), trained.state_dict()[k]) for k, v in got.items())  # really bf16
    assert (final / "tokenizer.json").exists()


def test_final_weights_are_saved_in_the_base_dtype_shard_by_shard(tmp_path):
    from safetensors import safe_open

    trained = _trained_from_a_bf16_base(str(tmp_path / "base"))
    accelerator = types.SimpleNamespace(unwrap_model=lambda m: m, is_main_process=True)
    written = []
    import safetensors.torch

    save_file = safetensors.torch.save_file

    def recording_save_file(tensors, path, metadata=None):
        written.append(sorted(tensors))
        return save_file(tensors, path, metadata=metadata)

    safetensors.torch.save_file = recording_save_file
    try:
        rc_run.save_final(str(tmp_path / "run"), trained, _Tokenizer(), accelerator, max_shard_bytes=20_000)
    finally:
        safetensors.torch.save_file = save_file
    final = tmp_path / "run" / "final"
    index = json.loads((final / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == len(written) > 2 and all(len(w) <= 4 for w in written)  # each shard as soon as it filled
    assert "lm_head.weight" not in index["weight_map"]  # tied: stored once, as the embedding
    assert index["metadata"]["total_size"] == sum(
        v.numel() * 2 for k, v in trained.state_dict().items() if k != "lm_head.weight"
    )
    for file in files:
        with safe_open(final / file, "pt") as f:
            assert f.metadata() == {"format": "pt"}
    _check_final(final, trained)
    rc_run.save_final(str(tmp_path / "one"), trained, _Tokenizer(), accelerator)  # below the default shard size
    assert sorted(p.name for p in (tmp_path / "one" / "final").glob("model*")) == ["model.safetensors"]
    _check_final(tmp_path / "one" / "final", trained)


def _fsdp_final_worker(rank, world, port, base_dir, run_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = rc_run.shard_model(_trained_from_a_bf16_base(base_dir), "cpu")
    accelerator = types.SimpleNamespace(unwrap_model=lambda m: m, is_main_process=rank == 0)
    rc_run.save_final(run_dir, model, _Tokenizer(), accelerator, max_shard_bytes=20_000)
    dist.destroy_process_group()


def test_final_weights_from_fsdp2_shards_equal_the_unsharded_ones(tmp_path):
    trained = _trained_from_a_bf16_base(str(tmp_path / "base"))  # writes the base the ranks load
    _spawn_or_fail(_fsdp_final_worker, (2, _free_port(), str(tmp_path / "base"), str(tmp_path / "run")), 300)
    _check_final(tmp_path / "run" / "final", trained)


def _fsdp_push_worker(rank, world, port, results):
    """One FSDP2 rank streaming the weight push (rc_run.full_weights) of a tiny tied Qwen2, its all-gathers counted."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.tensor import DTensor

    import tasks

    model = tasks.make_qwen2(vocab_size=50, eos=0, hidden=64, layers=2, intermediate=64, seed=0)
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    model = rc_run.shard_model(model, "cpu")
    gathers, full_tensor = [0], DTensor.full_tensor

    def counting_full_tensor(self, *a, **kw):
        gathers[0] += 1
        return full_tensor(self, *a, **kw)

    DTensor.full_tensor = counting_full_tensor
    pushed = [(name, t.clone()) for name, t in rc_run.full_weights(model)]
    DTensor.full_tensor = full_tensor
    results[rank] = {
        "names": [n for n, _ in pushed],
        "state_dict_names": list(model.state_dict()),
        "parameters": len(list(model.parameters())),
        "gathers": gathers[0],
        "equal": all(torch.equal(t, plain[n]) for n, t in pushed),
        "tied": model.config.tie_word_embeddings,
    }
    dist.destroy_process_group()


def test_fsdp2_weight_push_gathers_a_tied_lm_head_once():
    """A tied lm_head is the embedding under a second name: the push hands it to the engine under both names (vLLM's
    CPU build keeps its own packed copy of the output layer), in state-dict order, but all-gathers it once (before, a
    second full gather of the largest tensor at every sync)."""
    results = mp.Manager().dict()
    _spawn_or_fail(_fsdp_push_worker, (2, _free_port(), results), 300)
    for rank in (0, 1):
        r = results[rank]
        assert r["tied"] and "lm_head.weight" in r["names"], r
        assert r["names"] == r["state_dict_names"] and r["equal"], r
        assert r["gathers"] == r["parameters"] == len(r["names"]) - 1, r  # one name fewer: the tied one


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


def test_restore_rng_from_a_checkpoint(tmp_path):
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
    torch.manual_seed(1)  # whatever ran in between
    rc_checkpoint.restore_rng(str(tmp_path), 0)
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
    assert rc_checkpoint.check_run_dir(str(tmp_path), resume=True, overwrite=False, world=1) is False
    with pytest.raises(ValueError, match="written by 1 process.*this run has 2"):
        rc_checkpoint.check_run_dir(str(tmp_path), resume=True, overwrite=False, world=2)


def test_resume_with_another_staleness_bound_is_refused(tmp_path):
    """The batches in flight of a --max-staleness k checkpoint were sampled for that schedule; an older checkpoint
    (no max_staleness recorded) was written by the synchronous loop, k = 0."""
    import json

    ckpt = tmp_path / "checkpoints" / "step_000001"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(
        json.dumps({"step": 1, "position": 8, "world_size": 1, "max_staleness": 2})
    )
    assert rc_checkpoint.check_run_dir(str(tmp_path), resume=True, overwrite=False, max_staleness=2) is False
    with pytest.raises(ValueError, match="--max-staleness 2, this run has --max-staleness 1"):
        rc_checkpoint.check_run_dir(str(tmp_path), resume=True, overwrite=False, max_staleness=1)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 1, "position": 8, "world_size": 1}))
    with pytest.raises(ValueError, match="--max-staleness 0, this run has --max-staleness 1"):
        rc_checkpoint.check_run_dir(str(tmp_path), resume=True, overwrite=False, max_staleness=1)


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
            saved = rollouts.wait_queued(step)
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


# ---- The health check at run time -----------------------------------------------------------------------------
def test_health_watch_says_when_a_check_fires_and_clears_and_counts_steps():
    lines = []
    watch = rc_run.HealthWatch(lines.append)
    healthy = {"rollout_corr/rollout_is_eff_sample_size": 0.9, "rollout_corr/kl": 0.01}
    sick = {"rollout_corr/rollout_is_eff_sample_size": 0.2, "rollout_corr/kl": -0.3}
    assert watch.check(0, healthy) == {"health/is_ess": 0.0, "health/kl": 0.0}  # absent metrics: no key
    assert watch.check(1, sick) == {"health/is_ess": 1.0, "health/kl": 1.0}
    assert watch.check(2, sick) == {"health/is_ess": 1.0, "health/kl": 1.0}  # still firing: no new line
    assert watch.check(3, {**sick, "rollout_corr/kl": 0.05})["health/kl"] == 0.0
    assert len(lines) == 3 and all(line.startswith("health: ") for line in lines)
    assert "step 1" in lines[0] and "health/is_ess" in lines[0] and "< 0.3" in lines[0]
    assert "step 1" in lines[1] and "|rollout_corr/kl| = -0.3" in lines[1] and "> 0.1" in lines[1]
    assert lines[2] == "health: step 3: health/kl clears (rollout_corr/kl = 0.05)"
    assert watch.summary(4) == "health checks fired: health/is_ess on 3 of 4 steps, health/kl on 2 of 4 steps"
    assert rc_run.HealthWatch().summary(4) == "health checks: none fired"
