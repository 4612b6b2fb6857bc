#!/usr/bin/env bash
# The whole loop on one GPU, one command: rc_train.py trains Qwen2.5-0.5B-Instruct on GSM8K
# (configs/gsm8k_qwen0.5b_bypass.yaml) for 10 steps, evaluating before the first step and after the last, then
# benchmarks/gpu_smoke.py prints one table: seconds per step by phase (median, step 0 left out), memory (allocated,
# reserved, the engine's share), the update's MFU (bench_gpu_step's accounting, against the card's dense bf16 peak)
# and the accuracy before -> after.
#
#   bash benchmarks/gpu_smoke.sh                                   # one GPU with vLLM; writes to $OUT or runs/gpu_smoke
#   bash benchmarks/gpu_smoke.sh --num-steps 40 --eval-every 10    # any rc_train.py flag passes through (and wins)
#   bash benchmarks/gpu_smoke.sh --tiny                            # CPU: the tiny local model on `add`, 2 steps, ~1 min
#
# Written there: smoke/ (the run folder: config.yaml, metrics.jsonl, eval_samples.jsonl, engine.log; replaced by the
# next smoke run), gpu_smoke.log (what the trainer printed) and summary.txt (the table). No checkpoint, no final
# weights. The table again later: python -m benchmarks.gpu_smoke $OUT/smoke (--device NAME on another machine).
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
python=${PYTHON:-python3}
out=${OUT:-runs/gpu_smoke}
name=smoke
tiny=0
flags=()
for arg in "$@"; do
    case $arg in
        --tiny) tiny=1 ;;
        --output-dir | --output-dir=* | --run-name | --run-name=*)
            echo "gpu_smoke: $arg: the run goes to \$OUT/$name (OUT=DIR bash $0 ...)" >&2
            exit 2
            ;;
        *) flags+=("$arg") ;;
    esac
done
if [ "$tiny" = 1 ]; then  # configs/cpu_add.yaml: a 0.3M-parameter Qwen2 built locally, one-token answers
    base=(--config configs/cpu_add.yaml --num-steps 2 --num-prompts-per-step 8 --num-samples-per-prompt 8
        --eval-limit 10)
else  # the config compiles the decoder layers: expandable segments keep the cache near the memory in use
    base=(--config configs/gsm8k_qwen0.5b_bypass.yaml --num-steps 10)
    export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
fi
mkdir -p "$out" || exit 2
export PYTHONUNBUFFERED=1
echo "=== gpu_smoke: $python rc_train.py ${base[*]} ${flags[*]-} (into $out/$name)"
"$python" rc_train.py "${base[@]}" --output-dir "$out" --run-name "$name" --overwrite --checkpoint-every 0 \
    --no-save-final ${flags[@]+"${flags[@]}"} 2>&1 | tee "$out/gpu_smoke.log"
status=${PIPESTATUS[0]}
if [ "$status" -ne 0 ]; then
    echo "=== gpu_smoke: rc_train.py failed (exit $status; its output: $out/gpu_smoke.log)" >&2
fi
if [ -s "$out/$name/metrics.jsonl" ]; then  # what a failed run logged is still summarised
    "$python" -m benchmarks.gpu_smoke "$out/$name" | tee "$out/summary.txt"
    summary=${PIPESTATUS[0]}
    [ "$status" -eq 0 ] && status=$summary
fi
exit "$status"
