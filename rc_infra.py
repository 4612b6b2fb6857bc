"""Infrastructure of rc_train.py, kept out of its reading path: processes and devices, the engine's memory on
GPU, metric reduction across ranks, gradient norms, checkpoints and resume, run bookkeeping.

Nothing here changes the algorithm; every piece is unit-tested on CPU (test_infra.py).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal

import numpy as np
import torch


# ---------------------------------------------------------------------------------------------
# Processes and devices
# ---------------------------------------------------------------------------------------------
def check_distributed(accelerator, micro_batches_per_step: int | None) -> None:
    """Refuse the Accelerate backends whose weights are sharded: FSDP and DeepSpeed ZeRO-3.

    Every rank pushes the FULL weights into its own colocated engine after each update, runs the decoupled pi_old
    pass on the unwrapped module, and checkpoints from rank 0's copy. With sharded parameters each of these needs a
    gather (streamed into the engine parameter by parameter) and a sharded optimizer checkpoint per rank, which this
    trainer does not implement: it says so at start instead of half-working. DDP and DeepSpeed ZeRO-1/2 keep the
    parameters replicated and are supported. DeepSpeed steps its optimizer inside the backward of the last micro-batch
    of each accumulation window, so its gradient_accumulation_steps must equal the trainer's micro-batches per
    optimizer step, or it would step at the wrong times."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        raise ValueError("FSDP is not supported (sharded parameters: the engine sync, the pi_old pass and checkpoints "
                         "need full weights on every rank); use DDP (configs/accelerate/multi_gpu.yaml) or DeepSpeed "
                         "ZeRO-2 (configs/accelerate/deepspeed_zero2.yaml)")
    if kind == DistributedType.DEEPSPEED:
        plugin = accelerator.state.deepspeed_plugin
        if plugin.zero_stage == 3:
            raise ValueError("DeepSpeed ZeRO stage 3 is not supported (sharded parameters); use zero_stage 1 or 2 "
                             "(configs/accelerate/deepspeed_zero2.yaml)")
        steps = plugin.deepspeed_config.get("gradient_accumulation_steps")
        if micro_batches_per_step is None:
            raise ValueError("DeepSpeed needs the same number of micro-batches in every optimizer step: "
                             "drop --max-tokens-per-micro-batch (its micro-batch count varies with the lengths)")
        if steps != micro_batches_per_step:
            raise ValueError(f"DeepSpeed gradient_accumulation_steps is {steps!r} but the trainer runs "
                             f"{micro_batches_per_step} micro-batches per optimizer step (per-rank rollout batch / "
                             f"--num-minibatches / --micro-batch-size, rounded up): set it to {micro_batches_per_step}")


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


# ---------------------------------------------------------------------------------------------
# Metrics across micro-batches and ranks
# ---------------------------------------------------------------------------------------------
def metric_kind(name: str) -> str:
    """'max' / 'min' for names whose last part has a max/min word (rollout_is_max, log_ppl_diff_min,
    rollout_is_seq_max_deviation), else 'mean'."""
    words = name.rsplit("/", 1)[-1].split("_")
    return "max" if "max" in words else "min" if "min" in words else "mean"


class MetricSum:
    """Accumulates metrics with weights: means are weighted (by valid tokens, or sequences), max/min stay extremes."""

    def __init__(self):
        self.sums: dict[str, list[float]] = {}

    def add(self, metrics: dict, weight: float) -> None:
        for k, v in metrics.items():
            v = float(v)
            kind = metric_kind(k)
            if kind == "mean":
                s = self.sums.setdefault(k, [0.0, 0.0])
                s[0] += weight * v
                s[1] += weight
            elif k not in self.sums:
                self.sums[k] = [v, 1.0]
            else:
                self.sums[k][0] = max(self.sums[k][0], v) if kind == "max" else min(self.sums[k][0], v)

    def local(self) -> dict:
        return {k: (s[0] / s[1] if metric_kind(k) == "mean" and s[1] else s[0]) for k, s in self.sums.items()}


