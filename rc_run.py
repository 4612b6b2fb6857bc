"""The run: its folder and the other ranks, during and after training.

What belongs here keeps the record of a run and keeps the ranks together, and never changes what a step computes:
the trainer's own collectives (HostGroup) and FSDP2 sharding, gradient accumulation and clipping across ranks, metric
reduction (METRIC_REDUCTIONS) and the step's metrics, timers and progress bar, evaluation, the run folder (its lock,
config.yaml, its logs and trackers), data-parallel checksums, the final weights, the closing summary and the exit, and
the one-line report of a fault of the record (RunError). Checkpoints and resume are rc_checkpoint.py's, which builds
on this module (never the other way round).
Unit-tested on CPU (tests/test_infra.py) and end to end (tests/test_train.py).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import dataclasses
import errno
import fcntl
import hashlib
import json
import math
import os
import shutil
import socket
import sys
import time
from collections import Counter

import numpy as np
import torch
import yaml

import rc_core


@dataclasses.dataclass
class RunArgs:
    """What the run records beside its metrics, and where (rc_train.Args inherits these flags)."""

    log_with: list[str] = dataclasses.field(default_factory=list)
    """Accelerate trackers that get the metrics too: tensorboard, wandb, mlflow, comet_ml, aim, ..., or all"""
    wandb_project_name: str = "rollout-correction"
    """the project name of the trackers (W&B project)"""
    wandb_entity: str | None = None
    """the wandb entity (team)"""
    log_rank_checksums: bool = False
    """every rank appends the SHA-256 of its weights and sampled tokens to ranks/rank{r}.jsonl (DDP check)"""
    dump_log_ratio_every: int = 0
    """every N steps save rank 0's log(pi_trainer/pi_rollout) to log_ratio/step_N.npy (0 = never; LogRatioDump)"""
    save_final: bool = True
    """save the final weights to final/ in the base model's dtype, safetensors shards (save_final)"""


# ---------------------------------------------------------------------------------------------
# The other ranks: the trainer's own collectives, FSDP2 sharding, gradients across ranks
# ---------------------------------------------------------------------------------------------
class HostGroup:
    """The trainer's own collectives (loss denominators, metric sums, evaluation samples): small host-side values, on
    a gloo group of all ranks created at start. Accelerate and torchrun give GPU jobs an NCCL default group, which
    serves only CUDA tensors ("No backend type associated with device type cpu" for a CPU tensor); a gloo side group
    serves the CPU on every machine and spares a device round trip for a few floats. The model's own collectives
    (DDP, FSDP2) stay on the default group. tests/test_infra.py runs these under an NCCL-like group (gloo serving
    cuda only)."""

    def __init__(self, world: int):
        import torch.distributed as dist

        self.world = world
        self.group = dist.new_group(backend="gloo") if world > 1 else None

    def sum(self, values: list[float]) -> list[float]:
        """Elementwise sum over the ranks."""
        if self.world == 1:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self.group)
        return t.tolist()

    def extreme(self, values: list[float], op: str) -> list[float]:
        """Elementwise max or min over the ranks."""
        if self.world == 1:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN, group=self.group)
        return t.tolist()

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out


def transformer_blocks(model, flag: str) -> list:
    """The model's transformer blocks, the classes it names in _no_split_modules (Hugging Face's own unit of sharding
    and offload): what --fsdp shards and --compile compiles one by one. None is a ValueError naming `flag`."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"{flag}: {type(model).__name__} names no transformer block class (_no_split_modules)")
    return blocks


def shard_model(model, device_type: str):
    """torch's FSDP2 on a Hugging Face model: fully_shard on every transformer block (the classes the model names in
    _no_split_modules), then on the root (embeddings, final norm, lm_head; tied weights stay tied). Parameters stay
    fp32 and sharded dim 0 over all ranks; the trainer's autocast computes in --train-dtype as without sharding.
    Every FSDP2 forward is a collective, so all ranks must run the same forwards: rc_train.py turns the shared-prompt
    pass off (it runs one or two forwards depending on the lengths) and check_distributed refuses a token budget."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    for block in transformer_blocks(model, "--fsdp"):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_weights(model):
    """(name, full tensor) for every entry of the model's state dict (a tied lm_head too: vLLM's CPU build keeps its
    own copy), one at a time. Under FSDP2 each is gathered from the shards when it is reached, a collective that
    every rank runs in the same order, so no rank ever holds a full state dict; otherwise they are the live
    parameters (no copy). A tensor under two names (a tied lm_head: the embedding) is gathered once, at its first
    name, and kept until its last, in state-dict order (the dials seed by position: rc_rollout.rollout_weights)."""
    from torch.distributed.tensor import DTensor

    entries = model.state_dict(keep_vars=True)  # the parameters themselves: a tied pair is one object
    last = {id(t): name for name, t in entries.items()}
    gathered: dict[int, torch.Tensor] = {}  # a shared tensor's full value, from its first name to its last
    for name, t in entries.items():
        full = gathered.get(id(t))
        if full is None:
            full = (t.full_tensor() if isinstance(t, DTensor) else t).detach()
        if last[id(t)] == name:
            gathered.pop(id(t), None)
        else:
            gathered[id(t)] = full
        yield name, full


