"""The algorithm on one page: what a GRPO step with rollout correction computes, in that order.

A step: rollout (vLLM, with log-probs mu) -> reward, GRPO advantage -> correction -> update -> sync.
* bypass (docs/corrections.md §7.3/§7.4): pi_old := pi_rollout; the loss corrects each micro-batch.
* decoupled (§7.2): pi_old scored once per batch; IS weights and rejection mask frozen for it.
Formulas: rc_core.py. `ALGO LOGIC` marks what a fork edits; the plumbing lives beside this file
(docs/README.md). Commands: docs/running.md.
"""

import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process core: in-place weight push
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; else it takes most of the RAM
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # engine chatter goes to the run's engine.log
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch
from transformers import AutoModelForCausalLM

import rc_checkpoint
import rc_config
import rc_core
import rc_forward
import rc_moe
import rc_rollout
import rc_run
import tasks

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Args(
    rc_run.RunArgs,
    rc_checkpoint.CheckpointArgs,
    rc_rollout.EngineArgs,
    rc_rollout.DialArgs,
    rc_moe.MoEArgs,
    rc_forward.ForwardArgs,
):
    """The algorithm's settings; inherited groups live beside the code that reads them."""

    # General
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """experiment name"""
    seed: int = 1
    """seed of the experiment (runs also depend on the number of processes: docs/running.md)"""
    config: str | None = None
    """YAML file of defaults; flags win"""
    output_dir: str = "runs"
    """parent folder of the run folder"""
    run_name: str | None = None
    """run folder name (default: {task}__{exp_name}__{preset}__{seed}__{time})"""

    # Model and task
    model: str = tasks.TINY_MODEL
    """'tiny' (built here), 'tiny-moe' (docs/moe.md), a local path or a HF id"""
    task: str = "minigsm"
    """a name of tasks.TASKS: minigsm, gsm8k, add"""
    mini: tasks.MiniGSMArgs = field(default_factory=tasks.MiniGSMArgs)
    """miniature GSM8K: difficulty, splits, warm start"""
    dataset: str = "auto"
    """GSM8K source: HF id or JSONL/parquet; 'auto' = a local copy if present"""
    dataset_config: str = "main"
    """HF dataset config name"""
    train_limit: int | None = None
    """the first N training problems only"""
    reward_mode: str | None = None
    """a score key of the task (strict, flexible); None = its reward key"""
    format_bonus: float = 0.0
    """reward for a well-formed answer, right or wrong"""
    use_chat_template: bool = True
    """use the tokenizer's chat template when it has one"""
    max_model_len: int = 512
    """engine context length (prompt + response)"""

    # Rollout
    num_steps: int = 50
    """training steps (one rollout batch each)"""
    num_prompts_per_step: int = 32
    """prompts per step, over all ranks"""
    num_samples_per_prompt: int = 16
    """responses per prompt (the GRPO group size)"""
    max_response_length: int = 64
    """maximum generated tokens per response"""
    temperature: float = 1.0
    """sampling temperature; the trainer scores at it too"""
    top_p: float = 1.0
    """nucleus sampling; below 1 it changes the behaviour policy"""
    rollout_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype of the vLLM engine"""
    train_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """autocast dtype of the trainer's forward passes"""
    sync_every: int = 1
    """push the weights into vLLM every k steps; 0 = never"""
    max_staleness: int | None = None
    """k: step t trains on version max(0, t-k)'s batch (docs/async.md); None: 1 on a CPU, else 0"""
    partial_rollout: bool = False
    """unfinished responses continue next step, under newer weights (docs/async.md §9)"""
    partial_rollout_tokens: int = 16
    """--partial-rollout: tokens between two checks for a full batch"""
    partial_rollout_max_staleness: int | None = None
    """--partial-rollout: mask tokens further behind; None = the staleness bound + 1"""
    replay_window: int = 0
    """replay buffer: the fresh groups of the last W steps (docs/async.md §8)"""
    replay_fraction: float = 0.0
    """share of each step's groups drawn from the replay buffer"""
    mismatch_split: bool = False
    """also score each row at its sampling weights: mismatch = numerics + staleness (§6.9)"""
    kept_versions_gib: float = 8.0
    """host memory for the weights kept by version (--mismatch-split, --prox-logp sampling)"""

    # Optimisation
    learning_rate: float = 1e-4
    """AdamW learning rate"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    warmup_steps: int = 0
    """linear learning-rate warm-up, in optimizer steps"""
    max_grad_norm: float = 1.0
    """gradient clipping (global L2 norm)"""
    ppo_epochs: int = 1
    """passes over each rollout batch"""
    num_minibatches: int = 4
    """optimizer steps (minibatches) per epoch"""
    micro_batch_size: int = 32
    """sequences per forward/backward"""
    clip_ratio: float = 0.2
    """PPO clip epsilon (both sides unless overridden)"""
    clip_ratio_low: float | None = None
    """PPO lower clip epsilon (default: clip_ratio)"""
    clip_ratio_high: float | None = None
    """PPO upper clip epsilon (default: clip_ratio)"""
    clip_ratio_c: float = 3.0
    """dual-clip constant c > 1 (negative advantages only)"""
    loss_agg_mode: str = "token-mean"
    """token-mean | token-sum | seq-mean-token-{sum,mean,sum-norm} (§7.5)"""
    loss_scale_factor: float | None = None
    """divisor K of seq-mean-token-sum-norm (default: max_response_length)"""
    adv_estimator: str = "grpo"
    """a name in rc_core.ADVANTAGE_ESTIMATORS"""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group std (False = Dr.GRPO)"""
    kl_coef: float = 0.0
    """KL penalty to the initial model (0 = none)"""
    kl_estimator: str = "low_var_kl"
    """KL penalty estimator: kl (k1), abs, mse (k2), low_var_kl (k3)"""
    kl_is_corrected: bool = False
    """weight the KL penalty by pi_theta/pi_old (the unbiased KL, §7.8)"""
    prox_logp: Literal["recompute", "loglinear", "metrics", "sampling"] = "recompute"
    """decoupled pi_old: recompute | loglinear (no pass, §7.10) | metrics (both) | sampling (§6.9)"""

    # Evaluation
    eval_before: bool = True
    """evaluate the initial policy (logged at step -1)"""
    eval_every: int = 10
    """greedy pass@1 every N steps (0 = at the end)"""
    eval_limit: int | None = 200
    """eval problems (None = whole split)"""

    rc: rc_config.CorrectionArgs = field(default_factory=rc_config.CorrectionArgs)
    """rollout correction: a preset, then overrides"""


