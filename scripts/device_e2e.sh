#!/usr/bin/env bash
# On the GPU host (after the setup of docs/device_vllm034.md or ../shared/device): several
# end-to-end pytest selections side by side on the one GPU, each engine with a fixed KV pool
# (LIGHTER_MAMBA_GPU_KV_BYTES, default 4 GiB: memory profiling would count the neighbours'
# allocations). One device call then runs what took one call per selection.
#
#   SELECTIONS="models:qwen3_next and eager;models:qwen3_next and graphs;speculative:mtp and eager" \
#     bash scripts/device_e2e.sh
#
# Each selection is FILE:K, FILE one of tests/e2e/test_gpu_{FILE}.py. A selection's output goes
# to $R/e2e_<n>.txt and its runs to $R/e2e_<n>.json (R: $E2E_DIR, default $OUT; the device tool
# returns at most 8 files, so many selections want E2E_DIR and one archive); CUDA_LAUNCH_BLOCKING=1 in BLOCKING=<n,...>
# selections names the kernel of a device-side assert. Finished engine runs are kept in
# $RUNS_DIR (default /root/e2e_runs) so that a selection cut off by the call's limit resumes.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export LIGHTER_MAMBA_E2E_RUNS_DIR=${RUNS_DIR:-/root/e2e_runs}
export LIGHTER_MAMBA_GPU_KV_BYTES=${KV_BYTES:-4294967296}
R=${E2E_DIR:-$OUT}; mkdir -p "$R"
# Build the tiny models once, before any process needs them (parallel builds would race).
python3 -c "from tests.conftest import tiny_model; [tiny_model(m) for m in ('qwen3_next', 'qwen3_next_mtp', 'nemotron_h', 'nemotron_h_mtp', 'jamba')]" \
  > "$R/models.txt" 2>&1 || { tail -20 "$R/models.txt"; exit 1; }
IFS=';' read -ra selections <<< "$SELECTIONS"
for n in "${!selections[@]}"; do
  file=${selections[$n]%%:*}; k=${selections[$n]#*:}
  blocking=0; [[ ",${BLOCKING:-}," == *",$n,"* ]] && blocking=1
  ( [ $blocking = 1 ] && export CUDA_LAUNCH_BLOCKING=1
    LIGHTER_MAMBA_GPU_E2E_JSON="$R/e2e_$n.json" timeout "${E2E_TIMEOUT:-480}" \
      python3 -m pytest "tests/e2e/test_gpu_$file.py" -q -p no:cacheprovider -rA -k "$k" > "$R/e2e_$n.txt" 2>&1
    echo "selection $n ($file: $k) rc=$?" ) &
done
wait
for n in "${!selections[@]}"; do
  echo "== $n: ${selections[$n]}"; grep -E "^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED)|passed|failed|device-side|Error:" "$R/e2e_$n.txt" | head -12
done
