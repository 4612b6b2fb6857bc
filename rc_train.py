# GRPO with rollout correction: vLLM rollouts, rc_core corrections, in-place weight sync.
# Read alongside rc_core.py (the formulas), docs/corrections.md (their semantics, cited as §N), docs/running.md
# (commands) and docs/metrics.md (metrics glossary). Beside it, each module holds what it touches: rc_config.py the
# command line and its checks, rc_rollout.py the vLLM engine and the staleness schedule, rc_run.py the run folder and
# the other ranks (metrics, checkpoints, logs), tasks.py and gsm8k.py the problems and their scores.
"""One CleanRL-style script: Args -> rollout (vLLM) -> reward -> GRPO advantage -> update -> sync.

    python rc_train.py                                  # CPU: miniature GSM8K, a 1M-parameter base built here
    python rc_train.py --config configs/gsm8k_qwen0.5b_bypass.yaml   # GPU: Qwen2.5 on GSM8K
    torchrun --nproc_per_node 2 rc_train.py ...         # data parallel, one vLLM engine per rank
    python rc_train.py plot runs/A runs/B               # rollout-correction dashboard (rc_plot.py)

Two update modes (docs/corrections.md §7.2 decoupled, §7.3/§7.4 bypass):
* bypass:    pi_old := pi_rollout. No old-log-prob forward pass; corrections are computed inside
             the loss from sg(pi_theta) vs pi_rollout (rc_core.compute_policy_loss_bypass_mode).
* decoupled: pi_old is recomputed once per rollout batch, before the first update; IS weights
             pi_old/pi_rollout and the rejection mask are computed once and frozen for all epochs.
Sections marked `ALGO LOGIC` are the algorithm (fork and edit those); `TRY NOT TO MODIFY` marks the plumbing.
"""

import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

# vLLM's engine core runs inside the process that holds the engine (this one, or the rollout worker), so that weights
# can be pushed into it in place (rc_rollout.load_weights).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# vLLM's CPU build otherwise reserves almost all RAM for its KV cache (docs/running.md "The CPU engine").
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# The engine's log lines go to runs/{run_name}/engine.log (rc_rollout.engine_output_to), not to the console.
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch

import rc_config
import rc_core
import rc_moe
import rc_rollout
import rc_run
import tasks

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class CorrectionArgs:
    """Rollout correction: a preset from rc_core, then optional per-field overrides. Fields have the types of
    rc_core.RolloutCorrectionConfig; None (the default) keeps the preset's value, and the literal 'none' (CLI or
    YAML) switches an option off (it becomes None in the config)."""

    preset: str = "decoupled_k3_rs_token_tis"
    """name of a RolloutCorrectionConfig preset (rc_core.PRESET_NAMES), e.g. decoupled_token_is, disabled. The default,
    token-TIS with a k3 rejection gate in decoupled mode, logs every dashboard panel (docs/corrections.md §9.2)"""
    rollout_is: str | None = None
    """override: IS level 'token' | 'sequence'; 'none' switches IS off"""
    rollout_is_threshold: rc_config.Threshold = None
    """override: TIS cap (a number, e.g. 3) or IcePop bounds 'L_U' (e.g. 0.5_5, read as text, not as 0.55)"""
    rollout_is_batch_normalize: bool | None = None
    """override: self-normalise IS weights over the batch (docs/corrections.md §3.7)"""
    rollout_rs: str | None = None
    """override: comma-separated rejection options (e.g. 'seq_mean_k1,token_k3'); 'none' switches RS off"""
    rollout_rs_threshold: rc_config.Threshold = None
    """override: rejection thresholds, one entry or one per option (0.999_1.001, 0.01, '0.999_1.001,0.01')"""
    rollout_rs_threshold_lower: float | None = None
    """override: lower bound for the legacy RS names token/sequence/geometric"""
    rollout_token_veto_threshold: float | Literal["none"] | None = None
    """override: veto tau in (0,1): reject a sequence if any token ratio < tau; 'none' switches the veto off"""
    bypass_mode: bool | None = None
    """override: True = bypass (pi_old := pi_rollout), False = decoupled"""
    loss_type: str | None = None
    """override: 'ppo_clip' or 'reinforce' (reinforce needs bypass mode); 'none' = unset: ppo_clip, or what
    use_policy_gradient implies"""
    use_policy_gradient: bool | None = None
    """override, legacy alias of loss_type: True = reinforce, False = ppo_clip; an explicit loss_type (the preset's
    or --rc.loss-type) that differs is refused (docs/corrections.md §9.1)"""
    loss_mode: str | None = None
    """override: the policy objective, a name of rc_core.POLICY_LOSSES (verl's policy_loss.loss_mode): vanilla
    (PPO-clip, the default), gspo, gspo_token, cispo, sapo, geo_mean, dppo_tv, dppo_kl, clip_cov, kl_cov
    (docs/corrections.md §7.7); with loss_type ppo_clip, in decoupled or bypass mode"""
    clip_cov_ratio: float | None = None
    """override: clip_cov: share of tokens in (0, 1) whose covariance gets its gradient cut (verl: 0.0002)"""
    clip_cov_lb: float | None = None
    """override: clip_cov: lower bound of the covariance band (verl: 1.0)"""
    clip_cov_ub: float | None = None
    """override: clip_cov: upper bound of the covariance band (verl: 5.0)"""
    kl_cov_ratio: float | None = None
    """override: kl_cov: share of tokens in (0, 1) with the largest covariance that get the KL term (verl: 0.0002)"""
    ppo_kl_coef: float | None = None
    """override: kl_cov: coefficient of its per-token KL term (verl: 0.1)"""
    tau_pos: float | None = None
    """override: sapo: gate temperature for positive advantages (verl: 1.0)"""
    tau_neg: float | None = None
    """override: sapo: gate temperature for negative advantages (verl: 1.05)"""
    rollout_is_threshold_lower: float | Literal["none"] | None = None
    """override: two-sided TIS, the lower clamp C_min of the IS weight (0 < C_min < the cap; e.g. 0.5 with cap 5)"""
    rollout_opsm_threshold: float | Literal["none"] | None = None
    """override: off-policy sequence mask delta > 0: drop a negative-advantage response whose mean log(mu/pi) > delta
    (DeepSeek-V3.2; docs/corrections.md §4.6)"""
    rollout_m2_threshold: float | Literal["none"] | None = None
    """override: M2PO: mask the tokens with the largest squared log-ratio until its batch mean <= this (> 0; §4.7)"""
    rollout_outlier_threshold_low: float | Literal["none"] | None = None
    """override: two-sided worst-token rejection: a response with a token ratio below this is rejected (§4.8)"""
    rollout_outlier_threshold_high: float | Literal["none"] | None = None
    """override: two-sided worst-token rejection: a response with a token ratio above this is rejected (§4.8)"""


