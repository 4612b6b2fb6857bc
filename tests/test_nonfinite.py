"""Non-finite numbers, told and contained (issue 49, item 1): a NaN or inf reward, log-prob, loss or gradient norm
stops the run with one line naming it and where it was met, before the step is logged or checkpointed; the health
watch counts a NaN metric as firing.

Before: a scorer's NaN reward, or a NaN in the trainer's logits, was caught only by rc_core's input check, which
reads the step's first micro-batch: there it stopped the run (`ValueError: advantages has 181 non-finite value(s)...`)
with a ~30-line traceback that named neither the scorer, the row nor the tensor (in bypass mode it even named
old_log_prob for the trainer's own log_prob); anywhere else it was not caught at all: NaN loss, NaN gradients, NaN
weights, and the run went on to its end with exit code 0. rc_run.HealthWatch skipped a NaN metric as if it were absent.

Unit tests call rc_train.update_policy / decoupled_correction on a tiny Qwen2 whose logits are made NaN by a forward
hook, and rc_run.HealthWatch on hand-made metrics (seconds); one end-to-end test runs the real script on the one-token
fixture with a scorer that returns NaN for one training row of step 1 (~30 s, most of it the engine's start).
"""

import dataclasses
import math

import pytest
import torch

import rc_config
import rc_core
import rc_forward
import rc_run
import rc_train
import tasks
from tests.test_run_record import refused, run_patched
from tests.test_train import QUICK, read_jsonl

NAN = float("nan")


