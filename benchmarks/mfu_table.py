"""MFU of the committed GPU runs, the old accounting beside the field's: one row a run of benchmarks/gpu_runs/*.jsonl
(benchmarks/bench_gpu_step.py's JSON lines, as benchmarks/gpu_check.sh writes them). Prints the markdown tables of
docs/gpus.md, "MFU as the field counts it"; tests/test_bench_gpu_step.py checks that the page holds them verbatim.

    python -m benchmarks.mfu_table                  # every file of benchmarks/gpu_runs/
    python -m benchmarks.mfu_table RUNS.jsonl ...   # other records

The accountings, per update, over the seconds per update (the median of the run's timed updates):

  * old: bench_gpu_step's `mfu` as recorded: 6 x all parameters (embeddings included) x the tokens the run computed
    (with the shared-prompt pass each group's prompt once per micro-batch it has rows in, without it every sample's
    prompt copy: the 2026-11-28 --compile runs, which turned the pass off),
    against the bf16 8192^3 matmul measured in the run;
  * 6 N + lm_head, tokens computed: non-embedding 6N on the same tokens plus the lm_head's 6 x d x V on the logit
    positions (one per response token), no attention, against the card's dense bf16 peak: the issue's recomputation;
  * conventional: bench_gpu_step.conventional_flops, as PaLM (appendix B), nanoGPT's estimate_mfu and Megatron count
    it: non-embedding 6N on the tokens the algorithm needs (a shared prompt once per group, whether or not the run
    computed it once), the lm_head on the logit positions, and causal attention (12 x L x d per (query, key) pair),
    against the card's dense bf16 peak (bench_gpu_step.CARD_PEAKS), and the same FLOPs of the measured matmul peak.

A record written before bench_gpu_step recorded the counts (all of 2026-11-28's) lacks what the field's accounting
needs. They are derived by rebuilding the run's synthetic batch on the CPU (bench_gpu_step.make_rollout, seconds)
from the record's model (its parameter count names a MODEL_SHAPES entry), mean prompt and response lengths and
processes, the config benchmarks/gpu_check.sh passes for that size (configs/gsm8k_qwen<size>_bypass.yaml) and the
default seed 0; the rebuilt batch must match the record (sequences, padded length, batch padding, and the tokens the
run computed, counted micro-batch by micro-batch through rc_forward, equal to tokens_per_second x
seconds_per_update), or the row is refused.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import types
from collections import Counter

import rc_forward
import rc_run
from benchmarks import bench_gpu_step as bench

RUNS = os.path.join(bench.ROOT, "benchmarks", "gpu_runs")


def load(paths: list[str]) -> list[tuple[str, dict]]:
    """(the file's name without .jsonl, the record) of every line of `paths`."""
    out = []
    for path in paths:
        with open(path) as f:
            name = os.path.basename(path).removesuffix(".jsonl")
            out += [(name, json.loads(line)) for line in f if line.strip()]
    return out


def total_params(shape: dict) -> int:
    """All the parameters of a Qwen2 shape: the non-embedding ones, the embedding, and an untied lm_head."""
    embedding = shape["vocab_size"] * shape["hidden_size"]
    return bench.non_embedding_params(shape) + embedding * (1 if shape["tie_word_embeddings"] else 2)


def model_size(record: dict) -> str:
    """The MODEL_SHAPES key of the record: its own, else the one whose parameter count is the record's."""
    if record.get("model_size"):
        return record["model_size"]
    sizes = [k for k, shape in bench.MODEL_SHAPES.items() if total_params(shape) == record["params"]]
    if len(sizes) != 1:
        raise ValueError(f"{record['params']:,} parameters: no single Qwen2.5 shape of MODEL_SHAPES has them")
    return sizes[0]


def rebuilt(record: dict) -> dict:
    """The counts of a record without them, from its batch rebuilt on the CPU (the module's docstring) and checked
    against the record: the conventional counts (all ranks, one pass), the tokens the run computed per update, and
    the epochs."""
    size = model_size(record)
    argv = [
        *("--config", record.get("config") or f"configs/gsm8k_qwen{size}_bypass.yaml"),
        *("--model-size", size, "--seed", str(record.get("seed", 0))),
        *("--prompt-len", str(record["prompt_len"]), "--response-len", str(record["response_len"])),
        *("--compile", "layers" if record["compile"] else "off"),
    ]
    if not record["shared_prompt_pass"]:  # off by the flag, or (compiled runs before issue 51) by --compile
        argv.append("--no-share-prompt-prefix")
    if record["fsdp"]:
        argv.append("--fsdp")
    plan = bench.make_plan(bench.build_parser().parse_args(argv), world=record["processes"])
    share = rc_forward.shares_prefix(plan.train)
    if not plan.correction.bypass_mode:
        raise ValueError(f"preset {record['preset']}: a decoupled run's pi_old tokens are not in the record")
    counts, computed, host = Counter(), 0, rc_run.HostGroup(1)
    for rank in range(plan.world):
        batch = bench.make_rollout(plan, rank)
        counts.update(bench.conventional_counts(batch))
        shadow = types.SimpleNamespace(plan=plan, batch=batch, learner=types.SimpleNamespace(host=host))
        for _, micro in bench.update_schedule(shadow):
            computed += sum(rc_forward.micro_inputs(batch, rows, share, "cpu").size["tokens"] for rows in micro)
        if rank == 0:
            B, L = batch["input_ids"].shape
            padding = 1 - float(batch["attention_mask"].float().mean())
    recorded = record["tokens_per_second"] * record["seconds_per_update"]
    checks = {
        "sequences": (B * plan.world, record["sequences"]),
        "padded length": (L, record["padded_length"]),
        "shared-prompt pass": (share, record["shared_prompt_pass"]),
        "batch padding": (round(padding, 6), round(record["batch_padding_fraction"], 6)),
        "tokens computed": (computed, round(recorded)),
    }
    wrong = {k: v for k, v in checks.items() if v[0] != v[1]}
    if wrong or not math.isclose(computed, recorded, rel_tol=1e-9):
        raise ValueError(f"{record.get('check')}: the rebuilt batch is not the record's (rebuilt, recorded): {wrong}")
    epochs = plan.train.ppo_epochs  # bypass: no forward-only pass, no pi_old tokens
    return {
        "counts": dict(counts),
        "update_tokens": computed,
        "no_grad_tokens": 0,
        "epochs": epochs,
        "forward_passes": 0,
    }


def figures(record: dict) -> dict:
    """The row's accountings (the module's docstring), each an MFU or None where its peak is unknown."""
    if "conventional" in record:  # recorded by bench_gpu_step
        c = record["conventional"]
        known = {
            "counts": {k: c[k] for k in bench.COUNTS},
            "update_tokens": record["update_tokens"],
            "no_grad_tokens": record["no_grad_tokens"],
            "epochs": c["fwd_bwd_passes"],
            "forward_passes": c["forward_passes"],
        }
    else:
        known = rebuilt(record)
    shape = bench.MODEL_SHAPES[model_size(record)]
    seconds, world, params = record["seconds_per_update"], record["processes"], record["params"]
    counts, computed, no_grad = known["counts"], known["update_tokens"], known["no_grad_tokens"]
    card, card_tflops = record.get("card"), record.get("peak_tflops_card")
    if card_tflops is None:
        card, card_tflops = bench.card_peak(record["device"])
    conventional = bench.conventional_flops(shape, counts, known["epochs"], known["forward_passes"])["total"]
    non_embedding, lm_head = bench.non_embedding_params(shape), shape["hidden_size"] * shape["vocab_size"]
    lm_passes = 3 * known["epochs"] + known["forward_passes"]
    intermediate = 6 * non_embedding * computed + 2 * non_embedding * no_grad
    intermediate += 2 * lm_head * counts["logit_positions"] * lm_passes
    old = 6 * params * computed + 2 * params * no_grad

    def mfu(flops, peak, s=seconds):
        return None if peak is None else flops / s / (peak * 1e12 * world)

    low_high = record.get("seconds_per_update_range")
    return {
        "card": card,
        "card_tflops": card_tflops,
        "seconds": seconds,
        "seconds_range": low_high,
        "update_tokens": computed,
        "tokens_needed": counts["tokens"] * known["epochs"],
        "old": record["mfu"],
        "old_recomputed": mfu(old, record["peak_tflops"]),
        "old_flops": old,
        "intermediate": mfu(intermediate, card_tflops),
        "conventional": mfu(conventional, card_tflops),
        "conventional_range": None if not low_high else [mfu(conventional, card_tflops, s) for s in low_high[::-1]],
        "of_measured": mfu(conventional, record["peak_tflops"]),
        "measured_tflops": record["peak_tflops"],
    }


def pct(x) -> str:
    return "—" if x is None else f"{100 * x:.1f} %"


def run_name(file: str, record: dict, i: int) -> str:
    name = record.get("check", f"row {i}")
    return f"{file}: {name} ({'`--compile`' if record['compile'] else 'eager'})"


def tables(rows: list[tuple[str, dict]]) -> list[str]:
    """The markdown tables: every run's accountings, then each compiled run against its eager twin (the run of the same
    file whose check name is the compiled one's without "_compiled")."""
    rows = [(file, r, figures(r)) for file, r in rows]
    out = [
        "| run | card, dense bf16 TFLOP/s | s / update | tokens computed / needed | old: 6 × all params × tokens "
        "computed, of the measured matmul | 6 N<sub>non-emb</sub> + lm_head, tokens computed, of the card | "
        "**conventional**, of the card | conventional, of measured matmul peak |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, (file, r, f) in enumerate(rows):
        spread = "" if not f["seconds_range"] else " ({:.2f}–{:.2f})".format(*f["seconds_range"])
        peak = "—" if f["card_tflops"] is None else f"{f['card_tflops']:g}"
        conventional = f"**{pct(f['conventional'])}**"
        if f["conventional_range"] and f["conventional"] is not None:
            conventional += " ({:.1f}–{:.1f})".format(*(100 * x for x in f["conventional_range"]))
        out.append(
            f"| {run_name(file, r, i)} | {f['card'] or 'unknown'}, {peak} | "
            f"{f['seconds']:.2f}{spread} | {round(f['update_tokens']):,} / {round(f['tokens_needed']):,} | "
            f"{pct(f['old'])} of {f['measured_tflops']:.0f} | {pct(f['intermediate'])} | {conventional} | "
            f"{pct(f['of_measured'])} |"
        )
    twins = [
        (file, r, f, e, g)
        for file, r, f in rows
        if r.get("check", "").endswith("_compiled")
        for e_file, e, g in rows
        if e_file == file and e.get("check") == r["check"].removesuffix("_compiled")
    ]
    if twins:
        out += [
            "",
            "| compiled run | tokens computed | its eager twin's | old accounting, as recorded | old accounting on the "
            "eager twin's tokens |",
            "|---|---|---|---|---|",
        ]
        for file, r, f, _, g in twins:
            on_eager = f["old_flops"] * g["update_tokens"] / f["update_tokens"]
            on_eager /= f["seconds"] * f["measured_tflops"] * 1e12 * r["processes"]
            out.append(
                f"| {file}: {r['check']} | {f['update_tokens']:,} | {g['update_tokens']:,} | {pct(f['old'])} | "
                f"{pct(on_eager)} |"
            )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.mfu_table", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", help="JSON-lines records (default: benchmarks/gpu_runs/*.jsonl)")
    ns = p.parse_args(argv)
    files = ns.files or sorted(glob.glob(os.path.join(RUNS, "*.jsonl")))
    rows = load(files)
    if not rows:
        print(f"no records in {', '.join(files) or RUNS}", file=sys.stderr)
        return 1
    print("\n".join(tables(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
