"""benchmarks/sleep_level_check.py, the GPU check that level-2 rollouts equal level-1 rollouts token for token: it
refuses cleanly without CUDA, and its --cpu-dry-run runs the same engine calls on vLLM's CPU build (no sleep there), so
the script a GPU session runs is known to work up to the sleep itself."""

import json
import os
import subprocess
import sys

import torch

from benchmarks import sleep_level_check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_without_cuda_the_check_refuses_in_one_line(capsys):
    if torch.cuda.is_available():
        return
    assert sleep_level_check.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sleep_level_check: needs a CUDA GPU"), err


def test_the_cpu_dry_run_runs_the_engine_calls_and_prints_one_json_line(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.sleep_level_check", "--cpu-dry-run", "--cycles", "2", "--prompts", "2"]
    cmd += ["--work-dir", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["check"] == "sleep_levels" and result["pass"] and len(result["cycles"]) == 2
    for cycle in result["cycles"]:
        assert cycle["tokens_equal_level1_level2"] and cycle["tokens_equal_awake_level1"] and cycle["tokens"] > 0
        assert cycle["max_abs_logprob_diff_level1_level2"] == 0.0
    assert result["negative_control_differs"] is None  # no sleep on a CPU: nothing was discarded
    assert os.path.exists(tmp_path / "engine.log") and os.path.exists(tmp_path / "model" / "tokenizer.json")
