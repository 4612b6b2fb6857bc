# Where the rollouts come from: the vLLM engine in the trainer's process, or in a rollout worker process of its own,
# and the schedule that decides which policy version samples which step's batch (--max-staleness).
"""Rollout engines and the staleness schedule (infrastructure: a reader of rc_train.py can skip this file).

rc_train.py starts its engine (make_engine; `generate` samples with processed log-probs), asks `Rollouts` for the
batch of a step (take), hands it the new weights after each update (sync), queues the batch k steps ahead (request)
and asks it for greedy evaluations (evaluate).

Policy versions. Version v is the trainer's weights after v updates (one update per rollout batch, however many
optimizer steps it takes: those are PPO's own off-policy steps, measured by actor/ppo_kl). The trainer holds version
t while it trains on the batch of step t. With --max-staleness k the batch of step t is sampled by version
max(0, t - k), fixed by the schedule, never by timing:

    start:                 queue the batches of steps 0..k (sampled by the initial weights)
    after the update of t: load version t+1, then queue the batch of step t+1+k

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

import gc
import os
import queue
import time

import torch

import rc_infra


def load_weights(llm, weights) -> None:
    """Reload (name, tensor) pairs into the engine in place, then drop its prefix cache: the cached KV was computed
    with the old weights (a cache kept across a load made the KL grow for a peer)."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    llm.reset_prefix_cache()


# ---------------------------------------------------------------------------------------------
# vLLM generation with processed log-probs (rc_infra starts the engine, load_weights feeds it weights)
# ---------------------------------------------------------------------------------------------
def generate(llm, prompt_ids, n, args, seed_keys: tuple = (), first_index: int = 0, greedy: bool = False):
    """Per prompt, n responses: (token ids, rollout log-probs of those tokens, text).

    Prompt i is seeded with rc_infra.sampling_seed(*seed_keys, first_index + i), so a rollout is reproducible on CPU
    and a prompt gets the same seed whichever rank samples it."""
    from vllm import SamplingParams

    sampling = dict(
        temperature=args.rollout_temperature or args.temperature,
        top_p=args.top_p,
        logprobs=0,
        extra_args={rc_infra.CORRUPT_KEY: args.rollout_corrupt_prob},
    )  # greedy: the defaults at temperature 0
    params = [
        SamplingParams(
            n=n,
            max_tokens=args.max_response_length,
            **(
                {"temperature": 0.0}
                if greedy
                else {**sampling, "seed": rc_infra.sampling_seed(*seed_keys, first_index + i)}
            ),
        )
        for i in range(len(prompt_ids))
    ]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    result = []
    for out in outputs:
        group = []
        for o in out.outputs:
            ids = list(o.token_ids)
            lps = [] if greedy else [d[t].logprob if t in d else float("nan") for d, t in zip(o.logprobs, ids)]
            group.append((ids, lps, o.text))
        result.append(group)
    return result


# ---------------------------------------------------------------------------------------------
# Engines: load(version, weights), submit(tag, request), result(tag). A request is
# (prompt ids, n, seed keys, first prompt index, greedy); a result is
# (version, groups, seconds generating, seconds the engine sat idle before, seconds the caller waited).
# ---------------------------------------------------------------------------------------------
class LocalEngine:
    """vLLM in the trainer's process. A submitted request runs when its result is asked for (the synchronous loop:
    rollout at the start of the step); a load runs at once, so it needs no request to be waiting (k = 0 only).
    On a GPU the engine sleeps during the update (rc_infra.EngineMemory)."""

    def __init__(self, llm, memory: rc_infra.EngineMemory, generate, args):
        self.llm, self.memory, self.generate, self.args = llm, memory, generate, args
        self.version, self.waiting, self.idle, self.free_since = 0, {}, 0.0, time.time()

    def _busy(self):
        self.idle += time.time() - self.free_since

    def load(self, version: int, weights) -> None:
        assert not self.waiting, "the local engine loads weights only when no request waits (--max-staleness 0)"
        self._busy()
        with rc_infra.engine_awake(self.memory, "weights"):  # the KV cache sleeps on until the next generation
            load_weights(self.llm, weights)
        self.version, self.free_since = version, time.time()

    def submit(self, tag, request: tuple) -> None:
        self.waiting[tag] = request

    def result(self, tag, keep: bool = False) -> tuple:
        t0 = time.time()
        self._busy()
        prompts, n, seed_keys, first_index, greedy = self.waiting.pop(tag)
        with rc_infra.engine_awake(self.memory, "weights", "kv_cache", sleep_after=not greedy):  # the update next
            groups = self.generate(self.llm, prompts, n, self.args, seed_keys, first_index, greedy)
        idle, self.idle, self.free_since = self.idle, 0.0, time.time()
        return self.version, groups, time.time() - t0, idle, time.time() - t0

    def close(self) -> None:
        pass


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