def load_yaml_defaults(path: str) -> Args:
    """Args with a YAML file's defaults."""
    return rc_config.load_yaml_defaults(Args, path, config=path)


# ALGO LOGIC: prompts, their order, the reward
def prompt_indices(n_rows: int, seed: int, position: int, count: int) -> list[int]:
    """Rows position .. position+count-1 of a stream of seeded epoch permutations."""
    out = []
    while len(out) < count:
        epoch, offset = divmod(position + len(out), n_rows)
        perm = np.random.default_rng([seed, epoch]).permutation(n_rows)
        out.extend(perm[offset : offset + count - len(out)].tolist())
    return out


def reward(args: Args, task: tasks.Task, scores: dict) -> float:
    """The score under --reward-mode, plus --format-bonus for a well-formed answer."""
    bonus = args.format_bonus * scores[task.format_key] if task.format_key else 0.0
    return scores[args.reward_mode] + bonus


# ALGO LOGIC: the batch -- reward and GRPO advantage
class Sample(NamedTuple):
    """One response of a step's batch."""

    row: int
    group: int
    version: int
    response: rc_rollout.Response


class TrainData(NamedTuple):
    """The run's problems as a step reads them."""

    task: tasks.Task
    rows: list
    prompts: list
    pad_id: int


def drop_nonfinite(mask: torch.Tensor, rollout_log_prob: torch.Tensor) -> int:
    """Drop responses with a NaN/inf rollout log-prob (an engine fault); count their tokens."""
    bad = ~torch.isfinite(rollout_log_prob) & (mask > 0)
    mask[bad.any(-1)] = 0.0
    rollout_log_prob[~torch.isfinite(rollout_log_prob)] = 0.0
    return int(bad.sum())