def accumulating(accelerator, model, last_micro_batch: bool, fsdp: bool):
    """The context of one micro-batch's forward, loss and backward: gradients are reduced across ranks only on the
    last micro-batch of an optimizer step. DDP: no_sync on the others, entered before the forward (DDP decides there
    whether the backward reduces). FSDP2: no reduce-scatter until the last (set_requires_gradient_sync, read by the
    backward); the unsharded gradients accumulate meanwhile. Both counted in tests/test_infra.py."""
    if fsdp:
        model.set_requires_gradient_sync(last_micro_batch)
        return contextlib.nullcontext()
    if last_micro_batch or accelerator.num_processes == 1:
        return contextlib.nullcontext()
    return accelerator.no_sync(model)


def clip_and_step(accelerator, model, optimizer, max_norm: float) -> float:
    """Clip the gradients to a global L2 norm, take the optimizer step, and return the norm before clipping.
    Under FSDP2 the norm is a DTensor over the sharded gradients, replicated on every rank: its full value is the
    global norm (torch.nn.utils.clip_grad_norm_ computes it from the shards' partial sums)."""
    from torch.distributed.tensor import DTensor

    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


# ---------------------------------------------------------------------------------------------
# The step's metrics: their reduction over micro-batches and ranks, the batch's figures, timers, the progress bar
# ---------------------------------------------------------------------------------------------
# How each metric is reduced over micro-batches and ranks: a metric named here is that extreme over them; every other
# metric is a weighted mean (weighted by valid tokens or by sequences, as rc_train.py adds it). `<option>` stands for
# each RS option of rc_core.RS_OPTIONS. tests/test_docs.py checks the list against the names the trainer logs and
# docs/metrics.md; a fork that logs a new max or min adds its name here.
_EXTREMES = {
    "max": (
        "response_length/max",
        "rollout/staleness_max",
        "rollout/token_staleness_max",
        "rollout_corr/log_ppl_diff_max",
        "rollout_corr/rollout_probs_diff_max",
        "rollout_corr/log_prob_abs_diff_max",
        "rollout_corr/rollout_is_max",
        "rollout_corr/rollout_is_seq_max",
        "rollout_corr/rollout_is_seq_max_deviation",
        "rollout_corr/rollout_rs_<option>_max",
        "rollout_corr/rollout_rs_<option>_seq_max",
        "rollout_corr/rollout_rs_<option>_seq_max_deviation",
        "perf/max_memory_allocated_gib",  # the largest rank's peak
        "perf/max_memory_reserved_gib",
        "perf/engine_memory_gib",
        "perf/engine_budget_gib",
    ),
    "min": (
        "rollout_corr/log_ppl_diff_min",
        "rollout_corr/rollout_is_min",
        "rollout_corr/rollout_is_seq_min",
        "rollout_corr/rollout_rs_<option>_min",
        "rollout_corr/rollout_rs_<option>_seq_min",
    ),
}


METRIC_REDUCTIONS = {
    name.replace("<option>", option): kind
    for kind, names in _EXTREMES.items()
    for name in names
    for option in (rc_core.RS_OPTIONS if "<option>" in name else ("",))
}


def reduction(name: str) -> str:
    """'max', 'min' or 'mean': how the metric `name` is reduced (METRIC_REDUCTIONS; a mean unless it is listed)."""
    return METRIC_REDUCTIONS.get(name, "mean")


class MetricSum:
    """Accumulates metrics with weights: means are weighted (by valid tokens, or sequences), max/min stay extremes."""

    def __init__(self):
        self.sums: dict[str, list[float]] = {}

    def add(self, metrics: dict, weight: float) -> None:
        for k, v in metrics.items():
            v = float(v)
            kind = reduction(k)
            if kind == "mean":
                s = self.sums.setdefault(k, [0.0, 0.0])
                s[0] += weight * v
                s[1] += weight
            elif k not in self.sums:
                self.sums[k] = [v, 1.0]
            else:
                self.sums[k][0] = max(self.sums[k][0], v) if kind == "max" else min(self.sums[k][0], v)

    def local(self) -> dict:
        return {k: (s[0] / s[1] if reduction(k) == "mean" and s[1] else s[0]) for k, s in self.sums.items()}


def reduce_metrics(acc: MetricSum, host: HostGroup) -> dict:
    """Metrics of all ranks: weighted means (each rank's sum of weight x value over the sum of weights) and global
    max/min, over the union of the ranks' keys. A rank that lacks a key (e.g. every response of its micro-batch was
    dropped) contributes weight 0 to it; a key no rank has a weight for comes out NaN. No hang: every rank takes
    part in the same collectives with the same key list."""
    if host.world == 1:
        return acc.local()
    keys = sorted(set().union(*host.gather(sorted(acc.sums))))
    means = [k for k in keys if reduction(k) == "mean"]
    sums = host.sum([x for k in means for x in acc.sums.get(k, [0.0, 0.0])])
    out = {k: s / w if w > 0 else float("nan") for k, s, w in zip(means, sums[0::2], sums[1::2])}
    for kind, fill in (("max", -float("inf")), ("min", float("inf"))):
        names = [k for k in keys if reduction(k) == kind]
        out.update(zip(names, host.extreme([acc.sums[k][0] if k in acc.sums else fill for k in names], kind)))
    return out


