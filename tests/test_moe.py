"""The Mixture-of-Experts path (docs/moe.md): the tiny Qwen3-MoE, routing replay in the trainer (rc_moe), the routing
the engine captures and the weight push into an MoE engine (rc_rollout.MoEEngine), the bad-input refusals, and short
end-to-end runs of rc_train.py with --model tiny-moe.

The replay tests build a random tiny Qwen3-MoE in float64 and run rc_train's own forward (sequence_log_probs on
rc_forward's micro-batches, trimmed) on a batch made by rc_forward.make_batch, the step's routing an rc_moe.StepRouting;
they take seconds. The engine tests start vLLM's CPU build (one engine each, a minute or two on a busy machine); the
end-to-end runs start the real script.
"""

import dataclasses
import json
import os
import random
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import rc_config
import rc_forward
import rc_moe
import rc_rollout
import rc_train
import tasks
from tests.test_train import session_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
LAYERS, K, EXPERTS = 2, 2, 8


def tiny_moe(seed=0, router_scale=0.3):
    """A random 2-layer tiny Qwen3-MoE (tasks.make_qwen3_moe) in float64 (transformers' eager experts: its grouped_mm
    takes no float64), its routers hooked."""
    model = tasks.make_qwen3_moe(40, 0, 128, layers=LAYERS, seed=seed, router_scale=router_scale)
    model.set_experts_implementation("eager")
    model = model.double()
    assert rc_moe.install(model) == LAYERS
    return model


def toy_batch(seed=0, rows=7):
    """rc_forward.make_batch of `rows` responses to 3 prompts of different lengths (prompts left-padded, responses
    right-padded), each Response carrying an engine routing drawn at random (distinct experts per position, ids
    ascending, -1 on the last token as the engine leaves it)."""
    gen = np.random.default_rng(seed)
    prompts = [list(gen.integers(1, 40, n)) for n in (5, 9, 3)]
    prompt_ids, responses = [], []
    for i in range(rows):
        p = prompts[i % 3]
        ids = list(gen.integers(1, 40, int(gen.integers(1, 7))))
        routed = np.sort(np.stack([gen.permutation(EXPERTS)[:K] for _ in range((len(p) + len(ids)) * LAYERS)]), -1)
        routed = routed.reshape(len(p) + len(ids), LAYERS, K).astype(np.int16)
        routed[-1] = -1
        prompt_ids.append(p)
        responses.append(rc_rollout.Response(ids, list(-gen.random(len(ids))), "", routed))
    return rc_forward.make_batch(prompt_ids, responses, 0, [i % 3 for i in range(rows)])


def train_args(**changes):
    """The settings rc_train's forward reads (no shared prompt pass: replay turns it off, rc_forward.shares_prefix)."""
    fields = dict(
        share_prompt_prefix=True,
        gradient_checkpointing=False,
        fsdp=False,
        routing_replay="r3",
        routing_metrics=True,
        micro_batch_size=3,
        max_tokens_per_micro_batch=None,
        temperature=1.0,
        train_dtype="float32",
    )
    return SimpleNamespace(**{**fields, **changes})


def replaying(batch, replay):
    """The step's routing (rc_moe.StepRouting) that replays `replay` (B, P + T, layers, k) in every policy pass."""
    routing = rc_moe.StepRouting(batch)
    routing.replay = replay
    return routing


def log_probs_and_grads(model, batch, args, rows=None, replay=None):
    """rc_forward.sequence_log_probs over `rows` (default: all, in rc_forward's micro-batches of args) with gradients,
    replaying `replay` (None: the model's own routing): the log-probs (B, T) and the gradient of their sum, per
    parameter name."""
    model.zero_grad()
    out = torch.zeros(batch["response_mask"].shape, dtype=torch.float64)
    rows = torch.arange(len(out)) if rows is None else rows
    routing = replaying(batch, replay)
    for micro in rc_forward.micro_batches(rows, batch, args):
        log_prob, _, _ = rc_forward.sequence_log_probs(model, batch, micro, args, True, routing=routing)
        (log_prob * batch["response_mask"][micro]).sum().backward()
        out[micro] = log_prob.detach()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def own_routing(model, batch, args):
    """The trainer's own routing of the batch, recorded by rc_train's no-grad forward in args' micro-batches."""
    routing = rc_moe.StepRouting(batch)
    routing.record = routing.buffer(model)
    for micro in rc_forward.micro_batches(torch.arange(len(batch["group"])), batch, args):
        rc_forward.sequence_log_probs(model, batch, micro, args, False, routing=routing)
    return routing.record


