#!/usr/bin/env bash
# One device call of the serving comparison on the GPU host (vLLM 0.34, parts uploaded as in
# scripts/device_setup_034.sh):
#
#   PARTS=N CALL_S=570 STOP_AFTER_S=300 MODES=align,off,lighter ROUNDS=2 BENCH_ARGS="..." \
#     bash scripts/device_serve_call.sh
#
# Sets vLLM 0.34 up (idempotent), runs scripts/device_serving.sh under `timeout CALL_S` with the
# schedule kept in /root/serving (a later call on the same warm host resumes it), then packs the
# results and the servers' logs into $OUT/serving.tgz, whatever happened.
set -uo pipefail
CALL_S=${CALL_S:-570}
started=$(date +%s)
bash scripts/device_setup_034.sh "${PARTS:?number of upload parts}" > "$OUT/setup.log" 2>&1 \
  || { cat "$OUT/setup.log"; exit 3; }
tail -1 "$OUT/setup.log"
. /tmp/vllm34_env.sh
left=$(( CALL_S - ($(date +%s) - started) ))
timeout --kill-after=10 "$left" bash scripts/device_serving.sh; echo "device_serving rc=$?"
pkill -f "vllm.entrypoints" 2>/dev/null || true
nvidia-smi --query-gpu=memory.used --format=csv,noheader
grep -hE "^(stop|server .* failed)|serving done" /root/serving/serving.log | tail -5
(cd /root/serving && tar czf "$OUT/serving.tgz" --exclude='*.safetensors' .)
ls /root/serving