def scored_batch(args: Args, data: TrainData, samples: list[Sample], step: int, bound, n_fresh: int):
    """A step's samples scored: the batch, the update's tensors, the metrics."""
    scores = [data.task.score(s.response.text, data.rows[s.row]) for s in samples]
    rewards, corrects = [reward(args, data.task, x) for x in scores], [x[args.reward_mode] for x in scores]
    rc_run.check_rewards(data.task.name, rewards, [s.row for s in samples], data.rows, step)  # stop, not drop
    prompts = [data.prompts[s.row] for s in samples]
    responses, groups = [s.response for s in samples], [s.group for s in samples]
    batch = rc_forward.make_batch(prompts, responses, data.pad_id, groups)
    mask, rollout_log_prob = batch.pop("response_mask"), batch.pop("rollout_log_prob")
    n_nonfinite = drop_nonfinite(mask, rollout_log_prob)
    # the weights that sampled each row (--partial-rollout: its newest token's)
    versions = [s.response.versions[-1] if s.response.versions else s.version for s in samples]
    batch["version"] = versions = torch.tensor(versions)
    partial = rc_rollout.mask_stale_tokens(batch, mask, step, bound)  # --partial-rollout (async.md §9)
    stale = rc_rollout.stale_rows(versions, step, bound)  # beyond the bound: never trained on
    mask[stale] = 0.0
    advantages = rc_core.compute_advantage(
        args.adv_estimator,
        torch.tensor(rewards),
        batch["group"],
        response_mask=mask,
        norm_adv_by_std=args.norm_adv_by_std,
    )
    metrics = rc_run.batch_metrics(
        args, rewards, corrects, mask, n_nonfinite, versions=versions, step=step, stale=stale, n_fresh=n_fresh
    )
    tensors = dict(response_mask=mask, advantages=advantages, rollout_log_prob=rollout_log_prob)
    return batch, tensors, metrics | partial


# ALGO LOGIC: correction and loss
def decoupled_correction(
    args: Args, correction, model, batch: dict, tensors: dict, log_ratios=None, routing=None, step=None
):
    """Decoupled mode (§5, §7.2): pi_old once per batch; its IS weights and rejection mask join `tensors`, frozen."""
    model.eval()
    if args.prox_logp == "sampling":
        old_log_prob, size = tensors["sampling_log_prob"], Counter()
    else:
        old_log_prob, size = rc_forward.no_grad_pass(model, batch, args, routing)
    rollout_log_prob, mask = tensors["rollout_log_prob"], tensors["response_mask"]
    rc_run.check_finite("old_log_prob", old_log_prob, f"step {step}, the pi_old pass", mask)
    is_weights, keep_mask, metrics = rc_core.compute_rollout_correction_and_rejection_mask(
        old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob, response_mask=mask, config=correction
    )
    weights = {} if is_weights is None else {"rollout_is_weights": is_weights}
    tensors.update(old_log_prob=old_log_prob, **weights, keep_mask=keep_mask)
    if log_ratios is not None:
        log_ratios.add(old_log_prob - rollout_log_prob, mask)
    return metrics, size


def policy_loss(args: Args, correction, log_prob, micro: dict, denominators: dict, *, first: bool, check: bool):
    """The policy-gradient loss: bypass corrects in rc_core (§7.3/§7.4), decoupled (§7.2) not."""
    mask = micro["response_mask"]
    if mask.sum() == 0:  # every response dropped
        return (log_prob * 0).sum(), {}
    low, high = rc_config.clip_bounds(args)
    common = dict(
        log_prob=log_prob,
        rollout_log_prob=micro["rollout_log_prob"],
        advantages=micro["advantages"],
        response_mask=mask,
        loss_agg_mode=args.loss_agg_mode,
        clip_ratio_low=low,
        clip_ratio_high=high,
        clip_ratio_c=args.clip_ratio_c,
        config=correction,
        validate=check,  # the inputs once per step
        **denominators,
    )
    if correction.bypass_mode:
        return rc_core.compute_policy_loss_bypass_mode(**common, with_correction_metrics=first)
    keep, weights = micro["keep_mask"], micro.get("rollout_is_weights")
    return rc_core.compute_policy_loss_vanilla(
        **common, old_log_prob=micro["old_log_prob"], keep_mask=keep, rollout_is_weights=weights
    )


