"""benchmarks/bench_trl.py's own logic (the race installs TRL and runs for minutes: a benchmark, not a test)."""

import argparse
import json

import pytest
import tyro

from benchmarks import bench_trl

SYNC = {"max_staleness": 0, "preset": "decoupled_seq_mis"}
ASYNC = {"max_staleness": 1, "preset": "bypass_ppo_clip"}


def result(evals, train_s=10.0, wall_s=15.0, **arm):
    return {
        **arm,
        "evals": [{"step": s, "train_s": t, "accuracy": a} for s, t, a in evals],
        "train_s": train_s,
        "wall_s": wall_s,
    }


def args(**kw):
    return argparse.Namespace(**{"steps": 4, "targets": [0.5, 0.8], "eval_every": 2, **kw})


def test_time_to_target_is_the_first_eval_at_or_above_it():
    evals = result([(0, 0.0, 0.0), (2, 4.0, 0.49), (4, 8.5, 0.5), (6, 12.0, 0.9)])["evals"]
    assert bench_trl.time_to(evals, 0.5) == 8.5
    assert bench_trl.time_to(evals, 0.95) is None


def test_every_arm_against_every_trl_variant_per_seed_and_target_then_medians_and_goals():
    runs = {
        1: {
            "ours_sync": result([(2, 3.0, 0.6), (4, 6.0, 0.85)], **SYNC),
            "ours_async_bypass_ppo_clip": result([(2, 5.0, 0.6), (4, 9.0, 0.8)], **ASYNC),
            "trl_vllm": result([(2, 12.0, 0.55), (4, 20.0, 0.8)]),
            "trl_generate": result([(2, 10.0, 0.51), (4, 30.0, 0.7)]),
        },
        2: {
            "ours_sync": result([(2, 4.0, 0.4), (4, 8.0, 0.6)], **SYNC),
            "ours_async_bypass_ppo_clip": result([(2, 4.0, 0.5)], **ASYNC),
            "trl_vllm": result([(2, 8.0, 0.5), (4, 16.0, 0.9)]),
            "trl_generate": result([(2, 8.0, 0.5)]),
        },
        3: {
            "ours_sync": result([(2, 2.0, 0.9)], **SYNC),
            "ours_async_bypass_ppo_clip": result([(2, 2.0, 0.9)], **ASYNC),
            "trl_vllm": result([(2, 10.0, 0.3)]),
            "trl_generate": result([(2, 20.0, 0.8)]),
        },
    }
    lines = bench_trl.report(args(), runs)
    # each TRL variant apart: seed 1 ours_sync 3/12 against vLLM, 3/10 against generate; never the faster of the two
    assert "ours_sync/trl_vllm at 0.5: per seed 0.250, 1.000, 0.000; median 0.250 (goal <= 0.5: met)" in lines
    assert "ours_sync/trl_vllm at 0.8: per seed 0.300, inf, 0.000; median 0.300 (goal <= 0.5: met)" in lines
    assert "ours_sync/trl_generate at 0.5: per seed 0.300, 1.000, 0.100; median 0.300 (goal <= 0.5: met)" in lines
    assert "ours_sync/trl_generate at 0.8: per seed 0.000, inf, 0.100; median 0.100 (goal <= 0.5: met)" in lines
    assert (
        "ours_async_bypass_ppo_clip/trl_vllm at 0.5: per seed 0.417, 0.500, 0.000; median 0.417 (goal <= 0.4: not met)"
        in lines
    )
    assert "| trl_generate | ? | 2.50 | 10.0 (2) | never | 0.700 | 5 |" in lines
    # each arm over the seeds: median (range); a target's step median and range over the seeds that reached it
    assert "each arm over seeds 1, 2, 3: median (range)" in lines
    assert "| trl_generate | 2.50 (2.50–2.50) | 10.0 (2; 2–2) | 20.0 (2; 2–2), 2 never | 0.700 (0.500–0.800) |" in lines
    assert "| ours_sync | 2.50 (2.50–2.50) | 3.0 (2; 2–4) | 4.0 (3; 2–4), 1 never | 0.850 (0.600–0.900) |" in lines
    assert lines[-4:] == [
        "ours/TRL time-to-accuracy ours_sync/trl_vllm: 0.5=0.250 0.8=0.300",
        "ours/TRL time-to-accuracy ours_sync/trl_generate: 0.5=0.300 0.8=0.100",
        "ours/TRL time-to-accuracy ours_async_bypass_ppo_clip/trl_vllm: 0.5=0.417 0.8=0.450",
        "ours/TRL time-to-accuracy ours_async_bypass_ppo_clip/trl_generate: 0.5=0.500 0.8=0.100",
    ]
    assert not lines[-5]  # a blank line before the machine-readable block


