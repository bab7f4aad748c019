#!/usr/bin/env bash
# On the CPU machine, in the checkout root: builds everything the GPU host needs for vLLM 0.34 as
# upload parts in .devbundle34/pNN (git-ignored). The host's image (torch 2.11, triton 3.6, no
# network, docs/device_vllm034.md) lacks: torch 2.14.0, triton 3.8.0, vLLM 0.34.0, NCCL 2.32.3
# (torch 2.14 needs ncclCommResume), torchvision 0.29.0 (0.26 breaks vLLM's imports), vLLM's
# Python requirements that the image lacks (../shared/device/device-requirements.txt), the CuTe DSL
# and quack (vLLM's CUDA warm-up imports them), orjson (`vllm serve` imports it).
# One tar of all the wheels, cut into parts that fit one upload beside the tracked tree.
#
#   bash scripts/device_bundle_034.sh            # then upload p00..pNN, see scripts/device_setup_034.sh
set -euo pipefail
OUT=${1:-.devbundle34}
CACHE=${DEVBUNDLE_CACHE:-$HOME/.cache/devbundle}/v034all
SHARED=${SHARED_DEVICE:-$(cd "$(dirname "$0")/../.." && pwd)/shared/device}
# One upload holds at most 64 MiB with the tracked tree beside the part: leave 2 MB of room
# (2026-12-05: the tree had grown to 16 MB and 53 MB parts no longer fit).
TREE_BYTES=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
PART_BYTES=${PART_BYTES:-$(( 64 * 1024 * 1024 - TREE_BYTES - 2000000 ))}
grep -qxF "/$OUT/" .git/info/exclude 2>/dev/null || echo "/$OUT/" >> .git/info/exclude
mkdir -p "$CACHE" "$OUT"
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64
      --platform any)
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
          "${PLAT[@]}" -d "$CACHE" "$@"; }
get torch==2.14.0 triton==3.8.0 vllm==0.34.0 nvidia-nccl-cu13==2.32.3 torchvision==0.29.0
get -r "$SHARED/device-requirements.txt"
get nvidia-cutlass-dsl==4.8.0 nvidia-cutlass-dsl-libs-base==4.8.0 nvidia-cutlass-dsl-libs-core==4.8.0 \
    nvidia-cutlass-dsl-libs-cu13==4.8.0 cuda-bindings==13.5.0 cuda-pathfinder protobuf \
    quack-kernels==0.6.5 orjson==3.13.0
rm -rf "$OUT"/p[0-9]* && (cd "$CACHE" && tar cf - *.whl) | split -b "$PART_BYTES" -d -a 2 - "$OUT/part"
for f in "$OUT"/part*; do n=${f##*/part}; mkdir -p "$OUT/p$n" && mv "$f" "$OUT/p$n/"; done
ls -d "$OUT"/p[0-9]* | wc -l | xargs echo parts:; du -sh "$OUT"