def worker_main(args, generate, model_path: str, seed: int, limits: dict, log_path: str, requests, results) -> None:
    """The rollout worker process: start the engine, then serve requests in order until ("stop",).

    ("load", version, {name: tensor})  weights in shared memory, owned by this request; reloaded in place
                                       between two generations, then the prefix cache is dropped
    ("generate", tag, request)      -> ("result", tag, version, groups, seconds generating, seconds idle before)
    """
    exit_with_trainer()  # first: the engine's start alone takes ~15 s
    torch.set_num_threads(rc_infra.torch_threads(args.max_staleness))
    try:
        llm = rc_infra.start_engine(args, model_path, seed, limits, log_path, {})
    except Exception as e:  # the trainer is waiting for ("ready",): tell it why not
        results.put(("failed", f"{type(e).__name__}: {e}"))
        return
    version, idle = 0, 0.0
    results.put(("ready",))
    while True:
        t0 = time.time()
        message = requests.get()  # a trainer that dies meanwhile ends this process (exit_with_trainer)
        idle += time.time() - t0
        if message[0] == "stop":
            return
        if message[0] == "load":
            _, version, weights = message
            load_weights(llm, list(weights.items()))
            del weights, message
            continue
        _, tag, (prompts, n, seed_keys, first_index, greedy) = message
        t0 = time.time()
        groups = generate(llm, prompts, n, args, seed_keys, first_index, greedy)
        results.put(("result", tag, version, groups, time.time() - t0, idle))
        idle = 0.0


