#!/usr/bin/env bash
# The serving comparison with one server per mode, all started at once on the GPU host
# (benchmarks/benchmark_serving.py --concurrent), as a detached job that outlives the call:
#
#   PARTS=N WAIT_S=560 MODES=off,align,lighter ROUNDS=3 BENCH_ARGS="..." bash scripts/device_serve_concurrent.sh start
#   WAIT_S=580 bash scripts/device_serve_concurrent.sh wait      # next calls, back to back
#
# start: sets vLLM 0.34 up (scripts/device_setup_034.sh, which also stops servers a call left
# behind), then starts the job in its own process session (the host keeps such a process
# running between calls while it stays warm: the next call must follow within ~30 s). Both
# then wait up to WAIT_S for the job, print its progress, and pack $RESULTS (the servers' logs,
# runs, the step timeline of profiled runs; not the traces themselves) into $OUT/serving.tgz.
# Each server gets KV_BYTES of KV cache (default 10 GiB) so that three fit one H200 beside each
# other; PROFILE=W (a workload of BENCH_ARGS) adds one profiled run per mode of W. Pools that
# small fail two of vLLM 0.34's start-up checks at its defaults (seen 2026-12-05, 6 GiB: one
# request of the model's 262,144 tokens needs 6.09 GiB; max_num_seqs 1,024 exceeds the 455 Mamba
# blocks CUDA graph capture needs), so the servers get --max-model-len 32768 --max-num-seqs 128
# (a later SERVE_EXTRA flag overrides).
# SKIP_SETUP=1: a dry run where /tmp/vllm34_env.sh already sets the environment up (on the CPU
# machine: one that puts .venv/bin first; with ARCH=qwen3_next BUILD_DEVICE=cpu KV_BYTES=1073741824
# and the CPU serve flags in SERVE_EXTRA).
set -uo pipefail
ACTION=${1:?start or wait}
WAIT_S=${WAIT_S:-560}
RESULTS=${RESULTS:-/root/serving_concurrent}
started=$(date +%s)
if [ "$ACTION" = start ]; then
  if [ -z "${SKIP_SETUP:-}" ]; then
    bash scripts/device_setup_034.sh "${PARTS:?number of upload parts}" > "$OUT/setup.log" 2>&1 \
      || { cat "$OUT/setup.log"; exit 3; }
    tail -1 "$OUT/setup.log"
  fi
  # A restarted job keeps the servers' torch.compile caches (one per mode, VLLM_CACHE_ROOT).
  mkdir -p "$RESULTS" && find "$RESULTS" -mindepth 1 -maxdepth 1 ! -name 'vllm-cache-*' -exec rm -rf {} +
  PROFILE_ARGS=""
  [ -n "${PROFILE:-}" ] && PROFILE_ARGS="--profile-dir $RESULTS/profiles --profile-workloads $PROFILE"
  cat > "$RESULTS/job.sh" <<JOB
. /tmp/vllm34_env.sh
export RESULTS=$RESULTS MODES=${MODES:-off,align,lighter} ROUNDS=${ROUNDS:-3}
export BENCH_ARGS="--concurrent $PROFILE_ARGS ${BENCH_ARGS:-}"
export SERVE_EXTRA="--kv-cache-memory-bytes ${KV_BYTES:-10737418240} --gpu-memory-utilization 0.3 --max-model-len 32768 --max-num-seqs 128 ${SERVE_EXTRA:-}"
bash scripts/device_serving.sh
if [ -d $RESULTS/profiles ]; then
  python3 benchmarks/profile_steps.py \$(ls -d $RESULTS/profiles/*) --output-json $RESULTS/profile_steps.json \
    > $RESULTS/profile_steps.md 2>&1
  for d in $RESULTS/profiles/*; do  # vLLM's key-averages table, one per mode
    for t in \$d/*.txt; do cp "\$t" "$RESULTS/\$(basename \$d)-\$(basename \$t)"; done
  done
fi
echo done > $RESULTS/DONE
JOB
  setsid nohup bash "$RESULTS/job.sh" > "$RESULTS/job.log" 2>&1 < /dev/null &
  echo "job started"
fi
[ -f "$RESULTS/job.sh" ] || { echo "COLD: no job in $RESULTS (the host was replaced?)"; exit 3; }
while [ ! -f "$RESULTS/DONE" ] && [ $(( $(date +%s) - started )) -lt "$WAIT_S" ]; do sleep 5; done
[ -f "$RESULTS/DONE" ] && echo "job done" || echo "job still running after ${WAIT_S}s"
python3 - "$RESULTS" <<'PY'
import json, sys
from pathlib import Path
runs = Path(sys.argv[1], "concurrent-runs.json")
rows = json.loads(runs.read_text()) if runs.exists() else []
print(f"{len(rows)} runs:", ", ".join(f"{r['mode']}/{r['workload']}/{r.get('round', '-')}" for r in rows[-6:]))
PY
tail -3 "$RESULTS/serving.log" 2>/dev/null; tail -3 "$RESULTS/job.log"
nvidia-smi --query-gpu=memory.used --format=csv,noheader
(cd "$RESULTS" && tar czf "$OUT/serving.tgz" --exclude='*.safetensors' --exclude='profiles' --exclude='vllm-cache-*' .)
ls -la "$OUT/serving.tgz"