def reduce_metrics(acc: MetricSum, world: int) -> dict:
    """Metrics of all ranks: weighted means (each rank's sum of weight x value over the sum of weights) and global
    max/min, over the union of the ranks' keys. A rank that lacks a key (e.g. every response of its micro-batch was
    dropped) contributes weight 0 to it; a key no rank has a weight for comes out NaN. No hang: every rank takes
    part in the same collectives with the same key list."""
    if world == 1:
        return acc.local()
    import torch.distributed as dist

    key_lists = [None] * world
    dist.all_gather_object(key_lists, sorted(acc.sums))
    keys = sorted(set().union(*key_lists))
    means = [k for k in keys if metric_kind(k) == "mean"]
    sums = torch.tensor([acc.sums.get(k, [0.0, 0.0]) for k in means], dtype=torch.float64).reshape(-1, 2)
    dist.all_reduce(sums)
    out = {k: float(s / w) if w > 0 else float("nan") for k, (s, w) in zip(means, sums.tolist())}
    for kind, op, fill in (("max", dist.ReduceOp.MAX, -float("inf")), ("min", dist.ReduceOp.MIN, float("inf"))):
        names = [k for k in keys if metric_kind(k) == kind]
        vals = torch.tensor([acc.sums[k][0] if k in acc.sums else fill for k in names], dtype=torch.float64)
        dist.all_reduce(vals, op=op)
        out.update(zip(names, vals.tolist()))
    return out


def global_sum(values: list[float], accelerator) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        t = accelerator.reduce(t, reduction="sum")
    return t.tolist()


def accumulating(accelerator, model, last_micro_batch: bool):
    """The context of one micro-batch's backward: DDP skips the gradient all-reduce on all but the last micro-batch
    of an optimizer step (no_sync). DeepSpeed accumulates by itself (its no_sync refuses ZeRO-2)."""
    import contextlib

    from accelerate.utils import DistributedType

    if last_micro_batch or accelerator.num_processes == 1 or accelerator.distributed_type == DistributedType.DEEPSPEED:
        return contextlib.nullcontext()
    return accelerator.no_sync(model)


def clip_and_step(accelerator, model, optimizer, max_norm: float) -> float:
    """Clip the gradients, take the optimizer step, and return the global gradient norm before clipping.

    DDP: accelerator.clip_grad_norm_ clips and returns the norm. DeepSpeed clips inside its own step (the
    `gradient_clipping` of its config) and clip_grad_norm_ returns None; its engine reports the norm after the
    step (get_global_grad_norm)."""
    from accelerate.utils import DistributedType

    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    if norm is None and accelerator.distributed_type == DistributedType.DEEPSPEED:
        norm = model.get_global_grad_norm()
    return float("nan") if norm is None else float(norm)


# ---------------------------------------------------------------------------------------------
# Checkpoints, resume, run bookkeeping
# ---------------------------------------------------------------------------------------------
def checkpoint_dirs(run_dir: str) -> list[str]:
    """Complete checkpoints, oldest first. A complete one was renamed from *.tmp after its last file."""
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    names = sorted(n for n in os.listdir(root) if n.startswith("step_") and not n.endswith(".tmp")
                   and os.path.isfile(os.path.join(root, n, "trainer_state.json")))
    return [os.path.join(root, n) for n in names]


def save_checkpoint(run_dir, step, position, model, optimizer, scheduler, tokenizer, accelerator, counters):
    """Write checkpoints/step_N.tmp (every rank its RNG state; rank 0 the rest), then rename it."""
    final = os.path.join(run_dir, "checkpoints", f"step_{step:06d}")
    tmp = final + ".tmp"
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    accelerator.wait_for_everyone()
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
               os.path.join(tmp, f"rng_rank{accelerator.process_index}.pt"))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(os.path.join(tmp, "model"), state_dict=state_dict)
        tokenizer.save_pretrained(os.path.join(tmp, "model"))
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                   os.path.join(tmp, "optim.pt"))
        if os.environ.get("RC_TRAIN_KILL_IN_CHECKPOINT") == str(step):  # test hook: SIGKILL mid-write
            os.kill(os.getpid(), signal.SIGKILL)
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:  # written last
            json.dump({"step": step, "position": position, **counters}, f)
        os.replace(tmp, final)
    accelerator.wait_for_everyone()


def load_checkpoint(path, model, optimizer, scheduler, accelerator) -> dict:
    """Model, optimizer and scheduler state (onto this rank's device), and the trainer state. The RNG states are
    restored separately, by restore_rng, once the engine has started: vLLM seeds the global generators when it
    starts, which would overwrite them."""
    from safetensors.torch import load_file

    weights = {}
    for name in sorted(os.listdir(os.path.join(path, "model"))):
        if name.endswith(".safetensors"):
            weights.update(load_file(os.path.join(path, "model", name)))
    unwrapped = accelerator.unwrap_model(model)
    missing, unexpected = unwrapped.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and unwrapped.config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path!r} does not match the model: missing {missing}, unexpected {unexpected}")
    opt = torch.load(os.path.join(path, "optim.pt"), map_location=accelerator.device, weights_only=False)
    optimizer.load_state_dict(opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])
    with open(os.path.join(path, "trainer_state.json")) as f:
        return json.load(f)


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


def weights_sha256(model) -> str:
    """SHA-256 of a model's weights (names and bytes, in name order): the data-parallel consistency check."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode() + tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