def batch_metrics(
    args, rewards: list, corrects: list, mask, n_nonfinite: int, versions, step: int, stale, n_fresh: int
):
    """reward/*, response_length/* and rollout/* of this rank's batch: means and a std over its responses, the longest
    response, counts of non-finite tokens and dropped samples. `versions`: each row's policy version (staleness =
    step - version). With replay (rc_rollout.ReplayBuffer) rows 0..n_fresh-1 are this step's fresh samples: reward/*
    and response_length/* describe what the engine sampled for this step (rollout/policy_version is their version),
    rollout/staleness_* every trained sample, replayed ones included."""
    n = n_fresh  # the fresh rows
    lengths, staleness = mask[:n].sum(-1), step - versions
    return {
        "reward/mean": float(np.mean(rewards[:n])),
        "reward/std": float(np.std(rewards[:n])),
        "reward/correct": float(np.mean(corrects[:n])),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float((lengths >= args.max_response_length).float().mean()),
        "rollout/nonfinite_logprob_tokens": float(n_nonfinite),
        "rollout/policy_version": float(versions[0]),
        "rollout/staleness_mean": float(staleness.float().mean()),
        "rollout/staleness_max": float(staleness.max()),
        "rollout/dropped_samples": float(stale.sum()),
    }


def replay_metrics(replayed: int, rows: int, held: int, evicted: int) -> dict:
    """rollout/replay_* of this rank's step (--replay-window > 0): the share of its batch drawn from the buffer, the
    samples the buffer holds after this step's fresh ones joined, and those evicted for falling out of the window."""
    return {
        "rollout/replayed_fraction": replayed / rows,
        "rollout/replay_buffer_samples": float(held),
        "rollout/replay_evicted_samples": float(evicted),
    }


def pass_metrics(size: Counter, seconds: float) -> dict:
    """perf/* of the trainer's forward passes this step (pi_old, reference, update): `size` as
    rc_forward.sequence_log_probs counts it, `seconds` their wall time."""
    return {
        "perf/padding_fraction": 1.0 - size["tokens"] / max(1, size["positions"]),
        "perf/train_tokens_per_s": size["tokens"] / max(1e-9, seconds),
    }