@dataclass
class Args:
    # General
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment (rollouts are seeded by a hash of seed, step and the prompt's place in the step, so
    they do not depend on the number of processes)"""
    config: str | None = None
    """YAML file whose keys become the defaults; flags on the command line still win"""
    output_dir: str = "runs"
    """parent folder of the run folder"""
    run_name: str | None = None
    """run folder name (default: {task}__{exp_name}__{preset}__{seed}__{time})"""
    overwrite: bool = False
    """allow replacing an existing run folder (otherwise an existing run is never touched)"""
    resume: bool = False
    """continue the run in --run-name from its newest complete checkpoint"""
    log_with: list[str] = field(default_factory=list)
    """Accelerate trackers that get the metrics too (main process only): tensorboard (event files in the run
    folder), wandb, mlflow, comet_ml, aim, clearml, dvclive, swanlab, trackio, or all (every installed one)"""
    wandb_project_name: str = "rollout-correction"
    """the project name of the trackers (W&B project)"""
    wandb_entity: str | None = None
    """the wandb entity (team)"""

    # Model and task
    model: str = tasks.TINY_MODEL
    """'tiny' (built locally, cached, no download: the warm-started 1M-parameter base for minigsm, a random
    0.3M-parameter net for a task without a warm start), 'tiny-moe' (the same, as a Qwen3-MoE with 8 experts, top-2:
    docs/moe.md), a local path, or a HF model id"""
    task: str = "minigsm"
    """a name of tasks.TASKS: 'minigsm': the miniature GSM8K built here (tasks.py; settings under --mini.*);
    'gsm8k': the real data set; 'add': 'a+b=' -> one digit (the fast tests' one-token fixture)"""
    mini: tasks.MiniGSMArgs = field(default_factory=tasks.MiniGSMArgs)
    """miniature GSM8K: difficulty, splits and the warm start of its base model"""
    dataset: str = "auto"
    """GSM8K source: HF dataset id (openai/gsm8k), or a folder/file of JSONL/parquet; 'auto' = local copy if present"""
    dataset_config: str = "main"
    """HF dataset config name"""
    train_limit: int | None = None
    """use only the first N training problems"""
    reward_mode: str | None = None
    """reward: a score key of the task (None = its reward key, Task.reward_key). minigsm, gsm8k, add: 'strict' (the
    default) needs a final '#### N' line, 'flexible' takes the last number (gsm8k.score_response)"""
    format_bonus: float = 0.0
    """reward added for a well-formed answer, right or wrong (the task's format key: a '#### N' line on minigsm and
    gsm8k); refused for a task without one"""
    use_chat_template: bool = True
    """wrap prompts with the tokenizer's chat template when it has one"""
    max_model_len: int = 512
    """context length of the engine; prompt + response must fit"""

    # Rollout
    num_steps: int = 50
    """training steps (one rollout batch each)"""
    num_prompts_per_step: int = 32
    """prompts per step, over all ranks"""
    num_samples_per_prompt: int = 16
    """responses per prompt (the GRPO group size)"""
    max_response_length: int = 64
    """maximum generated tokens per response (stops earlier at EOS)"""
    temperature: float = 1.0
    """sampling temperature; the trainer scores with the same temperature (processed log-probs)"""
    top_p: float = 1.0
    """nucleus sampling; keep 1.0 for training: top-p < 1 changes the behaviour policy"""
    rollout_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype of the vLLM engine"""
    train_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """compute dtype of the trainer's forward passes (autocast; master weights stay float32)"""
    sync_every: int = 1
    """push trainer weights into vLLM every k steps; 0 = never after the start (stale engine)"""
    max_staleness: int | None = None
    """asynchronous rollout: the batch of step t is sampled by policy version max(0, t-k) (k = this value) in a
    rollout worker process while the trainer updates; 0 = the synchronous loop. Each sample carries its version
    (rc_rollout.py, docs/async.md). None = 1 on a CPU (rollout overlaps the update, and the one-version lag is a real
    mismatch for the correction); 0 on GPUs (CPU-only worker) or with --sync-every != 1; the checkpoint's on --resume"""
    rollout_worker: bool = False
    """run the engine in the rollout worker process at --max-staleness 0 too (same samples as in this process)"""
    replay_window: int = 0
    """replay buffer: keep the fresh groups of the last W steps (sampled by versions up to W + k behind the trainer,
    each with its own rollout log-probs and version), evict older ones (rc_rollout.ReplayBuffer, docs/async.md §8)"""
    replay_fraction: float = 0.0
    """share of each step's prompt groups drawn (seeded, uniformly, whole groups) from the replay buffer instead of
    sampled fresh: the batch's behaviour policy becomes a mixture of versions. 0 = no replay; needs --replay-window"""
    vllm_gpu_memory_utilization: float = 0.3
    """GPU: share of GPU memory for the colocated engine (weights + KV cache)"""
    vllm_kv_cache_gb: float = 1.0
    """CPU: KV-cache size of the engine in GiB (VLLM_CPU_KVCACHE_SPACE)"""
    vllm_max_num_seqs: int | None = None
    """sequences the engine runs at once (None = this rank's rollout batch, prompts x samples: one wave holds it)"""
    vllm_max_num_batched_tokens: int | None = None
    """tokens the engine schedules per step (None: on CPU the rollout batch's prompt tokens, within
    [max_model_len, 65536]; on GPU vLLM's default). On CPU it must be >= --max-model-len: prefills are never split
    there (docs/running.md "The CPU engine")"""
    vllm_sleep: bool = True
    """GPU: put the engine to sleep during the update;
    wake only its weights for a sync, and its KV cache too for rollout"""
    vllm_sleep_level: int = 1
    """GPU: 1 = weights offloaded to CPU RAM while asleep; 2 = weights discarded (least memory; needs --sync-every 1)"""

    # Mismatch dials (the lab, lab/README.md): each off by default; each makes the engine's
    # policy mu differ from the trainer's pi in one documented way. rollout_dtype and sync_every are dials too.
    rollout_weight_quant: Literal["none", "int8", "int4"] = "none"
    """engine gets fake-quantised weights (symmetric, per output channel, round to nearest; matrices only):
    models INT8/INT4 weight-only rollout (FlashRL)"""
    rollout_weight_noise: float = 0.0
    """engine gets weights + s*rms(W)*eps with a fixed seeded eps per matrix (s = this value):
    a synthetic, monotone dial for kernel/quantiser error"""
    rollout_corrupt_prob: float = 0.0
    """per sampled token, chance that the engine samples a uniformly random token instead, reported with mu = 1:
    planted catastrophic tokens for the veto (rc_rollout.planted_tokens_processor)"""
    rollout_temperature: float | None = None
    """engine samples at this temperature while the trainer scores at --temperature (a sampling-config mismatch);
    None = same"""
    rollout_logprobs: Literal["processed", "raw"] = "processed"
    """engine log-probs: 'processed' (after temperature/top-p: the sampling distribution)
    or 'raw' (before: the trl#4159 pitfall; differs only if T != 1 or top-p < 1)"""
    dump_log_ratio_every: int = 0
    """every N steps save log(pi_trainer/pi_rollout) of rank 0's valid tokens to log_ratio/step_N.npy
    (0 = never; for IS-weight histograms)"""

    # Mixture of Experts (docs/moe.md)
    moe_router_scale: float = 0.02
    """--model tiny-moe: standard deviation of the router weights at initialisation, before any warm start (> 0; the
    router's sharpness; hashed into the cached model's name)"""
    routing_replay: Literal["none", "r3", "reference"] = "none"
    """MoE: replay a recorded routing in the policy's forward passes, the gate weights being the trainer's router
    probabilities renormalised over the replayed experts. r3: the experts the engine chose, in every pi_old and pi_theta
    pass (rollout routing replay; CPU engine); reference: pi_old's own routing in the pi_theta passes (decoupled)"""
    routing_metrics: bool | None = None
    """MoE: capture the engine's routing and log the trainer-engine routing agreement and the mismatch without replay
    (rollout_corr/routing_*, rollout_corr/unreplayed_*); None = on for an MoE model on the CPU engine (not --compile)"""

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
    """optimizer steps per epoch (the rollout batch is split into this many minibatches)"""
    micro_batch_size: int = 32
    """sequences per forward/backward (gradient accumulation inside a minibatch); sorted by length, each trimmed"""
    max_tokens_per_micro_batch: int | None = None
    """also cap a micro-batch at this many padded tokens (verl's dynamic batch size); None = by count only"""
    share_prompt_prefix: bool = True
    """forward each distinct prompt of a micro-batch once, its n responses on its KV cache (micro-batches grouped by
    prompt; same log-probs and gradients to float rounding). Off under --gradient-checkpointing (no cache there) and
    --fsdp (every rank must run the same forwards): shares_prefix"""
    clip_ratio: float = 0.2
    """PPO clip epsilon (both sides unless overridden)"""
    clip_ratio_low: float | None = None
    """PPO lower clip epsilon (default: clip_ratio)"""
    clip_ratio_high: float | None = None
    """PPO upper clip epsilon (default: clip_ratio; DAPO clip-higher uses 0.28)"""
    clip_ratio_c: float = 3.0
    """dual-clip constant c > 1 (negative advantages only)"""
    loss_agg_mode: str = "token-mean"
    """token-mean | token-sum | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm"""
    loss_scale_factor: float | None = None
    """divisor K of seq-mean-token-sum-norm (default: max_response_length)"""
    adv_estimator: str = "grpo"
    """advantage estimator: a name in rc_core.ADVANTAGE_ESTIMATORS ('grpo'; README "Fork it" adds one)"""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group std (False = Dr.GRPO); an estimator without a std ignores it"""
    kl_coef: float = 0.0
    """coefficient of a KL penalty to the initial model (0 = no reference model)"""
    kl_estimator: str = "low_var_kl"
    """KL penalty estimator: kl (k1), abs, mse (k2), low_var_kl (k3), optionally with '+'"""
    kl_is_corrected: bool = False
    """weight the KL penalty per token by pi_theta/pi_old (pi_old = pi_rollout in bypass), so that it is estimated
    under the current policy rather than the sampler's (DeepSeek-V3.2's unbiased KL; docs/corrections.md §7.8)"""
    gradient_checkpointing: bool = False
    """trade compute for memory in the trainer's forward"""
    compile: bool = False
    """torch.compile every decoder layer of the policy (compile_layers: inductor, dynamic shapes, one graph for all
    layers): fused kernels for the update, which on a GPU is bound by launching eager ones (1.41-1.79x faster per
    update on an H200, docs/gpus.md); the first update pays the compilation (25-37 s there). Turns the shared-prompt
    pass off (shares_prefix); not with --fsdp or MoE routing replay/metrics"""
    fsdp: bool = False
    """shard parameters, gradients and optimizer state over the ranks with torch's FSDP2 (fully_shard on every
    decoder layer, then the root); for models whose fp32 weights + AdamW (16 bytes/parameter) do not fit one device.
    Launch with torchrun or configs/accelerate/fsdp2.yaml (docs/gpus.md)"""

    # Evaluation, checkpoints
    eval_before: bool = True
    """evaluate the initial policy before the first update (logged at step -1)"""
    eval_every: int = 10
    """greedy pass@1 on the eval set every N steps (0 = only at the end); a stale engine is synced first"""
    eval_limit: int | None = 200
    """number of eval problems (None = whole split)"""
    checkpoint_every: int = 0
    """save model, optimizer, scheduler, RNG, batches in flight and step every N steps (0 = never)"""
    keep_checkpoints: int = 2
    """keep the newest N complete checkpoints (>= 1): after each save the older ones are deleted, never the one just
    written; the second newest is the one to resume from if the newest is found damaged"""
    log_rank_checksums: bool = False
    """every rank appends {step, world_size, SHA-256 of its weights and of its sampled tokens}
    to ranks/rank{r}.jsonl (DDP check)"""
    save_final: bool = True
    """save the final weights to final/ in the base model's dtype, streamed in safetensors shards (loadable by
    transformers and vLLM; rc_run.save_final)"""

    rc: CorrectionArgs = field(default_factory=CorrectionArgs)
    """rollout correction settings: a preset, then overrides; an override left at None keeps the preset's value,
    the literal 'none' switches the option off"""


