"""The rollout engine: everything that talks to vLLM, and the schedule of which versions sampled a step's batch.

What belongs here starts, feeds, asks or stops an engine: its scheduler limits, device placement, logs and GPU memory
(sleep and wake), the in-place weight load, the sampling seeds, generation with processed log-probs, an MoE engine's
expert prepack after a load and its routing capture (MoEEngine, docs/moe.md), the lab's engine-side mismatch dials
(weights the engine receives, planted tokens), the engine in the trainer's process and the rollout worker process, and
the staleness schedule, the replay buffer (ReplayBuffer: whole groups of earlier steps, each with its own version,
docs/async.md §8) and the trainer's weights of those versions (KeptVersions: each row scored at the weights that
sampled it, docs/corrections.md §6.9). rc_train.py starts its engine (make_engine), asks `Rollouts` for
the batch of a step (take), hands it the new weights after each update (sync), queues the batch k steps ahead
(request) and asks it for greedy evaluations (evaluate). What crosses a process boundary is a named tuple: a
`Request` in, a `Result` of `Response`s out.

Policy versions. Version v is the trainer's weights after v updates (one update per rollout batch, however many
optimizer steps it takes: those are PPO's own off-policy steps, measured by actor/ppo_kl). The trainer holds version
t while it trains on the batch of step t. With --max-staleness k the batch of step t is sampled by version
max(0, t - k), fixed by the schedule, never by timing:

    start:                 queue the batches of steps 0..k (sampled by the initial weights)
    after the update of t: load version t+1, then queue the batch of step t+1+k

A batch is queued when a step takes it, or when a checkpoint keeps it: a checkpoint after the update of t holds the
batches of steps t+1..t+k, also those past the run's last step (Rollouts.wanted), so that a run continued past its
end (--resume with a larger --num-steps) trains on the very batches the uninterrupted run samples.

The engine answers its requests in order, so the batch of step t+1+k is sampled by version t+1; and it loads
weights only between two generations, never during one, so every token of a response comes from one version and
the response's version is its batch's. Staleness = trainer version - sample version = min(t, k). A sample whose
staleness exceeds the bound is never admitted by this schedule; rc_train.py still checks every sample against the
bound and drops (and counts) any that would exceed it, so a broken schedule shows up as rollout/dropped_samples
instead of silently training on older data (verl #4449: a "bound 0" mode that was really one step off).

Where the engine runs (measured on the 2-core CPU machines; docs/async.md has the table):
* k = 0: in the trainer's process (LocalEngine). Generation and update alternate, as in the synchronous loop.
* k >= 1 (or --rollout-worker at k = 0): a rollout worker process of our own holding an in-process engine
  (RolloutWorker), with the weights handed over in shared memory. It overlapped best of three arrangements: a
  thread in the trainer's process pays the GIL during the update (wall 0.86 of rollout + update against 0.77), and
  vLLM's own engine-core process serialises every request and would not take tensors through collective_rpc.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import logging
import os
import queue
import random
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import torch

import rc_config
import rc_core
import rc_forward
import rc_run


@dataclass
class EngineArgs:
    """Where and with how much memory the vLLM engine runs (rc_train.Args inherits these flags; docs/running.md)."""

    vllm_gpu_memory_utilization: float = 0.3
    """GPU: share of GPU memory for the colocated engine (weights + KV cache)"""
    vllm_kv_cache_gb: float = 1.0
    """CPU: KV-cache size of the engine in GiB (VLLM_CPU_KVCACHE_SPACE)"""
    vllm_max_num_seqs: int | None = None
    """sequences the engine runs at once (None = this rank's rollout batch: one wave holds it)"""
    vllm_max_num_batched_tokens: int | None = None
    """tokens the engine schedules per step (None: on CPU the batch's prompt tokens within [max_model_len, 65536], at
    least --max-model-len since CPU prefills are never split; on GPU vLLM's default)"""
    vllm_sleep: bool = True
    """GPU: the engine sleeps during the update; wakes its weights for a sync, its KV cache too for rollout"""
    vllm_sleep_level: int | None = None
    """GPU: 1 = weights offloaded to CPU RAM while asleep; 2 = weights discarded (least memory; needs --sync-every 1);
    None = 2 when every rollout follows a fresh push (--sync-every 1, a dense model), else 1 (sleep_level)"""
    vllm_v1_runner: bool = False
    """GPU: vLLM's V1 model runner (and sampler), not its default V2; --rollout-corrupt-prob > 0 needs it and turns it
    on, and a lab sweep over that dial pins it in every cell, so that its levels share one sampler (start_engine)"""
    rollout_worker: bool = False
    """run the engine in the rollout worker process at --max-staleness 0 too (same samples as in this process)"""


@dataclass
class DialArgs:
    """The lab's mismatch dials (lab/README.md): each off by default, each makes the engine's mu differ from the
    trainer's pi in one documented way (--rollout-dtype and --sync-every are dials too)."""

    rollout_weight_quant: Literal["none", "int8", "int4"] = "none"
    """engine gets fake-quantised weights (symmetric, per output channel, matrices only): INT8/INT4 rollout (FlashRL)"""
    rollout_weight_noise: float = 0.0
    """engine gets weights + s*rms(W)*eps, a fixed seeded eps per matrix (s = this value): a kernel-error dial"""
    rollout_corrupt_prob: float = 0.0
    """per sampled token, chance that the engine samples a uniformly random token, reported with mu = 1 (the veto)"""
    rollout_temperature: float | None = None
    """engine samples at this temperature while the trainer scores at --temperature; None = same"""
    rollout_logprobs: Literal["processed", "raw"] = "processed"
    """engine log-probs after temperature/top-p (processed: the sampling distribution) or before (raw: trl#4159)"""


# ---------------------------------------------------------------------------------------------
# Starting the engine: scheduler limits, device placement, logs, GPU memory (sleep and wake)
# ---------------------------------------------------------------------------------------------
def engine_limits(args, world: int, longest_prompt: int, on_gpu: bool) -> dict:
    """Scheduler settings of the engine: one wave holds this rank's whole rollout batch.

    CPU: chunked prefill is off, so no prefill is ever split across engine steps. vLLM rewinds the random
    generator of a seeded request whose prompt was only partly prefilled (its sampled token is discarded),
    and CPU generators cannot rewind: a split prefill crashed the first rollout ("CPU Generator does not use
    offset") with GSM8K-length prompts. Without chunking, a prompt waits for the next step instead, which only
    needs a step budget >= --max-model-len (checked in validate_args). GPU generators rewind fine: chunked
    prefill stays on there and the budget is passed only when set."""
    batch = rc_config.rollout_batch_size(args, world)
    if args.partial_rollout:  # two steps' groups in flight, each response's prefix part of its prompt
        batch, longest_prompt = 2 * batch, longest_prompt + args.max_response_length
    max_num_seqs = args.vllm_max_num_seqs or batch
    tokens = args.vllm_max_num_batched_tokens
    if tokens is None and not on_gpu:
        tokens = min(max(batch * longest_prompt, args.max_model_len), max(65536, args.max_model_len))
    limits = dict(max_num_seqs=max_num_seqs)
    if tokens is not None:
        limits["max_num_batched_tokens"] = max(tokens, max_num_seqs)
    if not on_gpu:
        limits["enable_chunked_prefill"] = False
    return limits


def engine_placement(on_gpu: bool, rank: int, local_rank: int, world: int) -> tuple[dict, dict]:
    """(vLLM keyword arguments, environment variables) that give each rank's engine its own device.

    GPU, several processes: vLLM's default in-process executor takes its device from a plain 'cuda' and makes GPU 0
    current on every rank, so every rank's engine would land on GPU 0. The 'external_launcher' executor (the way
    TRL's colocate mode starts vLLM) instead joins the launcher's processes: each engine runs on the rank's local
    GPU (tensor-parallel size 1: one engine per GPU, each sampling its own shard of the prompts). It reads the
    launcher's RANK / LOCAL_RANK / WORLD_SIZE. CPU, or one GPU: the default executor is right."""
    if not on_gpu or world == 1:
        return {}, {}
    env = {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world)}
    return {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": 1}, env


def start_engine(args, model_path: str, seed: int, limits: dict, log_path: str, placement: dict):
    """vLLM in this process; its log lines and start-up output go to log_path (the run's engine.log).
    limits: engine_limits; placement: engine_placement (each rank's engine on its own GPU)."""
    kwargs = dict(
        model=model_path,
        dtype=args.rollout_dtype,
        seed=seed,
        max_model_len=args.max_model_len,
        # processed: temperature/top-p applied, i.e. the distribution that sampled ('raw' is a lab dial)
        logprobs_mode=f"{args.rollout_logprobs}_logprobs",
        # off while the MoE routing is captured: a prompt position served from the cache is never computed, so its
        # routing would be missing (MoEEngine)
        enable_prefix_caching=not rc_config.routing_capture(args),
        **limits,
        **placement,
    )
    if args.rollout_corrupt_prob > 0:  # the veto lab's sampler dial (planted_tokens_processor)
        kwargs["logits_processors"] = [planted_tokens_processor()]
    if torch.cuda.is_available():
        kwargs.update(gpu_memory_utilization=args.vllm_gpu_memory_utilization, enable_sleep_mode=args.vllm_sleep)
        if args.rollout_corrupt_prob > 0 or args.vllm_v1_runner:
            # On CUDA, vLLM 0.32 defaults to its V2 model runner, whose logits-processor loader refuses V1
            # LogitsProcessor subclasses (PlantedTokens is one): keep the V1 runner (vllm/envs.py,
            # VllmConfig.use_v2_model_runner in vllm/config/vllm.py). Read at engine start, so set before LLM().
            # The two runners sample with different code, so a sweep over --rollout-corrupt-prob pins V1 in every
            # cell, level 0 included (--vllm-v1-runner, set by lab/rc_lab.py).
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    else:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(args.vllm_kv_cache_gb)))
        kwargs.update(enforce_eager=True)
    with engine_output_to(log_path), kept_global_rng():
        from vllm import LLM

        llm = LLM(**kwargs)
    # read by load_weights and generate; the model's config says MoE or not (rc_moe.check_model refused the rest)
    moe, on_gpu = llm.llm_engine.model_config.is_moe, torch.cuda.is_available()  # on GPU: vLLM's own update path
    llm.rc_moe = MoEEngine(llm, rc_config.routing_capture(args)) if moe and not on_gpu else None
    return llm


