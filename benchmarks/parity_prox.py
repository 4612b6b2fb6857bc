"""--prox-logp against AReaL (issue 50 item 2; not a test): rc_core's log-linear proximal approximation and its error
metrics (docs/corrections.md §7.10) against AReaL's own functions on the same random inputs. Prints the largest
difference per quantity; docs/results.md "The proximal approximation against AReaL" records the table.

AReaL 1.0.4 lives in its own virtual environment under .bench/ (benchmarks/parity_objectives.py builds it: the wheel
with --no-deps beside this interpreter's torch). Importing areal.trainer.ppo.actor would need AReaL's whole dependency
set, so the comparison loads the two functions it needs from the installed file itself: the module's source is parsed
and only `compute_prox_logp_approximations`, `_compute_approximation_errors`, `_compute_importance_weight` and the
`_EPSILON` constant are executed, with areal/utils/constants.py (standard library only) loaded as a module. The code
that runs is AReaL's, unchanged.

AReaL's call: compute_prox_logp_approximations(old_logp=log mu, logprobs=log pi_theta, versions=v_mu per token,
current_version=V, method="loglinear") with v_prox = V - 1, v_theta = V (its own bookkeeping); ours:
loglinear_proximal_log_prob(log mu, log pi_theta, loglinear_alpha(v_mu, V - 1, V)).

Usage:  python -m benchmarks.parity_prox            (the environment is created on first use)
        python -m benchmarks.parity_prox --worker   (inside AReaL's environment: what the above runs)
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
SEEDS, B, T = 20, 16, 24
WANTED = ("compute_prox_logp_approximations", "_compute_approximation_errors", "_compute_importance_weight")


def areal_functions() -> dict:
    """AReaL's approximation and error functions, executed from the installed areal/trainer/ppo/actor.py."""
    import torch

    root = importlib.util.find_spec("areal").submodule_search_locations[0]  # finds, does not import, the package
    spec = importlib.util.spec_from_file_location("areal_constants", os.path.join(root, "utils", "constants.py"))
    constants = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(constants)
    path = os.path.join(root, "trainer", "ppo", "actor.py")
    tree = ast.parse(open(path).read(), path)
    keep = [
        node
        for node in tree.body
        if (isinstance(node, ast.FunctionDef) and node.name in WANTED)
        or (isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_EPSILON" for t in node.targets))
    ]
    found = {n.name for n in keep if isinstance(n, ast.FunctionDef)}
    if found != set(WANTED) or len(keep) != len(WANTED) + 1:
        raise SystemExit(f"{path}: expected {WANTED} and _EPSILON, found {sorted(found)}: AReaL's layout changed")
    namespace = {"torch": torch, **{k: getattr(constants, k) for k in dir(constants) if k.startswith("PROX_")}}
    exec(compile(ast.Module(keep, []), path, "exec"), namespace)
    return namespace


def draw(seed: int, per_row: bool):
    """log mu, log pi_theta, the mask and versions (per token, or one per row as this trainer has them), V."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    mu = torch.log(torch.rand(B, T, generator=g, dtype=torch.float64) * 0.98 + 0.01)
    theta = (mu + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    V = int(torch.randint(1, 10, (1,), generator=g))
    versions = torch.randint(0, V + 1, (B, 1) if per_row else (B, T), generator=g).expand(B, T)
    return mu, theta, mask, versions, V


def worker() -> dict:
    sys.path.insert(0, ROOT)  # rc_core from this repository
    import torch

    import rc_core

    torch.set_num_threads(1)
    areal = areal_functions()
    worst: dict[str, float] = {}
    for seed in range(SEEDS):
        for per_row in (False, True):
            mu, theta, mask, versions, V = draw(seed, per_row)
            theirs = areal["compute_prox_logp_approximations"](
                old_logp=mu, logprobs=theta, versions=versions, current_version=V, method="loglinear"
            )["loglinear"]
            ours = rc_core.loglinear_proximal_log_prob(mu, theta, rc_core.loglinear_alpha(versions, V - 1, V))
            diffs = {"log pi_prox": float(((ours - theirs).abs() * mask).max())}
            recomputed = theta + 0.05 * torch.randn(B, T, generator=torch.Generator().manual_seed(seed), dtype=mu.dtype)
            errors = {
                k.removeprefix("actor/prox_loglinear_"): v
                for k, v in rc_core.proximal_approximation_errors(ours, recomputed, mu, theta, mask).items()
            }
            their_errors = areal["_compute_approximation_errors"](recomputed, theirs)
            weight = areal["_compute_importance_weight"]
            their_errors["behave_imp_weight_abs_error"] = areal["_compute_approximation_errors"](
                weight(recomputed, mu), weight(theirs, mu)
            )["abs_error"]
            their_errors["importance_weight_abs_error"] = areal["_compute_approximation_errors"](
                weight(theta, recomputed), weight(theta, theirs)
            )["abs_error"]
            for name, value in errors.items():
                theirs_mean = float((their_errors[name].double() * mask).sum() / mask.sum())
                diffs[name] = abs(float(value) - theirs_mean) / max(abs(theirs_mean), 1e-300)
            for k, v in diffs.items():
                worst[k] = max(worst.get(k, 0.0), v)
    from importlib.metadata import version

    return {"worst": worst, "torch": torch.__version__, "areal": version("areal")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        with open(args.out, "w") as f:
            json.dump(worker(), f)
        return 0
    from benchmarks.parity_objectives import AREAL_PIN, BENCH, peer_python

    python, out = peer_python("areal"), os.path.join(BENCH, "parity-areal.json")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    subprocess.run([python, "-m", "benchmarks.parity_prox", "--worker", "--out", out], check=True, cwd=ROOT, env=env)
    result = json.load(open(out))
    assert AREAL_PIN == f"areal=={result['areal']}", result["areal"]
    print(f"{AREAL_PIN}, torch {result['torch']}; float64, {SEEDS} seeds x (per-token, per-row versions), {B} x {T}")
    print("| quantity | largest difference |\n|---|---|")
    for name, value in result["worst"].items():
        kind = "abs" if name == "log pi_prox" else "rel"
        print(f"| {name} | {value:.1e} ({kind}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