# ---------------------------------------------------------------------------------------------
# Configuration (YAML loading, the CLI, the checks and the correction config live in rc_config.py)
# ---------------------------------------------------------------------------------------------
def load_yaml_defaults(path: str) -> Args:
    """Args whose defaults come from a YAML file (flat keys, plus nested `rc:` and `mini:` mappings)."""
    return rc_config.load_yaml_defaults(Args, path, config=path)


# ---------------------------------------------------------------------------------------------
# ALGO LOGIC: prompts, their order, the reward (the task itself lives in tasks.py: problems, prompt text, scores)
# ---------------------------------------------------------------------------------------------
def encode_prompts(args: Args, task: tasks.Task, tokenizer, rows) -> list[list[int]]:
    """Prompt token ids, through the chat template when the tokenizer has one (the task's system prompt as a system
    message), else tasks.prompt_text; the task's prefill after the generation prompt, so that the response continues
    it. Checks the context."""
    use_template = args.use_chat_template and getattr(tokenizer, "chat_template", None)
    system = [{"role": "system", "content": task.system_prompt}] if task.system_prompt else []
    prefill = tokenizer(task.prefill, add_special_tokens=False)["input_ids"] if task.prefill else []
    out = []
    for i, row in enumerate(rows):
        if use_template:
            ids = tokenizer.apply_chat_template(
                [*system, {"role": "user", "content": task.prompt(row)}], add_generation_prompt=True, tokenize=True
            )
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids) + prefill
        else:
            ids = tokenizer(tasks.prompt_text(task, row), add_special_tokens=False)["input_ids"]
        if len(ids) + args.max_response_length > args.max_model_len:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens; with --max-response-length "
                f"{args.max_response_length} it exceeds --max-model-len {args.max_model_len}"
            )
        out.append(ids)
    return out


def prompt_indices(n_rows: int, seed: int, position: int, count: int) -> list[int]:
    """Rows position .. position+count-1 of an endless stream of seeded epoch permutations.

    The stream depends only on (seed, position), so a checkpoint needs nothing but the position.
    """
    out = []
    while len(out) < count:
        epoch, offset = divmod(position + len(out), n_rows)
        perm = np.random.default_rng([seed, epoch]).permutation(n_rows)
        out.extend(perm[offset : offset + count - len(out)].tolist())
    return out


def reward(args: Args, task: tasks.Task, scores: dict) -> float:
    """The training reward: the score under --reward-mode, plus --format-bonus for a well-formed answer (the task's
    format key; validate_args refuses a bonus on a task without one)."""
    bonus = args.format_bonus * scores[task.format_key] if task.format_key else 0.0
    return scores[args.reward_mode] + bonus


def drop_nonfinite(mask: torch.Tensor, rollout_log_prob: torch.Tensor) -> int:
    """Responses with a NaN/inf rollout log-prob (an engine fault) are dropped: mask zeroed, those log-probs set to 0.
    Returns the number of such tokens (rollout/nonfinite_logprob_tokens)."""
    bad = ~torch.isfinite(rollout_log_prob) & (mask > 0)
    mask[bad.any(-1)] = 0.0
    rollout_log_prob[~torch.isfinite(rollout_log_prob)] = 0.0
    return int(bad.sum())


def make_batch(prompt_ids, responses, pad_id, group_ids=None):
    """Left-pad prompts and right-pad responses so every response starts at the same column P.

    Returns input_ids/attention_mask (B, P+T), rollout log-probs and response mask (B, T), each row's prompt and
    response length, and each row's group (rows of one group share their prompt; default: every row its own).
    `responses`: rc_rollout.Response (token ids, rollout log-probs, text, routing) per row. With the engine's MoE
    routing (Response.routed_experts) the batch also holds it as rollout_routing (B, P+T, layers, k), rc_moe.
    """
    P = max(len(p) for p in prompt_ids)
    T = max(1, max(len(r[0]) for r in responses))
    B = len(responses)
    input_ids = torch.full((B, P + T), pad_id, dtype=torch.long)
    attention = torch.zeros((B, P + T), dtype=torch.long)
    rollout_lp = torch.zeros((B, T), dtype=torch.float32)
    mask = torch.zeros((B, T), dtype=torch.float32)
    for i, (p, (ids, lps, *_)) in enumerate(zip(prompt_ids, responses)):
        input_ids[i, P - len(p) : P] = torch.tensor(p)
        attention[i, P - len(p) : P] = 1
        if ids:
            input_ids[i, P : P + len(ids)] = torch.tensor(ids)
            attention[i, P : P + len(ids)] = 1
            rollout_lp[i, : len(ids)] = torch.tensor(lps, dtype=torch.float32)
            mask[i, : len(ids)] = 1.0
    routing = rc_moe.batch_routing(prompt_ids, responses, P, T)
    return dict(
        input_ids=input_ids,
        attention_mask=attention,
        rollout_log_prob=rollout_lp,
        response_mask=mask,
        prompt_len=attention[:, :P].sum(-1),
        response_len=attention[:, P:].sum(-1),
        group=torch.tensor(range(B) if group_ids is None else group_ids, dtype=torch.long),
        **({} if routing is None else {"rollout_routing": routing}),
    )


class TrainData(NamedTuple):
    """The run's problems as the step reads them: the task's train rows, their encoded prompts, the pad token id."""

    task: tasks.Task
    rows: list
    prompts: list
    pad_id: int