def conventional_counts(batch: dict) -> dict:
    """What one pass over `batch` (rc_forward.make_batch's layout: prompt_len, response_len, group per row) needs,
    whatever the run computed: its tokens (each group's prompt once, every response), its logit positions (one per
    response token: the logit that predicts it) and the (query, key) pairs its causal attention scores (a p-token
    prompt's p(p+1)/2 once per group; response token j after it attends p + j + 1 keys). Padding counts nowhere. The
    inputs of benchmarks/bench_gpu_step.conventional_flops (MFU as the field counts it)."""
    prompt, response, group = (batch[k].tolist() for k in ("prompt_len", "response_len", "group"))
    prompts = dict(zip(group, prompt))  # a group's rows share one prompt
    return {
        "tokens": sum(prompts.values()) + sum(response),
        "logit_positions": sum(response),
        "attention_pairs": sum(p * (p + 1) // 2 for p in prompts.values())
        + sum(r * p + r * (r + 1) // 2 for p, r in zip(prompt, response)),
    }


def flop_inputs(batch: dict) -> dict:
    """perf/mfu_*: conventional_counts of this rank's batch, which the update trains on once per epoch (a summary
    turns them into the update's MFU with bench_gpu_step.conventional_flops: benchmarks/gpu_smoke.py)."""
    counts = conventional_counts(batch)
    return {
        "perf/mfu_tokens": float(counts["tokens"]),
        "perf/mfu_logit_positions": float(counts["logit_positions"]),
        "perf/mfu_attention_pairs": float(counts["attention_pairs"]),
    }


def reset_memory_peaks() -> None:
    """Start this step's perf/max_memory_* (CUDA only)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def memory_metrics() -> dict:
    """perf/max_memory_*_gib: torch's peak allocated and reserved CUDA memory of this process since
    reset_memory_peaks (the step's start), in GiB; {} on a CPU. An engine in this process (vLLM at --max-staleness
    0) allocates through torch's allocator, its sleep-mode pool included, so these peaks are expected to include its
    weights and KV cache (rc_rollout.engine_memory_metrics; not yet measured on a GPU: docs/gpus.md, "One-command
    smoke run")."""
    if not torch.cuda.is_available():
        return {}
    return {
        "perf/max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "perf/max_memory_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
    }


class StepTimer:
    """The timing/* seconds of one step: `with timer("timing/update_s"): ...` adds that block's wall time to the
    name; `seconds` starts from the figures given (the rollout's, measured by the engine) and `elapsed()` is the
    time since the timer was made (timing/step_s)."""

    def __init__(self, seconds: dict | None = None):
        self.start, self.seconds = time.time(), dict(seconds or {})

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.time()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.time() - t0

    def elapsed(self) -> float:
        return time.time() - self.start


class LogRatioDump:
    """--dump-log-ratio-every: log(pi_trainer/pi_rollout) of the valid tokens of one step, rows one after another,
    to log_ratio/step_N.npy, and each row's number of valid tokens to log_ratio/lengths/step_N.npy (so the flat
    array splits back into responses: the lab's length law). `add` takes (B, T) log-ratio and response-mask pairs:
    decoupled mode adds log(pi_old/pi_rollout) once, bypass mode the first minibatch's log(pi_theta/pi_rollout).
    Inactive on a step off the schedule (every `every` steps; 0 = never) and on all but the main process."""

    def __init__(self, run_dir: str, step: int, every: int, main_process: bool):
        self.folder, self.step, self.chunks = os.path.join(run_dir, "log_ratio"), step, []
        self.active = bool(every) and step % every == 0 and main_process

    def add(self, log_ratio: torch.Tensor, response_mask: torch.Tensor) -> None:
        if self.active:
            self.chunks.append((log_ratio.detach().cpu(), response_mask.cpu()))

    def save(self) -> None:
        if not self.active:
            return
        os.makedirs(os.path.join(self.folder, "lengths"), exist_ok=True)
        flat = [ratio[m > 0] for ratio, m in self.chunks]
        flat = torch.cat(flat).float().numpy() if flat else np.zeros(0, np.float32)
        lengths = [m.sum(-1) for _, m in self.chunks]
        lengths = torch.cat(lengths).to(torch.int32).numpy() if lengths else np.zeros(0, np.int32)
        np.save(os.path.join(self.folder, f"step_{self.step:06d}.npy"), flat)
        np.save(os.path.join(self.folder, "lengths", f"step_{self.step:06d}.npy"), lengths)


class HealthWatch:
    """The usage guide's health check at run time (rc_core.HEALTH_CHECKS; docs/corrections.md §6.7): after each step,
    the checks on the step's reduced rollout_corr/* metrics. health/<check> is logged 1.0 on a step where it fires and
    0.0 where its metric exists and passes (absent: the correction has no such metric, e.g. no IS; a NaN or inf
    metric fires, rc_core.check_rollout_correction_health); the console gets one line when a check starts firing and
    one when it clears (`say`: the main process's writer, None elsewhere); `fired` counts the steps each check fired
    on, for the closing summary."""

    def __init__(self, say=None):
        self.say, self.firing, self.fired = say, set(), Counter()

    def check(self, step: int, metrics: dict) -> dict:
        fired = rc_core.check_rollout_correction_health(metrics)
        out = {}
        for name, check in rc_core.HEALTH_CHECKS.items():
            value = metrics.get(check.metric)
            if value is None:
                continue
            out[name] = float(name in fired)
            if name in fired and name not in self.firing:
                bounds = " or ".join(
                    f"{'<' if i == 0 else '>'} {b:g}" for i, b in enumerate((check.low, check.high)) if b is not None
                )
                bounds = bounds if math.isfinite(value) else "not a finite number"
                what = f"|{check.metric}|" if check.absolute else check.metric
                self._say(f"step {step}: {what} = {value:.4g}, {bounds}: {name} fires (docs/corrections.md §6.7)")
            elif name in self.firing and name not in fired:
                self._say(f"step {step}: {name} clears ({check.metric} = {value:.4g})")
        self.firing = (self.firing - set(out)) | set(fired)
        self.fired.update(fired.keys())  # steps fired on, not the values
        return out

    def summary(self, steps: int) -> str:
        if not self.fired:
            return "health checks: none fired"
        return "health checks fired: " + ", ".join(
            f"{n} on {c} of {steps} steps" for n, c in sorted(self.fired.items())
        )

    def _say(self, line: str) -> None:
        if self.say is not None:
            self.say(f"health: {line}")


def progress(metrics: dict, last_eval: dict | None, accuracy_key: str) -> dict:
    """The few numbers on the progress bar (eval: the task's accuracy key, Task.accuracy_key)."""
    shown = {"reward": f"{metrics['reward/mean']:.3f}", "len": f"{metrics['response_length/mean']:.0f}"}
    if last_eval:
        name = f"eval/accuracy_{accuracy_key}"
        shown["eval"] = f"{last_eval[name]:.3f}"
    return {**shown, "k3": f"{metrics.get('rollout_corr/k3_kl', 0):.1e}", "step_s": f"{metrics['timing/step_s']:.1f}"}


def progress_bar(start_step: int, num_steps: int, show: bool):
    """The console's progress bar over the run's steps, shown by the main process (its numbers: progress)."""
    from tqdm import tqdm

    return tqdm(range(start_step, num_steps), initial=start_step, total=num_steps, disable=not show, dynamic_ncols=True)


# ---------------------------------------------------------------------------------------------
# Evaluation: greedy pass@1 of a policy version, every problem gathered from the ranks
# ---------------------------------------------------------------------------------------------
def evaluate(task, rollouts, prompts, rows, rank, world, host, version: int, restore: bool = True):
    """Greedy pass@1 of policy version `version` on the eval set (each rank its shard): metrics (eval/accuracy_<key>
    for each score key of the task), and every problem with its response and scores (gathered from all ranks, in
    problem order; the row's question and gold when it has them)."""
    shard = list(range(rank, len(prompts), world))
    outs = rollouts.evaluate([prompts[i] for i in shard], version, restore)  # every rank: a load can be collective
    samples = []
    for i, group in zip(shard, outs):
        response = group[0]  # an rc_rollout.Response
        ids, text = response.token_ids, response.text
        scores = task.score(text, rows[i])
        for key in task.score_keys:  # a NaN would vanish into eval/accuracy_*
            check_rewards(task.name, [scores[key]], [i], rows, f"the eval of version {version}", "test", key)
        samples.append(
            {
                "index": i,
                **{k: rows[i][k] for k in ("question", "gold") if k in rows[i]},
                "response": text,
                **{k: scores[k] for k in task.score_keys},
                "tokens": len(ids),
            }
        )
    samples = [s for part in host.gather(samples) for s in part]
    samples.sort(key=lambda r: r["index"])
    n = max(1, len(samples))
    metrics = {f"eval/accuracy_{k}": sum(r[k] for r in samples) / n for k in task.score_keys}
    metrics["eval/response_length"] = sum(r["tokens"] for r in samples) / n
    return metrics, samples


# ---------------------------------------------------------------------------------------------
# Faults of the record: one line each, naming the file and what to do (no traceback)
# ---------------------------------------------------------------------------------------------
class RunError(ValueError):
    """A fault of the run folder or its checkpoints, or a rollout worker that died, told in one line: what is wrong,
    which file, what to do.
    rc_train.py prints it as `rc_train.py: error: ...` and exits (report_faults for the ones met mid-run)."""


class NonFinite(RunError):
    """A NaN or inf where a step needs a number (a reward, a log-prob, a loss), told in one line: which, and where.
    Raised before the step is logged or checkpointed: the record ends at the last good step, its checkpoint intact."""


NOT_KEPT = "; nothing of this step is logged or saved (the last checkpoint is intact)"


def check_rewards(
    task: str, rewards: list, rows: list[int], problems: list, step, split: str = "train", key: str = "reward"
) -> None:
    """Stop (NonFinite) on a reward (or an eval score: `key`) that is NaN or inf, naming the task, the first such
    sample's row (its index in the `split` and, if it has one, the start of its question) and the value. `rows[i]`:
    the row of reward i; `step`: the step, or what else names the moment. No host sync: the rewards are numbers."""
    where = f"step {step}" if isinstance(step, int) else step
    bad = [i for i, r in enumerate(rewards) if not math.isfinite(r)]
    if not bad:
        return
    i = bad[0]
    row = problems[rows[i]]
    question = row.get("question") if isinstance(row, dict) else None
    said = "" if question is None else f" ({str(question)[:48]!r}{'...' * (len(str(question)) > 48)})"
    raise NonFinite(
        f"{where}: task {task!r} scored {key} {float(rewards[i])} for {split} row {rows[i]}{said}, sample {i} of "
        f"the batch ({len(bad)} of {len(rewards)} not finite): its scorer must return finite numbers{NOT_KEPT}"
    )


def check_finite(name: str, value, where: str, mask: torch.Tensor | None = None) -> None:
    """Stop (NonFinite) if `value` holds a NaN or inf, naming `name` (log_prob, old_log_prob, loss, grad_norm) and
    `where` (the step, the micro-batch): `value` a float (no host sync), or a tensor read at the valid positions of
    `mask` (one sync), naming its rows."""
    if isinstance(value, torch.Tensor):
        bad = (mask > 0) & ~torch.isfinite(value.detach())
        if not bool(bad.any()):
            return
        rows = bad.any(-1).nonzero().flatten().tolist()
        rows_said = ", ".join(map(str, rows[:8])) + (", ..." if len(rows) > 8 else "")
        what = f"has {int(bad.sum())} non-finite value(s) at valid tokens, in row(s) {rows_said}"
    elif math.isfinite(value):
        return
    else:
        what = f"is {float(value)}"
    raise NonFinite(f"{where}: {name} {what}{NOT_KEPT}")


def check_loss(loss: float, where: str, mask: torch.Tensor, **log_probs) -> None:
    """Stop (NonFinite) if a micro-batch's loss (the float the trainer already has: no host sync) is NaN or inf,
    naming the first of `log_probs` (name -> tensor) that is not finite at a valid token as its cause, else the
    loss itself. The log-probs are read only once the loss failed."""
    if not math.isfinite(loss):
        for name, log_prob in log_probs.items():
            if log_prob is not None:
                check_finite(name, log_prob, where, mask)
        check_finite("loss", loss, where)


# The OS errors that are the machine's, not the program's: said in words, with the file, instead of a traceback.
FILE_FAULTS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EIO: "input/output error",
    errno.ENOENT: "no such file or folder",
    errno.EISDIR: "a folder, not a file",
    errno.ENOTDIR: "a path through something that is not a folder",
}


def os_error_in(exc: BaseException) -> OSError | None:
    """The OSError behind `exc`: itself, its cause or context, or one of the ranks' failures that torch distributed
    checkpoint wraps in a CheckpointException (a BaseException whose `failures` maps rank -> (exception,
    traceback))."""
    stack, seen = [exc], set()
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            stack.extend(f[0] if isinstance(f, tuple) else f for f in failures.values())
        stack.extend((e.__cause__, e.__context__))
    return None


def io_fault(e: OSError, doing: str, path: str | None = None) -> RunError:
    """One line for an OSError met while `doing` something ('writing', 'reading') to `path` (the OS's own file name
    when it gives one: a write() that fails names none)."""
    what = FILE_FAULTS.get(e.errno) or e.strerror or str(e)
    return RunError(f"{what} while {doing} {e.filename or path}")


@contextlib.contextmanager
def writing(path: str, doing: str = "writing"):
    """The block writes `path`: an OSError in it (a full disk, a read-only file system) becomes a RunError naming
    `path`."""
    try:
        yield
    except OSError as e:
        raise io_fault(e, doing, path) from e


def append_lines(path: str, text: str) -> None:
    """Append `text` (whole lines) to `path` in one write of an O_APPEND descriptor. A write that fails part way (a
    full disk) is cut back to the file's size before it, then raised as a RunError naming `path`: the file never
    ends in a fragment that a later line would join (a kill mid-write still can: a resume drops that one,
    rc_checkpoint.truncate_metrics)."""
    with writing(path):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            size, left = os.fstat(fd).st_size, memoryview(text.encode())
            try:
                while left:
                    left = left[os.write(fd, left) :]
            except BaseException:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)
                raise
        finally:
            os.close(fd)


def fault_line(exc: BaseException) -> str | None:
    """The one line owed for `exc` (a RunError, or an OSError of FILE_FAULTS), or None: a fault of the program,
    whose traceback is the report."""
    if isinstance(exc, RunError):
        return str(exc)
    e = os_error_in(exc)
    if e is not None and e.errno in FILE_FAULTS:
        return f"{FILE_FAULTS[e.errno]}: {e.filename or 'a file the OS did not name'}"
    return None


def _in_resource_sharer(tb) -> bool:
    """The traceback passes through multiprocessing's resource sharer, the trainer's thread that hands file
    descriptors (torch's shared tensors) to the rollout worker: a connection lost there is the worker's death, which
    its RolloutWorker reports in one line as soon as the trainer waits on it (that thread calls sys.excepthook)."""
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(os.path.join("multiprocessing", "resource_sharer.py")):
            return True
        tb = tb.tb_next
    return False


def report_faults(program: str = "rc_train.py") -> None:
    """From now on an uncaught fault of the record or of the machine's files (fault_line) ends the process with one
    line `program: error: ...` on stderr and exit code 1; every other exception keeps its traceback."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        if isinstance(value, (ConnectionError, EOFError)) and _in_resource_sharer(tb):
            return  # a rollout worker that died while it fetched shared tensors: its line comes from the next wait
        line = fault_line(value)
        if line is None:
            return previous(kind, value, tb)
        # sys.__stderr__: once a process group is up, torch's own hook captures sys.stderr to prefix it "[rank0]: "
        (sys.__stderr__ or sys.stderr).write(f"{program}: error: {line}\n")

    sys.excepthook = hook


REFUSALS = (ValueError, TypeError, FileNotFoundError, FileExistsError, ImportError)  # what a bad setting raises


@contextlib.contextmanager
def refused(*kinds: type[BaseException], program: str = "rc_train.py"):
    """A refusal inside the block (`kinds`, default REFUSALS) ends the process with one line `program: error: ...`:
    a bad value named, before anything more is built or written."""
    kinds = kinds or REFUSALS
    try:
        yield
    except kinds as e:
        sys.exit(f"{program}: error: {e}")


# ---------------------------------------------------------------------------------------------
# The run folder: its lock, creation and config.yaml, logs and trackers, data-parallel checksums
# ---------------------------------------------------------------------------------------------
LOCK_FILE = ".lock"  # in the run folder: RunLock's file (the run's owner); not part of the run's record


class RunLock:
    """The run folder's owner: an exclusive flock on run_dir/.lock (fcntl.flock), taken before anything is written
    and held until the process ends. The kernel releases it when its process dies, by any signal, so it never
    outlives its run, and a process started later takes it over (no stale lock to remove by hand). The file holds the
    holder's pid and host, which a refused start names. A lock folder the process created itself and left with nothing
    but the lock (its start refused before anything was written) is removed at exit."""

    def __init__(self, run_dir: str):
        self.run_dir, self.path = run_dir, os.path.join(run_dir, LOCK_FILE)
        made = not os.path.isdir(run_dir)
        os.makedirs(run_dir, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)  # not inherited by a spawned child
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").split()
            os.close(fd)
            who = f"pid {holder[0]}" + (f" on {holder[1]}" if len(holder) > 1 else "") if holder else "another process"
            raise RunError(
                f"run folder {run_dir!r} is in use by {who} (a run or a resume of it holds {self.path}): wait for it "
                f"to end or stop it; two processes never write one run"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        self.fd = fd
        if made:
            atexit.register(self._remove_if_unused)

    def _remove_if_unused(self) -> None:
        with contextlib.suppress(OSError):
            if os.listdir(self.run_dir) == [LOCK_FILE]:
                os.unlink(self.path)
                os.rmdir(self.run_dir)


def run_dir_in_use(run_dir: str) -> bool:
    """The folder holds something besides its lock file."""
    return os.path.isdir(run_dir) and bool(set(os.listdir(run_dir)) - {LOCK_FILE})


def open_run_dir(run_dir: str, replace: bool, accelerator, args, correction, **facts) -> None:
    """Create the run folder (emptied first when `replace`, its lock kept) and write config.yaml (write_config). On
    --resume config.yaml is left alone here: rc_checkpoint.commit_resume rewrites it once the checkpoint has loaded."""
    if replace and accelerator.is_main_process:
        for name in sorted(set(os.listdir(run_dir)) - {LOCK_FILE}):
            path = os.path.join(run_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)
    accelerator.wait_for_everyone()
    os.makedirs(run_dir, exist_ok=True)
    if not args.resume:
        write_config(run_dir, accelerator, args, correction, **facts)


def write_config(run_dir: str, accelerator, args, correction, **facts) -> None:
    """config.yaml (main process): the arguments, the processes, the resolved correction config and `facts` (model
    path, training rows)."""
    if accelerator.is_main_process:
        correction = {
            f.name: (str(v) if isinstance(v := getattr(correction, f.name), str) else v)  # str(): an unset
            for f in dataclasses.fields(correction)
            if f.init
        }  # loss_type is a str subclass
        fields = dataclasses.asdict(args)
        own = [k for k in vars(type(args)).get("__annotations__", {}) if k in fields]  # the class's own fields first
        config = {
            "args": {**{k: fields[k] for k in own}, **fields},  # then the groups it inherits
            "world_size": accelerator.num_processes,
            "distributed_type": str(accelerator.distributed_type),
            "model_path": facts.pop("model_path"),
            "rollout_correction": correction,
            **facts,
        }
        path = os.path.join(run_dir, "config.yaml")
        with writing(path), open(path + ".tmp", "w") as f:
            yaml.safe_dump(config, f, sort_keys=False)
        os.replace(path + ".tmp", path)


class RunLog:
    """The run's logs, written by the main process only: metrics.jsonl (one line per step, keys sorted after step
    -1's evaluation line),
    eval_samples.jsonl, and the same figures to every tracker of --log-with through Accelerate (init_trackers /
    accelerator.log, main process only). A W&B run keeps its id in wandb_id.txt, so --resume continues it. Each record
    is one write (append_lines): a full disk leaves no torn line behind."""

    def __init__(self, run_dir: str, accelerator):
        self.run_dir, self.accelerator, self.main = run_dir, accelerator, accelerator.is_main_process
        self.path = os.path.join(run_dir, "metrics.jsonl")
        if self.main:
            append_lines(self.path, "")  # made now, as the run starts

    def start_trackers(self, args, run_name: str) -> None:
        if not args.log_with:
            return
        init = {
            "wandb": {
                "name": run_name,
                "entity": args.wandb_entity,
                "dir": self.run_dir,
                "resume": "allow",
                "id": wandb_run_id(self.run_dir, args.resume) if self.main else None,
            }
        }
        self.accelerator.init_trackers(
            args.wandb_project_name,
            config=flat_config(dataclasses.asdict(args)),
            init_kwargs={k: v for k, v in init.items() if k in args.log_with},
        )

    def log(self, step: int, metrics: dict, trackers: bool = True) -> None:
        """One line of metrics.jsonl; with `trackers`, keys sorted and the same figures to the trackers."""
        if trackers:
            self.accelerator.log(metrics, step=step)
        if self.main:
            record = {"step": step, **(dict(sorted(metrics.items())) if trackers else metrics)}
            append_lines(self.path, json.dumps(record) + "\n")

    def eval_samples(self, step: int, samples: list[dict]) -> None:
        if self.main:
            path = os.path.join(self.run_dir, "eval_samples.jsonl")
            append_lines(path, "".join(json.dumps({"step": step, **s}) + "\n" for s in samples))

    def close(self) -> None:
        for tracker in self.accelerator.trackers:  # end_training() would also destroy the process group, which the
            tracker.finish()  # engine (and exit_cleanly) still need


def flat_config(config: dict, prefix: str = "") -> dict:
    """Nested settings as one level of 'a.b' keys with scalar values (what TensorBoard's hparams accept)."""
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(flat_config(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


def wandb_run_id(run_dir: str, resume: bool) -> str:
    """The W&B run id of this run folder: stored in wandb_id.txt when the run starts, read back on --resume, so a
    resumed run continues the same W&B run instead of starting a new one."""
    path = os.path.join(run_dir, "wandb_id.txt")
    if resume and os.path.isfile(path):
        with open(path) as f:
            return f.read().strip()
    run_id = hashlib.blake2b(os.urandom(16), digest_size=6).hexdigest()
    with open(path, "w") as f:
        f.write(run_id + "\n")
    return run_id


def weights_sha256(weights) -> str:
    """SHA-256 of (name, tensor) pairs in name order: names and a 64-bit fingerprint of each tensor's bits, computed
    on its device (every word of the tensor times a position weight, summed in int64), so a GPU copies 8 bytes per
    tensor to the host, not the weights. Any changed bit changes the fingerprint."""

    def fingerprint(t: torch.Tensor) -> int:
        t = t.detach().contiguous()
        words = {8: torch.int64, 4: torch.int32, 2: torch.int16}.get(t.element_size())
        bits = (t.view(words) if words else t).flatten().to(torch.int64)
        pos = torch.arange(1, bits.numel() + 1, device=bits.device, dtype=torch.int64) % 1_000_003 + 1
        return int((bits * pos).sum())

    h = hashlib.sha256()  # one tensor at a time (under FSDP2 each is a gathered full tensor), then in name order
    for name, value in sorted((name, fingerprint(t)) for name, t in weights):
        h.update(name.encode() + str(value).encode())
    return h.hexdigest()


def log_rank_checksums(run_dir: str, step: int, rank: int, world: int, token_ids: list, weights) -> None:
    """Data-parallel sanity: every rank appends {step, world_size, SHA-256 of its sampled tokens and of the full
    weights it holds (under FSDP2: gathers the full weights, what its engine receives)} to ranks/rank{r}.jsonl: the
    weights must agree across ranks, the samples must not."""
    rollout = hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()
    os.makedirs(os.path.join(run_dir, "ranks"), exist_ok=True)
    record = {
        "step": step,
        "rank": rank,
        "world_size": world,
        "rollout_sha256": rollout,
        "weights_sha256": weights_sha256(weights),
    }
    append_lines(os.path.join(run_dir, "ranks", f"rank{rank}.jsonl"), json.dumps(record) + "\n")


# ---------------------------------------------------------------------------------------------
# The end of a run: final weights, the closing summary, the exit
# ---------------------------------------------------------------------------------------------
FINAL_SHARD_BYTES = 2 * 1024**3  # final/'s safetensors shards: the most rank 0 holds in host memory while saving


def save_final(run_dir: str, model, tokenizer, accelerator, max_shard_bytes: int = FINAL_SHARD_BYTES) -> None:
    """final/: the trained weights in the base model's own dtype (config.dtype, the checkpoint's: bf16 for Qwen2.5,
    not the fp32 master weights; from_pretrained(dtype="auto") sets it and .float() leaves it), as safetensors shards
    of at most `max_shard_bytes` with their index, the config and the tokenizer: loadable by transformers and vLLM.
    Streamed: one tensor at a time is gathered (under FSDP2 every rank runs each all-gather, in state-dict order),
    cast on its device and, on the main process, moved to host memory; a shard is written as soon as its last tensor
    is in. So the main process holds at most a shard, never the full state dict (in fp32, 30.5 GB at 7B), and the
    other ranks hold one tensor at a time. By hand because save_pretrained and huggingface_hub's
    save_torch_state_dict take the whole state dict at once; the shard plan and the file names are
    huggingface_hub's (split_torch_state_dict_into_shards, on meta tensors), the files safetensors'."""
    from huggingface_hub import constants, split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    unwrapped = accelerator.unwrap_model(model)
    dtype = unwrapped.config.dtype or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    # a tied lm_head is the same parameter under a second name: keep each under its first name only
    owned = {n for n, _ in unwrapped.named_parameters()} | {n for n, _ in unwrapped.named_buffers()}
    entries = [(n, t) for n, t in unwrapped.state_dict().items() if n in owned]  # live tensors or shards: no copy
    plan = split_torch_state_dict_into_shards(
        {n: torch.empty(t.shape, dtype=dtype, device="meta") for n, t in entries}, max_shard_size=max_shard_bytes
    )
    final, main = os.path.join(run_dir, "final"), accelerator.is_main_process
    if main:
        os.makedirs(final, exist_ok=True)
    shards: dict[str, dict] = {}
    for name, t in entries:
        full = (t.full_tensor() if isinstance(t, DTensor) else t).detach()  # under FSDP2 a collective on every rank
        if not main:
            continue
        file = plan.tensor_to_filename[name]
        shard = shards.setdefault(file, {})
        shard[name] = full.to(dtype).cpu().contiguous()  # cast where it lives: half the bytes to move for bf16
        if len(shard) == len(plan.filename_to_tensors[file]):
            save_file(shards.pop(file), os.path.join(final, file), metadata={"format": "pt"})
        del full
    if not main:
        return
    if plan.is_sharded:
        index = {"metadata": plan.metadata, "weight_map": plan.tensor_to_filename}
        with open(os.path.join(final, constants.SAFETENSORS_INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    config = copy.deepcopy(unwrapped.config)
    config.dtype = dtype
    config.architectures = [type(unwrapped).__name__.removeprefix("FSDP")]  # as save_pretrained names a sharded one
    config.save_pretrained(final)
    if unwrapped.can_generate() and unwrapped.generation_config is not None:
        unwrapped.generation_config.save_pretrained(final)
    tokenizer.save_pretrained(final)


def print_summary(
    first_eval: dict | None,
    last_eval: dict | None,
    n_eval: int,
    seconds: float,
    run_dir: str,
    accuracy_key: str,
    health: str = "",
) -> None:
    """The closing lines on the console: greedy accuracy under the task's accuracy key (Task.accuracy_key) before ->
    after, the health checks that fired (HealthWatch.summary), wall time, where the run is. A run that evaluated
    nothing (a resume of a finished run) says so rather than leave the line empty."""
    name = f"eval/accuracy_{accuracy_key}"
    line = f"eval accuracy ({accuracy_key}, greedy, {n_eval} problems): "
    if first_eval and last_eval:
        line += f"{first_eval[name]:.3f} before -> {last_eval[name]:.3f} after"
    elif last_eval:
        line += f"{last_eval[name]:.3f} after training"
    else:
        line = f"eval accuracy ({accuracy_key}, greedy): no evaluation in this run"
    print(line + (f"\n{health}" if health else ""))
    print(f"wall time: {seconds:.0f} s\nrun folder: {run_dir}\ndashboard: python rc_train.py plot {run_dir}")


def exit_cleanly(world: int) -> None:
    """End a multi-process run: destroy the process group, flush, and leave with os._exit(0). A plain interpreter
    exit after gloo collectives or torch distributed checkpoint aborts some of the time on these machines
    ("terminate called without an active exception", SIGABRT, though every file is written: docs/gpus.md).
    At world 1 the only group is the one the engine created, which the engine's close tore down
    (rc_rollout.shutdown_engine); one left by anything else is destroyed here too, and the interpreter exits."""
    import torch.distributed as dist

    if world > 1:
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if dist.is_initialized():
        dist.destroy_process_group()