# ---- replay in the trainer -----------------------------------------------------------------------------------------
def test_replaying_the_trainers_own_routing_is_the_unreplayed_forward_bit_for_bit():
    model, batch = tiny_moe(), toy_batch()
    plain, plain_grads = log_probs_and_grads(model, batch, train_args(micro_batch_size=5))
    # recorded in micro-batches of 3 (other rows side by side, other trimming), replayed in micro-batches of 5: a
    # routing put back at the wrong rows or columns would route some position elsewhere and change the numbers
    own = own_routing(model, batch, train_args(micro_batch_size=3))
    recorded = own >= 0
    assert torch.equal(recorded.all(-1).all(-1), batch["attention_mask"] > 0)  # every real position, no padding
    replayed, replayed_grads = log_probs_and_grads(model, batch, train_args(micro_batch_size=5), replay=own)
    assert torch.equal(replayed, plain)
    assert plain_grads.keys() == replayed_grads.keys()
    assert all(torch.equal(plain_grads[n], replayed_grads[n]) for n in plain_grads)
    # the check can fail: the engine's (random) routing is another routing, and changes both
    engine = batch["rollout_routing"]
    other, other_grads = log_probs_and_grads(model, batch, train_args(micro_batch_size=5), replay=engine)
    assert (other - plain).abs().max() > 1e-3
    assert not torch.equal(other_grads["model.layers.0.mlp.gate.weight"], plain_grads["model.layers.0.mlp.gate.weight"])


def test_replay_batched_equals_one_sample_at_a_time():
    model, batch = tiny_moe(), toy_batch()
    engine = batch["rollout_routing"]
    batched, batched_grads = log_probs_and_grads(model, batch, train_args(micro_batch_size=7), replay=engine)
    singles = torch.zeros_like(batched)
    single_grads = {n: torch.zeros_like(g) for n, g in batched_grads.items()}
    for i in range(len(singles)):
        log_prob, grads = log_probs_and_grads(model, batch, train_args(micro_batch_size=1), torch.tensor([i]), engine)
        singles[i] = log_prob[i]
        for n, g in grads.items():
            single_grads[n] += g
    mask = batch["response_mask"] > 0  # beyond its response a row's log-probs are padding
    torch.testing.assert_close(batched[mask], singles[mask], rtol=0, atol=1e-12)
    for n in batched_grads:
        torch.testing.assert_close(batched_grads[n], single_grads[n], rtol=1e-9, atol=1e-12)