def scored_batch(args: Args, data: TrainData, samples: list, step: int, bound, n_fresh: int):
    """ALGO LOGIC: reward and GRPO advantage of a step's samples [(train row, group, policy version, Response)]: the
    padded batch (make_batch), the update's tensors (response mask, a row dropped when its engine log-probs are not
    finite or it lags beyond `bound`; advantages; rollout log-probs) and the step's reward/*, response_length/* and
    rollout/* metrics (rows 0..n_fresh-1 sampled for this step, the rest replayed: rc_run.batch_metrics)."""
    rows, group_ids, versions, responses = zip(*samples)  # rc_rollout.Response: token_ids, log_probs, text
    scores = [data.task.score(resp.text, data.rows[i]) for i, _, _, resp in samples]
    rewards, corrects = [reward(args, data.task, s) for s in scores], [s[args.reward_mode] for s in scores]
    batch = make_batch([data.prompts[i] for i in rows], responses, data.pad_id, group_ids)
    mask, rollout_lp = batch["response_mask"], batch["rollout_log_prob"]
    n_nonfinite = drop_nonfinite(mask, rollout_lp)
    versions = torch.tensor(versions)  # each sample's own policy version
    stale = rc_rollout.stale_rows(versions, step, bound)  # beyond the bound: never trained on
    mask[stale] = 0.0
    advantages = rc_core.compute_advantage(  # --adv-estimator: GRPO by default
        args.adv_estimator,
        torch.tensor(rewards),
        batch["group"],
        response_mask=mask,
        norm_adv_by_std=args.norm_adv_by_std,
    )
    metrics = rc_run.batch_metrics(args, rewards, corrects, mask, n_nonfinite, versions, step, stale, n_fresh)
    return batch, dict(response_mask=mask, advantages=advantages, rollout_log_prob=rollout_lp), metrics


def sequence_log_probs(
    model,
    input_ids,
    attention_mask,
    T: int,
    temperature: float,
    dtype: str,
    with_entropy: bool = False,
    group: torch.Tensor | None = None,
):
    """log pi(y_t | y_<t) of the last T tokens at the rollout temperature (processed log-probs).
    With `group` (each row's prompt group), shared_prefix_logits computes each distinct prompt once."""
    autocast = torch.autocast(
        device_type=input_ids.device.type, dtype=getattr(torch, dtype), enabled=dtype != "float32"
    )
    with autocast:
        if group is not None:
            logits = shared_prefix_logits(model, input_ids, attention_mask, T, group)
        else:
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                logits_to_keep=T + 1,
                use_cache=False,
            ).logits[:, :-1]
    labels = input_ids[:, -T:]
    log_prob = rc_core.log_probs_from_logits(logits, labels, temperature=temperature)
    entropy = rc_core.entropy_from_logits(logits, temperature) if with_entropy else None  # chunked, no grad
    return log_prob, entropy


def policy_loss(
    args: Args,
    correction: rc_core.RolloutCorrectionConfig,
    log_prob: torch.Tensor,
    micro: dict,
    denominators: dict,
    correction_metrics: bool,
) -> tuple[torch.Tensor, dict]:
    """ALGO LOGIC: the policy-gradient loss of one micro-batch, and its metrics (actor/*, bypass also rollout_corr/*).

    bypass (docs/corrections.md §7.3/§7.4): PPO ratio pi_theta/pi_rollout; rc_core computes the correction inside,
    from sg(pi_theta) vs pi_rollout. decoupled (§7.2): PPO ratio pi_theta/pi_old, times the IS weights and under the
    rejection mask computed once per rollout batch. `micro` holds this micro-batch's rows of the step's tensors."""
    mask = micro["response_mask"]
    if mask.sum() == 0:  # every response of this micro-batch was dropped: nothing to learn
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
        **denominators,
    )
    if correction.bypass_mode:
        return rc_core.compute_policy_loss_bypass_mode(
            **common, config=correction, with_correction_metrics=correction_metrics
        )
    return rc_core.compute_policy_loss_vanilla(
        **common,
        config=correction,
        old_log_prob=micro["old_log_prob"],
        keep_mask=micro["keep_mask"],
        rollout_is_weights=micro.get("rollout_is_weights"),
    )


def micro_batch_loss(
    args: Args, correction: rc_core.RolloutCorrectionConfig, log_prob, micro: dict, denominators: dict, first: bool
) -> tuple[torch.Tensor, dict, float, float]:
    """ALGO LOGIC: one micro-batch's loss: the policy-gradient term (bypass mode corrects here, inside the loss:
    rc_core, docs/corrections.md §7.3/§7.4), plus the KL penalty to the initial model over the original mask (§7.5)
    when there is a reference model; its metrics; the values of the two terms (actor/pg_loss, actor/kl_loss)."""
    loss, loss_metrics = policy_loss(args, correction, log_prob, micro, denominators, correction_metrics=first)
    pg_loss, kl_loss = float(loss.detach()), 0.0  # actor/pg_loss: the policy-gradient term alone
    if "ref_log_prob" in micro:
        prox = micro["rollout_log_prob" if correction.bypass_mode else "old_log_prob"]
        kl = rc_core.kl_penalty(
            log_prob, micro["ref_log_prob"], args.kl_estimator, old_log_prob=prox if args.kl_is_corrected else None
        )
        kl_term = rc_core.agg_loss(
            kl, micro["response_mask"], args.loss_agg_mode, response_mask=micro["response_mask"], **denominators
        )
        loss, kl_loss = loss + args.kl_coef * kl_term, float(kl_term.detach())
    return loss, loss_metrics, pg_loss, kl_loss


def micro_batch_metrics(
    loss_metrics: dict, log_prob, entropy, micro: dict, bypass: bool, first: bool, batch_correction: dict
) -> dict:
    """The loss metrics plus CleanRL's approx_kl (k3 of the PPO ratio, Schulman 2020) and the entropy, over this
    micro-batch's valid tokens. rollout_corr/* are kept from the first minibatch only (first): in bypass mode
    sg(pi_theta) equals pi_old only before the first optimizer step; later the comparison with pi_rollout adds the
    update itself (policy drift, logged as actor/ppo_kl). Names in `batch_correction` (the decoupled
    correction, logged once per rollout batch) are dropped."""
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
    return {k: v for k, v in out.items() if k not in batch_correction and (first or not k.startswith("rollout_corr/"))}


def decoupled_correction(
    args: Args, correction: rc_core.RolloutCorrectionConfig, model, batch: dict, tensors: dict, log_ratios=None
) -> tuple[dict, Counter]:
    """ALGO LOGIC: decoupled mode's correction (docs/corrections.md §5, §7.2), once per rollout batch, before the first
    update: pi_old is the trainer's current weights, scored without gradients; the IS weights pi_old/pi_rollout and
    the rejection mask are computed from it and stay frozen for every epoch and minibatch. Adds old_log_prob,
    keep_mask and rollout_is_weights (when the preset has IS) to `tensors`; returns the correction's metrics and the
    size of the pass. `model`: the unwrapped policy (DDP's module, or the FSDP2-sharded model itself)."""
    model.eval()
    old_log_prob, size = no_grad_pass(
        model, batch, args
    )  # under FSDP2 each forward is a collective: every rank runs it
    rollout_log_prob, mask = tensors["rollout_log_prob"], tensors["response_mask"]
    is_weights, keep_mask, metrics = rc_core.compute_rollout_correction_and_rejection_mask(
        old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob, response_mask=mask, config=correction
    )
    weights = {} if is_weights is None else {"rollout_is_weights": is_weights}  # none when the preset has no IS
    tensors.update(old_log_prob=old_log_prob, **weights, keep_mask=keep_mask)
    if log_ratios is not None:
        log_ratios.add(old_log_prob - rollout_log_prob, mask)
    return metrics, size