# ---- the trainer's side: log-probs, loss, gradient norm ----------------------------------------------------------
def tiny_update(preset: str = "bypass_ppo_clip", **changes):
    """Args, correction config, Learner, batch and tensors of a tiny update: 8 responses to 4 prompts, two minibatches
    of two micro-batches of two rows each, on a random 2-layer Qwen2 (tasks.make_qwen2) on the CPU."""
    from accelerate import Accelerator

    fields = dict(micro_batch_size=2, num_minibatches=2, ppo_epochs=1, share_prompt_prefix=False, max_response_length=4)
    args = dataclasses.replace(rc_train.Args(), **{**fields, **changes}, rc=rc_config.CorrectionArgs(preset=preset))
    correction = rc_config.build_correction_config(args.rc)
    model = tasks.make_qwen2(vocab_size=50, eos=0, hidden=64, layers=2, intermediate=64, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    learner = rc_train.Learner(accelerator, rc_run.HostGroup(1), model, optimizer, scheduler)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 50, (3 + i % 4,), generator=gen).tolist() for i in range(8)]
    responses = []
    for i in range(8):
        ids = torch.randint(1, 50, (1 + i % 4,), generator=gen).tolist()
        responses.append((ids, (-torch.rand(len(ids), generator=gen)).tolist(), ""))
    batch = rc_forward.make_batch(prompts, responses, 0, [i // 2 for i in range(8)])
    mask, rollout_log_prob = batch.pop("response_mask"), batch.pop("rollout_log_prob")
    advantages = torch.randn((8, 1), generator=gen).expand_as(mask) * mask
    tensors = dict(response_mask=mask, advantages=advantages, rollout_log_prob=rollout_log_prob)
    return args, correction, learner, batch, tensors


def nan_logits_on_call(model, calls: set[int]):
    """Every logit NaN in the model's forward calls numbered in `calls` (0 = the first after this)."""
    count = [0]

    def hook(module, inputs, output):
        if count[0] in calls:
            output.logits = output.logits * NAN  # through the graph, as a real NaN would be
        count[0] += 1
        return output

    return model.register_forward_hook(hook)


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def update(args, correction, learner, batch, tensors, step):
    return rc_train.update_policy(
        args,
        correction,
        learner,
        batch,
        tensors,
        generator=torch.Generator().manual_seed(0),
        batch_correction={},
        step=step,
    )


@pytest.mark.parametrize("call, micro_batch", [(0, 0), (1, 1)])
def test_a_nan_log_prob_in_the_update_stops_it_naming_the_tensor_step_and_micro_batch(call, micro_batch):
    """Before: on the step's first micro-batch rc_core raised `ValueError: old_log_prob has N non-finite value(s)` (a
    traceback, the wrong tensor's name in bypass mode, no step, no micro-batch); on a later one nothing was checked:
    the NaN loss went into the gradients and the optimizer step made the weights NaN, without a word. Now:
    rc_run.NonFinite (one line) naming log_prob, the step, epoch, minibatch and micro-batch, raised before the
    minibatch's optimizer step: the weights are untouched."""
    args, correction, learner, batch, tensors = tiny_update()
    before = weights(learner.model)
    handle = nan_logits_on_call(learner.model, {call})
    with pytest.raises(rc_run.NonFinite) as info:
        update(args, correction, learner, batch, tensors, step=5)
    handle.remove()
    line = str(info.value)
    assert "\n" not in line and rc_run.fault_line(info.value) == line  # what rc_train.py prints, then exits 1
    assert line.startswith(f"step 5, epoch 0, minibatch 0, micro-batch {micro_batch}: log_prob has ")
    assert "non-finite value(s) at valid tokens" in line and "the last checkpoint is intact" in line
    assert all(torch.equal(p, q) for p, q in zip(before, learner.model.parameters()))
    _, actor, _ = update(args, correction, learner, batch, tensors, step=6)  # the hook gone: the same update runs
    assert math.isfinite(actor["actor/pg_loss"]) and actor["actor/grad_norm"] > 0


def test_a_nan_ref_log_prob_is_named_as_the_cause_of_a_nan_loss():
    """The loss is checked on the float the trainer already reads per micro-batch (no host sync); only once it is not
    finite are the log-probs read to name the cause. Before: a NaN KL term went into the gradients unnoticed."""
    args, correction, learner, batch, tensors = tiny_update(kl_coef=0.1)
    tensors["ref_log_prob"] = torch.where(tensors["response_mask"] > 0, NAN, 0.0)
    with pytest.raises(rc_run.NonFinite, match=r"^step 2, epoch 0, minibatch 0, micro-batch 0: ref_log_prob has "):
        update(args, correction, learner, batch, tensors, step=2)


def test_a_nan_in_the_pi_old_pass_is_named_old_log_prob():
    """Decoupled mode's pi_old pass (rc_train.decoupled_correction). Before: rc_core's `ValueError: old_log_prob has N
    non-finite value(s)` with a traceback and no step. Now: one line naming old_log_prob, the step, the pi_old pass
    and the batch rows."""
    args, correction, learner, batch, tensors = tiny_update("decoupled_token_is")
    model = learner.accelerator.unwrap_model(learner.model)
    handle = nan_logits_on_call(model, {0})  # the pass's first micro-batch
    with pytest.raises(rc_run.NonFinite) as info:
        rc_train.decoupled_correction(args, correction, model, batch, tensors, step=4)
    handle.remove()
    assert str(info.value).startswith("step 4, the pi_old pass: old_log_prob has ")
    assert "in row(s) " in str(info.value) and "old_log_prob" not in tensors  # nothing joined the step's tensors


def test_a_non_finite_loss_or_gradient_norm_is_one_line():
    """The floats the trainer already has (the micro-batch's loss, the optimizer step's gradient norm): NaN and inf
    stop it, finite values pass without reading any tensor."""
    mask = torch.ones((2, 3))
    rc_run.check_loss(0.5, "here", mask, log_prob=torch.full((2, 3), NAN))  # a finite loss: the tensors stay unread
    with pytest.raises(rc_run.NonFinite, match=r"^step 1, epoch 0, minibatch 1, micro-batch 2: loss is nan; "):
        rc_run.check_loss(NAN, "step 1, epoch 0, minibatch 1, micro-batch 2", mask, log_prob=torch.zeros((2, 3)))
    with pytest.raises(rc_run.NonFinite, match=r"^step 3, epoch 1, minibatch 0: grad_norm is inf; "):
        rc_run.check_finite("grad_norm", math.inf, "step 3, epoch 1, minibatch 0")
    padded = torch.tensor([[0.0, NAN], [-1.0, -2.0]])  # a NaN at a padded position is no fault
    rc_run.check_finite("log_prob", padded, "here", torch.tensor([[1.0, 0.0], [1.0, 1.0]]))


# ---- the health watch --------------------------------------------------------------------------------------------
def test_a_nan_or_inf_health_metric_fires():
    """Before: rc_core.check_rollout_correction_health and rc_run.HealthWatch skipped a NaN metric as if the correction
    had none (no health/* key, no console line, nothing in the summary). Now a NaN or inf metric fires, the console
    line says it is not a finite number, and it clears when the metric is a healthy number again; an absent metric
    still fires nothing."""
    fired = rc_core.check_rollout_correction_health({"rollout_corr/rollout_is_mean": NAN, "rollout_corr/kl": -math.inf})
    assert set(fired) == {"health/is_mean", "health/kl"}
    lines = []
    watch = rc_run.HealthWatch(lines.append)
    assert watch.check(0, {"rollout_corr/rollout_is_eff_sample_size": NAN}) == {"health/is_ess": 1.0}
    assert watch.check(1, {"rollout_corr/rollout_is_eff_sample_size": 0.9}) == {"health/is_ess": 0.0}
    assert watch.check(2, {}) == {}  # absent: no key
    assert lines == [
        "health: step 0: rollout_corr/rollout_is_eff_sample_size = nan, not a finite number: health/is_ess fires "
        "(docs/corrections.md §6.7)",
        "health: step 1: health/is_ess clears (rollout_corr/rollout_is_eff_sample_size = 0.9)",
    ]
    assert watch.summary(3) == "health checks fired: health/is_ess on 1 of 3 steps"


# ---- the reward: the real script ---------------------------------------------------------------------------------
def test_a_nan_reward_stops_the_run_naming_the_task_row_and_value(tmp_path):
    """The one-token fixture, its scorer returning NaN for one training row of step 1 (a wrapper registers it in
    tasks.TASKS, as a fork would), a checkpoint after every step. Before: the NaN row's group fell outside the step's
    first micro-batch, the only one rc_core checks, so nothing stopped it: its NaN advantages went into the update,
    the progress bar showed reward=nan, later steps sampled empty responses, every step was checkpointed and the run
    ended with exit code 0 (had the group fallen inside, `ValueError: advantages has N non-finite value(s)`, a
    traceback naming neither the task nor the row). Now: exit code 1 and one line `rc_train.py: error: step 1: task
    'add' scored reward nan for train row R ('<question>')...`, no traceback; step 0 is logged and checkpointed,
    nothing of step 1 is (no line, no checkpoint, no half-written one)."""
    train_rows, _ = tasks.make_task("add").problems("train")
    step0, step1 = (rc_train.prompt_indices(len(train_rows), 1, 8 * s, 8) for s in (0, 1))  # --seed 1, 8 per step
    row = next(i for i in step1 if i not in step0)
    question = train_rows[row]["question"]
    patch = (
        "import dataclasses, tasks\n"
        "add = tasks.TASKS['add']\n"
        "def nan_add(**kw):\n"
        "    task = add(**kw)\n"
        "    def score(text, row):\n"
        f"        bad = row['question'] == {question!r}\n"
        "        return {**task.score(text, row), **({task.reward_key: float('nan')} if bad else {})}\n"
        "    return dataclasses.replace(task, score=score)\n"
        "tasks.TASKS['add'] = nan_add\n"
    )
    flags = [*QUICK, "--seed", "1", "--num-steps", "3", "--checkpoint-every", "1"]  # QUICK: 8 prompts per step
    flags += ["--no-eval-before", "--output-dir", str(tmp_path), "--run-name", "r"]
    proc = run_patched(tmp_path, patch, flags)
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = refused(proc, "step 1: task 'add' scored reward nan", f"train row {row} ({question!r})")
    assert "rewards not finite" not in line and "not finite): its scorer must return finite numbers" in line, line
    run = tmp_path / "r"
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [0]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000000"]


def test_a_nan_eval_score_stops_the_run_naming_the_test_row():
    """An eval score that is NaN: before, it vanished into eval/accuracy_* (a NaN accuracy, logged, no word); now
    rc_run.evaluate stops in one line naming the eval, the score key, the test row and its question."""
    from types import SimpleNamespace

    import rc_rollout

    task = tasks.make_task("add")
    rows, _ = task.problems("test")
    bad = rows[2]["question"]

    def score(text, row):
        return {**task.score(text, row), "strict": NAN if row["question"] == bad else 1.0}

    nan_task = dataclasses.replace(task, score=score)
    prompts = [[1, 2]] * 4
    rollouts = SimpleNamespace(evaluate=lambda p, version, restore: [[rc_rollout.Response([3], [], "7")] for _ in p])
    with pytest.raises(rc_run.NonFinite) as info:
        rc_run.evaluate(nan_task, rollouts, prompts, rows[:4], 0, 1, rc_run.HostGroup(1), version=5)
    line = str(info.value)
    assert "\n" not in line and line.startswith("the eval of version 5: task 'add' scored strict nan for test row 2")
    assert repr(bad[:48]) in line
    metrics, _ = rc_run.evaluate(task, rollouts, prompts, rows[:4], 0, 1, rc_run.HostGroup(1), version=5)
    assert math.isfinite(metrics["eval/accuracy_strict"])  # a finite scorer passes
