#!/usr/bin/env bash
# On the GPU host: kernel tests and micro-benchmark, then the CUDA-graph end-to-end runs
# (one fresh process per engine) for Qwen3-Next (GDN) and Jamba (Mamba1). Results in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 TINY_MODEL_ROOT=/tmp/tiny_models VLLM_WORKER_MULTIPROC_METHOD=spawn
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
python3 -c "import vllm, torch, triton; print('vllm', vllm.__version__, 'torch', torch.__version__, 'triton', triton.__version__)" >> $OUT/gpu.txt
python3 -m pytest tests/kernels -q -p no:cacheprovider 2>&1 | tail -3 | tee $OUT/kernel_tests.txt
python3 benchmarks/benchmark_state_indices.py --json $OUT/kernel_bench.json 2>&1 | grep -v "INFO\|WARN" | tee $OUT/kernel_bench.txt
PLAN=${GPU_E2E_PLAN:-qwen3_next:graphs:lighter,qwen3_next:graphs:none,qwen3_next:graphs:align,jamba:graphs:lighter,jamba:graphs:none}
GPU_E2E_ISOLATE=1 GPU_E2E_PLAN=$PLAN timeout ${E2E_TIMEOUT:-420} python3 -m tests.e2e.test_gpu_models $OUT/gpu_e2e_graphs.json > $OUT/gpu_e2e.log 2>&1
echo "e2e rc=$?"; grep -E "^(qwen3_next|nemotron_h|jamba) |^\{|Error|error" $OUT/gpu_e2e.log | tail -20