def micro_batch_loss(
    args: Args, correction, log_prob, micro: dict, denominators: dict, first: bool, check: bool, where: str = ""
):
    """A micro-batch's loss: the policy gradient plus the KL penalty (§7.6); a NaN or inf stops the run at `where`."""
    mask = micro["response_mask"]
    if check:  # the step's first micro-batch
        rc_run.check_finite("log_prob", log_prob, where, mask)
    approx = loglinear_correction(args, correction, log_prob, micro, first) if "prox_alpha" in micro else {}
    loss, loss_metrics = policy_loss(args, correction, log_prob, micro, denominators, first=first, check=check)
    pg_loss, kl_loss = float(loss.detach()), 0.0
    if "ref_log_prob" in micro:
        prox = micro["rollout_log_prob" if correction.bypass_mode else "old_log_prob"]
        old = prox if args.kl_is_corrected else None
        kl = rc_core.kl_penalty(log_prob, micro["ref_log_prob"], args.kl_estimator, old_log_prob=old)
        kl_term = rc_core.agg_loss(kl, mask, args.loss_agg_mode, response_mask=mask, **denominators)
        loss, kl_loss = loss + args.kl_coef * kl_term, float(kl_term.detach())
    rc_run.check_loss(pg_loss + kl_loss, where, mask, log_prob=log_prob, ref_log_prob=micro.get("ref_log_prob"))
    return loss, {**loss_metrics, **approx}, pg_loss, kl_loss


def prox_alpha(args: Args, batch: dict, step: int, updates: int) -> dict:
    """--prox-logp loglinear | metrics: each row's alpha after `updates` optimizer steps of the step (§7.10)."""
    if args.prox_logp not in ("loglinear", "metrics"):
        return {}
    theta = step + updates / (args.ppo_epochs * args.num_minibatches)
    return {"prox_alpha": rc_core.loglinear_alpha(batch["version"], step, theta)}


def loglinear_correction(args: Args, correction, log_prob, micro: dict, first: bool) -> dict:
    """--prox-logp: pi_old interpolated from mu and pi_theta (§7.10); it trains (loglinear) or its error is logged."""
    mu, mask = micro["rollout_log_prob"], micro["response_mask"]
    approx = rc_core.loglinear_proximal_log_prob(mu, log_prob, micro.pop("prox_alpha"))
    if args.prox_logp == "metrics":
        errors = rc_core.proximal_approximation_errors(approx, micro["old_log_prob"], mu, log_prob, mask)
        return {k: float(v) for k, v in errors.items()}
    is_weights, keep_mask, metrics = rc_core.compute_rollout_correction_and_rejection_mask(
        old_log_prob=approx, rollout_log_prob=mu, response_mask=mask, config=correction, with_metrics=first
    )
    weights = {} if is_weights is None else {"rollout_is_weights": is_weights}
    micro.update(old_log_prob=approx, keep_mask=keep_mask, **weights)
    return metrics


def micro_batch_metrics(loss_metrics: dict, log_prob, entropy, micro: dict, *, bypass: bool, first: bool, skip: dict):
    """Loss metrics, approx_kl, entropy; rollout_corr/* from the first minibatch only."""
    mask = micro["response_mask"]
    if mask.sum() == 0:
        return {}
    prox = micro["rollout_log_prob"] if bypass else micro["old_log_prob"]
    with torch.no_grad():
        k3 = rc_core.kl_penalty(prox, log_prob.detach(), "low_var_kl")
        out = {
            **loss_metrics,
            "actor/ppo_kl_k3": float(k3[mask > 0].mean()),
            "actor/entropy": float(entropy[mask > 0].mean()),
        }
    return {k: v for k, v in out.items() if k not in skip and (first or not k.startswith("rollout_corr/"))}


# ALGO LOGIC: the update
@dataclass
class Learner:
    """What every update works on."""

    accelerator: Any
    host: rc_run.HostGroup
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any


def make_learner(args: Args, accelerator, host: rc_run.HostGroup, model_path: str, moe: bool):
    """The fp32 policy on this rank's device, AdamW, and the KL penalty's frozen reference (or None)."""
    load = dict(dtype="auto", device_map={"": accelerator.device})  # on the device, not the host
    model = AutoModelForCausalLM.from_pretrained(model_path, **load).float()
    if moe:  # the router hooks
        rc_moe.install(model)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.compile:  # in place: parameter names stay
        rc_forward.compile_layers(model)
    ref_model = None
    if args.kl_coef > 0:  # the policy's own precision: KL is 0 at step 0
        ref_model = AutoModelForCausalLM.from_pretrained(model_path, **load).float()
        ref_model.eval().requires_grad_(False)
    if args.fsdp:  # FSDP2: shard before building the optimizer
        model = rc_run.shard_model(model, accelerator.device.type)
        ref_model = ref_model and rc_run.shard_model(ref_model, accelerator.device.type)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (args.warmup_steps + 1)))
    if not args.fsdp:
        model, optimizer = accelerator.prepare(model, optimizer)
    return Learner(accelerator, host, model, optimizer, scheduler), ref_model


