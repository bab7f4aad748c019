#!/usr/bin/env bash
# On the GPU host: build the ~1B random-weight Qwen3-Next and run the prefix-caching
# benchmark (CUDA graphs on: no --enforce-eager) for $MODES (default none,align,lighter).
# Each mode's raw results stay in /root/bench_modes, so calls that each fit the device's
# 10-minute limit can add one mode at a time: MODES=none, then none,align, then all three.
set -uo pipefail
export PYTHONUNBUFFERED=1 VLLM_WORKER_MULTIPROC_METHOD=spawn
[ -f /tmp/q1b/config.json ] || python3 -m vllm_lighter_mamba.testing.tiny_models --arch qwen3_next_1b --out /tmp/q1b --device cuda
timeout ${BENCH_TIMEOUT:-560} python3 benchmarks/benchmark_prefix_caching.py --model /tmp/q1b \
  --compare ${MODES:-none,align,lighter} --workload ${WORKLOADS:-shared-prefix,divergent,multi-turn} \
  --num-prompts 32 --prefix-len 4096 --input-length-range 128:512 --output-len 64 --num-turns 3 \
  --max-model-len 16384 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.5 \
  --mamba-ssm-cache-dtype float32 --additional-config '{"gdn_prefill_backend": "triton"}' \
  --results-dir /root/bench_modes \
  --output-json $OUT/bench_gpu.json --plot $OUT/bench_gpu.png 2>&1 | grep -v "INFO\|WARNING\|it/s" | tail -30
cp -r /root/bench_modes $OUT/ 2>/dev/null
