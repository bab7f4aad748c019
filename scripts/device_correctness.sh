#!/usr/bin/env bash
# On the GPU host (after ../shared/device's setup): kernel tests, the kernel micro-benchmark
# and the GPU end-to-end runs of the three tiny models. Results go to $OUT.
# GPU_E2E_PLAN picks the runs (e.g. qwen3_next:graphs:lighter,qwen3_next:graphs:none) and
# GPU_E2E_ISOLATE=1 runs each engine in its own process (needed for CUDA graphs).
set -uo pipefail
export PYTHONUNBUFFERED=1 TINY_MODEL_ROOT=/tmp/tiny_models VLLM_WORKER_MULTIPROC_METHOD=spawn
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
python3 -c "import vllm, torch, triton; print('vllm', vllm.__version__, 'torch', torch.__version__, 'triton', triton.__version__)" >> $OUT/gpu.txt
python3 -m pytest tests/kernels -q -p no:cacheprovider 2>&1 | tail -5 | tee $OUT/kernel_tests.txt
python3 benchmarks/benchmark_state_indices.py --json $OUT/kernel_bench.json 2>&1 | grep -v "INFO\|WARN" | tee $OUT/kernel_bench.txt
timeout ${E2E_TIMEOUT:-420} python3 -m tests.e2e.test_gpu_models $OUT/gpu_e2e.json > $OUT/gpu_e2e.log 2>&1
echo "e2e rc=$?"; grep -E "^(qwen3_next|nemotron_h|jamba) |^\{" $OUT/gpu_e2e.log
