"""bench_trl.py's own logic (the race itself installs TRL and runs for minutes: it is a benchmark, not a test)."""
import argparse

import pytest

import bench_trl


def result(evals, train_s=10.0, wall_s=15.0):
    return {"evals": [{"step": s, "train_s": t, "accuracy": a} for s, t, a in evals], "train_s": train_s,
            "wall_s": wall_s}


def args(**kw):
    return argparse.Namespace(**{"steps": 4, "target": 0.5, "seed": 1, **kw})


def test_time_to_target_is_the_first_eval_at_or_above_it():
    evals = result([(0, 0.0, 0.0), (2, 4.0, 0.49), (4, 8.5, 0.5), (6, 12.0, 0.9)])["evals"]
    assert bench_trl.time_to(evals, 0.5) == 8.5
    assert bench_trl.time_to(evals, 0.95) is None


def test_last_line_is_the_ratio_against_the_faster_trl_variant():
    results = {"ours": result([(2, 3.0, 0.6)]), "trl_vllm": result([(2, 12.0, 0.55)]),
               "trl_generate": result([(2, 10.0, 0.51)])}
    lines = bench_trl.report(args(), results)
    assert lines[-1] == "ours/TRL time-to-accuracy: 0.300"
    assert any(line.startswith("| trl_generate | 2.50 | 10.0 | 2 | 0.510 |") for line in lines)


@pytest.mark.parametrize("ours, trl, expected", [
    ([(2, 3.0, 0.1)], [(2, 10.0, 0.6)], "inf"),   # ours never reached the target
    ([(2, 3.0, 0.6)], [(2, 10.0, 0.4)], "0"),     # no TRL variant did
])
def test_never_reaching_the_target(ours, trl, expected):
    lines = bench_trl.report(args(), {"ours": result(ours), "trl_generate": result(trl)})
    assert lines[-1] == f"ours/TRL time-to-accuracy: {expected}"


@pytest.mark.parametrize("argv, bad", [
    (["--variants", "ours,trl_fast"], "trl_fast"), (["--target", "1.5"], "1.5"), (["--steps", "0"], "got 0"),
])
def test_bad_arguments_are_refused_by_name(argv, bad, capsys):
    with pytest.raises(SystemExit):
        bench_trl.parse_args(argv)
    assert bad in capsys.readouterr().err


def test_quick_means_twenty_steps():
    assert bench_trl.parse_args(["--quick"]).steps == 20 and bench_trl.parse_args([]).steps == 50
