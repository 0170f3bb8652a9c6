#!/usr/bin/env bash
# Compiles one Encore CUDA kernel for sm_90 here (no GPU, no CUDA toolkit:
# NVRTC and cuobjdump come from their PyPI wheels, fetched once into
# target/cuda-tools) and reports registers, stack, spills and instructions;
# --sass prints the machine code too.
#
#   scripts/kernel-info.sh fused_matmul 1 576 576 192 192 3 3 3 3 0 1 0x3727c5ac 0
#   scripts/kernel-info.sh --sass matmul 1 49152 576 8
#
# An exact version (`encore::Config::exact`) that differs from the default
# one is named with `-exact` (`scripts/kernel-info.sh matmul-exact`).
#
# The numbers after the kernel's name are the words of its value argument
# (the shape struct, in field order), which compiles the variant a graph
# specializes for that shape; without them, the generic code. The GPU
# machine's NVRTC may be a newer release than the wheel's, so counts can
# differ a little there.
set -euo pipefail
cd "$(dirname "$0")/.."
sass=()
if [[ ${1:-} == --sass ]]; then sass=(--sass); shift; fi
kernel=${1:?usage: scripts/kernel-info.sh [--sass] KERNEL [WORD...]}
shift
tools=target/cuda-tools
if ! compgen -G "$tools/nvidia/cuda_nvrtc/lib/libnvrtc.so.*" >/dev/null \
    || ! compgen -G "$tools/nvidia/*/bin/cuobjdump" >/dev/null; then
    echo "fetching NVRTC and cuobjdump into $tools" >&2
    mkdir -p "$tools/wheels"
    python3 -m pip download --quiet --no-deps -d "$tools/wheels" \
        nvidia-cuda-nvrtc-cu12 nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
    for w in "$tools"/wheels/*.whl; do python3 -m zipfile -e "$w" "$tools"; done
    chmod +x "$tools"/nvidia/*/bin/* 2>/dev/null || true
fi
cargo run --quiet -p encore-ops --example cuda_sources -- target/cuda-sources >/dev/null
source=target/cuda-sources/$kernel.cu
[[ -f $source ]] || { echo "no kernel $kernel (see target/cuda-sources)" >&2; exit 1; }
python3 scripts/kernel_info.py "$tools" "$source" "${sass[@]}" "$@"
