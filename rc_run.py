"""The run: its folder and the other ranks, during and after training.

What belongs here keeps the record of a run and keeps the ranks together, and never changes what a step computes:
the trainer's own collectives (HostGroup) and FSDP2 sharding, gradient accumulation and clipping across ranks, metric
reduction (METRIC_REDUCTIONS) and the step's metrics, timers and progress bar, evaluation, the run folder, its logs
and trackers, checkpoints and resume, data-parallel checksums, the final weights, the closing summary and the exit.
Unit-tested on CPU (tests/test_infra.py) and end to end (tests/test_train.py).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import signal
import sys
import time
from collections import Counter

import numpy as np
import torch
import yaml

import rc_core


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
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"--fsdp: {type(model).__name__} names no transformer block class (_no_split_modules)")
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_weights(model):
    """(name, full tensor) for every entry of the model's state dict (a tied lm_head too: vLLM's CPU build keeps its
    own copy), one at a time. Under FSDP2 each is gathered from the shards when it is reached, a collective that
    every rank runs in the same order, so no rank ever holds a full state dict; otherwise they are the live
    parameters (no copy)."""
    from torch.distributed.tensor import DTensor

    for name, t in model.state_dict().items():
        yield name, (t.full_tensor() if isinstance(t, DTensor) else t).detach()


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
        "rollout_corr/log_ppl_diff_max",
        "rollout_corr/rollout_probs_diff_max",
        "rollout_corr/rollout_is_max",
        "rollout_corr/rollout_is_seq_max",
        "rollout_corr/rollout_is_seq_max_deviation",
        "rollout_corr/rollout_rs_<option>_max",
        "rollout_corr/rollout_rs_<option>_seq_max",
        "rollout_corr/rollout_rs_<option>_seq_max_deviation",
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


def batch_metrics(args, rewards: list, corrects: list, mask, n_nonfinite: int, version: int, step: int, stale):
    """reward/*, response_length/* and rollout/* of this rank's rollout batch: means and a std over its responses,
    the longest response, counts of non-finite tokens and dropped samples. Every response of the batch was sampled by
    policy version `version`: its staleness is step - version."""
    lengths, staleness = mask.sum(-1), torch.full((len(mask),), step - version)
    return {
        "reward/mean": float(np.mean(rewards)),
        "reward/std": float(np.std(rewards)),
        "reward/correct": float(np.mean(corrects)),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float((lengths >= args.max_response_length).float().mean()),
        "rollout/nonfinite_logprob_tokens": float(n_nonfinite),
        "rollout/policy_version": float(version),
        "rollout/staleness_mean": float(staleness.float().mean()),
        "rollout/staleness_max": float(staleness.max()),
        "rollout/dropped_samples": float(stale.sum()),
    }


def pass_metrics(size: Counter, seconds: float) -> dict:
    """perf/* of the trainer's forward passes this step (pi_old, reference, update): `size` as
    rc_train.forward_log_probs counts it, `seconds` their wall time."""
    return {
        "perf/padding_fraction": 1.0 - size["tokens"] / max(1, size["positions"]),
        "perf/train_tokens_per_s": size["tokens"] / max(1e-9, seconds),
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
    0.0 where its metric exists and passes (absent: the correction has no such metric, e.g. no IS); the console gets
    one line when a check starts firing and one when it clears (`say`: the main process's writer, None elsewhere);
    `fired` counts the steps each check fired on, for the closing summary."""

    def __init__(self, say=None):
        self.say, self.firing, self.fired = say, set(), Counter()

    def check(self, step: int, metrics: dict) -> dict:
        fired = rc_core.check_rollout_correction_health(metrics)
        out = {}
        for name, check in rc_core.HEALTH_CHECKS.items():
            value = metrics.get(check.metric)
            if value is None or math.isnan(value):
                continue
            out[name] = float(name in fired)
            if name in fired and name not in self.firing:
                bounds = " or ".join(
                    f"{'<' if i == 0 else '>'} {b:g}" for i, b in enumerate((check.low, check.high)) if b is not None
                )
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
# The run folder: checks, creation and config.yaml, logs and trackers, data-parallel checksums
# ---------------------------------------------------------------------------------------------
def check_run_dir(run_dir: str, resume: bool, overwrite: bool, world: int = 1, max_staleness: int = 0) -> bool:
    """Refuse to touch an existing run unless --resume or --overwrite (before anything is written), and a resume
    with another number of processes than its checkpoint's (each rank's RNG state and data shard are in it) or another
    --max-staleness (its batches in flight were sampled for that schedule); True when the folder must be emptied first
    (--overwrite of an existing run)."""
    exists = os.path.isdir(run_dir) and bool(os.listdir(run_dir))
    state = newest_checkpoint_state(run_dir) if resume else None
    if resume and state is None:
        raise FileNotFoundError(f"--resume: no complete checkpoint under {run_dir!r}")
    if resume:
        written_by, k = state.get("world_size", 1), state.get("max_staleness", 0)
        if written_by != world:
            raise ValueError(
                f"--resume: the checkpoint under {run_dir!r} was written by {written_by} process(es), "
                f"this run has {world}: resume with as many"
            )
        if k != max_staleness:
            raise ValueError(
                f"--resume: the checkpoint under {run_dir!r} was written with --max-staleness {k}, this "
                f"run has --max-staleness {max_staleness}: resume with the same bound"
            )
    if exists and not (resume or overwrite):
        raise FileExistsError(f"run folder {run_dir!r} exists; pass --overwrite to replace it or --resume")
    return exists and overwrite and not resume


def open_run_dir(run_dir: str, replace: bool, accelerator, args, correction, **facts) -> None:
    """Create the run folder (emptied first when `replace`) and write config.yaml: the arguments, the processes,
    the resolved correction config and `facts` (model path, training rows)."""
    if replace and accelerator.is_main_process:
        shutil.rmtree(run_dir)
    accelerator.wait_for_everyone()
    os.makedirs(run_dir, exist_ok=True)
    if accelerator.is_main_process:
        correction = {
            f.name: (str(v) if isinstance(v := getattr(correction, f.name), str) else v)  # str(): an unset
            for f in dataclasses.fields(correction)
            if f.init
        }  # loss_type is a str subclass
        config = {
            "args": dataclasses.asdict(args),
            "world_size": accelerator.num_processes,
            "distributed_type": str(accelerator.distributed_type),
            "model_path": facts.pop("model_path"),
            "rollout_correction": correction,
            **facts,
        }
        with open(os.path.join(run_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(config, f, sort_keys=False)


class RunLog:
    """The run's logs, written by the main process only: metrics.jsonl (one line per step, keys sorted after step
    -1's evaluation line),
    eval_samples.jsonl, and the same figures to every tracker of --log-with through Accelerate (init_trackers /
    accelerator.log, main process only). A W&B run keeps its id in wandb_id.txt, so --resume continues it."""

    def __init__(self, run_dir: str, accelerator):
        self.run_dir, self.accelerator, self.main = run_dir, accelerator, accelerator.is_main_process
        self.file = open(os.path.join(run_dir, "metrics.jsonl"), "a") if self.main else None

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
            self.file.write(
                json.dumps({"step": step, **(dict(sorted(metrics.items())) if trackers else metrics)}) + "\n"
            )
            self.file.flush()

    def eval_samples(self, step: int, samples: list[dict]) -> None:
        if self.main:
            with open(os.path.join(self.run_dir, "eval_samples.jsonl"), "a") as f:
                f.writelines(json.dumps({"step": step, **s}) + "\n" for s in samples)

    def close(self) -> None:
        for tracker in self.accelerator.trackers:  # end_training() would also destroy the process group, which the
            tracker.finish()  # engine (and exit_cleanly) still need
        if self.main:
            self.file.close()


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
    with open(os.path.join(run_dir, "ranks", f"rank{rank}.jsonl"), "a") as f:
        f.write(
            json.dumps(
                {
                    "step": step,
                    "rank": rank,
                    "world_size": world,
                    "rollout_sha256": rollout,
                    "weights_sha256": weights_sha256(weights),
                }
            )
            + "\n"
        )


# ---------------------------------------------------------------------------------------------
# Checkpoints and resume
# ---------------------------------------------------------------------------------------------
def checkpoint_dirs(run_dir: str) -> list[str]:
    """Complete checkpoints, oldest first. A complete one was renamed from *.tmp after its last file."""
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    names = sorted(
        n
        for n in os.listdir(root)
        if n.startswith("step_")
        and not n.endswith(".tmp")
        and os.path.isfile(os.path.join(root, n, "trainer_state.json"))
    )
    return [os.path.join(root, n) for n in names]


def newest_checkpoint_state(run_dir: str) -> dict | None:
    """trainer_state.json of the run's newest complete checkpoint (None when it has none)."""
    dirs = checkpoint_dirs(run_dir)
    if not dirs:
        return None
    with open(os.path.join(dirs[-1], "trainer_state.json")) as f:
        return json.load(f)


def save_checkpoint(
    run_dir, step, model, optimizer, scheduler, accelerator, counters, in_flight: dict, max_staleness: int
):
    """checkpoints/step_N: model and optimizer through torch distributed checkpoint (each rank writes its own shards
    under FSDP2; replicated DDP tensors are written once), every rank's RNG state and the batches it has in flight
    (--max-staleness k: those of the next k steps, sampled by older versions), the scheduler, and
    trainer_state.json. All of it goes into step_N.tmp, trainer_state.json last, then one rename: a process killed
    during a save leaves a .tmp folder that --resume never loads."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = os.path.join(run_dir, "checkpoints", f"step_{step:06d}")
    tmp = final + ".tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    accelerator.wait_for_everyone()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(tmp, "state"))
    torch.save(
        {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        os.path.join(tmp, f"rng_rank{accelerator.process_index}.pt"),
    )
    torch.save(in_flight, os.path.join(tmp, f"in_flight_rank{accelerator.process_index}.pt"))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        torch.save(scheduler.state_dict(), os.path.join(tmp, "scheduler.pt"))
        if os.environ.get("RC_TRAIN_KILL_IN_CHECKPOINT") == str(step):  # test hook: SIGKILL mid-write
            os.kill(os.getpid(), signal.SIGKILL)
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:  # written last
            json.dump(
                {
                    "step": step,
                    "world_size": accelerator.num_processes,  # the step fixes the data position
                    "max_staleness": max_staleness,
                    **counters,
                },
                f,
            )
        os.replace(tmp, final)
    accelerator.wait_for_everyone()


def load_checkpoint(path, model, optimizer, scheduler) -> dict:
    """Model and optimizer state (resharded onto this run's ranks by DCP), the scheduler, and the trainer state. The
    RNG states are restored separately, by restore_rng, once the engine has started: vLLM seeds the global
    generators when it starts, which would overwrite them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    with open(os.path.join(path, "trainer_state.json")) as f:
        state = json.load(f)
    model_state, optim_state = get_state_dict(model, optimizer)  # the layout to load into (creates Adam's state)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(path, "state"))
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    scheduler.load_state_dict(torch.load(os.path.join(path, "scheduler.pt"), weights_only=False))
    return state


def load_in_flight(path: str, rank: int) -> dict:
    """The batches this rank had in flight when the checkpoint was written ({step: result}; empty at k = 0, and for a
    checkpoint written before asynchronous rollout existed, which has no such file)."""
    file = os.path.join(path, f"in_flight_rank{rank}.pt")
    return torch.load(file, weights_only=False) if os.path.isfile(file) else {}


def restore_rng(path: str, rank: int) -> None:
    rng = torch.load(os.path.join(path, f"rng_rank{rank}.pt"), weights_only=False)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])


def truncate_metrics(path: str, start_step: int) -> None:
    """On resume, drop lines of steps that will be run again (rewritten atomically)."""
    if not os.path.isfile(path):
        return
    keep = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] < start_step:
                    keep.append(line)
            except (json.JSONDecodeError, KeyError):  # a line torn by the kill that interrupted the run
                continue
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)


def resume(run_dir: str, model, optimizer, scheduler, accelerator, counters: dict) -> tuple[str, int, dict]:
    """Load the newest complete checkpoint; drop the log lines of the steps that will run again.
    Returns (checkpoint path, first step to run, counters). The RNG states are restored later, by
    restore_rng, once the engine has started."""
    ckpt = checkpoint_dirs(run_dir)[-1]
    state = load_checkpoint(ckpt, model, optimizer, scheduler)
    start_step = state["step"] + 1
    if accelerator.is_main_process:
        for name in ("metrics.jsonl", "eval_samples.jsonl"):
            truncate_metrics(os.path.join(run_dir, name), start_step)
    truncate_metrics(os.path.join(run_dir, "ranks", f"rank{accelerator.process_index}.jsonl"), start_step)
    if accelerator.is_main_process:
        print(f"resumed from {ckpt} at step {start_step}")
    return ckpt, start_step, {k: state[k] for k in counters}


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
    after, the health checks that fired (HealthWatch.summary), wall time, where the run is."""
    name = f"eval/accuracy_{accuracy_key}"
    line = f"eval accuracy ({accuracy_key}, greedy, {n_eval} problems): "
    if first_eval and last_eval:
        line += f"{first_eval[name]:.3f} before -> {last_eval[name]:.3f} after"
    elif last_eval:
        line += f"{last_eval[name]:.3f} after training"
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