def save(tmp_path, runs, **saved_args):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"args": {"steps": 2, "eval_every": 2, **saved_args}, "runs": runs}))
    return str(path)


def test_from_results_reports_again_at_other_targets(tmp_path, capsys):
    runs = {"1": {"ours_sync": result([(2, 3.0, 0.6)], **SYNC), "trl_vllm": result([(2, 12.0, 0.55)])}}
    bench_trl.main(["--from-results", save(tmp_path, runs), "--targets", "0.55"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("miniature GSM8K, 2 rollout steps")
    assert out[-1] == "ours/TRL time-to-accuracy ours_sync/trl_vllm: 0.55=0.250"


def test_from_results_reports_the_seeds_asked_for(tmp_path, capsys):
    runs = {
        "1": {"ours_sync": result([(2, 3.0, 0.6)], **SYNC), "trl_vllm": result([(2, 12.0, 0.55)])},
        "2": {"ours_sync": result([(2, 6.0, 0.6)], **SYNC), "trl_vllm": result([(2, 10.0, 0.55)])},
    }
    path = save(tmp_path, runs)
    bench_trl.main(["--from-results", path, "--seeds", "2"])
    out = capsys.readouterr().out
    assert (
        "seed 1:" not in out
        and out.splitlines()[-1] == "ours/TRL time-to-accuracy ours_sync/trl_vllm: 0.5=0.600 0.8=inf 0.9=inf"
    )
    with pytest.raises(SystemExit, match=r"--seeds \[3\] not in"):
        bench_trl.main(["--from-results", path, "--seeds", "2,3"])


@pytest.mark.parametrize(
    "saved_args, arm",
    [
        ({"max_staleness": 1, "preset": "bypass_pg_is"}, "ours_async_bypass_pg_is"),
        ({"max_staleness": 1}, "ours_async_bypass_ppo_clip"),  # before --preset: the default job's preset then
        ({"max_staleness": 0}, "ours_sync"),
    ],
)
def test_an_earlier_results_json_with_one_ours_arm_is_read_as_the_arm_it_was(tmp_path, capsys, saved_args, arm):
    runs = {"1": {"ours": result([(2, 3.0, 0.6)]), "trl_vllm": result([(2, 12.0, 0.55)])}}
    bench_trl.main(["--from-results", save(tmp_path, runs, **saved_args), "--targets", "0.5"])
    assert capsys.readouterr().out.splitlines()[-1] == f"ours/TRL time-to-accuracy {arm}/trl_vllm: 0.5=0.250"


def test_a_results_json_it_cannot_read_is_refused_in_one_line_naming_the_file(tmp_path):
    runs = {"1": {"ours": result([(2, 3.0, 0.6)]), "trl_vllm": result([(2, 12.0, 0.55)])}}
    path = save(tmp_path, runs)  # no max_staleness: which arm `ours` was is unknown
    with pytest.raises(SystemExit, match=rf"^bench_trl: {path} is in a layout this version cannot read[^\n]*$"):
        bench_trl.main(["--from-results", path])


@pytest.mark.parametrize(
    "argv, bad",
    [
        (["--variants", "ours_sync,trl_fast"], "trl_fast"),
        (["--variants", "ours,trl_vllm"], "need an ours arm and a TRL variant"),
        (["--variants", "trl_vllm"], "need an ours arm and a TRL variant"),
        (["--variants", "ours_sync,ours_async"], "need an ours arm and a TRL variant"),
        (["--targets", "0.5,1.5"], "1.5"),
        (["--steps", "0"], "got 0"),
        (["--seeds", "1,x"], "integers"),
        (["--trl-threads", "0"], "--trl-threads must be >= 1, got 0"),
        (["--ours-threads", "0"], "--ours-threads must be >= 1, got 0"),
        (["--sync-preset", "tis"], "--sync-preset must name presets of rc_core.PRESET_NAMES, got ['tis']"),
        (
            ["--async-presets", "bypass_ppo_clip,tis"],
            "--async-presets must name presets of rc_core.PRESET_NAMES, got ['tis']",
        ),
    ],
)
def test_bad_arguments_are_refused_by_name_in_one_line(argv, bad, capsys):
    with pytest.raises(SystemExit):
        bench_trl.parse_args(argv)
    err = capsys.readouterr().err.splitlines()
    assert "error:" in err[-1] and bad in err[-1]  # argparse's usage, then the one line that names it


def test_defaults_five_seeds_three_targets_a_synchronous_arm_and_one_asynchronous_arm_per_lab_holder():
    a = bench_trl.parse_args([])
    assert (a.steps, a.seeds, a.targets) == (50, [1, 2, 3, 4, 5], [0.5, 0.8, 0.9])
    assert a.variants == ["ours_sync", "ours_async", "trl_vllm", "trl_generate"]
    # lab/staleness/summary.md at k = 2 (its smallest k > 0): naive below, these four not below their own k = 0
    holders = ["bypass_ppo_clip", "decoupled_token_is", "decoupled_seq_mis", "bypass_pg_is"]
    assert a.async_presets == holders
    assert bench_trl.ours_arms(a) == {
        "ours_sync": {"max_staleness": 0, "preset": "decoupled_seq_mis"},
        **{f"ours_async_{p}": {"max_staleness": 1, "preset": p} for p in holders},
    }
    assert a.ours_threads is None and a.trl_threads == 2  # ours: the trainer's own thread choice in every arm
    assert bench_trl.parse_args(["--from-results", "r.json"]).seeds is None  # every seed of the results
    assert bench_trl.parse_args(["--quick"]).steps == 20
    only_sync = bench_trl.parse_args(["--variants", "ours_sync,trl_vllm", "--async-presets", "bypass_pg_is"])
    assert list(bench_trl.ours_arms(only_sync)) == ["ours_sync"]


def test_ours_and_trl_get_the_same_prompts_and_samples_per_rollout_step():
    import rc_train

    a = bench_trl.parse_args(["--steps", "3", "--variants", "ours_sync,ours_async,trl_vllm"])
    for name, arm in bench_trl.ours_arms(a).items():
        cmd = bench_trl.ours_command(a, name, arm, seed=5, out="out")
        ours = tyro.cli(rc_train.Args, args=cmd[2:])  # what rc_train.py makes of the command line
        assert (ours.max_staleness, ours.rc.preset, ours.run_name, ours.seed) == (*arm.values(), name, 5)
        assert (ours.num_prompts_per_step, ours.num_samples_per_prompt) == (32, 16)
        shape = {k: getattr(ours, f.lstrip("-").replace("-", "_")) for k, f in bench_trl.OURS_FLAGS.items()}
        assert shape == bench_trl.SHAPE
    assert set(bench_trl.OURS_FLAGS) == set(bench_trl.SHAPE)
    trl = bench_trl.trl_config({**bench_trl.SHAPE, "steps": 3, "seed": 5}, "out", use_vllm=True)
    assert trl["generation_batch_size"] // trl["num_generations"] == bench_trl.SHAPE["prompts_per_step"]
    assert trl["num_generations"] == bench_trl.SHAPE["samples_per_prompt"] and not trl["shuffle_dataset"]


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


def _race_without_running(monkeypatch, ran):
    """bench_trl.main with every expensive part replaced: TRL's environment, the base model, the runs."""
    monkeypatch.setattr(bench_trl, "trl_python", lambda env: "python")
    monkeypatch.setattr(bench_trl, "warn_if_busy", lambda: None)
    monkeypatch.setattr(bench_trl, "write_spec", lambda args, seed, out: "spec.json")

    def run_ours(args, name, arm, seed, out):
        ran.append((seed, name))
        return result([(2, 3.0 * seed, 0.6)], **arm)

    def run_trl(args, name, spec_path, python, out):
        ran.append((seed_of(out), name))
        return result([(2, 12.0, 0.55)])

    def seed_of(out):
        return int(out.rsplit("seed", 1)[1])

    monkeypatch.setattr(bench_trl, "run_ours", run_ours)
    monkeypatch.setattr(bench_trl, "run_trl", run_trl)


def test_a_race_split_over_two_invocations_adds_its_seeds_to_one_results_json(tmp_path, monkeypatch, capsys):
    """`--seeds 1,2` then `--seeds 2,3` into the same --out: seed 2 is not raced again, and the report and
    results.json hold seeds 1, 2 and 3."""
    ran = []
    _race_without_running(monkeypatch, ran)
    race = ["--out", str(tmp_path), "--steps", "2", "--variants", "ours_sync,trl_vllm", "--targets", "0.5"]
    bench_trl.main([*race, "--seeds", "1,2"])
    assert ran == [(1, "ours_sync"), (1, "trl_vllm"), (2, "ours_sync"), (2, "trl_vllm")]
    bench_trl.main([*race, "--seeds", "2,3"])
    assert ran[4:] == [(3, "ours_sync"), (3, "trl_vllm")]
    out = capsys.readouterr().out
    assert "[bench_trl] seed 2: already in" in out
    assert out.splitlines()[-1] == "ours/TRL time-to-accuracy ours_sync/trl_vllm: 0.5=0.500"  # median of 3, 6, 9 / 12
    saved = json.loads((tmp_path / "results.json").read_text())
    assert sorted(saved["runs"]) == ["1", "2", "3"]


def test_a_results_json_of_another_race_is_refused_before_anything_runs(tmp_path, monkeypatch):
    ran = []
    _race_without_running(monkeypatch, ran)
    race = ["--out", str(tmp_path), "--variants", "ours_sync,trl_vllm", "--seeds", "1"]
    bench_trl.main([*race, "--steps", "2"])
    before = (tmp_path / "results.json").read_text()
    with pytest.raises(SystemExit, match=r"^bench_trl: \S+results.json holds a race with other steps; [^\n]*$"):
        bench_trl.main([*race, "--steps", "4", "--seeds", "2"])
    with pytest.raises(SystemExit, match=r"holds a race with other variants, the ours arms;"):
        bench_trl.main(["--out", str(tmp_path), "--steps", "2", "--variants", "ours_async,trl_vllm", "--seeds", "2"])
    assert ran == [(1, "ours_sync"), (1, "trl_vllm")] and (tmp_path / "results.json").read_text() == before


def test_the_committed_record_holds_no_path_of_this_clone():
    """results.json is written with paths relative to the repository root: a user's clone lives at another path."""
    record = {
        "args": {"out": f"{bench_trl.ROOT}/runs/bench_trl", "seeds": [1]},
        "runs": {"1": [f"x {bench_trl.ROOT}/a"]},
    }
    assert bench_trl.in_repository(record) == {"args": {"out": "runs/bench_trl", "seeds": [1]}, "runs": {"1": ["x a"]}}
    committed = open(f"{bench_trl.ROOT}/benchmarks/trl_race/results.json").read()
    assert bench_trl.ROOT not in committed and json.loads(committed)["runs"]
