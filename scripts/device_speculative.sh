#!/usr/bin/env bash
# On the GPU host (after ../shared/device's setup): the speculative-decoding end-to-end test
# (tests/e2e/test_gpu_speculative.py; SPEC_K selects cases, e.g. "qwen3_next_mtp-mtp-eager", "graphs", "nemotron"), every
# run's outputs and agreements into $OUT/gpu_speculative$TAG.json, the test's output beside it.
# PARALLEL="graphs;nemotron;ngram": one pytest per selection, side by side on the one GPU, each
# into $OUT/gpu_speculative$TAG_<n>.json, each engine with a fixed 4 GiB pool (KV_BYTES) since
# memory profiling would count the neighbours' allocations. Finished engine runs are kept in
# $RUNS_DIR (default /root/spec_runs, on the host while it stays up): a case cut off by the
# call's limit (the graphs case: five compiled engines, ~150-200 s each) resumes from them
# when the same command runs again.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export LIGHTER_MAMBA_E2E_RUNS_DIR=${RUNS_DIR:-/root/spec_runs}
run_cases() {  # $1: pytest -k selection, $2: output name suffix
  LIGHTER_MAMBA_GPU_E2E_JSON="$OUT/gpu_speculative$2.json" timeout "${E2E_TIMEOUT:-540}" \
    python3 -m pytest tests/e2e/test_gpu_speculative.py -q -p no:cacheprovider -k "$1" \
    > "$OUT/gpu_speculative$2.txt" 2>&1
}
# Build the tiny models once, before any process needs them (parallel builds would race).
python3 -c "from tests.conftest import tiny_model; [tiny_model(m) for m in ('qwen3_next_mtp', 'nemotron_h_mtp')]"
if [ -z "${PARALLEL:-}" ]; then
  run_cases "${SPEC_K:-}" "${TAG:-}"
  exit
fi
export LIGHTER_MAMBA_GPU_KV_BYTES=${KV_BYTES:-4294967296}
IFS=';' read -ra selections <<< "$PARALLEL"
for n in "${!selections[@]}"; do
  run_cases "${selections[$n]}" "${TAG:-}_$n" &
done
wait
