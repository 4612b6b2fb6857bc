"""benchmarks/bench_build.py without running it (it takes minutes): the arms' environments and the report."""

import pytest

from benchmarks import bench_build


def test_each_arm_gets_its_wait_policy_and_no_thread_setting(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert bench_build.worker_env("passive_adaptive")["OMP_WAIT_POLICY"] == "PASSIVE"
    for arm in ("before", "after", "one_thread"):  # libgomp's default: spinning, as rc_train.py runs
        assert "OMP_WAIT_POLICY" not in bench_build.worker_env(arm)
    assert not any("OMP_NUM_THREADS" in bench_build.worker_env(arm) for arm in bench_build.ARMS)


def test_the_report_puts_the_arms_side_by_side():
    args = bench_build.parse_args(["--steps", "4", "--rounds", "2"])
    times = {"before": [0.4, 0.5], "after": [0.5, 0.5], "one_thread": [0.8, 0.8]}
    busy = {"before": [6.0, 5.0], "after": [1.0, 1.0], "one_thread": [1.0, 1.2]}
    results = {
        "idle": {arm: {"times": t, "threads": [2]} for arm, t in times.items()},
        "beside 2 busy": {arm: {"times": t, "threads": [1, 2]} for arm, t in busy.items()},
    }
    lines = bench_build.report(args, results)
    assert "0.45 [0.45] (2)" in lines[2] and "5.50 [5.50] (1,2)" in lines[2] and "12.22x" in lines[2]
    assert lines[-2] == "after/one_thread step time: idle 0.62, beside 2 busy 0.91"
    assert lines[-1] == "after/before step time: idle 1.11, beside 2 busy 0.18"
    with pytest.raises(SystemExit):
        bench_build.parse_args(["--arms", "spin"])
    with pytest.raises(SystemExit):
        bench_build.parse_args(["--steps", "3", "--rounds", "2"])
