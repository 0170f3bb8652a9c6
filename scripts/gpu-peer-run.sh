#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, what scripts/gpu-peer.sh
# staged in .gpu-peer/: builds llama.cpp with CUDA (llama-bench only), writes
# the catalog models' shapes and types with random weights, and compares
# Encore with llama.cpp on each (scripts/peer-bench.sh: pp512 and tg128,
# alternated, ENCORE_PEER_ROUNDS rounds, default 2). Figures go to
# $OUT/peer.txt. With `--models` it only writes the synthetic models (to
# /tmp/encore-peer/models) and stops. ENCORE_PEER_MODELS names the models
# to compare (file names without .gguf; default every one).
#
# The build takes about five minutes on 16 cores. It runs in the background
# and the call waits for it within its budget (ENCORE_PEER_BUDGET, 560 s of
# the call's 600); where it has not finished, the call says so and exits 3,
# and a second call made while the machine is warm picks it up. Nothing of
# Encore runs while it builds: NVRTC compiling kernels beside sixteen nvcc
# jobs took minutes where it takes seconds.
set -uo pipefail
cd "$(dirname "$0")/.."
stage=.gpu-peer
out=${OUT:-gpu-out}
work=/tmp/encore-peer
budget=${ENCORE_PEER_BUDGET:-560}
rounds=${ENCORE_PEER_ROUNDS:-2}
mkdir -p "$out" "$work/models" "$work/templates"
export ENCORE_CACHE_DIR=$work/kernels
[[ -x $stage/encore ]] || xz -dkf "$stage/encore.xz"

# Each catalog model's shapes and types, from its header made a sparse file
# of the model's size.
for t in "$stage"/templates/*.gguf; do
    name=${t##*/}
    [[ -f $work/models/$name ]] && continue
    cp "$t" "$work/templates/$name"
    truncate -s "$(cat "$t.size")" "$work/templates/$name"
    "$stage/synthetic_like" "$work/templates/$name" "$work/models/$name" || exit 1
done
[[ ${1:-} == --models ]] && exit 0

llama=$work/llama
if [[ ! -x $llama/build/bin/llama-bench ]]; then
    bash "$stage/llama-cuda-build.sh" "$stage/llama-src.tgz" "$llama"
    # Leave time for the benchmarks once it is built.
    while [[ ! -f $llama/finished ]] && (( SECONDS < budget - 240 )); do sleep 5; done
    if [[ ! -x $llama/build/bin/llama-bench ]]; then
        if [[ -f $llama/finished ]]; then
            echo "llama.cpp's build failed:" >&2
            tail -n 20 "$llama/cmake.log" "$llama/build.log" >&2
            exit 1
        fi
        echo "llama.cpp is still building ($(tail -c 120 "$llama/build.log" | tr -d '\0' | tail -n 1));" \
            "make the same call again now, while the machine is warm" >&2
        exit 3
    fi
fi

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/peer.txt"
for m in "$work"/models/*.gguf; do
    name=${m##*/}
    [[ -z ${ENCORE_PEER_MODELS:-} || " $ENCORE_PEER_MODELS " == *" ${name%.gguf} "* ]] || continue
    # A short run first, so that kernel compiles stay out of the figures.
    timeout 300 "$stage/encore" generate --model "$m" --device cuda -n 4 hi >/dev/null 2>&1
    timeout 240 bash "$stage/peer-bench.sh" "$stage/encore" "$llama/build/bin" "$m" cuda 512 128 "$rounds" \
        2>&1 | tee -a "$out/peer.txt"
done
