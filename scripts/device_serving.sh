#!/usr/bin/env bash
# On the GPU host (after the vLLM 0.34 setup of docs/device_vllm034.md): the serving comparison
# (`vllm serve` per mode, `vllm bench serve` as client, vLLM's defaults otherwise: torch.compile,
# CUDA graphs, async scheduling, the extensible KV cache) into $RESULTS.
#
# ARCH: the tiny_models architecture (default qwen3_next_80b_shape: Qwen3-Next-80B-A3B's
# dimensions with 64 experts, config only, served with --load-format dummy; qwen3_next_1b is
# built with random weights). MODES (default lighter,align,off), ROUNDS (default 2): servers in
# rounds, modes alternated. STOP_AFTER_S: start no server after that many seconds (servers
# already in $RESULTS are reused, so one schedule can span several calls of a time-limited
# host). BENCH_ARGS: more benchmark_serving.py options (e.g. --workloads system:32768);
# SERVE_EXTRA: more `vllm serve` options. BUILD_DEVICE (default cuda): where tiny_models
# initializes a model's weights (cpu for a dry run of these scripts on the CPU machine).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
RESULTS=${RESULTS:-/root/serving}
mkdir -p "$RESULTS"
ARCH=${ARCH:-qwen3_next_80b_shape}
MODEL=/tmp/$ARCH
[ -f $MODEL/config.json ] || python3 -m vllm_lighter_mamba.bench.tiny_models --arch $ARCH \
  --out $MODEL --device ${BUILD_DEVICE:-cuda} > "$RESULTS/build.log" 2>&1 || { tail -20 "$RESULTS/build.log"; exit 1; }
LOAD=""; ls $MODEL/*.safetensors > /dev/null 2>&1 || LOAD="--load-format dummy"
python3 benchmarks/benchmark_serving.py --model $MODEL --modes "${MODES:-lighter,align,off}" \
  --rounds "${ROUNDS:-2}" --results-dir "$RESULTS" --output-json "$RESULTS/serving.json" \
  ${STOP_AFTER_S:+--stop-after-s $STOP_AFTER_S} ${BENCH_ARGS:-} \
  --serve-args "$LOAD --additional-config '{\"gdn_prefill_backend\": \"triton\"}' ${SERVE_EXTRA:-}" \
  >> "$RESULTS/serving.log" 2>&1
echo "serving done rc=$?" >> "$RESULTS/serving.log"
