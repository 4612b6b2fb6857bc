"""The example configs the docs point to (docs/running.md "Choosing a correction step by step"): loaded through
rc_config like `--config FILE`, their correction built by rc_config.build_correction_config and checked by rc_core,
and the multi-RS example run for two steps on the one-token fixture.

(tests/test_cli.py::test_shipped_configs_pass validates every file of configs/ through rc_config.validate_args.)
"""

import os
import sys
import warnings

import pytest

import rc_config
import rc_core
import rc_train
from tests.test_train import ROOT, run_train

MULTI_RS = os.path.join(ROOT, "configs", "cpu_multi_rs.yaml")
# The one-token fixture's shape (configs/cpu_add.yaml), small: the multi-RS correction of MULTI_RS on 'a+b='.
FIXTURE = [
    "--task",
    "add",
    "--max-response-length",
    "1",
    "--max-model-len",
    "64",
    "--num-prompts-per-step",
    "8",
    "--num-samples-per-prompt",
    "8",
    "--micro-batch-size",
    "64",
    "--max-staleness",
    "0",
    "--eval-limit",
    "10",
    "--no-save-final",
]


def correction(monkeypatch, *argv):
    """The correction config rc_train.py would build from this command line (rc_config.parse_cli, then
    build_correction_config), and the Args."""
    monkeypatch.setattr(sys, "argv", ["rc_train.py", *argv])
    args = rc_config.parse_cli(rc_train.Args, rc_train.load_yaml_defaults)
    return rc_config.build_correction_config(args.rc), args


def test_multi_rs_config_chains_two_rejection_options(monkeypatch):
    config, args = correction(monkeypatch, "--config", MULTI_RS)
    rc_config.validate_args(args, world_size=1)
    assert isinstance(config, rc_core.RolloutCorrectionConfig)
    assert [o.name for o in config.rs_specs] == ["token_k1", "seq_max_k2"]
    token_k1, seq_max_k2 = config.rs_specs
    assert (token_k1.lower, token_k1.upper) == (0.6, 1.6)  # 0.6 <= rho <= 1.6 per token (docs/corrections.md §4.1)
    assert (seq_max_k2.lower, seq_max_k2.upper) == (None, 2.5)  # max_t (1/2)(log rho_t)^2 <= 2.5 per response
    assert (config.rollout_is, config.is_spec.upper, config.bypass_mode) == ("token", 2.0, False)
    # The guide's own form, bypass PPO-clip (IS metrics only, rc_core says so), is one flag away.
    with pytest.warns(UserWarning, match="metrics"):
        bypass, _ = correction(monkeypatch, "--config", MULTI_RS, "--rc.bypass-mode", "True")
    assert bypass.bypass_mode and bypass.rs_specs == config.rs_specs


def test_multi_rs_config_runs_two_steps_on_the_one_token_fixture(tmp_path):
    """The chained options act in the trainer: both per-option rejection metrics are logged every step, and with the
    sampler-fault dial on (a planted token is reported with mu = 1, so rho = pi_old(token) is tiny) both options
    reject: the token band the planted token, the chi-square guard its whole response."""
    flags = ("--num-steps", "2", "--rollout-corrupt-prob", "0.1")
    rows, proc = run_train(tmp_path, "--config", MULTI_RS, *FIXTURE, *flags)
    assert len(rows) == 2, proc.stdout[-2000:]
    for r in rows:
        for option in ("token_k1", "seq_max_k2"):
            assert f"rollout_corr/rollout_rs_{option}_masked_fraction" in r
        assert r["rollout_corr/rollout_rs_masked_fraction"] >= r["rollout_corr/rollout_rs_token_k1_masked_fraction"]
        assert "rollout_corr/rollout_is_mean" in r  # Token-TIS on
    assert max(r["rollout_corr/rollout_rs_token_k1_masked_fraction"] for r in rows) > 0
    assert max(r["rollout_corr/rollout_rs_seq_max_k2_seq_masked_fraction"] for r in rows) > 0


def test_a_preset_without_overrides_reaches_the_trainer_as_built(monkeypatch):
    """`--rc.preset ppo_is_bypass` (docs/running.md step 1) builds without the metrics-only-IS warning, as
    RolloutCorrectionConfig.ppo_is_bypass() does (docs/design-readings.md §9); an override rebuilds and may warn."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        config, _ = correction(monkeypatch, "--rc.preset", "ppo_is_bypass")
    assert config == rc_core.RolloutCorrectionConfig.ppo_is_bypass()
    with pytest.warns(UserWarning, match="metrics"):
        correction(monkeypatch, "--rc.preset", "ppo_is_bypass", "--rc.rollout-is-threshold", "3")