def test_replay_forces_the_recorded_experts_with_the_routers_own_renormalised_weights():
    """omega^R3 = omega_theta restricted to the recorded experts, renormalised (Qwen3-MoE's norm_topk_prob): written
    out by hand from the router's weight; the router keeps its gradient; -1 rows take the router's own top-k."""
    model = tiny_moe()
    router = model.model.layers[1].mlp.gate
    hidden = torch.randn(5, 128, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    own_logits, own_weights, own_ids = router(hidden)
    forced = torch.tensor([[0, 1], [2, 7], [-1, -1], [5, 6], [3, 4]])
    replay = torch.full((5, LAYERS, K), -1)
    replay[:, 1] = forced
    with rc_moe.routing(model, replay[None]):
        logits, weights, ids = router(hidden)
    probs = torch.softmax(hidden @ router.weight.T, -1, dtype=torch.float32)  # the router's softmax is float32
    by_hand = probs.gather(-1, forced.clamp(min=0))
    by_hand = (by_hand / by_hand.sum(-1, keepdim=True)).double()
    torch.testing.assert_close(logits, own_logits, rtol=0, atol=0)
    for row in range(5):
        if row == 2:  # nothing recorded: the router's own choice, untouched
            assert torch.equal(ids[row], own_ids[row]) and torch.equal(weights[row], own_weights[row])
        else:
            assert ids[row].tolist() == forced[row].tolist()
            torch.testing.assert_close(weights[row], by_hand[row], rtol=0, atol=0)
    (weights * torch.arange(10, dtype=torch.float64).view(5, 2)).sum().backward()
    assert router.weight.grad.abs().sum() > 0
    router.weight.grad = None
    with rc_moe.routing(model, replay[None]):  # a replay of layer 1 leaves layer 0 alone
        assert torch.equal(model.model.layers[0].mlp.gate(hidden)[2], model.model.layers[0].mlp.gate(hidden)[2])
    assert torch.equal(router(hidden)[2], own_ids)  # outside the block: the router's own routing again


def test_the_batch_carries_the_engines_routing_at_its_tokens_columns():
    batch = toy_batch(rows=3)
    routing, attention = batch["rollout_routing"], batch["attention_mask"]
    P = batch["input_ids"].shape[1] - batch["response_mask"].shape[1]
    for i in range(3):
        p, t = int(batch["prompt_len"][i]), int(batch["response_len"][i])
        real = routing[i, P - p : P + t]
        assert (real[:-1] >= 0).all() and (real[-1] == -1).all()  # the last token has no routing
        assert (routing[i][attention[i] == 0] == -1).all()  # padding has none either
    plain = rc_forward.make_batch([[1, 2]], [rc_rollout.Response([3], [-0.1], "")], 0)
    assert "rollout_routing" not in plain  # a dense model's batch is unchanged


def test_routing_metrics_by_hand():
    # 1 row, prompt 2 + response 2 (P = 2, T = 2), 2 layers, top-2; the last position unrecorded
    engine = torch.tensor([[[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[4, 5], [6, 7]], [[-1, -1], [-1, -1]]]])
    trainer = engine.clone()
    trainer[0, 1, 1] = torch.tensor([3, 4])  # position 1 (predicts response token 0) flips at layer 1
    trainer[0, 2, 0] = torch.tensor([5, 4])  # the same set in another order: no flip
    metrics = rc_moe.routing_metrics(trainer, engine, torch.tensor([[1.0, 1.0]]))
    assert metrics["rollout_corr/routing_agreement"] == 5 / 6
    assert (metrics["rollout_corr/routing_agreement_layer0"], metrics["rollout_corr/routing_agreement_layer1"]) == (
        1.0,
        2 / 3,
    )
    assert metrics["rollout_corr/routing_flip_token_fraction"] == 0.5


# ---- bad input: one line naming the setting, before the engine starts ----------------------------------------------
def refused(call) -> str:
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    "changes, words",
    [
        (dict(moe_router_scale=0.0), "--moe-router-scale"),
        (dict(moe_router_scale=-0.1), "--moe-router-scale"),
        (dict(moe_router_scale=float("nan")), "--moe-router-scale"),
        (dict(routing_replay="r3"), "--routing-replay r3 needs a Mixture-of-Experts model"),
        (dict(routing_metrics=True), "--routing-metrics needs a Mixture-of-Experts model"),
        (dict(model="tiny-moe", routing_replay="r3", gradient_checkpointing=True), "--gradient-checkpointing"),
    ],
)
def test_moe_settings_are_refused_before_anything_is_built(changes, words):
    args = dataclasses.replace(rc_train.Args(), **changes)
    assert words in refused(lambda: rc_config.validate_args(args, world_size=1))


def test_moe_settings_that_need_the_models_config_are_refused_before_the_engine():
    from transformers import MixtralConfig, Qwen2Config, Qwen3MoeConfig

    def check(config, bypass=False, on_gpu=False, **changes):
        args = dataclasses.replace(rc_train.Args(model="some/model"), **changes)
        rc_moe.check_model(args, config, bypass, on_gpu)
        return args

    dense, mixtral, qwen3 = Qwen2Config(), MixtralConfig(), Qwen3MoeConfig()
    assert "is dense" in refused(lambda: check(dense, routing_replay="r3"))
    assert "is dense" in refused(lambda: check(dense, routing_metrics=True))
    assert "'mixtral' is not supported" in refused(lambda: check(mixtral))
    assert "bypass mode" in refused(lambda: check(qwen3, bypass=True, routing_replay="reference"))
    assert check(dense).routing_metrics is False  # None resolves: off for a dense model
    assert check(qwen3).routing_metrics is True  # on for an MoE on the CPU engine
    assert check(qwen3, on_gpu=True).routing_metrics is False  # no capture on GPUs
    # --compile with an MoE model on a GPU: neither built nor verified there, refused in one line naming both
    message = refused(lambda: check(qwen3, on_gpu=True, compile=True))
    assert message.startswith("--compile with an MoE model (--model some/model (qwen3_moe)) on a GPU"), message
    assert check(qwen3, compile=True).routing_metrics is False  # the CPU engine: allowed (metrics off, as before)
    assert check(dense, on_gpu=True, compile=True).routing_metrics is False  # a dense model compiles on a GPU
    assert rc_moe.moe_type(dense) is None and rc_moe.moe_type(qwen3) == "qwen3_moe"


