#!/usr/bin/env bash
# The GPU check of the trainer's update, one command: benchmarks/bench_gpu_step.py on one GPU at the configs' own
# micro-batches (Qwen2.5-0.5B at the mean GSM8K shape with --breakdown, 1.5B at the worst case: 400-token prompts,
# 512-token responses), then the same two shapes with torch.compile'd decoder layers (0.5B with --breakdown: its
# micro-batches with and without the shared-prompt pass side by side), then one table of the runs. At most 550 s
# (each run is bounded by `timeout`, so a slow or failing run leaves the others).
#
#   bash benchmarks/gpu_check.sh          # from any folder; writes to $OUT if set, else runs/gpu_check
#   GPU_CHECK_EXTRA="--tiny --prompt-len 16 --response-len 12" bash benchmarks/gpu_check.sh   # a CPU dry run, seconds
#
# Written there (8 files at most, none more than one folder down): gpu_check.log (everything printed),
# results.jsonl (each run's JSON line, with "check": its name); a run given --profile (the default of run() when
# BREAKDOWN is unset) adds its profiler table to profiles.txt and a Chrome trace, trace_<run>.json.gz
# (https://ui.perfetto.dev).
#
# tyro (imported by rc_infra) may be missing on a GPU machine that has torch, transformers and accelerate: the script
# then installs it from wheels in .whl/ (git-ignored), downloaded beforehand where an index is reachable:
#   python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1
# .whl/ is ignored by git, so a tool that copies the working tree must be told to take it along: with this
# workplace's device tool, run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=600).
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
out=${OUT:-runs/gpu_check}
mkdir -p "$out" || exit 2
log="$out/gpu_check.log"
results="$out/results.jsonl"
: >"$log"
: >"$results"
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

if ! "$python" -c "import tyro" 2>/dev/null; then
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "gpu_check: tyro is not installed and .whl/ holds no wheels: see the header of $0" | tee -a "$log" >&2
        exit 2
    fi
    site=$(mktemp -d /tmp/gpu_check_site.XXXXXX)
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
        2>&1 | tee -a "$log" || exit 2
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$python" -c "import torch, transformers, accelerate, tyro; print('python', __import__('sys').version.split()[0], \
'torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, \
'tyro', tyro.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee -a "$log"

run() { # run NAME SECONDS ARGS...: one bench_gpu_step run; its last line (the JSON) goes to results.jsonl
    local name=$1 limit=$2
    shift 2
    local stdout status
    stdout=$(mktemp /tmp/gpu_check_stdout.XXXXXX)
    local extra=${BREAKDOWN---breakdown --profile $out}  # BREAKDOWN="" for a run without them
    echo "=== $name: python -m benchmarks.bench_gpu_step $extra $*" | tee -a "$log"
    # shellcheck disable=SC2086  # GPU_CHECK_EXTRA, extra: words
    timeout -k 10 "$limit" "$python" -m benchmarks.bench_gpu_step $extra "$@" ${GPU_CHECK_EXTRA:-} \
        2> >(tee -a "$log" >&2) | tee -a "$log" "$stdout" | grep -v '^{'  # the JSON line: in the log and results
    status=${PIPESTATUS[0]}
    if [ "$status" -eq 0 ] && tail -n 1 "$stdout" | grep -q '^{'; then
        tail -n 1 "$stdout" | sed "s/^{/{\"check\": \"$name\", /" >>"$results"
    else
        echo "=== $name: failed (exit $status; 124 = over its $limit s)" | tee -a "$log"
    fi
    rm -f "$stdout"
}

# The configs' micro-batches (sized by tokens), eager (--compile off), then the same shapes as the configs run them,
# with the trainer's --compile (bench_gpu_step --compile layers: every decoder layer compiled, fused kernels against
# the host-bound eager update). All four with the shared-prompt pass, as the configs run; the compiled 0.5B run's
# --breakdown times its micro-batches without it too (its "without the shared-prompt pass" row: the compiled update
# with and without the shared prompt, side by side).
BREAKDOWN="--breakdown" run 0.5b_mean 120 --config configs/gsm8k_qwen0.5b_bypass.yaml --repeats 2 --compile off
BREAKDOWN="" run 1.5b_worst 100 --config configs/gsm8k_qwen1.5b_bypass.yaml --prompt-len 400 --response-len 512 \
    --repeats 1 --compile off
# The compiled runs use the allocator's expandable segments (unless PYTORCH_CUDA_ALLOC_CONF says otherwise): their
# varying shapes otherwise leave the cache at twice the memory in use (108 GiB reserved for 44 GiB allocated,
# reported by the 2026-11-28 session without a committed record).
alloc=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
PYTORCH_CUDA_ALLOC_CONF=$alloc BREAKDOWN="--breakdown" run 0.5b_mean_compiled 180 \
    --config configs/gsm8k_qwen0.5b_bypass.yaml --repeats 2 --compile layers
PYTORCH_CUDA_ALLOC_CONF=$alloc BREAKDOWN="" run 1.5b_worst_compiled 150 --config configs/gsm8k_qwen1.5b_bypass.yaml \
    --prompt-len 400 --response-len 512 --repeats 1 --compile layers

if ls "$out"/profile_*.txt >/dev/null 2>&1; then
    cat "$out"/profile_*.txt >"$out/profiles.txt" && rm -f "$out"/profile_*.txt
fi
echo "=== summary (per micro-batch unless said; the runs' JSON lines: $results)" | tee -a "$log"
"$python" -c "import sys, benchmarks.bench_gpu_step as b; sys.exit(b.summarize(sys.argv[1]))" "$results" 2>&1 |
    tee -a "$log"