def plan_routing(args: Args, correction: rc_core.RolloutCorrectionConfig, model, batch: dict) -> None:
    """ALGO LOGIC: which policy passes of the step replay or record an MoE routing (rc_moe, docs/moe.md). r3: every
    pass from here on replays the engine's routing (batch['rollout_routing']), pi_old's and pi_theta's alike. The
    trainer's own routing (reference replay, the routing metrics) is recorded by decoupled mode's pi_old pass when that
    pass runs unreplayed; otherwise routing_step runs a pass of its own."""
    if args.routing_replay == "r3":
        batch["replay_routing"] = batch["rollout_routing"]
    elif not correction.bypass_mode and (args.routing_replay == "reference" or args.routing_metrics):
        batch["record_routing"] = rc_moe.record_buffer(model, batch)


def routing_step(args: Args, model, batch: dict, tensors: dict) -> tuple[dict, Counter]:
    """ALGO LOGIC: after the correction, the trainer's own MoE routing of the batch (rc_moe, docs/moe.md): recorded by
    the pi_old pass (plan_routing), or by one more no-grad pass without replay, whose log-probs also give the
    mismatch that replay hides from the loss (the three-policy note: replay rewrites the surrogate, it does not shrink
    alpha_1): rollout_corr/unreplayed_k3_kl and rollout_corr/unreplayed_tv_mismatch. reference: the update's pi_theta
    passes replay it from here on. Returns the routing metrics (none without the engine's routing) and the size of the
    extra pass. `model`: the unwrapped policy (no gradient, no collective)."""
    size, own, own_log_prob = Counter(), batch.pop("record_routing", None), tensors.get("old_log_prob")
    if own is None:  # r3 replayed pi_old, or bypass mode: the extra pass
        replay = batch.pop("replay_routing", None)
        batch["record_routing"] = rc_moe.record_buffer(model, batch)
        model.eval()
        own_log_prob, size = no_grad_pass(model, batch, args)
        own = batch.pop("record_routing")
        if replay is not None:
            batch["replay_routing"] = replay
    if args.routing_replay == "reference":
        batch["replay_routing"] = own
    if "rollout_routing" not in batch:
        return {}, size
    mask = tensors["response_mask"]
    ell = rc_core.safety_clip(own_log_prob - tensors["rollout_log_prob"])
    return {
        **rc_moe.routing_metrics(own, batch["rollout_routing"], mask),
        "rollout_corr/unreplayed_k3_kl": float(rc_core.masked_mean(rc_core.k3_divergence(ell), mask)),
        "rollout_corr/unreplayed_tv_mismatch": float(rc_core.estimate_tv_distance(ell, None, mask)),
    }, size


@dataclass
class Learner:
    """What every update of the run works on, made once at start: the Accelerator, the trainer's own collectives,
    the policy as prepared (DDP-wrapped, FSDP2-sharded or plain), its optimizer and learning-rate schedule."""

    accelerator: Any
    host: rc_run.HostGroup
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any


def update_policy(
    *,
    args: Args,
    correction: rc_core.RolloutCorrectionConfig,
    learner: Learner,
    batch: dict,
    tensors: dict,
    generator: torch.Generator,
    batch_correction: dict,
    log_ratios: rc_run.LogRatioDump | None = None,
):
    """ALGO LOGIC: the update on one rollout batch: epochs x minibatches (one optimizer step each) x micro-batches
    (gradient accumulation). `tensors` holds the step's (B, T) tensors (response_mask, advantages, rollout_log_prob,
    and old_log_prob, rollout_is_weights, keep_mask, ref_log_prob when they exist); `generator` shuffles the rows
    into minibatches. Returns the micro-batch metrics (token-weighted), the step's actor/* figures and the size of
    its forward passes. Bypass mode adds the first minibatch's log(pi_theta/pi_rollout) to `log_ratios`.
    `batch_correction`: the decoupled correction's metrics, computed once for the batch (decoupled_correction; its
    names are not taken again from the micro-batches)."""
    model, host, world = learner.model, learner.host, learner.accelerator.num_processes
    mask = tensors["response_mask"]
    model.train()
    B = mask.shape[0]
    per_minibatch = B // args.num_minibatches
    loss_sums, kl_sums, grad_norms, size = [], [], [], Counter()
    step_metrics = rc_run.MetricSum()  # micro-batch metrics, weighted by their valid tokens
    scale_k = args.loss_scale_factor or float(args.max_response_length)
    for epoch in range(args.ppo_epochs):
        perm = torch.randperm(B, generator=generator)
        for minibatch in range(args.num_minibatches):
            rows, first = perm[minibatch * per_minibatch : (minibatch + 1) * per_minibatch], not (epoch or minibatch)
            # Denominators of the whole optimizer-step batch, all ranks, pre-rejection (docs/corrections.md §7.5)
            n_tok, n_seq = host.sum([float(mask[rows].sum()), float((mask[rows].sum(-1) > 0).sum())])
            denominators = dict(
                global_token_count=max(n_tok, 1.0), global_seq_count=max(n_seq, 1.0), loss_scale_factor=scale_k
            )
            loss_sum = kl_sum = 0.0
            micro = micro_batches(
                rows, batch, args.micro_batch_size, args.max_tokens_per_micro_batch, shares_prefix(args)
            )
            if world > 1 and args.max_tokens_per_micro_batch:  # the ranks' budget cuts differ: run as many as the most
                micro = split_to_count(micro, batch, int(host.extreme([len(micro)], "max")[0]))
            for j, micro_rows in enumerate(micro):
                # The whole micro-batch (forward, loss, backward) inside the accumulation context: DDP decides at
                # forward time whether the backward all-reduces (DistributedDataParallel.no_sync's docstring), so a
                # forward outside no_sync would reduce the gradients after every micro-batch
                with rc_run.accumulating(learner.accelerator, model, j == len(micro) - 1, args.fsdp):
                    log_prob, entropy, micro_size = forward_log_probs(model, batch, micro_rows, args, True, True)
                    micro_tensors = {k: v[micro_rows].to(log_prob.device) for k, v in tensors.items()}
                    loss, loss_metrics, pg_loss, kl_loss = micro_batch_loss(
                        args, correction, log_prob, micro_tensors, denominators, first
                    )
                    learner.accelerator.backward(loss * world)  # partial sum over global denominators; DDP averages
                size += micro_size
                loss_sum, kl_sum = loss_sum + pg_loss, kl_sum + kl_loss
                step_metrics.add(
                    micro_batch_metrics(
                        loss_metrics, log_prob, entropy, micro_tensors, correction.bypass_mode, first, batch_correction
                    ),
                    weight=float(micro_tensors["response_mask"].sum()),
                )
                if first and log_ratios is not None and correction.bypass_mode:
                    log_ratios.add(log_prob - micro_tensors["rollout_log_prob"], micro_tensors["response_mask"])
            grad_norms.append(rc_run.clip_and_step(learner.accelerator, model, learner.optimizer, args.max_grad_norm))
            learner.scheduler.step()
            learner.optimizer.zero_grad(set_to_none=True)
            loss_sums.append(loss_sum)
            kl_sums.append(kl_sum)
    actor = {
        "actor/pg_loss": float(np.mean(loss_sums)) * world,
        "actor/grad_norm": float(np.mean(grad_norms)),
        "actor/lr": learner.scheduler.get_last_lr()[0],
        **({"actor/kl_loss": float(np.mean(kl_sums)) * world} if "ref_log_prob" in tensors else {}),
    }
    return step_metrics, actor, size


# ---------------------------------------------------------------------------------------------
# TRY NOT TO MODIFY: what each forward pass sees -- micro-batches sorted by length, each trimmed to its own longest
# prompt and response, and one forward per distinct prompt (--share-prompt-prefix). An optimisation: the same
# log-probs and gradients to float rounding (tests/test_train.py), a fraction of the padding and prompt compute
# ---------------------------------------------------------------------------------------------
def shares_prefix(args: Args) -> bool:
    """Forward each distinct prompt once (--share-prompt-prefix): not under gradient checkpointing (no KV cache
    there), nor under FSDP2 (every sharded forward is a collective, and this pass runs one or two forwards depending
    on the lengths, so the ranks could run different numbers), nor when an MoE routing is replayed or recorded: each
    sample's prompt positions carry their own routing (the engine computes every sample's prompt, and a bf16 engine
    can route one sample's prompt differently from its sibling's), which one shared prompt pass cannot replay."""
    routing = args.routing_replay != "none" or args.routing_metrics
    # nor under --compile: the pass hands each layer the KV cache and the layer's own index, on which torch.compile
    # specialises (a graph per layer instead of one for all)
    return args.share_prompt_prefix and not (args.gradient_checkpointing or args.fsdp or routing or args.compile)