def update_policy(
    args: Args,
    correction,
    learner: Learner,
    batch,
    tensors,
    *,
    generator,
    batch_correction,
    log_ratios=None,
    routing=None,
    step=None,
):
    """The update on one rollout batch: epochs x minibatches x micro-batches."""
    model, world = learner.model, learner.accelerator.num_processes
    mask, bypass = tensors["response_mask"], correction.bypass_mode
    model.train()
    per_minibatch = mask.shape[0] // args.num_minibatches
    loss_sums, kl_sums, grad_norms, size, metrics = [], [], [], Counter(), rc_run.MetricSum()
    for epoch in range(args.ppo_epochs):
        perm = torch.randperm(mask.shape[0], generator=generator)
        for minibatch in range(args.num_minibatches):
            rows, first = perm[minibatch * per_minibatch : (minibatch + 1) * per_minibatch], not (epoch or minibatch)
            denominators = global_denominators(args, learner.host, mask[rows])
            tensors.update(prox_alpha(args, batch, step, epoch * args.num_minibatches + minibatch))
            micro = rc_forward.micro_batches(rows, batch, args, learner.host)
            loss_sum = kl_sum = 0.0
            for j, micro_rows in enumerate(micro):
                where = f"step {step}, epoch {epoch}, minibatch {minibatch}, micro-batch {j}"
                # the forward inside too: DDP decides there whether to reduce
                with rc_run.accumulating(learner.accelerator, model, j == len(micro) - 1, args.fsdp):
                    # log pi(y_t | y_<t) = log_softmax(logits / temperature)[y_t] (§1)
                    log_prob, entropy, micro_size = rc_forward.sequence_log_probs(
                        model, batch, micro_rows, args, True, True, routing=routing
                    )
                    part = {k: v[micro_rows].to(log_prob.device) for k, v in tensors.items()}
                    loss, loss_metrics, pg_loss, kl_loss = micro_batch_loss(
                        args, correction, log_prob, part, denominators, first, check=first and j == 0, where=where
                    )
                    learner.accelerator.backward(loss * world)  # DDP averages over ranks
                size, loss_sum, kl_sum = size + micro_size, loss_sum + pg_loss, kl_sum + kl_loss
                part_metrics = micro_batch_metrics(
                    loss_metrics, log_prob, entropy, part, bypass=bypass, first=first, skip=batch_correction
                )
                metrics.add(part_metrics, weight=float(part["response_mask"].sum()))
                if first and bypass and log_ratios is not None:
                    log_ratios.add(log_prob - part["rollout_log_prob"], part["response_mask"])
            grad_norms.append(rc_run.clip_and_step(learner.accelerator, model, learner.optimizer, args.max_grad_norm))
            rc_run.check_finite("grad_norm", grad_norms[-1], f"step {step}, epoch {epoch}, minibatch {minibatch}")
            learner.scheduler.step()
            learner.optimizer.zero_grad(set_to_none=True)
            loss_sums, kl_sums = loss_sums + [loss_sum], kl_sums + [kl_sum]
    actor = {
        "actor/pg_loss": float(np.mean(loss_sums)) * world,
        "actor/grad_norm": float(np.mean(grad_norms)),
        "actor/lr": learner.scheduler.get_last_lr()[0],
        **({"actor/kl_loss": float(np.mean(kl_sums)) * world} if "ref_log_prob" in tensors else {}),
    }
    return metrics, actor, size