@contextlib.contextmanager
def kept_global_rng():
    """Python's, numpy's and torch's global generators (CUDA's too) as they were before: vLLM seeds them all with
    its engine's seed when the engine starts in this process, and the trainer's seeds (or a resumed run's states)
    must survive it. Checked at start-up: tests/test_train.py runs a resumed and an uninterrupted run alike."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state_all() if cuda else None
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.set_rng_state(state[2])
        if cuda_state is not None:
            torch.cuda.set_rng_state_all(cuda_state)


@contextlib.contextmanager
def output_to(path: str):
    """Send this process's stdout and stderr (file descriptors 1 and 2: C++ warnings and progress bars
    included) to a file for the duration; exceptions still reach the console once restored."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "a") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


class _BenignReloadWarning(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights" after each weight sync. Benign: vLLM's
    layer-wise reload counts the rotary cos/sin cache as a loadable tensor, no checkpoint holds it (it is
    computed from the config, not learnt), and the reload puts the existing cache back. The fp32 tests
    check that the engine's log-probs still match the trainer's to ~1e-8 after every sync."""

    def filter(self, record):
        return not (
            record.getMessage().startswith("RotaryEmbedding") and "Failed to load weights" in record.getMessage()
        )


@contextlib.contextmanager
def engine_output_to(log_path: str):
    """Start the engine inside this block: vLLM's log lines go to log_path (the run's engine.log) from now on, and
    so does everything its start-up prints, C++ warnings and progress bars included (the console stays quiet)."""
    engine_log = logging.getLogger("vllm")
    engine_log.setLevel(logging.INFO)
    engine_log.propagate = False
    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_BenignReloadWarning())
    engine_log.addHandler(handler)
    with output_to(log_path), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


class EngineMemory:
    """Which parts of a sleeping-capable GPU engine are awake, and the order that keeps memory free for training.

    A weight sync wakes the weights only; a generation also wakes the KV cache; sleep() before the update puts
    everything back to sleep (level 1: weights offloaded to CPU RAM, KV cache freed; level 2: both freed, so the
    next weight sync must rewrite every weight). torch.cuda.empty_cache() runs before every wake-up: the trainer's
    cached blocks are returned to the device first, so the engine's memory is really there. On CPU (or with
    --no-vllm-sleep) every call is a no-op: the engine never sleeps."""

    TAGS = ("weights", "kv_cache")

    def __init__(self, llm, enabled: bool, level: int = 1):
        self.llm, self.enabled, self.level = llm, enabled, level
        self.awake = set(self.TAGS)  # a new engine starts awake

    def wake(self, *tags: str) -> None:
        missing = [t for t in self.TAGS if t in tags and t not in self.awake]
        if self.enabled and missing:
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=missing)
        self.awake.update(missing)

    def sleep(self) -> None:
        if self.enabled and self.awake:
            self.llm.sleep(level=self.level)
            self.awake.clear()


@contextlib.contextmanager
def engine_awake(engine: EngineMemory, *tags: str, sleep_after: bool = False):
    """Wake `tags` of the engine for the block; with sleep_after, put it all back to sleep at the end (only after a
    rollout: the update comes next and gets the memory). A weight sync wakes the weights alone and leaves them
    awake: the KV cache sleeps on until the next generation, and a level-2 sleep would discard the new weights."""
    engine.wake(*tags)
    yield
    if sleep_after:
        engine.sleep()


def sleep_level(args, moe: bool = False) -> int:
    """The level the engine sleeps at: --vllm-sleep-level when given, else 2 when every generation that follows a sleep
    follows a fresh weight push, else 1.

    Level 2 frees the weights instead of parking them in pinned host memory (0.92 / 2.9 GiB each way per step at
    0.5B / 1.5B), so an engine woken from it computes with garbage until a push rewrites every weight. The engine
    sleeps only after a sampled rollout (LocalEngine.result; never after a greedy evaluation, and never before its
    first generation: a new engine holds the model's weights, and a resumed run's Rollouts.begin pushes the
    checkpoint's). What follows that sleep is the update, then Rollouts.sync: with --sync-every 1 it pushes version
    t + 1 after every update, the last one included, before the step's evaluation (greedy) and the next rollout, with
    or without a weight dial (Rollouts.evaluate pushes the unperturbed weights, then the perturbed ones). With
    --sync-every m > 1 or 0 a rollout follows a sleep without a push: level 1 (level 2 is refused there,
    rc_config._check_engine). The rollout worker (--max-staleness >= 1, CPU only) never sleeps. An MoE model stays at
    level 1 unless asked: its GPU update path is not verified (docs/moe.md), and level 2 would turn any weight the push
    leaves out into garbage where level 1 keeps the old one; benchmarks/sleep_level_check.py compares the two levels
    token for token on a dense model."""
    if args.vllm_sleep_level is not None:
        return args.vllm_sleep_level
    return 2 if args.sync_every == 1 and not moe else 1


def engine_memory_metrics(engine, args) -> dict:
    """The engine's GPU memory this step, in GiB ({} on a CPU): perf/engine_budget_gib, the share vLLM may take
    (--vllm-gpu-memory-utilization x the device's memory), and, for a sleeping engine in this process (LocalEngine
    with --vllm-sleep), perf/engine_memory_gib: what its sleep-mode pool holds when awake, the weights and the KV
    cache (its sleep-mode allocator's get_current_usage, which counts them asleep or awake)."""
    if not torch.cuda.is_available():
        return {}
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    metrics = {"perf/engine_budget_gib": args.vllm_gpu_memory_utilization * total / 2**30}
    memory = getattr(engine, "memory", None)  # a LocalEngine's EngineMemory; a rollout worker's is in its process
    if memory is not None and memory.enabled:
        from vllm.device_allocator import get_mem_allocator_instance  # CuMemAllocator on CUDA

        metrics["perf/engine_memory_gib"] = get_mem_allocator_instance().get_current_usage() / 2**30
    return metrics


# ---------------------------------------------------------------------------------------------
# Mismatch dials of the lab (lab/README.md): the weights the engine receives, planted tokens
# ---------------------------------------------------------------------------------------------
def fake_quantise(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """Symmetric per-output-channel round-to-nearest: W_q = s * clamp(round(W / s), -q, q), s = max|W_row| / q,
    q = 2^(bits-1) - 1. The weight-only INT8/INT4 scheme whose rollout mismatch FlashRL (Yao et al. 2025)
    measures; quantisation happens once per sync, like a calibration-free quantised engine."""
    q = 2 ** (bits - 1) - 1
    scale = weight.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / q
    return (weight / scale).round().clamp(-q, q) * scale


def has_weight_dial(args) -> bool:
    """True when the engine is sent perturbed weights (--rollout-weight-quant or --rollout-weight-noise)."""
    return args.rollout_weight_quant != "none" or args.rollout_weight_noise > 0


def rollout_weights(weights, args):
    """The (name, tensor) pairs the engine receives: the trainer's, or perturbed copies when a weight dial is on.

    Only matrices (dim >= 2: projections, embedding/lm_head) are perturbed; norms and biases are kept, as weight-only
    quantisers do. The noise eps is drawn on the tensor's device from a generator seeded by (--seed, tensor index),
    so every sync sends the same perturbation pattern (a persistent error, like a quantiser's, not fresh noise) and a
    GPU draws it on the GPU. One tensor at a time: the pairs stream through (no second copy of the model here; a
    rollout worker's load copies them, RolloutWorker.load)."""
    if not has_weight_dial(args):
        yield from weights
        return
    for i, (name, w) in enumerate(weights):
        if w.dim() >= 2 and w.is_floating_point():
            w = w.detach().float()
            if args.rollout_weight_noise:
                gen = torch.Generator(device=w.device).manual_seed(args.seed * 100_003 + i)
                eps = torch.randn(w.shape, generator=gen, device=w.device)
                w = w + args.rollout_weight_noise * w.pow(2).mean().sqrt() * eps
            if args.rollout_weight_quant != "none":
                w = fake_quantise(w, int(args.rollout_weight_quant[3:]))
        yield name, w


CORRUPT_KEY = "rc_corrupt_prob"  # SamplingParams.extra_args key that switches PlantedTokens on for a request


def planted_tokens_processor():
    """The vLLM logits processor behind --rollout-corrupt-prob (imported lazily: vLLM is heavy).

    At each decoding step of a request that carries extra_args[CORRUPT_KEY] = p, with probability p the row's
    distribution is replaced by a point mass on a token drawn uniformly from the vocabulary. The engine then
    samples that token and, with processed log-probs, reports mu = 1 for it, while the trainer's pi gives it
    roughly 1/vocab or far less: a planted catastrophic token, the failure the worst-token veto is built to catch
    (docs/corrections.md §4.5). Requests without the key (greedy evaluation) are left alone."""
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates

    class PlantedTokens(LogitsProcessor):
        def __init__(self, vllm_config, device, is_pin_memory):
            self.prob: dict[int, float] = {}  # persistent-batch row -> corruption probability
            self.gen = torch.Generator(device="cpu").manual_seed(vllm_config.model_config.seed or 0)

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            def prob(params, _prompt, _output):
                p = (params.extra_args or {}).get(CORRUPT_KEY, 0.0)
                return float(p) if p else None

            process_dict_updates(self.prob, batch_update, prob)

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            if not self.prob:
                return logits
            rows = torch.tensor(sorted(self.prob), dtype=torch.long)
            chance = torch.tensor([self.prob[r] for r in rows.tolist()])
            draw = torch.rand(len(rows), generator=self.gen)
            token = torch.randint(logits.shape[-1], (len(rows),), generator=self.gen)
            hit = draw < chance
            if hit.any():
                rows, token = rows[hit].to(logits.device), token[hit].to(logits.device)
                logits[rows] = float("-inf")
                logits[rows, token] = 0.0
            return logits

    return PlantedTokens


# ---------------------------------------------------------------------------------------------
# Weights in, samples out: the in-place weight load, the sampling seeds, generation with processed log-probs
# ---------------------------------------------------------------------------------------------
class Response(NamedTuple):
    """One sampled response: its token ids, the engine's log-prob of each (processed: the distribution that sampled
    it; empty for a greedy one), its text, and with the MoE routing capture (MoEEngine) the experts the engine routed
    each position to: int16 [prompt + response tokens, MoE layers, top-k], ids ascending, -1 where nothing was
    computed (the last sampled token is never fed to the model); None otherwise (greedy, dense, capture off)."""

    token_ids: list[int]
    log_probs: list[float]
    text: str
    routed_experts: np.ndarray | None = None
    versions: list[int] | None = None  # --partial-rollout: the version that sampled each token (PartialRollouts)


class Request(NamedTuple):
    """A generation asked of an engine: n responses to each prompt (token ids), prompt i seeded by
    sampling_seed(*seed_keys, first_index + i); greedy (evaluation) at temperature 0, without log-probs."""

    prompts: list[list[int]]
    n: int
    seed_keys: tuple = ()
    first_index: int = 0
    greedy: bool = False
    rows: tuple = ()  # --partial-rollout: the train row of each prompt ...
    keys: tuple = ()  # ... and its seed keys (PartialRollouts; whole responses need neither)


class Result(NamedTuple):
    """An engine's answer to a Request: the policy version that sampled it, per prompt its n Responses, the seconds
    spent generating and the seconds the engine sat idle before it started."""

    version: int
    groups: list[list[Response]]
    generating_s: float
    idle_s: float
    rows: list[int] | None = None  # --partial-rollout: each group's train row (PartialRollouts)...
    carried: list | None = None  # ... and the responses it left unfinished (the state the next request continues)


def load_weights(llm, weights) -> None:
    """Reload (name, tensor) pairs into the engine in place, then drop its prefix cache: the cached KV was computed
    with the old weights (a cache kept across a load made the KL grow for a peer). An MoE engine on CPU then
    prepacks its expert weights again (MoEEngine.after_load): vLLM 0.32 skips that on an update."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    moe = getattr(llm, "rc_moe", None)
    if moe is not None:
        moe.after_load()
    llm.reset_prefix_cache()


# ---------------------------------------------------------------------------------------------
# Mixture-of-Experts engines (docs/moe.md): the expert prepack after a weight push, the routing capture
# ---------------------------------------------------------------------------------------------
VLLM_MOE_INTERNALS = (
    # (module, attribute path): what MoEEngine relies on in vLLM 0.32 (docs/moe.md "The weight push")
    ("vllm.model_executor.layers.fused_moe.runner.moe_runner", "MoERunner"),
    ("vllm.model_executor.layers.fused_moe.router.base_router", "BaseRouter.set_capture_fn"),
    ("vllm.model_executor.layers.fused_moe.experts.cpu_moe", "CPUUnquantizedExperts.process_weights_after_loading"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._model_forward"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.execute_model"),
)


def check_vllm_moe_internals() -> None:
    """Raise RuntimeError naming the first vLLM internal that MoEEngine relies on and this vLLM lacks (before an
    engine starts: rc_moe.check_model)."""
    import importlib

    with output_to(os.devnull):  # vLLM's import-time notes (Triton) stay off the console
        import vllm

        modules = {module: importlib.import_module(module) for module, _ in VLLM_MOE_INTERNALS}
    for module, path in VLLM_MOE_INTERNALS:
        obj = modules[module]
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                raise RuntimeError(
                    f"vLLM {vllm.__version__} has no {module}.{path}, which the MoE weight push and routing capture "
                    f"rely on (written against vLLM 0.32; docs/moe.md)"
                )


class MoEEngine:
    """What an in-process vLLM engine of a Mixture-of-Experts model needs beside the dense path (docs/moe.md).

    The weight push. On the CPU build, vLLM 0.32 prepacks the expert weights into its grouped-GEMM layout once, at
    load (CPUUnquantizedExperts.process_weights_after_loading); an in-place update (reload_weights) copies the new
    checkpoint-layout weights into the packed parameters and never packs them again (unquantized_fused_moe_method.py,
    _setup_kernel), so the engine computes with garbage and says nothing (measured while building this: routing
    agreement 0.52, |log p error| 5.35 nats after a perturbed push; tests/test_moe.py: 0.84 nats after an identity
    push of the tiny MoE). after_load() runs the prepack again on every MoE layer (~0.02 s). Built for the CPU engine
    only: on GPU start_engine makes none, and the engine's own update path runs as is (not verified here).

    The routing capture (capture=True; CPU engine only: vLLM's own enable_return_routed_experts needs its V2 runner,
    which the CPU build cannot run). vLLM's routers call a capture function with the logical top-k expert ids of every
    token of a forward (BaseRouter.set_capture_fn, the hook of the native feature); a wrapper around the runner's
    _model_forward splits the forward's rows by request (input_batch.req_ids, num_scheduled_tokens of the
    execute_model call) and reads each row's position. begin() clears the store before a generation, routed() returns
    a request sample's [positions, layers, k] array after it. Both need the engine in this process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0, as rc_train.py sets). Prompt positions served from the prefix cache would never
    be computed, so an engine that captures runs without prefix caching (start_engine)."""

    def __init__(self, llm, capture: bool):
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        self.runner = llm.collective_rpc(lambda worker: worker.model_runner)[0]  # the live object (in-process engine)
        self.layers = sorted((m for m in self.runner.model.modules() if isinstance(m, MoERunner)), key=_layer_id)
        if not self.layers:
            raise RuntimeError("the engine's model is MoE by its config, but vLLM built no MoERunner layer")
        self.top_k = self.layers[0].router.top_k
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

        for m in self.layers:
            experts = getattr(getattr(m.routed_experts.quant_method, "moe_kernel", None), "fused_experts", None)
            if not isinstance(experts, CPUUnquantizedExperts):
                raise RuntimeError(
                    f"MoE layer {m.layer_id} of the engine runs {type(experts).__name__}, not the "
                    f"CPUUnquantizedExperts whose prepack every weight push repeats (docs/moe.md)"
                )
        self.capturing, self.enabled = capture, False
        self.step: dict[int, torch.Tensor] = {}  # MoE layer -> top-k ids of the current forward's rows
        self.store: dict[str, list] = {}  # engine request id -> [(positions, ids [rows, layers, k]), ...]
        self.by_sample: dict[str, list] | None = None  # the store by '{sample}_{request}' (routed)
        if capture:
            for index, m in enumerate(self.layers):
                m.router.set_capture_fn(functools.partial(self._capture, index))
            self._wrap_runner()

    def after_load(self) -> None:
        """Prepack every layer's experts again, from the weights the reload just wrote (CPU; see the class)."""
        for m in self.layers:
            m.routed_experts.quant_method.moe_kernel.fused_experts.process_weights_after_loading(m.routed_experts)

    def _capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        if self.enabled:
            self.step[layer] = topk_ids.clone()

    def _wrap_runner(self) -> None:
        """Keep each step's scheduled tokens per request (execute_model) and file each forward's captured rows under
        their requests (_model_forward)."""
        runner = self.runner
        execute_model, model_forward = runner.execute_model, runner._model_forward

        def execute(scheduler_output, *args, **kwargs):
            self.scheduled = scheduler_output.num_scheduled_tokens  # {engine request id: tokens in this step}
            return execute_model(scheduler_output, *args, **kwargs)

        def forward(*args, **kwargs):
            self.step.clear()
            out = model_forward(*args, **kwargs)
            if self.enabled:
                self._keep(kwargs["positions"])
            return out

        runner.execute_model, runner._model_forward = execute, forward

    def _keep(self, positions: torch.Tensor) -> None:
        """Split one forward's captured rows by request: the runner lays the requests out in input_batch order, each
        with its scheduled tokens; padding rows (if any) come last."""
        requests = self.runner.input_batch.req_ids
        counts = [self.scheduled.get(r, 0) for r in requests]
        n = sum(counts)
        if len(self.step) != len(self.layers) or n > len(positions) or any(len(t) < n for t in self.step.values()):
            raise RuntimeError(
                f"routing capture: {len(self.step)} of {len(self.layers)} MoE layers reported, {n} scheduled tokens "
                f"for {len(positions)} positions (vLLM's runner changed?)"
            )
        ids = torch.stack([self.step[i][:n] for i in range(len(self.layers))], 1)
        ids = ids.sort(-1).values.to(torch.int16).cpu()  # vLLM's CPU router takes an unsorted top-k
        positions, first = positions[:n].to("cpu", copy=True), 0  # the runner reuses its buffer next step
        for request, count in zip(requests, counts):
            self.store.setdefault(request, []).append((positions[first : first + count], ids[first : first + count]))
            first += count

    def begin(self) -> None:
        """Before a sampled generation: capture on, store empty."""
        self.store.clear()
        self.by_sample, self.enabled = None, True

    def end(self) -> None:
        self.store.clear()
        self.by_sample, self.enabled = None, False

    def routed(self, request_id: str, n: int, index: int, length: int) -> np.ndarray:
        """Sample `index` of the request `request_id` (RequestOutput.request_id, n samples): its routing over `length`
        positions (prompt + response). vLLM runs sample k of a request of n > 1 as '{k}_{id}-{8 hex}', of n = 1 as
        '{id}-{8 hex}' (vllm/v1/engine/parallel_sampling.py and input_processor.py)."""
        if self.by_sample is None:
            self.by_sample = {}
            for engine_id, chunks in self.store.items():
                self.by_sample.setdefault(engine_id.rsplit("-", 1)[0], []).append(chunks)
        found = self.by_sample.get(f"{index}_{request_id}" if n > 1 else request_id, [])
        if len(found) != 1:
            raise RuntimeError(
                f"routing capture: {len(found)} engine requests hold sample {index} of request {request_id!r} "
                f"(vLLM's request ids changed?)"
            )
        out = np.full((length, len(self.layers), self.top_k), -1, dtype=np.int16)
        for positions, ids in found[0]:  # in order: a recomputed position keeps its latest routing
            keep = positions < length
            out[positions[keep].numpy()] = ids[keep].numpy()
        return out


def _layer_id(module) -> int:
    return module.layer_id


def sampling_seed(*keys: int) -> int:
    """A 62-bit seed hashed from (run seed, step, 0, the prompt's place in the step). vLLM seeds the k-th of the n
    samples of a request with `seed + k`, so consecutive per-prompt seeds would make prompt i+1 replay prompt i's
    random stream shifted by one sample: every prompt then explores the same few tokens (measured: the CPU demo
    collapsed onto one answer). Hashed seeds keep the streams apart and the run reproducible."""
    digest = hashlib.blake2b("/".join(map(str, keys)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def sampling_settings(args) -> dict:
    """SamplingParams of a sampled (not greedy) rollout, but n, max_tokens and the seed."""
    return dict(
        temperature=args.rollout_temperature or args.temperature,
        top_p=args.top_p,
        logprobs=0,
        extra_args={CORRUPT_KEY: args.rollout_corrupt_prob},
    )


def generate(llm, request: Request, args) -> list[list[Response]]:
    """Per prompt of the request, its n Responses.

    Prompt i is seeded with sampling_seed(*seed_keys, first_index + i), so a rollout is reproducible on CPU
    and a prompt gets the same seed whichever rank samples it."""
    prompt_ids, greedy = request.prompts, request.greedy
    from vllm import SamplingParams

    sampling = sampling_settings(args)  # greedy: the defaults at temperature 0
    params = [
        SamplingParams(
            n=request.n,
            max_tokens=args.max_response_length,
            **(
                {"temperature": 0.0}
                if greedy
                else {**sampling, "seed": sampling_seed(*request.seed_keys, request.first_index + i)}
            ),
        )
        for i in range(len(prompt_ids))
    ]
    moe = getattr(llm, "rc_moe", None)
    capture = moe is not None and moe.capturing and not greedy  # greedy evaluation: no routing wanted
    if capture:
        moe.begin()
    try:
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        result = []
        for prompt, out in zip(prompt_ids, outputs):
            group = []
            for o in out.outputs:
                ids = list(o.token_ids)
                lps = [] if greedy else [d[t].logprob if t in d else float("nan") for d, t in zip(o.logprobs, ids)]
                routed = moe.routed(out.request_id, request.n, o.index, len(prompt) + len(ids)) if capture else None
                group.append(Response(ids, lps, o.text, routed))
            result.append(group)
    finally:
        if capture:
            moe.end()
    return result


class PartialRollouts:
    """--partial-rollout (docs/async.md §9): responses that span weight updates. Held by the engine, which answers its
    requests in order, so each request continues what the one before it left unfinished.

    A request admits prompts (its `rows`, each with its seed keys) as groups of n empty responses. The engine then
    works as one that generates --partial-rollout-tokens L tokens a round for every unfinished response, at its
    current version, until `per_rank` groups are complete (every response ended: EOS or --max-response-length), as
    slime stops a rollout once its batch is full, and for one round at least (an engine with unfinished work never
    idles). It returns the `per_rank` complete groups admitted first; the rest stay: their unfinished responses
    continue in the next request, under whatever version the engine holds then, their earlier tokens and log mu kept.
    Every token carries the version that sampled it. The trainer admits one step's prompts per request and two at the
    first (Rollouts.request), so the pool holds 2 x per_rank groups before each emission.

    Done in one engine call: every unfinished response is generated to its end, then cut where the rounds would have
    stopped, at the first round R >= 1 after which per_rank groups are complete (a group completes in round
    ceil(new tokens / L) of its longest response); tokens past R x L new ones are dropped, as an interrupted
    generation's never exist. Sampling at one version draws the same distribution whether a response is generated
    in rounds or at once, and rounds would prefill every response's prefix again each round (measured: 3x the step
    time at L = 8 on the default job). A fresh group is one request of n samples (its prompt prefilled once), seeded
    like a whole-response prompt; a continuation is seeded by (its prompt's seed keys, its index in the group, its
    length so far): deterministic in (seed, step), independent of timing. State: plain lists (state(), for a
    checkpoint), group = [row, prompt, keys, responses], response = [token ids, log mu, versions, finished]."""

    def __init__(self, per_rank: int, state=None):
        self.per_rank, self.groups = per_rank, self._copy(state or [])

    def state(self) -> list:
        return self._copy(self.groups)

    @staticmethod
    def _copy(groups) -> list:
        return [
            [row, list(prompt), tuple(keys), [[*map(list, r[:3]), r[3]] for r in responses]]
            for row, prompt, keys, responses in groups
        ]

    def serve(self, llm, request: Request, version: int, args) -> tuple[list, list]:
        """(per_rank complete groups of Responses, their train rows), admitted first first."""
        for row, prompt, keys in zip(request.rows, request.prompts, request.keys):
            self.groups.append([row, list(prompt), tuple(keys), [[[], [], [], False] for _ in range(request.n)]])
        new = self._generate(llm, args)  # (response, its new tokens, their log mu) per unfinished one
        budget = args.partial_rollout_tokens
        ends = {id(r): -(-len(ids) // budget) for r, ids, _ in new}  # the round in which each response ends
        rounds = sorted(max(ends.get(id(r), 0) for r in g[3]) for g in self.groups)  # ... each group completes
        cut = budget * max(1, rounds[min(self.per_rank, len(rounds)) - 1])
        for r, ids, lps in new:
            r[0] += ids[:cut]
            r[1] += lps[:cut]
            r[2] += [version] * len(ids[:cut])
            r[3] = len(ids) <= cut  # it ended (EOS or the length limit) within the tokens kept
        emitted = [g for g in self.groups if all(r[3] for r in g[3])][: self.per_rank]
        self.groups = [g for g in self.groups if all(g is not e for e in emitted)]
        decode = functools.partial(llm.get_tokenizer().decode, skip_special_tokens=True)
        groups = [[Response(r[0], r[1], decode(r[0]), None, r[2]) for r in g[3]] for g in emitted]
        return groups, [g[0] for g in emitted]

    def _generate(self, llm, args) -> list:
        """Every unfinished response to its end at the engine's weights: [(response, new token ids, their log mu)]."""
        from vllm import SamplingParams

        longest = args.max_response_length
        calls = []  # (engine prompt, n, max tokens, seed, the responses it continues)
        for _, prompt, keys, responses in self.groups:
            if all(not r[3] and not r[0] for r in responses):  # a fresh group: one request of n samples
                calls.append((prompt, len(responses), longest, sampling_seed(*keys), responses))
                continue
            calls += [
                (prompt + r[0], 1, longest - len(r[0]), sampling_seed(*keys, j, len(r[0])), [r])
                for j, r in enumerate(responses)
                if not r[3]
            ]
        if not calls:
            return []
        params = [SamplingParams(n=n, max_tokens=m, seed=seed, **sampling_settings(args)) for _, n, m, seed, _ in calls]
        outputs = llm.generate([{"prompt_token_ids": c[0]} for c in calls], params, use_tqdm=False)
        new = []
        for (*_, responses), out in zip(calls, outputs):
            for r, o in zip(responses, sorted(out.outputs, key=lambda o: o.index)):
                ids = list(o.token_ids)
                new.append((r, ids, [d[t].logprob if t in d else float("nan") for d, t in zip(o.logprobs, ids)]))
        return new


def answer(llm, request: Request, args, generate, partial: PartialRollouts | None, version: int):
    """(groups, rows, carried) of a request: a sampled one through the partial rollouts when they are on (rows and
    carried None otherwise)."""
    if partial is not None and not request.greedy:
        groups, rows = partial.serve(llm, request, version, args)
        return groups, rows, partial.state()
    return generate(llm, request, args), None, None


# ---------------------------------------------------------------------------------------------
# Engines: load(version, weights), submit(tag, Request), result(tag) -> (Result, seconds the caller waited).
# ---------------------------------------------------------------------------------------------
class LocalEngine:
    """vLLM in the trainer's process. A submitted request runs when its result is asked for (the synchronous loop:
    rollout at the start of the step); a load runs at once, so it needs no request to be waiting (k = 0 only).
    On a GPU the engine sleeps during the update (EngineMemory)."""

    def __init__(self, llm, memory: EngineMemory, generate, args, owns_process_group: bool = False, partial=None):
        self.llm, self.memory, self.generate, self.args = llm, memory, generate, args
        self.owns_process_group = owns_process_group  # the engine created this process's default group (world 1)
        self.version, self.waiting, self.idle, self.free_since = 0, {}, 0.0, time.time()
        self.partial = partial  # --partial-rollout: the unfinished responses (PartialRollouts)

    def carry(self, state: list) -> None:
        """A checkpoint's unfinished responses (resume): the next request continues them."""
        self.partial = PartialRollouts(self.partial.per_rank, state)

    def _busy(self):
        self.idle += time.time() - self.free_since

    def load(self, version: int, weights) -> None:
        assert not self.waiting, "the local engine loads weights only when no request waits (--max-staleness 0)"
        self._busy()
        with engine_awake(self.memory, "weights"):  # the KV cache sleeps on until the next generation
            load_weights(self.llm, weights)
        self.version, self.free_since = version, time.time()

    def submit(self, tag, request: Request) -> None:
        self.waiting[tag] = request

    def result(self, tag, keep: bool = False) -> tuple[Result, float]:
        """Generate the request now (`keep` is moot: at k = 0 nothing is asked for twice)."""
        t0 = time.time()
        self._busy()
        request = self.waiting.pop(tag)
        with engine_awake(self.memory, "weights", "kv_cache", sleep_after=not request.greedy):  # the update next
            groups, rows, carried = answer(self.llm, request, self.args, self.generate, self.partial, self.version)
        idle, self.idle, self.free_since = self.idle, 0.0, time.time()
        return Result(self.version, groups, time.time() - t0, idle, rows, carried), time.time() - t0

    def close(self) -> None:
        """At world 1 the engine created the process's torch.distributed groups itself: tear them down now, with
        vLLM's own shutdown (shutdown_engine). Under several ranks the engine runs in the trainer's group, which
        rc_run.exit_cleanly destroys."""
        if self.owns_process_group:
            shutdown_engine(self.llm)


def shutdown_engine(llm) -> None:
    """vLLM's own teardown of an engine in this process (its InprocClient's shutdown: EngineCore.shutdown, then
    cleanup_dist_env_and_memory). At world 1 vLLM's CPU build initialises torch.distributed itself (measured: a gloo
    default group of world 1 on a file:// store in the temp folder, and 12 model-parallel subgroups), which it would
    otherwise destroy only from an interpreter-exit finalizer. Torch's destroy_process_group alone is not enough:
    that finalizer then destroys vLLM's subgroups again and fails ("Invalid process group specified")."""
    llm.llm_engine.engine_core.shutdown()


def exit_with_trainer() -> None:
    """Make this process (the rollout worker) end, with every process it started, as soon as the trainer that
    spawned it dies, by whatever signal (SIGKILL and SIGTERM included: neither lets the trainer say a word).

    A daemon thread waits on multiprocessing's parent sentinel: the read end of a pipe whose only write end the
    trainer holds, so it reads EOF the moment the trainer is gone, however it died; nothing can be missed and
    nothing is polled. The thread then SIGKILLs this process's own process group (made here: this process and
    whatever it started, such as the compilers torch's inductor runs during the first rollouts) in one call.
    It has to end the process itself, from its own thread: the main thread may be anywhere, in the middle of a
    generation or blocked for good; a return from worker_main was not enough (issue: a trainer killed while a
    result larger than the pipe's 64 KiB was on its way left the worker alive forever, its exit waiting on the
    queue's feeder thread, which was blocked writing into a pipe nobody reads any more).
    With the worker gone, the multiprocessing resource tracker, which the trainer started, reads EOF from its
    last holder and exits too. Not chosen: prctl(PR_SET_PDEATHSIG), Linux only and tied to the trainer's thread
    that spawned the worker, and it would kill the worker alone, leaving what the worker started behind.
    Its own process group also keeps a Ctrl-C at the terminal for the trainer alone, which stops the worker as
    it stops (RolloutWorker.close, or multiprocessing's exit handler for a daemonic process)."""
    import multiprocessing.connection
    import signal
    import threading

    sentinel = multiprocessing.parent_process().sentinel
    try:
        os.setpgid(0, 0)
        group = True
    except OSError:  # cannot happen for a spawned process; then the worker ends alone
        group = False

    def watch():
        multiprocessing.connection.wait([sentinel])
        if group:
            os.killpg(0, signal.SIGKILL)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-trainer", daemon=True).start()


def worker_main(
    args, generate, model_path: str, seed: int, limits: dict, log_path: str, requests, results, per_rank: int = 0
) -> None:
    """The rollout worker process: start the engine, then serve requests in order until ("stop",).

    ("load", version, {name: tensor})  weights in shared memory, owned by this request; reloaded in place
                                       between two generations, then the prefix cache is dropped
    ("generate", tag, Request)      -> ("result", tag, Result)
    ("carry", state)                   --partial-rollout: a checkpoint's unfinished responses, continued next
    """
    exit_with_trainer()  # first: the engine's start alone takes ~15 s
    import tqdm

    # vLLM's bars here lock with threads only: tqdm's default multiprocessing lock, a named semaphore, would be left
    # to the resource tracker if this process were killed ("There appear to be 1 leaked semaphore objects").
    tqdm.std.TqdmDefaultWriteLock.mp_lock = None
    torch.set_num_threads(rc_config.torch_threads(args.max_staleness))
    try:
        llm = start_engine(args, model_path, seed, limits, log_path, {})
    except Exception as e:  # the trainer is waiting for ("ready",): tell it why not
        results.put(("failed", f"{type(e).__name__}: {e}"))
        return
    version, idle = 0, 0.0
    partial = PartialRollouts(per_rank) if args.partial_rollout else None
    results.put(("ready",))
    while True:
        t0 = time.time()
        message = requests.get()  # a trainer that dies meanwhile ends this process (exit_with_trainer)
        idle += time.time() - t0
        if message[0] == "stop":
            shutdown_engine(llm)  # its process groups, before the process ends (LocalEngine.close)
            return
        if message[0] == "load":
            _, version, weights = message
            load_weights(llm, list(weights.items()))
            del weights, message
            continue
        if message[0] == "carry":
            partial = PartialRollouts(per_rank, message[1])
            continue
        _, tag, request = message
        t0 = time.time()
        groups, rows, carried = answer(llm, request, args, generate, partial, version)
        results.put(("result", tag, Result(version, groups, time.time() - t0, idle, rows, carried)))
        idle = 0.0


class RolloutWorker:
    """The trainer's handle on the worker process: queue loads and generations; collect results by tag (they come
    back in request order; one that arrives before it is wanted is kept). The worker's torch takes as many threads
    as the trainer's (rc_config.torch_threads): at k >= 1, half the cores each."""

    def __init__(self, args, generate, model_path: str, seed: int, limits: dict, log_path: str, per_rank: int = 0):
        import torch.multiprocessing as mp  # its queues pass tensors through shared memory, not through a pipe

        ctx = mp.get_context("spawn")  # a fresh interpreter: no copy of the trainer's threads or engine state
        self.requests, self.results = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(
            target=worker_main,
            name="rollout-worker",
            daemon=True,
            args=(args, generate, model_path, seed, limits, log_path, self.requests, self.results, per_rank),
        )
        self.process.start()
        self.kept: dict = {}
        message = self._receive()
        if message[0] == "failed":
            raise RuntimeError(f"the rollout worker could not start its engine: {message[1]} (see {log_path})")
        self.log_path = log_path

    def load(self, version: int, weights) -> None:
        """Queue a weight load: the (name, tensor) pairs are copied now (so later updates cannot race it) and move to
        shared memory once, when the request is sent; the worker reloads them when it reaches the request."""
        self.requests.put(("load", version, {name: t.detach().to("cpu", copy=True) for name, t in weights}))

    def submit(self, tag, request: Request) -> None:
        self.requests.put(("generate", tag, request))

    def carry(self, state: list) -> None:
        """A checkpoint's unfinished responses (resume): the worker's next request continues them."""
        self.requests.put(("carry", state))

    def result(self, tag, keep: bool = False) -> tuple[Result, float]:
        """The Result of `tag` (waited for; kept for a later call when `keep`), and the seconds waited."""
        t0 = time.time()
        while tag not in self.kept:
            _, received, result = self._receive()
            self.kept[received] = result
        return (self.kept[tag] if keep else self.kept.pop(tag)), time.time() - t0

    def restore(self, tag, result: Result) -> None:
        """A result saved by a checkpoint (resume): handed out by result(tag) as if the worker had sent it."""
        self.kept[tag] = Result(*result)

    def _receive(self):
        while True:
            try:
                return self.results.get(timeout=5)
            except queue.Empty:  # make sure the worker is alive, or say why not: one line (rc_run.report_faults)
                if not self.process.is_alive():
                    self.requests.cancel_join_thread()  # what is queued for it can never be read: exit without it
                    raise rc_run.RunError(
                        f"the rollout worker died (exit code {self.process.exitcode}); "
                        f"see {getattr(self, 'log_path', 'the engine log')}"
                    ) from None

    def close(self) -> None:
        """Stop the worker, then release the queues' semaphores now: a run of several processes ends with os._exit
        (rc_run.exit_cleanly), which skips the finalisers that would, and the resource tracker then warns."""
        if self.process.is_alive():
            self.requests.put(("stop",))
            self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()
        for q in (self.requests, self.results):
            q.close()
            q.join_thread()
        self.requests = self.results = None
        gc.collect()


def make_engine(args, model_path: str, run_dir: str, prompts: list, accelerator):
    """The rank's engine (seeded with args.seed + rank, its log lines in run_dir/engine{rank or ''}.log, its limits
    sized for the longest of `prompts`): a rollout worker process of its own when rollouts overlap the update
    (--max-staleness k >= 1, or --rollout-worker), else vLLM in the trainer's process (LocalEngine)."""
    rank, world = accelerator.process_index, accelerator.num_processes
    on_gpu = torch.cuda.is_available()
    limits = engine_limits(args, world, max(map(len, prompts)), on_gpu)
    engine_log = os.path.join(run_dir, f"engine{rank or ''}.log")
    per_rank = rc_config.prompts_per_rank(args, world)  # --partial-rollout: the groups a request must complete
    if rc_config.uses_rollout_worker(args):  # a process of its own: rollouts overlap the update
        return RolloutWorker(args, generate, model_path, args.seed + rank, limits, engine_log, per_rank)
    placement, env = engine_placement(on_gpu, rank, accelerator.local_process_index, world)
    os.environ.update(env)
    import torch.distributed as dist

    had_group = dist.is_initialized()  # the trainer's (several ranks), or none yet (world 1)
    llm = start_engine(args, model_path, args.seed + rank, limits, engine_log, placement)
    memory = EngineMemory(llm, on_gpu and args.vllm_sleep, sleep_level(args, llm.llm_engine.model_config.is_moe))
    logging.getLogger("vllm.rc_rollout").info(  # the run's engine log (engine_output_to)
        f"sleep level {memory.level} (--vllm-sleep-level {args.vllm_sleep_level}, --sync-every {args.sync_every})"
        if memory.enabled
        else "the engine never sleeps (CPU, or --no-vllm-sleep)"
    )
    partial = PartialRollouts(per_rank) if args.partial_rollout else None
    return LocalEngine(llm, memory, generate, args, not had_group and dist.is_initialized(), partial)


# ---------------------------------------------------------------------------------------------
# The schedule
# ---------------------------------------------------------------------------------------------
def staleness_bound(args) -> int | None:
    """The most versions a trained sample may lag the trainer: --max-staleness k; with --sync-every m > 1 (k = 0) the
    engine is synced every m steps, so m - 1; never synced (--sync-every 0): no bound (None). Replay (ReplayBuffer)
    trains on the fresh groups of up to W steps back: W more."""
    if args.sync_every == 1:
        bound = args.max_staleness
    else:
        bound = args.sync_every - 1 if args.sync_every else None
    if bound is not None and args.partial_rollout:  # a response's tokens may lag more (PartialRollouts): per token
        return bound + 1 if args.partial_rollout_max_staleness is None else args.partial_rollout_max_staleness
    return None if bound is None else bound + (args.replay_window if args.replay_fraction > 0 else 0)


def mask_stale_tokens(batch: dict, mask: torch.Tensor, step: int, bound: int | None) -> dict:
    """--partial-rollout (docs/async.md §9): mask every response token more than `bound` versions behind the trainer
    (slime's semantics, per token: the rest of its response still trains; dropping the response would drop exactly
    the long ones, the bias partial rollouts remove); rollout/* of the tokens' staleness before the mask. {} for whole
    responses (no batch["token_version"])."""
    if "token_version" not in batch:
        return {}
    tokens = mask > 0
    staleness = step - batch["token_version"]
    versions = [len(set(v[m].tolist())) for v, m in zip(batch["token_version"], tokens) if m.any()]
    masked = stale_rows(batch["token_version"], step, bound) & tokens
    mask[masked] = 0.0
    return {
        "rollout/token_staleness_mean": float(staleness[tokens].float().mean()) if tokens.any() else 0.0,
        "rollout/token_staleness_max": float(staleness[tokens].max()) if tokens.any() else 0.0,
        "rollout/spanning_responses": float(np.mean([v > 1 for v in versions])) if versions else 0.0,
        "rollout/versions_per_response": float(np.mean(versions)) if versions else 0.0,
        "rollout/masked_stale_tokens": float(masked.sum()),
    }


def stale_rows(versions: torch.Tensor, trainer_version: int, bound: int | None) -> torch.Tensor:
    """Rows whose staleness (trainer version - sample version) exceeds the bound: never trained on."""
    if bound is None:
        return torch.zeros_like(versions, dtype=torch.bool)
    return trainer_version - versions > bound


class ReplayBuffer:
    """The replay buffer (--replay-window W, --replay-fraction f; docs/async.md §8): the fresh prompt groups of the
    last W steps, each kept whole with its prompt, its Responses (the engine's log-probs: its own mu) and the version
    that sampled it. The batch of step t holds `per_rank` groups per rank: `replayed(t)` of them drawn from the buffer,
    the rest sampled fresh. replayed(t) = min(round(f x per_rank), groups held), a function of t alone, so the engine's
    requests (queued k steps ahead) and a resumed run know it. The draw is seeded by (seed, step, rank), uniform
    over the held groups, without replacement; then the step's fresh groups are added and those of step t + 1 - W
    evicted. Groups are replayed whole, so GRPO's group baseline is the group's own (rewards are scored again from the
    kept text, deterministic); the corrections see each sample's own mu and version. f = 0: nothing is drawn and no
    generator is used, the run is bit for bit the one without a buffer."""

    def __init__(self, args, per_rank: int, replayed: int, rank: int, entries=()):
        self.window, self.per_rank, self.count = args.replay_window, per_rank, replayed
        self.seed, self.rank = args.seed, rank
        self.entries = [
            (s, v, list(rows), [[Response(*r) for r in g] for g in groups]) for s, v, rows, groups in entries
        ]
        self._fresh = []  # fresh groups of steps 0, 1, ... (the schedule, extended on demand)

    def replayed(self, step: int) -> int:
        """Groups this rank replays at `step`: round(f x per_rank), fewer while the buffer holds fewer groups."""
        while len(self._fresh) <= step:
            t = len(self._fresh)
            held = sum(self._fresh[max(0, t - self.window) : t]) if self.count else 0
            self._fresh.append(self.per_rank - min(self.count, held))
        return self.per_rank - self._fresh[step]

    def fresh(self, step: int) -> int:
        """Groups this rank samples fresh at `step` (the first of its prompts of the step; the rest are replayed)."""
        return self.per_rank - self.replayed(step)

    def draw(self, step: int) -> list[tuple[int, int, list]]:
        """The groups replayed at `step`, as (train row, version, responses), in buffer order."""
        pool = [(row, v, group) for _, v, rows, groups in self.entries for row, group in zip(rows, groups)]
        count = self.replayed(step)
        assert len(pool) >= count, (step, len(pool), count)  # the schedule and the buffer agree (tests/test_replay.py)
        if not count:
            return []
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 8191 + self.rank)
        return [pool[i] for i in sorted(torch.randperm(len(pool), generator=generator)[:count].tolist())]

    def add(self, step: int, version: int, rows: list[int], groups: list) -> int:
        """Keep the fresh groups of `step`; evict the steps the next one may not draw from. Returns the samples
        evicted."""
        if self.window:
            self.entries.append((step, version, list(rows), [list(g) for g in groups]))
        old = [e for e in self.entries if e[0] <= step - self.window]
        self.entries = [e for e in self.entries if e[0] > step - self.window]
        return sum(len(g) for e in old for g in e[3])

    def samples(self) -> int:
        return sum(len(g) for e in self.entries for g in e[3])

    def state(self) -> list:
        """Plain tuples for a checkpoint (ReplayBuffer(..., entries=state) rebuilds it)."""
        return [(s, v, rows, [[tuple(r) for r in g] for g in groups]) for s, v, rows, groups in self.entries]


class KeptVersions:
    """The trainer's weights of every version that may still have a sample in a batch, on the host (--mismatch-split,
    --prox-logp sampling; docs/corrections.md §6.9): version t is kept when step t starts, and those more than
    `depth` = staleness_bound versions behind are dropped, so at most depth + 1 copies are held. slime keeps the one
    version that sampled (--keep-old-actor); this keeps what replay and a staleness bound can still ask for."""

    def __init__(self, depth: int, weights: dict | None = None):
        self.depth, self.weights = depth, dict(weights or {})

    @staticmethod
    def _unique(tensors) -> list:
        """One tensor per storage: a tied lm_head is the embedding, copied and counted once."""
        return list({t.data_ptr(): t for t in tensors}.values())

    @staticmethod
    def copy_bytes(model) -> int:
        """One copy's bytes: the parameters (a tied one once) and the buffers a state dict holds; works on a
        meta-device model."""
        saved = model.state_dict().keys()
        buffers = [b for name, b in model.named_buffers() if name in saved]
        return sum(t.numel() * t.element_size() for t in [*model.parameters(), *buffers])

    @classmethod
    def check_budget(cls, args, hf_config) -> int | None:
        """None without --mismatch-split or --prox-logp sampling; else the depth, after refusing, naming the values,
        a --kept-versions-gib that cannot hold staleness_bound + 1 copies of the model (counted on the meta device:
        no memory). Before the engine starts."""
        from transformers import AutoModelForCausalLM

        if not (args.mismatch_split or args.prox_logp == "sampling"):
            return None
        bound = staleness_bound(args)
        rc_config.need(
            bound is not None,
            f"--mismatch-split / --prox-logp sampling keep the weights of every version a sample may lag, but with "
            f"--sync-every {args.sync_every} the lag has no bound: use --sync-every >= 1",
        )
        with torch.device("meta"):
            gib = cls.copy_bytes(AutoModelForCausalLM.from_config(hf_config).float()) / 2**30
        rc_config.need(
            (bound + 1) * gib <= args.kept_versions_gib,
            f"--kept-versions-gib {args.kept_versions_gib} cannot hold the {bound + 1} versions a sample may lag "
            f"(staleness bound {bound}) x {gib:.3g} GiB: raise it to {(bound + 1) * gib:.3g} or lower the bound",
        )
        return bound

    def keep(self, version: int, model) -> None:
        by_storage, copies = {}, {}
        for name, t in model.state_dict().items():
            if t.data_ptr() not in by_storage:
                by_storage[t.data_ptr()] = t.detach().to("cpu", copy=True)
            copies[name] = by_storage[t.data_ptr()]
        self.weights[version] = copies
        self.weights = {v: w for v, w in self.weights.items() if v >= version - self.depth}

    def metrics(self) -> dict:
        """perf/kept_versions and perf/kept_versions_gib: the copies held and their host memory."""
        held = self._unique(t for w in self.weights.values() for t in w.values())
        gib = sum(t.numel() * t.element_size() for t in held) / 2**30
        return {"perf/kept_versions": float(len(self.weights)), "perf/kept_versions_gib": gib}

    @contextlib.contextmanager
    def loaded(self, model, version: int, current: int):
        """`model` holds version `version`'s weights for the block, then the current version's again (bit for bit:
        the kept copy of the current version is what it held)."""
        if version == current:
            yield model
            return
        if version not in self.weights:
            raise RuntimeError(f"version {version} is not kept (held: {sorted(self.weights)}, depth {self.depth})")
        try:
            model.load_state_dict(self.weights[version])
            yield model
        finally:
            model.load_state_dict(self.weights[current])

    def log_probs(self, args, model, batch: dict, step: int, current: torch.Tensor | None = None):
        """log pi_v of each row at the weights of the version v that sampled it: the rollout's own policy under the
        trainer's numerics (§6.9). Rows of the current version are scored at the current weights, or taken from
        `current` when those log-probs were already computed (decoupled's pi_old)."""
        versions, size = batch["version"], Counter()
        out = torch.zeros(len(versions), rc_forward.response_width(batch))
        model.eval()
        for v in sorted(set(versions.tolist())):
            rows = torch.nonzero(versions == v).flatten()
            if v == step and current is not None:
                out[rows] = current[rows]
                continue
            with self.loaded(model, v, current=step):
                log_prob, part = rc_forward.no_grad_pass(model, batch, args, rows=rows)
            out[rows], size = log_prob[rows], size + part
        return out, size

    def mismatch_split(self, args, model, batch: dict, tensors: dict, step: int):
        """log(pi_t/mu) split at pi_v into numerics and staleness (rc_core.mismatch_split_metrics, §6.9). pi_t, the
        weights of step t, is decoupled's recomputed pi_old; otherwise (bypass, loglinear, sampling) the stale rows
        are scored at the current weights here. pi_v (tensors["sampling_log_prob"]) is scored here unless --prox-logp
        sampling already did, the current rows taken from the recomputed pi_old: no row is scored twice."""
        recomputed = tensors.get("old_log_prob") if args.prox_logp in ("recompute", "metrics") else None
        size = Counter()
        if "sampling_log_prob" not in tensors:
            tensors["sampling_log_prob"], size = self.log_probs(args, model, batch, step, current=recomputed)
        v = tensors["sampling_log_prob"]
        if recomputed is not None:
            current = recomputed
        else:
            stale, current = torch.nonzero(batch["version"] < step).flatten(), v.clone()
            if len(stale):
                model.eval()
                scored, part = rc_forward.no_grad_pass(model, batch, args, rows=stale)
                current[stale], size = scored[stale], size + part
        split = rc_core.mismatch_split_metrics(current, v, tensors["rollout_log_prob"], tensors["response_mask"])
        return split, size


class Rollouts:
    """The batches of the run, each sampled by the version the schedule names (module docstring).

    `model` is the trainer's (unwrapped) model: a load reads its weights at the moment it is queued.
    `prompts_of(step)` gives that step's (prompt ids, index of this rank's first prompt in the step, train rows)."""

    def __init__(self, args, engine, model, prompts_of, sync_count: int = 0):
        self.args, self.engine, self.model, self.prompts_of = args, engine, model, prompts_of
        self.k, self.dial = args.max_staleness, has_weight_dial(args)
        self.loaded = (0, False)  # (version, perturbed by a dial) of the last load queued; the engine starts at 0
        self.sync_count = sync_count  # loads that brought the engine a new version (actor/sync_count)
        self.carried = {}  # --partial-rollout: step -> the unfinished responses its request left (PartialRollouts)

    def load(self, version: int, dials: bool = True, count: bool = True) -> None:
        """Queue the trainer's current weights as `version`: perturbed by the lab's weight dial when `dials`
        (rollout_weights), its own for evaluation; read one tensor at a time (rc_run.full_weights): streamed into an
        engine in this process, copied once for a rollout worker."""
        weights = rc_run.full_weights(self.model)
        self.engine.load(version, rollout_weights(weights, self.args) if dials else weights)
        self.sync_count += int(count and version != self.loaded[0])
        self.loaded = (version, dials and self.dial)

    def begin(self, step: int, in_flight: dict | None = None, carried: list | None = None) -> None:
        """Before the first step run (`step`: 0, or the checkpoint's next step): the engine gets the trainer's
        weights when they are not the initial ones, or when a dial perturbs them, and a checkpoint's unfinished
        responses (`carried`, --partial-rollout); then the batches of steps step..step+k are queued, except those a
        checkpoint saved (`in_flight`: step -> result, sampled earlier)."""
        if step > 0 or self.dial:
            self.load(step, count=False)
        if carried is not None:
            self.engine.carry(carried)
        in_flight = in_flight or {}
        for t, result in sorted(in_flight.items()):
            self.engine.restore(t, Result(*result))  # a checkpoint of an older version holds plain tuples
        for t in range(step, step + self.k + 1):
            if t not in in_flight:
                self.request(t)

    def wanted(self, step: int) -> bool:
        """The batch of `step` is sampled: a step of the run takes it, or a checkpoint keeps it (one after the update
        of c keeps those of steps c+1..c+k: in_flight). Past the last step only the latter: without them a run
        continued past its end would sample step N with version N instead of N-k (tests/test_run_record.py)."""
        if step < self.args.num_steps:
            return True
        every, last = self.args.checkpoint_every, self.args.num_steps - 1
        return bool(every) and any((c + 1) % every == 0 for c in range(max(0, step - self.k), last + 1))

    def request(self, step: int) -> None:
        """Queue the batch of `step` (past the last step, only one a checkpoint keeps: wanted)."""
        if not self.wanted(step):
            return
        n = self.args.num_samples_per_prompt
        if not self.args.partial_rollout:
            prompts, first_index = self.prompts_of(step)[:2]
            self.engine.submit(step, Request(prompts, n, (self.args.seed, step, 0), first_index))
            return
        prompts, rows, keys = [], [], []  # the prompts of step + 1 (and at the first request of step 0 too)
        for admitted in ([0] if step == 0 else []) + [step + 1]:
            ids, first_index, indices = self.prompts_of(admitted)
            prompts, rows = prompts + ids, rows + list(indices)
            keys += [(self.args.seed, admitted, 0, first_index + i) for i in range(len(ids))]
        self.engine.submit(step, Request(prompts, n, rows=tuple(rows), keys=tuple(keys)))

    def take(self, step: int) -> tuple[list, int, dict, list | None]:
        """The batch of `step`: (groups of responses, the version that sampled them, timing/* seconds, the groups'
        train rows under --partial-rollout, else None: the step's own prompts)."""
        result, waited = self.engine.result(step)
        self.carried = {t: c for t, c in self.carried.items() if t > step} | {step: result.carried}
        seconds = {"timing/rollout_s": result.generating_s, "timing/rollout_wait_s": waited}
        return result.groups, result.version, {**seconds, "timing/engine_idle_s": result.idle_s}, result.rows

    def sync(self, step: int) -> None:
        """After the update of `step` the trainer holds version step+1: load it when --sync-every says so."""
        every = self.args.sync_every
        if every and (step + 1) % every == 0:
            self.load(step + 1)

    def evaluate(self, prompts: list, version: int, restore: bool = True) -> list:
        """Greedy responses of the trainer's own weights (version `version`): a stale engine is synced first and a
        perturbed one gets the unperturbed weights (and, with `restore`, the perturbed ones back afterwards)."""
        if self.loaded != (version, False):
            self.load(version, dials=False)
        groups = []
        if prompts:  # a rank without eval problems still takes part in the loads (collectives under FSDP2)
            self.engine.submit("eval", Request(prompts, 1, greedy=True))
            groups = self.engine.result("eval")[0].groups
        if self.dial and restore:
            self.load(version)
        return groups

    def wait_queued(self, step: int) -> dict:
        """Waits for the batches queued after the update of `step` and returns them (for an evaluation, which must not
        count their generation, and for a checkpoint): the batches of steps step+1..step+k, already queued and
        sampled by versions <= step (waited for here; they stay queued for the steps that take them), those past the
        last step included when a checkpoint keeps them (wanted). The batch of step+k+1 is not among them: the
        checkpoint's own weights sample it again on resume."""
        queued = {t: self.engine.result(t, keep=True)[0] for t in range(step + 1, step + self.k + 1) if self.wanted(t)}
        self.carried.update({t: result.carried for t, result in queued.items()})
        return queued

    def carried_after(self, step: int) -> list | None:
        """--partial-rollout: the unfinished responses after the last batch queued before the update of `step`
        returned (step + k's), for a checkpoint (after wait_queued); None otherwise."""
        return self.carried.get(step + self.k)

    def close(self) -> None:
        self.engine.close()