def compile_layers(model, backend: str = "inductor"):
    """--compile: torch.compile every transformer block (rc_run.transformer_blocks, as FSDP2 shards them) on its own,
    in place: regional compilation (PyTorch's recipe of that name). The blocks share one compiled graph, so the model
    compiles once rather than once per block, and nn.Module.compile keeps the module tree, so parameter and
    state-dict names do not change (weight sync, checkpoints, final/). Dynamic shapes: micro-batches differ in rows
    and length. A block's graphs: padded micro-batches (a mask) or not (None), with gradients (the update) or without
    (the pi_old pass). Embeddings, final norm, lm_head and rc_core's log-probs stay eager. Same log-probs and
    gradients to float rounding (tests/test_train.py); `backend` aot_eager checks the capture without generating
    code."""
    for block in rc_run.transformer_blocks(model, "--compile"):
        block.compile(dynamic=True, backend=backend)
    return model


def forward_log_probs(net, batch: dict, rows, args: Args, with_grad: bool, with_entropy=False):
    """Log-probs (and entropies) of `rows`, computed on their trimmed inputs, padded back to the batch's width; and
    the pass's size: the positions computed and the real tokens among them (perf/*; a shared prompt counts once)."""
    input_ids, attention, t = trimmed_inputs(batch, rows)
    group = batch["group"][rows] if shares_prefix(args) else None
    p, once = input_ids.shape[1] - t, slice(None)
    if group is not None:
        once = torch.as_tensor(np.unique(group.numpy(), return_index=True)[1])
    size = Counter(
        positions=len(attention[once]) * p + input_ids.shape[0] * t,
        tokens=int(attention[once, :p].sum() + attention[:, p:].sum()),
    )
    device = next(net.parameters()).device
    # an MoE's routing replayed and/or recorded for these rows (rc_moe; when the batch holds it)
    with torch.enable_grad() if with_grad else torch.no_grad(), rc_moe.forward_routing(net, batch, rows, input_ids, t):
        out = sequence_log_probs(
            net,
            input_ids.to(device),
            attention.to(device),
            t,
            args.temperature,
            args.train_dtype,
            with_entropy,
            None if group is None else group.to(device),
        )
    width = batch["response_mask"].shape[1] - t
    log_prob, entropy = (None if x is None else torch.nn.functional.pad(x, (0, width)) for x in out)
    return log_prob, entropy, size


def no_grad_pass(net, batch: dict, args: Args) -> tuple[torch.Tensor, Counter]:
    """Log-probs of every row of the batch, without gradients (the decoupled pi_old, the reference model), and the
    size of the passes (forward_log_probs)."""
    out, size = torch.zeros(batch["response_mask"].shape), Counter()
    for rows in micro_batches(
        torch.arange(out.shape[0]), batch, args.micro_batch_size, args.max_tokens_per_micro_batch, shares_prefix(args)
    ):
        log_prob, _, micro_size = forward_log_probs(net, batch, rows, args, False)
        out[rows], size = log_prob.cpu(), size + micro_size
    return out, size


def micro_batches(
    rows: torch.Tensor, batch: dict, size: int, max_tokens: int | None, by_group: bool = False
) -> list[torch.Tensor]:
    """One minibatch's rows, sorted by length and cut into micro-batches of at most `size` sequences and, with a
    token budget, at most `max_tokens` padded tokens (a sequence longer than the budget goes alone). Each
    micro-batch is then trimmed to its own longest prompt and response (trimmed_inputs), so sorting keeps the
    padding small, like verl's dynamic batch size. The loss has global denominators, so the grouping does not
    change it (tests/test_train.py::test_length_batching_gives_the_same_loss_and_gradients)."""
    p, t = batch["prompt_len"][rows], batch["response_len"][rows]
    # by_group (--share-prompt-prefix): a group's rows side by side, so a micro-batch holds few distinct prompts
    key = batch["group"][rows] * (int(t.max()) + 1) + t if by_group else p + t
    order = torch.argsort(key, stable=True)
    rows, p, t = rows[order], p[order], t[order]
    groups, start = [], 0
    while start < len(rows):
        end = min(start + size, len(rows))
        if max_tokens:  # the longest run whose padded size, n x (longest prompt + longest response), fits
            n = torch.arange(1, end - start + 1)
            padded = n * (torch.cummax(p[start:end], 0).values + torch.cummax(t[start:end], 0).values)
            end = start + max(1, int((padded <= max_tokens).sum()))
        groups.append(rows[start:end])
        start = end
    return groups


def split_to_count(groups: list[torch.Tensor], batch: dict, count: int) -> list[torch.Tensor]:
    """`groups` (micro_batches' cut of one minibatch) split until there are `count`: each time the micro-batch with
    the most padded tokens, into the two halves of its sorted rows (each within the budget still). Under DDP every
    rank must run as many micro-batches as the others (each one's forward may broadcast buffers, the last reduces
    the gradients: collectives), but a token budget cuts each rank's rows by their own lengths, so update_policy
    splits every rank's cut up to the largest count over the ranks. Split rather than padded with empty
    micro-batches (a zero loss): padding would leave each rank's gradient sum bit for bit as its own cut makes it,
    but costs a forward and backward for nothing (and 0 x a non-finite log-prob is NaN); splitting only regroups
    the rows, and the loss has global denominators, so it changes the gradient by float rounding, as any grouping
    does (tests/test_infra.py::test_a_token_budget_under_ddp_neither_hangs_nor_changes_the_update)."""
    groups = list(groups)
    while len(groups) < count:
        padded = [len(g) * int(batch["prompt_len"][g].max() + batch["response_len"][g].max()) for g in groups]
        i = max((i for i in range(len(groups)) if len(groups[i]) > 1), key=padded.__getitem__, default=None)
        if i is None:  # every rank holds as many rows (validate_args), so the largest count is within reach
            raise RuntimeError(f"cannot split {len(groups)} micro-batches of one row each into {count}")
        half = (len(groups[i]) + 1) // 2
        groups[i : i + 1] = [groups[i][:half], groups[i][half:]]
    return groups


def trimmed_inputs(batch: dict, rows: torch.Tensor):
    """input_ids and attention_mask of `rows`, cut to their own longest prompt and response; and that response width."""
    P = batch["input_ids"].shape[1] - batch["response_mask"].shape[1]
    p, t = int(batch["prompt_len"][rows].max()), max(1, int(batch["response_len"][rows].max()))
    cols = slice(P - p, P + t)
    return batch["input_ids"][rows][:, cols], batch["attention_mask"][rows][:, cols], t