def global_denominators(args: Args, host: rc_run.HostGroup, mask: torch.Tensor) -> dict:
    """Loss denominators of the optimizer step over all ranks, pre-rejection (§7.5)."""
    n_tok, n_seq = host.sum([float(mask.sum()), float((mask.sum(-1) > 0).sum())])
    scale_k = args.loss_scale_factor or float(args.max_response_length)
    return dict(global_token_count=max(n_tok, 1.0), global_seq_count=max(n_seq, 1.0), loss_scale_factor=scale_k)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "plot":
        import rc_plot

        sys.exit(rc_plot.main(sys.argv[2:]))
    # TRY NOT TO MODIFY: setup -- every check before the run folder
    args = rc_config.parse_cli(Args, load_yaml_defaults, os.path.join(HERE, "configs", "gsm8k_qwen0.5b_bypass.yaml"))
    t_start = time.time()
    rc_run.report_faults()  # a disk fault: one line
    with rc_run.refused():  # a bad value: one line, before anything is written
        run = rc_config.start(args)  # the Accelerator, collectives, run name
        accelerator, host, run_dir, rank, world = run.accelerator, run.host, run.dir, run.rank, run.world
        task = rc_config.validate_args(args, world)
        rc_config.check_distributed(accelerator, args)
        correction = rc_config.build_correction_config(args.rc)
        rc_config.check_prox_logp(args, correction)
        args.reward_mode = args.reward_mode or task.reward_key
        run_lock, replace_run = rc_checkpoint.claim_run_dir(run_dir, args, host, accelerator.is_main_process)
        train_rows, n_skipped = task.problems("train", args.train_limit)
        eval_rows, _ = task.problems("test", args.eval_limit)
        tasks.check_scorer(task, train_rows[:1])
        with accelerator.main_process_first():  # rank 0 builds a tiny model first
            model_path = tasks.resolve_model(args, task, accelerator.is_main_process)
        hf_config, tokenizer = rc_config.model_config(model_path)
        rc_moe.check_model(args, hf_config, correction.bypass_mode, torch.cuda.is_available())
        kept_depth = rc_rollout.KeptVersions.check_budget(args, hf_config)  # --mismatch-split, --prox-logp sampling
        for what, part in (("train prompt", train_rows), ("eval prompt", eval_rows)):
            tasks.check_coverage(tokenizer, [tasks.prompt_text(task, row) for row in part], what)
        train_prompts = tasks.encode_prompts(args, task, tokenizer, train_rows)
        eval_prompts = tasks.encode_prompts(args, task, tokenizer, eval_rows)
        rc_config.check_token_budget(args, max(map(len, train_prompts)))
        rc_checkpoint.agree_settings(run_dir, args, host, accelerator.is_main_process)  # --resume
    rc_config.warn_allocator(args, accelerator)  # --compile on a GPU without expandable segments
    facts = dict(model_path=model_path, train_rows=len(train_rows), train_rows_skipped=n_skipped)
    rc_run.open_run_dir(run_dir, replace_run, accelerator, args, correction, **facts)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    # TRY NOT TO MODIFY: models, optimizer, resume, engine
    moe = args.routing_replay != "none" or bool(args.routing_metrics)
    learner, ref_model = make_learner(args, accelerator, host, model_path, moe)
    model, optimizer, scheduler = learner.model, learner.optimizer, learner.scheduler
    unwrapped = accelerator.unwrap_model(model)
    start_step, counters, in_flight, kept, carried = 0, {"old_log_prob_passes": 0, "sync_count": 0}, {}, (), None
    if args.resume:  # loaded and checked before the run folder is touched
        with rc_run.refused(rc_run.RunError):
            resumed = rc_checkpoint.load_resume(
                run_dir, model, optimizer, scheduler, accelerator, host=host, counters=counters, args=args
            )
        rc_checkpoint.set_rng(resumed.rng)
        start_step, counters, in_flight, kept = resumed.start_step, resumed.counters, resumed.in_flight, resumed.replay
        carried = resumed.carried  # --partial-rollout: the unfinished responses
    engine = rc_rollout.make_engine(args, model_path, run_dir, train_prompts, accelerator)  # RNG states kept
    if args.resume:  # the engine is up: the resume takes the run folder
        rc_checkpoint.commit_resume(run_dir, resumed, accelerator, args, correction, **facts)
    prompts_per_rank = rc_config.prompts_per_rank(args, world)
    replay = rc_rollout.ReplayBuffer(args, prompts_per_rank, rc_config.replay_groups(args, world), rank, kept)
    resumed_versions = resumed.kept_versions if args.resume else None
    versions = None if kept_depth is None else rc_rollout.KeptVersions(kept_depth, resumed_versions)

    def step_indices(step: int) -> list[int]:
        """This rank's fresh prompts of the step."""
        P, first = args.num_prompts_per_step, rank * prompts_per_rank
        return prompt_indices(len(train_prompts), args.seed, step * P, P)[first : first + replay.fresh(step)]

    def step_prompts(step: int):
        indices = step_indices(step)
        return [train_prompts[i] for i in indices], rank * prompts_per_rank, indices

    rollouts = rc_rollout.Rollouts(args, engine, unwrapped, step_prompts, counters["sync_count"])
    log, evals = rc_run.RunLog(run_dir, accelerator), []

    def run_eval(step: int, timer: rc_run.StepTimer) -> dict:
        """Greedy eval of version step+1, after the batches queued before it."""
        if step >= 0:
            rollouts.wait_queued(step)
        with timer("timing/eval_s"):  # a dialed engine gets its perturbed weights back
            restore = step < args.num_steps - 1
            metrics, samples = rc_run.evaluate(
                task, rollouts, eval_prompts, eval_rows, rank, world, host=host, version=step + 1, restore=restore
            )
        log.eval_samples(step, samples)
        evals.append(metrics)
        return metrics

    if args.eval_before and not args.resume:  # the initial policy, logged at step -1
        timer = rc_run.StepTimer()
        log.log(-1, {**run_eval(-1, timer), **timer.seconds}, trackers=False)
    rollouts.begin(start_step, in_flight, carried)  # the batches of the first k+1 steps are queued
    bound = rc_rollout.staleness_bound(args)
    log.start_trackers(args, run.name)
    bar = rc_run.progress_bar(start_step, args.num_steps, accelerator.is_main_process)
    health = rc_run.HealthWatch(bar.write if accelerator.is_main_process else None)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    data = TrainData(task, train_rows, train_prompts, pad_id)

    for step in bar:
        # ALGO LOGIC: rollout -- the batch of step t, sampled by version max(0, t - k)
        timer = rc_run.StepTimer({"timing/old_log_prob_s": 0.0})
        rc_run.reset_memory_peaks()  # perf/max_memory_*: this step's
        groups, version, rollout_seconds, rows = rollouts.take(step)  # rows: --partial-rollout's
        timer.seconds.update(rollout_seconds)  # the engine's clocks
        indices = step_indices(step) if rows is None else rows
        fresh = [(i, version, group) for i, group in zip(indices, groups)]
        replayed = replay.draw(step)  # earlier steps' groups, each with its own mu
        evicted = replay.add(step, version, indices, groups)
        with timer("timing/reward_s"):  # ALGO LOGIC: reward and GRPO advantage (group = one prompt)
            samples = [Sample(i, g, v, r) for g, (i, v, group) in enumerate(fresh + replayed) for r in group]
            n_fresh = sum(map(len, groups))  # rows 0..n_fresh-1: this step's
            batch, tensors, rollout_metrics = scored_batch(args, data, samples, step, bound, n_fresh)
        mask = tensors["response_mask"]
        routing = rc_moe.plan(args, correction.bypass_mode, unwrapped, batch) if moe else None
        dump = rc_run.LogRatioDump(run_dir, step, args.dump_log_ratio_every, accelerator.is_main_process)

        # ALGO LOGIC: correction -- decoupled: pi_old once per batch (§5, §7.2); bypass: in the loss
        batch_correction, size = {}, Counter()
        if versions is not None:  # each row at the weights that sampled it (§6.9)
            with timer("timing/sampling_log_prob_s"):
                versions.keep(step, unwrapped)
                if args.prox_logp == "sampling":  # pi_old itself; else the split's, after pi_old
                    tensors["sampling_log_prob"], size = versions.log_probs(args, unwrapped, batch, step)
        if not correction.bypass_mode and args.prox_logp != "loglinear":  # loglinear: in the update (§7.10)
            with timer("timing/old_log_prob_s"):
                batch_correction, size = decoupled_correction(
                    args, correction, unwrapped, batch, tensors, log_ratios=dump, routing=routing, step=step
                )
                counters["old_log_prob_passes"] += 1
        if args.mismatch_split:  # numerics and staleness (§6.9)
            with timer("timing/sampling_log_prob_s"):
                split, split_size = versions.mismatch_split(args, unwrapped, batch, tensors, step)
                batch_correction, size = {**batch_correction, **split}, size + split_size
        if moe and (args.routing_metrics or args.routing_replay == "reference"):
            with timer("timing/routing_s"):
                routing_metrics, routing_size = rc_moe.routing_pass(args, unwrapped, batch, tensors, routing)
                batch_correction, size = {**batch_correction, **routing_metrics}, size + routing_size
        with timer("timing/ref_log_prob_s"):
            if ref_model is not None:
                tensors["ref_log_prob"], ref_size = rc_forward.no_grad_pass(ref_model, batch, args)
                size += ref_size

        # ALGO LOGIC: update
        with timer("timing/update_s"):
            generator = torch.Generator().manual_seed(args.seed * 7919 + step * 31 + rank)
            step_metrics, actor_metrics, update_size = update_policy(
                args,
                correction,
                learner,
                batch,
                tensors,
                generator=generator,
                batch_correction=batch_correction,
                log_ratios=dump,
                routing=routing,
                step=step,
            )
        dump.save()
        passes = (
            "timing/sampling_log_prob_s",
            "timing/old_log_prob_s",
            "timing/routing_s",
            "timing/ref_log_prob_s",
            "timing/update_s",
        )
        perf = rc_run.pass_metrics(size + update_size, sum(timer.seconds.get(k, 0.0) for k in passes))
        perf.update(versions.metrics() if versions else {})

        # TRY NOT TO MODIFY: weight sync (version step+1), eval, the batch of step+1+k
        with timer("timing/sync_s"):
            rollouts.sync(step)
        last = step == args.num_steps - 1
        eval_metrics = run_eval(step, timer) if last or (args.eval_every and (step + 1) % args.eval_every == 0) else {}
        rollouts.request(step + 1 + args.max_staleness)

        # TRY NOT TO MODIFY: logging
        step_metrics.add({**batch_correction, **perf}, weight=float(mask.sum()))
        if args.replay_window:
            rollout_metrics.update(
                rc_run.replay_metrics(len(samples) - n_fresh, len(samples), replay.samples(), evicted)
            )
        counts = {"actor/old_log_prob_passes": counters["old_log_prob_passes"], "actor/sync_count": rollouts.sync_count}
        step_metrics.add({**rollout_metrics, **actor_metrics, **counts}, weight=float(len(mask)))
        step_metrics.add({**timer.seconds, "timing/step_s": timer.elapsed()}, weight=1.0)
        memory = {**rc_run.memory_metrics(), **rc_rollout.engine_memory_metrics(engine, args)}  # {} on a CPU
        step_metrics.add({**rc_run.flop_inputs(batch), **memory}, weight=1.0)  # the MFU's inputs, per rank
        metrics = {**rc_run.reduce_metrics(step_metrics, host), **eval_metrics}
        metrics.update(health.check(step, metrics))  # health/*: a console line when one fires
        log.log(step, metrics)
        bar.set_postfix(**rc_run.progress(metrics, evals[-1] if evals else None, task.accuracy_key))
        if args.log_rank_checksums:  # DDP: same weights on every rank, other samples
            response_ids = [s.response.token_ids for s in samples]
            rc_run.log_rank_checksums(run_dir, step, rank, world, response_ids, rc_run.full_weights(unwrapped))

        # TRY NOT TO MODIFY: checkpoint
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            with rc_run.refused(rc_run.RunError):
                rc_checkpoint.save_checkpoint(
                    run_dir,
                    step,
                    accelerator,
                    args,
                    model=model,
                    optimizer=optimizer,
                    scheduler=scheduler,
                    counters={**counters, "sync_count": rollouts.sync_count},
                    in_flight=rollouts.wait_queued(step),
                    carried=rollouts.carried_after(step),
                    replay=replay.state(),
                    kept_versions=None if versions is None else versions.weights,
                )

    # TRY NOT TO MODIFY: final weights and summary
    if args.save_final:
        rc_run.save_final(run_dir, model, tokenizer, accelerator)
    rollouts.close()
    log.close()
    bar.close()
    if accelerator.is_main_process:
        first_eval = evals[0] if args.eval_before and not args.resume else None
        summary = dict(seconds=time.time() - t_start, run_dir=run_dir, accuracy_key=task.accuracy_key)
        health_line = health.summary(args.num_steps - start_step)
        rc_run.print_summary(first_eval, evals[-1] if evals else None, len(eval_rows), **summary, health=health_line)
    accelerator.wait_for_everyone()
    rc_run.exit_cleanly(world)
