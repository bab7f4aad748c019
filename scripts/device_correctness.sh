#!/usr/bin/env bash
# On the GPU host (after ../shared/device's setup): the kernel tests on the GPU and the GPU
# end-to-end tests of the tiny models (GPU_E2E_K selects, e.g. "qwen3_next and graphs").
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
python3 -c "import vllm, torch, triton; print('vllm', vllm.__version__, 'torch', torch.__version__, 'triton', triton.__version__)" >> $OUT/gpu.txt
python3 -m pytest tests/kernels -q -p no:cacheprovider 2>&1 | tail -5 | tee $OUT/kernel_tests.txt
if [ -n "${GPU_E2E_K:-}" ]; then
  LIGHTER_MAMBA_GPU_E2E_JSON=$OUT/gpu_e2e.json timeout "${E2E_TIMEOUT:-420}" \
    python3 -m pytest tests/e2e/test_gpu_models.py -q -p no:cacheprovider -k "$GPU_E2E_K" 2>&1 | tail -15 | tee $OUT/gpu_e2e.txt
fi