def shared_prefix_logits(model, input_ids, attention_mask, T: int, group: torch.Tensor) -> torch.Tensor:
    """The logits that predict the last T tokens, each distinct prompt forwarded once: pass 1 runs the distinct
    prompts and keeps their KV cache, each row indexes its prompt's (so its gradients add up there), pass 2 runs the
    responses on it. Same positions and masks as one pass over [prompt | response] (tests/test_train.py). DDP must see
    one forward per backward: pass 1 calls the inner module when pass 2 follows."""
    P = input_ids.shape[1] - T
    distinct, row_prompt = torch.unique(group, return_inverse=True)
    first = torch.empty(len(distinct), dtype=torch.long, device=group.device)
    first[row_prompt] = torch.arange(len(group), device=group.device)  # any row of each prompt: they are identical
    prompt_mask = attention_mask[first, :P]
    out = (getattr(model, "module", model) if T > 1 else model)(
        input_ids=input_ids[first, :P],
        attention_mask=prompt_mask,
        logits_to_keep=1,
        use_cache=True,
        position_ids=(prompt_mask.cumsum(-1) - 1).clamp(min=0),
    )
    cache = out.past_key_values
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[row_prompt], layer.values[row_prompt]
    if T == 1:
        return out.logits[row_prompt]
    position_ids = prompt_mask.sum(-1)[row_prompt, None] + torch.arange(T - 1, device=input_ids.device)
    logits = model(
        input_ids=input_ids[:, P:-1],
        attention_mask=attention_mask[:, :-1],
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=True,
    ).logits
    return torch.cat([out.logits[row_prompt], logits], 1)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "plot":
        import rc_plot

        sys.exit(rc_plot.main(sys.argv[2:]))
    # TRY NOT TO MODIFY: setup -- CLI, every check before the engine starts, run folder, seeding
    args = rc_config.parse_cli(Args, load_yaml_defaults, os.path.join(HERE, "configs", "gsm8k_qwen0.5b_bypass.yaml"))
    from accelerate import Accelerator
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the console holds our progress bar only
    t_start = time.time()
    run_name = args.run_name or f"{args.task}__{args.exp_name}__{args.rc.preset}__{args.seed}__{int(time.time())}"
    run_dir = os.path.join(args.output_dir, run_name)
    rc_run.report_faults()  # a full disk, an unreadable file, a damaged checkpoint: one line, not a traceback
    try:
        rc_config.check_environment()  # OMP_NUM_THREADS, RC_CACHE_DIR, ... as the rest of the start reads them
        rc_config.launcher_settings(args)  # DeepSpeed refused; an Accelerate FSDP2 config turns --fsdp on
        accelerator = Accelerator(
            cpu=not torch.cuda.is_available(), log_with=args.log_with or None, project_dir=run_dir
        )
    except (ValueError, ImportError) as e:
        sys.exit(f"rc_train.py: error: {e}")
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    args.max_staleness = rc_config.resolve_max_staleness(args, torch.cuda.is_available(), run_dir)  # None: by device
    torch.set_num_threads(rc_config.torch_threads(args.max_staleness))  # vLLM and torch share the cores
    host = rc_run.HostGroup(world)  # the trainer's own collectives: host values on gloo, NCCL or not
    try:
        task = rc_config.validate_args(args, world)  # every check before the engine starts; the task they built
        rc_config.check_distributed(accelerator, args)
        correction = rc_config.build_correction_config(args.rc)
        args.reward_mode = args.reward_mode or task.reward_key  # --reward-mode's default: the task's reward key
        # the run folder's lock (rank 0 holds it for the run's life), its checks and, on --resume, the checkpoint's
        run_lock, replace_run = rc_run.claim_run_dir(run_dir, args, host, accelerator.is_main_process)
        train_rows, n_skipped = task.problems("train", args.train_limit)
        eval_rows, _ = task.problems("test", args.eval_limit)
        tasks.check_scorer(task, train_rows[:1])
        with accelerator.main_process_first():  # rank 0 builds (or checks) the cached model, the others reuse it
            say = (lambda m: print(m, flush=True)) if accelerator.is_main_process else None  # None: quiet
            model_path = args.model
            if args.model in (tasks.TINY_MODEL, tasks.TINY_MOE_MODEL):  # built here; the MoE with its router scale
                moe = args.moe_router_scale if args.model == tasks.TINY_MOE_MODEL else None
                model_path = tasks.base_model_path(task, args.mini, args.seed, say, router_scale=moe)
        hf_config = AutoConfig.from_pretrained(model_path)  # dense or MoE: replay and capture need the latter
        rc_config.check_moe(args, hf_config, correction.bypass_mode, torch.cuda.is_available())
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        for what, part in (("train prompt", train_rows), ("eval prompt", eval_rows)):  # before the engine starts
            tasks.check_coverage(tokenizer, [tasks.prompt_text(task, row) for row in part], what)
        train_prompts = encode_prompts(args, task, tokenizer, train_rows)
        eval_prompts = encode_prompts(args, task, tokenizer, eval_rows)
        rc_config.check_token_budget(args, max(map(len, train_prompts)))  # needs the tokenized prompts
        rc_run.agree_settings(run_dir, args, host, accelerator.is_main_process)  # --resume: the checkpoint's settings
    except (ValueError, TypeError, FileNotFoundError, FileExistsError) as e:
        sys.exit(f"rc_train.py: error: {e}")
    advice = rc_config.allocator_advice(args, device.type == "cuda")  # --compile without expandable segments
    if advice and accelerator.is_main_process:
        print(f"rc_train.py: warning: {advice}", flush=True)
    facts = dict(model_path=model_path, train_rows=len(train_rows), train_rows_skipped=n_skipped)  # in config.yaml
    rc_run.open_run_dir(run_dir, replace_run, accelerator, args, correction, **facts)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    # TRY NOT TO MODIFY: models, optimizer, resume, engine
    load = dict(dtype="auto", device_map={"": device})  # then fp32 on the device: no fp32 host copy per rank
    model = AutoModelForCausalLM.from_pretrained(model_path, **load).float()
    if args.routing_replay != "none" or args.routing_metrics:  # the MoE router hooks (rc_moe): replay and record
        rc_moe.install(model)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.compile:  # in place: parameter names stay (weight sync, checkpoints)
        compile_layers(model)
    ref_model = None
    if args.kl_coef > 0:  # the policy's own precision (fp32 weights, --train-dtype autocast): KL is 0 at step 0
        ref_model = AutoModelForCausalLM.from_pretrained(model_path, **load).float()
        ref_model.eval().requires_grad_(False)
    if args.fsdp:  # FSDP2: shard first, then build the optimizer over the sharded parameters
        model = rc_run.shard_model(model, device.type)
        ref_model = ref_model and rc_run.shard_model(ref_model, device.type)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (args.warmup_steps + 1)))
    if not args.fsdp:
        model, optimizer = accelerator.prepare(model, optimizer)
    unwrapped = accelerator.unwrap_model(model)
    start_step, counters, in_flight = 0, {"old_log_prob_passes": 0, "sync_count": 0}, {}
    if args.resume:  # everything loaded and checked first; the run folder is not touched until all of it has
        try:
            resumed = rc_run.load_resume(run_dir, model, optimizer, scheduler, accelerator, host, counters, args)
        except rc_run.RunError as e:
            sys.exit(f"rc_train.py: error: {e}")
        start_step, counters, in_flight = resumed.start_step, resumed.counters, resumed.in_flight
    engine = rc_rollout.make_engine(args, model_path, run_dir, train_prompts, accelerator)  # vLLM here or in a worker
    if args.resume:  # an engine in this process reseeded the global RNGs when it started
        rc_run.set_rng(resumed.rng)
        rc_run.commit_resume(run_dir, resumed, accelerator, args, correction, **facts)  # logs cut, config.yaml
    prompts_per_rank = rc_config.prompts_per_rank(args, world)
    replay_count = rc_config.replay_groups(args, world)  # whole groups replayed per step (--replay-fraction)
    replay = rc_rollout.ReplayBuffer(args, prompts_per_rank, replay_count, rank, resumed.replay if args.resume else ())

    def step_indices(step: int) -> list[int]:
        """This rank's fresh prompts of the step (the stream depends on seed and step only; with replay the last
        replay.replayed(step) of its share are not sampled: replayed groups take their place)."""
        P, first = args.num_prompts_per_step, rank * prompts_per_rank
        return prompt_indices(len(train_prompts), args.seed, step * P, P)[first : first + replay.fresh(step)]

    rollouts = rc_rollout.Rollouts(
        args,
        engine,
        unwrapped,
        lambda step: ([train_prompts[i] for i in step_indices(step)], rank * prompts_per_rank),
        counters["sync_count"],
    )
    log = rc_run.RunLog(run_dir, accelerator)
    evals = []  # every evaluation's metrics: the first and the last make the closing summary

    def run_eval(step: int, timer: rc_run.StepTimer) -> dict:
        """Greedy eval of the trainer's weights after `step` (version step+1); every problem to eval_samples.jsonl.
        Batches queued before it are waited for first: their generation is the step's time, not the eval's."""
        if step >= 0:
            rollouts.in_flight(step)
        with timer("timing/eval_s"):  # a dialed engine gets its perturbed weights back unless this is the last eval
            restore = step < args.num_steps - 1
            metrics, samples = rc_run.evaluate(
                task, rollouts, eval_prompts, eval_rows, rank, world, host, step + 1, restore
            )
        log.eval_samples(step, samples)
        evals.append(metrics)
        return metrics

    if args.eval_before and not args.resume:  # the initial policy, before any update: logged at step -1
        timer = rc_run.StepTimer()
        log.log(-1, {**run_eval(-1, timer), **timer.seconds}, trackers=False)
    rollouts.begin(start_step, in_flight)  # the batches of the first k+1 steps are queued
    bound = rc_rollout.staleness_bound(args)  # a sample more versions behind is never trained on
    log.start_trackers(args, run_name)
    bar = rc_run.progress_bar(start_step, args.num_steps, accelerator.is_main_process)
    health = rc_run.HealthWatch(bar.write if accelerator.is_main_process else None)  # the usage guide's alarms
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    data = TrainData(task, train_rows, train_prompts, pad_id)  # what scored_batch reads of a step's samples
    learner = Learner(accelerator, host, model, optimizer, scheduler)  # what every update works on

    def save_checkpoint(step: int) -> None:
        """After the update of `step`: weights, optimizer, schedule, RNGs, counters and the batches in flight."""
        counts = {**counters, "sync_count": rollouts.sync_count}
        try:
            in_flight = rollouts.in_flight(step)
            rc_run.save_checkpoint(
                run_dir, step, model, optimizer, scheduler, accelerator, counts, in_flight, args, replay.state()
            )
        except rc_run.RunError as e:  # a full disk: said in one line, the earlier checkpoints kept
            sys.exit(f"rc_train.py: error: {e}")

    for step in bar:
        # ALGO LOGIC: rollout -- vLLM samples n responses per prompt, with their (processed) log-probs, seeded by
        # (seed, step, 0, the prompt's place in the step). The batch of step t was sampled by policy version
        # max(0, t - k) (--max-staleness k; rc_rollout.Rollouts queued it k steps ago, or now when k = 0)
        timer = rc_run.StepTimer({"timing/old_log_prob_s": 0.0})  # timing/step_s counts the wait for the batch too
        groups, version, rollout_seconds = rollouts.take(step)
        timer.seconds.update(rollout_seconds)  # timing/rollout_s, rollout_wait_s, engine_idle_s: the engine's clocks
        # --replay-fraction: whole groups of the last W steps' rollouts, each with its own mu and version, join the
        # fresh ones (rc_rollout.ReplayBuffer); then this step's fresh groups are kept and the oldest evicted
        indices = step_indices(step)  # the fresh groups' train rows (a seeded permutation of the rows: once a step)
        fresh = [(i, version, group) for i, group in zip(indices, groups)]
        replayed = replay.draw(step)
        evicted = replay.add(step, version, indices, groups)
        with timer("timing/reward_s"):  # ALGO LOGIC: reward and GRPO advantage (a group = one prompt's n responses)
            samples = [(i, g, v, resp) for g, (i, v, group) in enumerate(fresh + replayed) for resp in group]
            n_fresh = sum(map(len, groups))  # rows 0..n_fresh-1: sampled for this step; the rest replayed
            batch, tensors, rollout_metrics = scored_batch(args, data, samples, step, bound, n_fresh)
        mask = tensors["response_mask"]
        plan_routing(args, correction, unwrapped, batch)  # MoE: which passes replay or record a routing (rc_moe)
        dump = rc_run.LogRatioDump(run_dir, step, args.dump_log_ratio_every, accelerator.is_main_process)

        # ALGO LOGIC: correction -- decoupled: pi_old once per rollout batch, IS weights and rejection mask frozen
        # for all epochs (docs/corrections.md §5, §7.2). bypass: pi_old := pi_rollout, no pass here: the loss
        # corrects each micro-batch against pi_rollout (policy_loss -> rc_core.compute_policy_loss_bypass_mode)
        batch_correction, size = {}, Counter()
        if not correction.bypass_mode:
            with timer("timing/old_log_prob_s"):
                batch_correction, size = decoupled_correction(args, correction, unwrapped, batch, tensors, dump)
                counters["old_log_prob_passes"] += 1
        if args.routing_metrics or args.routing_replay == "reference":  # MoE: the trainer's own routing (rc_moe)
            with timer("timing/routing_s"):
                routing_metrics, routing_size = routing_step(args, unwrapped, batch, tensors)
                batch_correction, size = {**batch_correction, **routing_metrics}, size + routing_size
        with timer("timing/ref_log_prob_s"):
            if ref_model is not None:
                tensors["ref_log_prob"], ref_size = no_grad_pass(ref_model, batch, args)
                size += ref_size

        # ALGO LOGIC: update -- epochs x minibatches (one optimizer step each) x micro-batches (update_policy)
        with timer("timing/update_s"):
            step_metrics, actor_metrics, update_size = update_policy(
                args=args,
                correction=correction,
                learner=learner,
                batch=batch,
                tensors=tensors,
                generator=torch.Generator().manual_seed(args.seed * 7919 + step * 31 + rank),  # the minibatch order
                batch_correction=batch_correction,
                log_ratios=dump,
            )
        dump.save()
        passes = ("timing/old_log_prob_s", "timing/routing_s", "timing/ref_log_prob_s", "timing/update_s")
        train_s = sum(timer.seconds.get(k, 0.0) for k in passes)
        perf = rc_run.pass_metrics(size + update_size, train_s)

        # TRY NOT TO MODIFY: weight sync -- the new weights (version step+1) reach the engine in place, between two
        # generations, its prefix cache dropped; then the batch of step+1+k is queued (sampled by version step+1)
        with timer("timing/sync_s"):
            rollouts.sync(step)
        last = step == args.num_steps - 1  # evaluation (greedy pass@1) of the trained policy, never a perturbed copy
        eval_metrics = run_eval(step, timer) if last or (args.eval_every and (step + 1) % args.eval_every == 0) else {}
        rollouts.request(step + 1 + args.max_staleness)

        # TRY NOT TO MODIFY: logging. Token-weighted over micro-batches and ranks; the decoupled correction (this
        # rank's batch) by its tokens, batch statistics by sequences (rc_run.reduce_metrics). Loss terms are partial
        # sums over global denominators on each rank, so x world turns their rank mean into the global loss.
        step_metrics.add({**batch_correction, **perf}, weight=float(mask.sum()))
        if args.replay_window:  # the buffer: the replayed share of the batch, what it holds and what left it
            rollout_metrics.update(
                rc_run.replay_metrics(len(samples) - n_fresh, len(samples), replay.samples(), evicted)
            )
        counts = {"actor/old_log_prob_passes": counters["old_log_prob_passes"], "actor/sync_count": rollouts.sync_count}
        step_metrics.add({**rollout_metrics, **actor_metrics, **counts}, weight=float(len(mask)))
        step_metrics.add({**timer.seconds, "timing/step_s": timer.elapsed()}, weight=1.0)
        metrics = {**rc_run.reduce_metrics(step_metrics, host), **eval_metrics}
        metrics.update(health.check(step, metrics))  # health/*: a line on the console when one fires or clears
        log.log(step, metrics)
        bar.set_postfix(**rc_run.progress(metrics, evals[-1] if evals else None, task.accuracy_key))
        if args.log_rank_checksums:  # data-parallel sanity: same weights on every rank, different samples
            response_ids = [resp.token_ids for *_, resp in samples]
            rc_run.log_rank_checksums(run_dir, step, rank, world, response_ids, rc_run.full_weights(unwrapped))

        # TRY NOT TO MODIFY: checkpoint
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            save_checkpoint(step)

    # TRY NOT TO MODIFY: final weights and summary
    if args.save_final:
        rc_run.save_final(run_dir, model, tokenizer, accelerator)
    rollouts.close()
    log.close()
    bar.close()
    if accelerator.is_main_process:
        first_eval = evals[0] if args.eval_before and not args.resume else None
        last_eval = evals[-1] if evals else None
        rc_run.print_summary(
            first_eval,
            last_eval,
            len(eval_rows),
            time.time() - t_start,
            run_dir,
            task.accuracy_key,
            health.summary(args.num_steps - start_step),
        )
    accelerator.wait_for_everyone()
    rc_run.exit_cleanly(world)