def test_the_script_refuses_replay_on_a_dense_model_folder_before_its_engine(tmp_path, monkeypatch):
    """--model given as a folder (not 'tiny'): the model's config says dense, rc_train.py stops with one line before
    the engine starts and before the run folder exists."""
    monkeypatch.setenv("RC_CACHE_DIR", str(tmp_path / "cache"))
    dense = tasks.base_model_path(tasks.make_task("add"), tasks.MiniGSMArgs(), seed=1, log=None)
    env = dict(os.environ, OMP_NUM_THREADS="1", RC_CACHE_DIR=str(tmp_path / "cache"))
    cmd = [sys.executable, os.path.join(ROOT, "rc_train.py"), "--config", os.path.join(ROOT, "configs", "cpu_add.yaml")]
    cmd += ["--model", dense, "--routing-replay", "r3", "--output-dir", str(tmp_path), "--run-name", "run"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("rc_train.py: error: --routing-replay r3 needs a Mixture-of-Experts model"), last
    assert "(qwen2) is dense" in last
    assert "Initializing a V1 LLM engine" not in proc.stdout + proc.stderr and not (tmp_path / "run").exists()


def test_capture_on_a_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for changes, flag in (
        (dict(routing_replay="r3"), "--routing-replay r3"),
        (dict(routing_metrics=True), "--routing-metrics"),
    ):
        args = dataclasses.replace(rc_train.Args(model="tiny-moe", max_staleness=0), **changes)
        assert flag in refused(lambda args=args: rc_config._check_moe_settings(args))


def test_the_moe_bases_cache_names_hash_the_router_scale(tmp_path, monkeypatch):
    monkeypatch.setenv("RC_CACHE_DIR", str(tmp_path))
    add = tasks.make_task("add")
    dense = tasks.base_model_path(add, tasks.MiniGSMArgs(), seed=1, log=None)
    moe = tasks.base_model_path(add, tasks.MiniGSMArgs(), seed=1, log=None, router_scale=0.3)
    sharper = tasks.base_model_path(add, tasks.MiniGSMArgs(), seed=1, log=None, router_scale=1.0)
    assert len({dense, moe, sharper}) == 3
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(moe)
    assert (config.model_type, config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (
        "qwen3_moe",
        8,
        2,
        True,
    )
    routers = [AutoModelForCausalLM.from_pretrained(p).model.layers[0].mlp.gate.weight for p in (moe, sharper)]
    assert 0.25 < float(routers[0].std()) < 0.35 and 0.85 < float(routers[1].std()) < 1.15


# ---- the engine: weight push and routing capture (vLLM's CPU build) ------------------------------------------------
def engine_args(dtype="float32", **changes):
    fields = dict(
        rollout_dtype=dtype,
        max_model_len=64,
        rollout_logprobs="processed",
        rollout_corrupt_prob=0.0,
        vllm_kv_cache_gb=1.0,
        routing_replay="r3",
        routing_metrics=True,
        rollout_temperature=None,
        temperature=1.0,
        top_p=1.0,
        max_response_length=8,
    )
    return SimpleNamespace(**{**fields, **changes})


def test_weight_push_and_routing_capture_on_the_cpu_engine(tmp_path, monkeypatch):
    """fp32 engine, the tiny MoE at router scale 0.3: an identity push leaves the greedy log-probs bit-identical (and
    without the prepack, vLLM 0.32's own reload changes them: the bug after_load repairs); after a perturbed push the
    engine matches the trainer to 1e-5; the captured routing of a sampled batch is the trainer's own at every recorded
    position, every prompt and response position but the last is recorded, and replaying it is the unreplayed
    forward."""
    monkeypatch.setenv("RC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    path = tasks.base_model_path(tasks.make_task("add"), tasks.MiniGSMArgs(), seed=1, log=None, router_scale=0.3)
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).float()
    limits = dict(max_num_seqs=64, max_num_batched_tokens=512, enable_chunked_prefill=False)
    random.seed(42), np.random.seed(6789), torch.manual_seed(12345)  # not the engine's seed (0)
    rng = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()
    llm = rc_rollout.start_engine(engine_args(), path, 0, limits, str(tmp_path / "engine.log"), {})
    # vLLM seeds the global generators with its own seed as it starts: start_engine gives the trainer's back
    assert random.getstate() == rng[0] and (np.random.get_state()[1] == rng[1]).all()
    assert torch.equal(torch.get_rng_state(), rng[2])
    assert isinstance(llm.rc_moe, rc_rollout.MoEEngine) and len(llm.rc_moe.layers) == LAYERS
    prompts = [tokenizer(f"{a}+{b}=", add_special_tokens=False)["input_ids"] for a in range(4) for b in range(3)]

    def greedy():
        params = SamplingParams(temperature=0.0, logprobs=0, max_tokens=8)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [([d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in outs], [
            list(o.outputs[0].token_ids) for o in outs
        ]

    def weights():
        return [(n, t.detach().clone()) for n, t in model.state_dict().items()]

    before, tokens = greedy()
    rc_rollout.load_weights(llm, weights())
    assert greedy() == (before, tokens)  # bit for bit
    moe, llm.rc_moe = llm.rc_moe, None  # the check can fail: vLLM's reload alone
    rc_rollout.load_weights(llm, weights())
    assert greedy()[0] != before
    llm.rc_moe = moe
    rc_rollout.load_weights(llm, weights())
    assert greedy() == (before, tokens)

    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    rc_rollout.load_weights(llm, weights())
    engine_lp, tokens = greedy()
    for p, ids, lps in zip(prompts, tokens, engine_lp):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + ids])).logits[0, len(p) - 1 : -1]
        trainer = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
        torch.testing.assert_close(trainer, torch.tensor(lps), rtol=0, atol=1e-5)

    groups = rc_rollout.generate(llm, rc_rollout.Request(prompts, 4, (1, 0, 0), 0), engine_args())
    responses = [r for group in groups for r in group]
    for p, r in zip([p for p in prompts for _ in range(4)], responses):
        assert r.routed_experts.shape == (len(p) + len(r.token_ids), LAYERS, K)
        assert (r.routed_experts[:-1] >= 0).all() and (r.routed_experts[-1] == -1).all()
    greedy_groups = rc_rollout.generate(llm, rc_rollout.Request(prompts, 1, greedy=True), engine_args())
    assert all(r.routed_experts is None for group in greedy_groups for r in group)  # evaluation: no capture
    batch = rc_forward.make_batch([p for p in prompts for _ in range(4)], responses, 0, [i // 4 for i in range(48)])
    rc_moe.install(model)
    args = train_args(micro_batch_size=48)
    own = own_routing(model, batch, args)
    metrics = rc_moe.routing_metrics(own, batch["rollout_routing"], batch["response_mask"])
    assert metrics["rollout_corr/routing_agreement"] == 1.0 and metrics["rollout_corr/routing_flip_token_fraction"] == 0
    plain, _ = rc_forward.no_grad_pass(model, batch, args)
    replayed, _ = rc_forward.no_grad_pass(model, batch, args, replaying(batch, batch["rollout_routing"]))
    assert torch.equal(plain, replayed)
    mask = batch["response_mask"] > 0
    torch.testing.assert_close(replayed[mask], batch["rollout_log_prob"][mask], rtol=0, atol=1e-5)


# ---- end to end: rc_train.py --model tiny-moe ---------------------------------------------------------------------
def run_moe(tmp_path, *flags, name="run"):
    """rc_train.py on the one-token fixture with the random tiny MoE; the metrics rows of the training steps."""
    env = dict(os.environ, OMP_NUM_THREADS="1", RC_CACHE_DIR=str(session_cache(tmp_path.parent)))
    cmd = [
        sys.executable,
        os.path.join(ROOT, "rc_train.py"),
        "--config",
        os.path.join(ROOT, "configs", "cpu_add.yaml"),
        "--model",
        "tiny-moe",
        "--moe-router-scale",
        "0.3",
        "--num-prompts-per-step",
        "8",
        "--num-samples-per-prompt",
        "8",
        "--eval-limit",
        "10",
        "--no-save-final",
        "--output-dir",
        str(tmp_path),
        "--run-name",
        name,
        *flags,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["step"] >= 0], proc


def test_r3_run_in_the_rollout_worker_keeps_the_engine_exact_after_every_push(tmp_path):
    """fp32 engine, decoupled, r3 through the rollout worker: after every update's push the engine still routes as the
    trainer does and matches it to fp32 rounding (the prepack runs in the worker too), and the metrics are logged."""
    rows, proc = run_moe(
        tmp_path, "--routing-replay", "r3", "--rc.preset", "decoupled_token_is", "--rollout-worker", "--num-steps", "4"
    )
    assert " INFO " not in proc.stdout + proc.stderr and "Triton" not in proc.stdout + proc.stderr  # a quiet console
    assert max(r["actor/ppo_kl_k3"] for r in rows) > 1e-6  # the updates changed the weights
    for r in rows:
        assert r["rollout_corr/routing_agreement"] == 1.0 and r["rollout_corr/routing_flip_token_fraction"] == 0.0
        assert r["rollout_corr/routing_agreement_layer0"] == r["rollout_corr/routing_agreement_layer1"] == 1.0
        assert r["rollout_corr/k3_kl"] < 1e-9 and r["rollout_corr/unreplayed_k3_kl"] < 1e-9
        assert r["timing/routing_s"] > 0
    import rc_plot  # the dashboard draws them: routing, and the unreplayed k3 and alpha_1 beside the replayed ones

    fig = rc_plot.build_dashboard([rc_plot.load_metrics(str(tmp_path / "run"))], ["moe"])
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_visible() and ax.get_title()}
    assert len(axes["MoE routing (trainer vs engine)"].get_lines()) == 2
    assert len(axes["Mismatch KL k3"].get_lines()) == 2
    assert len(axes["TV estimates (three-policy bound)"].get_lines()) == 3


def test_reference_replay_and_bypass_r3_runs(tmp_path):
    """reference (decoupled, in the trainer's process) and r3 in bypass mode (the extra unreplayed pass) both run and
    log the routing metrics; without replay in decoupled mode the unreplayed mismatch is the logged one."""
    ref, _ = run_moe(tmp_path, "--routing-replay", "reference", "--rc.preset", "decoupled_token_is", "--num-steps", "2")
    bypass, _ = run_moe(tmp_path, "--routing-replay", "r3", "--num-steps", "2", name="bypass")
    plain, _ = run_moe(tmp_path, "--rc.preset", "decoupled_token_is", "--num-steps", "2", name="plain")
    for rows in (ref, bypass, plain):
        assert all(r["rollout_corr/routing_agreement"] == 1.0 for r in rows)
    for r in ref + plain:  # pi_old ran unreplayed: its mismatch is the unreplayed one
        assert r["rollout_corr/unreplayed_k3_kl"] == r["rollout_corr/k3_kl"]


@pytest.mark.parametrize("sharding", [[], ["--fsdp"]], ids=["ddp", "fsdp2"])
def test_r3_under_two_processes_keeps_the_ranks_weights_equal(tmp_path, sharding):
    """torchrun, 2 processes (DDP, or FSDP2), r3 with a bf16 engine: replay runs inside the wrapped (or sharded)
    model, the ranks' weights agree after every step and change, each rank samples its own shard."""
    env = dict(os.environ, OMP_NUM_THREADS="1", RC_CACHE_DIR=str(session_cache(tmp_path.parent)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "rc_train.py"]
    cmd += ["--config", "configs/cpu_add.yaml", "--model", "tiny-moe", "--moe-router-scale", "0.3"]
    cmd += ["--routing-replay", "r3", "--rollout-dtype", "bfloat16", "--rc.preset", "decoupled_token_is", *sharding]
    cmd += ["--num-steps", "4", "--num-prompts-per-step", "8", "--num-samples-per-prompt", "8", "--eval-limit", "10"]
    cmd += ["--no-save-final", "--log-rank-checksums", "--output-dir", str(tmp_path), "--run-name", "run"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [[json.loads(line) for line in (tmp_path / "run" / "ranks" / f"rank{r}.jsonl").open()] for r in (0, 1)]
    assert [len(r) for r in ranks] == [4, 4]
    for a, b in zip(*ranks):
        assert a["weights_sha256"] == b["weights_sha256"] and a["rollout_sha256"] != b["rollout_sha256"], a["step"]
    assert len({r["weights_sha256"] for r in ranks[0]}) > 1
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()][1:]
    assert all("rollout_corr/routing_agreement" in r and "rollout_corr/unreplayed_k3_kl" in r for r in rows)
