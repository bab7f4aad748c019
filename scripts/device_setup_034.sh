#!/usr/bin/env bash
# On the GPU host, from the checkout root, after every part of scripts/device_bundle_034.sh was
# copied to /root/vb34 (one upload call each, back to back: the host goes back ~30 s after a call):
#
#   run(carry=[".devbundle34/pNN"], command="mkdir -p /root/vb34 && cp .devbundle34/pNN/* /root/vb34/ && ls /root/vb34 | wc -l")
#
# then, in the call that uses vLLM:  bash scripts/device_setup_034.sh N && . /tmp/vllm34_env.sh && ...
# N: the number of parts (a missing part is named instead of a broken tar). Idempotent: a second
# call only re-installs the checkout. Kills servers a killed call left behind (own sessions).
set -euo pipefail
N=${1:?number of parts}
have=$(ls /root/vb34/part* 2>/dev/null | wc -l)
[ "$have" = "$N" ] || { echo "COLD: $have of $N parts in /root/vb34"; exit 3; }
pkill -f "vllm.entrypoints" 2>/dev/null && sleep 3 || true
if [ ! -f /tmp/site34/.done ]; then
  rm -rf /tmp/site34 /root/vb34/w && mkdir -p /tmp/site34 /root/vb34/w
  cat /root/vb34/part* | tar xf - -C /root/vb34/w
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site34 /root/vb34/w/*.whl
  rm -rf /root/vb34/w
  touch /tmp/site34/.done
fi
cat > /tmp/vllm34_env.sh <<'ENV'
# The CuTe DSL puts its package on sys.path through a .pth file, which PYTHONPATH does not run.
export PYTHONPATH=/tmp/site34:/tmp/site34/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0
export PATH=/tmp/site34/bin:$PATH
ENV
. /tmp/vllm34_env.sh
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site34 . \
  > /tmp/plugin_install.log 2>&1 || { echo "could not install the checkout"; tail -5 /tmp/plugin_install.log; exit 4; }
python3 -c "import torch, triton, vllm; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'triton', triton.__version__, 'vllm', vllm.__version__)"
