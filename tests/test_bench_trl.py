"""benchmarks/bench_trl.py's own logic (the race installs TRL and runs for minutes: a benchmark, not a test)."""

import argparse
import json

import pytest

from benchmarks import bench_trl


def result(evals, train_s=10.0, wall_s=15.0):
    return {
        "evals": [{"step": s, "train_s": t, "accuracy": a} for s, t, a in evals],
        "train_s": train_s,
        "wall_s": wall_s,
    }


def args(**kw):
    return argparse.Namespace(**{"steps": 4, "targets": [0.5, 0.8], "eval_every": 2, "max_staleness": 1, **kw})


def test_time_to_target_is_the_first_eval_at_or_above_it():
    evals = result([(0, 0.0, 0.0), (2, 4.0, 0.49), (4, 8.5, 0.5), (6, 12.0, 0.9)])["evals"]
    assert bench_trl.time_to(evals, 0.5) == 8.5
    assert bench_trl.time_to(evals, 0.95) is None


def test_every_ratio_per_seed_and_target_then_medians_last_line_the_first_target():
    runs = {
        1: {
            "ours": result([(2, 3.0, 0.6), (4, 6.0, 0.85)]),
            "trl_vllm": result([(2, 12.0, 0.55), (4, 20.0, 0.8)]),
            "trl_generate": result([(2, 10.0, 0.51), (4, 30.0, 0.7)]),
        },
        2: {"ours": result([(2, 4.0, 0.4), (4, 8.0, 0.6)]), "trl_vllm": result([(2, 8.0, 0.5), (4, 16.0, 0.9)])},
        3: {"ours": result([(2, 2.0, 0.9)]), "trl_vllm": result([(2, 10.0, 0.3)])},
    }
    lines = bench_trl.report(args(), runs)
    # seed 1: 3/10 (the faster TRL variant) and 6/20; seed 2: 8/8 and never; seed 3: TRL never reached either
    assert "ours/TRL at 0.5: per seed 0.300, 1.000, 0.000; median 0.300" in lines
    assert "ours/TRL at 0.8: per seed 0.300, inf, 0.000; median 0.300" in lines
    assert lines[-1] == "ours/TRL time-to-accuracy: 0.300"
    assert "| trl_generate | ? | 2.50 | 10.0 (2) | never | 0.700 | 5 |" in lines


def test_from_results_reports_again_at_other_targets(tmp_path, capsys):
    runs = {"1": {"ours": result([(2, 3.0, 0.6)]), "trl_vllm": result([(2, 12.0, 0.55)])}}
    saved = tmp_path / "results.json"
    saved.write_text(json.dumps({"args": {"steps": 2, "eval_every": 2, "max_staleness": 0}, "runs": runs}))
    bench_trl.main(["--from-results", str(saved), "--targets", "0.55"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("miniature GSM8K, 2 rollout steps") and out[-1] == "ours/TRL time-to-accuracy: 0.250"


def test_from_results_reports_the_seeds_asked_for(tmp_path, capsys):
    runs = {
        "1": {"ours": result([(2, 3.0, 0.6)]), "trl_vllm": result([(2, 12.0, 0.55)])},
        "2": {"ours": result([(2, 6.0, 0.6)]), "trl_vllm": result([(2, 10.0, 0.55)])},
    }
    saved = tmp_path / "results.json"
    saved.write_text(json.dumps({"args": {"steps": 2, "eval_every": 2, "max_staleness": 1}, "runs": runs}))
    bench_trl.main(["--from-results", str(saved), "--seeds", "2"])
    out = capsys.readouterr().out
    assert "seed 1:" not in out and out.splitlines()[-1] == "ours/TRL time-to-accuracy: 0.600"
    with pytest.raises(SystemExit, match=r"--seeds \[3\] not in"):
        bench_trl.main(["--from-results", str(saved), "--seeds", "2,3"])


@pytest.mark.parametrize(
    "argv, bad",
    [
        (["--variants", "ours,trl_fast"], "trl_fast"),
        (["--variants", "trl_vllm"], "need ours"),
        (["--targets", "0.5,1.5"], "1.5"),
        (["--steps", "0"], "got 0"),
        (["--seeds", "1,x"], "integers"),
        (["--max-staleness", "-1"], "got -1"),
        (["--trl-threads", "0"], "--trl-threads must be >= 1, got 0"),
        (["--preset", "tis"], "--preset must be one of rc_core.PRESET_NAMES, got 'tis'"),
    ],
)
def test_bad_arguments_are_refused_by_name(argv, bad, capsys):
    with pytest.raises(SystemExit):
        bench_trl.parse_args(argv)
    assert bad in capsys.readouterr().err


def test_defaults_three_seeds_three_targets_ours_asynchronous():
    a = bench_trl.parse_args([])
    assert (a.steps, a.seeds, a.targets, a.max_staleness) == (50, [1, 2, 3], [0.5, 0.8, 0.9], 1)
    assert a.preset == "bypass_ppo_clip"  # the preset of the README's race figures, not the default job's
    assert bench_trl.parse_args(["--from-results", "r.json"]).seeds is None  # every seed of the results
    assert bench_trl.parse_args(["--quick"]).steps == 20


def test_trl_config_matches_one_rollout_batch_to_num_minibatches_optimizer_steps():
    spec = {**bench_trl.SHAPE, "steps": 3, "seed": 5}
    config = bench_trl.trl_config(spec, "out", use_vllm=True)
    per_rollout = spec["prompts_per_step"] * spec["samples_per_prompt"]
    assert config["generation_batch_size"] == per_rollout
    step_rows = config["per_device_train_batch_size"] * config["gradient_accumulation_steps"]
    assert step_rows * spec["num_minibatches"] == per_rollout  # every response of a rollout trains once
    assert config["max_steps"] == 3 * spec["num_minibatches"] and config["seed"] == 5
    assert config["epsilon"] == config["epsilon_high"] == spec["clip"] and config["beta"] == 0.0
    assert config["use_vllm"] and config["output_dir"] == "out"
