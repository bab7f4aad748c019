#!/usr/bin/env bash
# On the GPU host (after ../shared/device's setup): the speculative-decoding end-to-end test
# (tests/e2e/test_gpu_speculative.py; SPEC_K selects cases, e.g. "qwen3_next_mtp-mtp-eager", "graphs", "nemotron"), every
# run's outputs and agreements into $OUT/gpu_speculative$TAG.json, the test's output beside it.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
LIGHTER_MAMBA_GPU_E2E_JSON="$OUT/gpu_speculative${TAG:-}.json" timeout "${E2E_TIMEOUT:-540}" \
  python3 -m pytest tests/e2e/test_gpu_speculative.py -q -p no:cacheprovider -k "${SPEC_K:-}" \
  > "$OUT/gpu_speculative${TAG:-}.txt" 2>&1
