#!/usr/bin/env bash
# On the GPU host (after ../shared/device's setup): build the ~1B random-weight Qwen3-Next and
# run the serving comparison (`vllm serve` per mode, `vllm bench serve` as client, vLLM's
# defaults: torch.compile, CUDA graphs, async scheduling) for $MODES into $RESULTS.
# BENCH_ARGS: more benchmark_serving.py options (e.g. --workloads prefix_repetition
# --num-prefixes 64); SERVE_EXTRA: more `vllm serve` options (e.g. --num-gpu-blocks-override 200).
# Modes already in $RESULTS are reused, so calls that each fit the device's limit can add one
# mode at a time. ARCH: the tiny_models architecture served (default qwen3_next_1b; with
# qwen3_next_1b_mtp, SERVE_EXTRA can add --speculative-config '{"method": "mtp", ...}').
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
RESULTS=${RESULTS:-/root/serving}
mkdir -p "$RESULTS"
ARCH=${ARCH:-qwen3_next_1b}
MODEL=/tmp/$ARCH
[ -f $MODEL/config.json ] || python3 -m vllm_lighter_mamba.bench.tiny_models --arch $ARCH \
  --out $MODEL --device cuda > "$RESULTS/build.log" 2>&1
python3 benchmarks/benchmark_serving.py --model $MODEL --modes "${MODES:-lighter,align,off}" \
  --repeats "${REPEATS:-2}" --results-dir "$RESULTS" --output-json "$RESULTS/serving.json" ${BENCH_ARGS:-} \
  --serve-args "--mamba-ssm-cache-dtype float32 --max-model-len 8192 --gpu-memory-utilization 0.5 \
    --additional-config '{\"gdn_prefill_backend\": \"triton\"}' ${SERVE_EXTRA:-}" > "$RESULTS/serving.log" 2>&1
echo "serving done rc=$?" >> "$RESULTS/serving.log"