class RolloutWorker:
    """The trainer's handle on the worker process: queue loads and generations; collect results by tag (they come
    back in request order; one that arrives before it is wanted is kept). The worker's torch takes as many threads
    as the trainer's (rc_infra.torch_threads): at k >= 1, half the cores each."""

    def __init__(self, args, generate, model_path: str, seed: int, limits: dict, log_path: str):
        import torch.multiprocessing as mp  # its queues pass tensors through shared memory, not through a pipe

        ctx = mp.get_context("spawn")  # a fresh interpreter: no copy of the trainer's threads or engine state
        self.requests, self.results = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(
            target=worker_main,
            name="rollout-worker",
            daemon=True,
            args=(args, generate, model_path, seed, limits, log_path, self.requests, self.results),
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

    def submit(self, tag, request: tuple) -> None:
        self.requests.put(("generate", tag, request))

    def result(self, tag, keep: bool = False) -> tuple:
        t0 = time.time()
        while tag not in self.kept:
            message = self._receive()
            self.kept[message[1]] = message[2:]
        out = self.kept[tag] if keep else self.kept.pop(tag)
        return (*out, time.time() - t0)

    def restore(self, tag, result: tuple) -> None:
        """A result saved by a checkpoint (resume): handed out by result(tag) as if the worker had sent it."""
        self.kept[tag] = tuple(result[:4])

    def _receive(self):
        while True:
            try:
                return self.results.get(timeout=5)
            except queue.Empty:  # make sure the worker is alive, or say why not
                if not self.process.is_alive():
                    raise RuntimeError(
                        f"the rollout worker died (exit code {self.process.exitcode}); "
                        f"see {getattr(self, 'log_path', 'the engine log')}"
                    ) from None

    def close(self) -> None:
        """Stop the worker, then release the queues' semaphores now: a run of several processes ends with os._exit
        (rc_infra.exit_cleanly), which skips the finalisers that would, and the resource tracker then warns."""
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
    limits = rc_infra.engine_limits(args, world, max(map(len, prompts)), on_gpu)
    engine_log = os.path.join(run_dir, f"engine{rank or ''}.log")
    if args.max_staleness or args.rollout_worker:  # a process of its own: rollouts overlap the update
        return RolloutWorker(args, generate, model_path, args.seed + rank, limits, engine_log)
    placement, env = rc_infra.engine_placement(on_gpu, rank, accelerator.local_process_index, world)
    os.environ.update(env)
    llm = rc_infra.start_engine(args, model_path, args.seed + rank, limits, engine_log, placement)
    return LocalEngine(
        llm, rc_infra.EngineMemory(llm, on_gpu and args.vllm_sleep, args.vllm_sleep_level), generate, args
    )


# ---------------------------------------------------------------------------------------------
# The schedule
# ---------------------------------------------------------------------------------------------
def staleness_bound(args) -> int | None:
    """The most versions a trained sample may lag the trainer: --max-staleness k; with --sync-every m > 1 (k = 0) the
    engine is synced every m steps, so m - 1; never synced (--sync-every 0): no bound (None)."""
    if args.sync_every == 1:
        return args.max_staleness
    return args.sync_every - 1 if args.sync_every else None


def stale_rows(versions: torch.Tensor, trainer_version: int, bound: int | None) -> torch.Tensor:
    """Rows whose staleness (trainer version - sample version) exceeds the bound: never trained on."""
    if bound is None:
        return torch.zeros_like(versions, dtype=torch.bool)
    return trainer_version - versions > bound


class Rollouts:
    """The batches of the run, each sampled by the version the schedule names (module docstring).

    `model` is the trainer's (unwrapped) model: a load reads its weights at the moment it is queued.
    `prompts_of(step)` gives that step's (prompt ids, index of this rank's first prompt in the step)."""

    def __init__(self, args, engine, model, prompts_of, sync_count: int = 0):
        self.args, self.engine, self.model, self.prompts_of = args, engine, model, prompts_of
        self.k, self.dial = args.max_staleness, rc_infra.has_weight_dial(args)
        self.loaded = (0, False)  # (version, perturbed by a dial) of the last load queued; the engine starts at 0
        self.sync_count = sync_count  # loads that brought the engine a new version (actor/sync_count)

    def load(self, version: int, dials: bool = True, count: bool = True) -> None:
        """Queue the trainer's current weights as `version`: perturbed by the lab's weight dial when `dials`
        (rc_infra.rollout_weights), its own for evaluation; streamed one tensor at a time (rc_infra.full_weights)."""
        weights = rc_infra.full_weights(self.model)
        self.engine.load(version, rc_infra.rollout_weights(weights, self.args) if dials else weights)
        self.sync_count += int(count and version != self.loaded[0])
        self.loaded = (version, dials and self.dial)

    def begin(self, step: int, in_flight: dict | None = None) -> None:
        """Before the first step run (`step`: 0, or the checkpoint's next step): the engine gets the trainer's
        weights when they are not the initial ones, or when a dial perturbs them; then the batches of steps
        step..step+k are queued, except those a checkpoint saved (`in_flight`: step -> result, sampled earlier)."""
        if step > 0 or self.dial:
            self.load(step, count=False)
        for t, result in sorted((in_flight or {}).items()):
            self.engine.restore(t, result)
        for t in range(step + len(in_flight or {}), step + self.k + 1):
            self.request(t)

    def request(self, step: int) -> None:
        """Queue the batch of `step` (nothing past the last step)."""
        if step < self.args.num_steps:
            prompts, first_index = self.prompts_of(step)
            self.engine.submit(
                step, (prompts, self.args.num_samples_per_prompt, (self.args.seed, step, 0), first_index, False)
            )

    def take(self, step: int) -> tuple[list, int, dict]:
        """The batch of `step`: (groups of responses, the version that sampled them, timing/* seconds)."""
        version, groups, generating, idle, waited = self.engine.result(step)
        return (
            groups,
            version,
            {"timing/rollout_s": generating, "timing/rollout_wait_s": waited, "timing/engine_idle_s": idle},
        )

    def sync(self, step: int) -> bool:
        """After the update of `step` the trainer holds version step+1: load it when --sync-every says so."""
        every = self.args.sync_every
        if every and (step + 1) % every == 0:
            self.load(step + 1)
            return True
        return False

    def evaluate(self, prompts: list, version: int, restore: bool = True) -> list:
        """Greedy responses of the trainer's own weights (version `version`): a stale engine is synced first and a
        perturbed one gets the unperturbed weights (and, with `restore`, the perturbed ones back afterwards)."""
        if self.loaded != (version, False):
            self.load(version, dials=False)
        groups = []
        if prompts:  # a rank without eval problems still takes part in the loads (collectives under FSDP2)
            self.engine.submit("eval", (prompts, 1, (), 0, True))
            groups = self.engine.result("eval")[1]
        if self.dial and restore:
            self.load(version)
        return groups

    def in_flight(self, step: int) -> dict:
        """For a checkpoint after the update of `step`: the batches of steps step+1..step+k, already queued and
        sampled by versions <= step (waited for here; they stay queued for the steps that take them). The batch of
        step+k+1 is not among them: the checkpoint's own weights sample it again on resume."""
        return {
            t: self.engine.result(t, keep=True)[:4]
            for t in range(step + 1, min(step + self.k, self.args.num_steps - 1) + 1)
        }

    def close(self) -> None:
        self.engine.close()
