"""benchmarks/bench_async.py's own logic (the benchmark itself runs the default job nine times: minutes, not a test)."""

import argparse
import json

import pytest

from benchmarks import bench_async


def run(arm, seed, wall, acc, loop=None):
    return {
        "arm": arm,
        "seed": seed,
        "wall_s": wall,
        "loop_s": loop or wall - 20,
        "step_median_s": 1.0,
        "rollout_wait_s": 5.0,
        "engine_idle_s": 9.0,
        "accuracy": acc,
        "max_staleness": 1 if arm == "async" else 0,
    }


RESULTS = [
    run("sync", 1, 300, 0.90),
    run("async", 1, 150, 0.88),
    run("sync", 2, 320, 0.92),
    run("async", 2, 200, 0.90),
    run("sync", 3, 310, 0.91),
    run("async", 3, 186, 0.92),
]


def test_report_gives_each_seed_its_ratio_and_ends_with_the_median():
    lines = bench_async.report(argparse.Namespace(seeds=[1, 2, 3], arms=["sync", "async"]), RESULTS)
    assert lines[-1] == "async/sync wall time: 0.600 (target: <= 0.6)"  # median of 0.500, 0.625, 0.600
    assert "async/sync wall time per seed: 0.500, 0.625, 0.600 (median 0.600)" in lines[-3]
    assert lines[-2] == "async - sync mean final strict accuracy: 0.900 - 0.910 = -0.010 (target: within 0.03)"
    rows = [line.split() for line in lines if line.split()[1:2] in (["1"], ["2"], ["3"])]
    assert [(r[0], r[1], r[-1]) for r in rows] == [(r["arm"], str(r["seed"]), f"{r['accuracy']:.3f}") for r in RESULTS]


def test_report_again_from_a_results_file(tmp_path, capsys):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(RESULTS))
    bench_async.main(["--from-results", str(path)])
    assert capsys.readouterr().out.rstrip().endswith("async/sync wall time: 0.600 (target: <= 0.6)")


@pytest.mark.parametrize(
    "argv, bad",
    [
        (["--arms", "sync,turbo"], "turbo"),
        (["--arms", "async"], "include sync"),
        (["--steps", "0"], "got 0"),
        (["--preset", "tis"], "got 'tis'"),
    ],
)
def test_bad_arguments_are_refused_by_name(argv, bad, capsys):
    with pytest.raises(SystemExit):
        bench_async.parse_args(argv)
    assert bad in capsys.readouterr().err
