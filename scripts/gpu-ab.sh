#!/usr/bin/env bash
# Compares builds of `encore` on the GPU machine: decode speed on the
# synthetic SmolLM2, the builds alternated three times in one call, so that
# their figures come from the same machine and clocks.
#
# Here: build each variant and copy it, stripped, into .gpu-exp/ (ignored by
# git), e.g. `strip -o .gpu-exp/before target/release/encore`; stage the
# suite with scripts/gpu-suite.sh (its cuda_engine test writes the model).
# Then on the GPU machine (device tool, carrying .gpu and .gpu-exp):
#   bash scripts/gpu-ab.sh before after
set -uo pipefail
cd "$(dirname "$0")/.."
(( $# > 0 )) || { echo "usage: scripts/gpu-ab.sh BUILD... (names of binaries in .gpu-exp/)" >&2; exit 2; }
out=${OUT:-gpu-out}
mkdir -p "$out"
export ENCORE_SYNTHETIC_GGUF=${ENCORE_SYNTHETIC_GGUF:-/tmp/encore-synthetic/smollm2-135m-q4_1.gguf}
export ENCORE_CACHE_DIR=${ENCORE_CACHE_DIR:-/tmp/encore-ab-cache}
model=$ENCORE_SYNTHETIC_GGUF
if [[ ! -f $model ]]; then
    timeout 180 .gpu/tests/cuda_engine --ignored --exact synthetic_smollm2_decode_speed_on_cuda \
        --test-threads=1 >"$out/ab-model.log" 2>&1
fi
{
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    # One short run each first, so that kernel compiles stay out of the figures.
    for b in "$@"; do timeout 120 ".gpu-exp/$b" generate --model "$model" --device cuda -n 4 hi >/dev/null 2>&1; done
    for round in 1 2 3; do
        for b in "$@"; do
            echo "$b (round $round): $(timeout 120 ".gpu-exp/$b" bench --device cuda --model "$model" --repeats 5 2>&1 | tr '\n' ' ')"
        done
    done
    for b in "$@"; do
        echo "$b, tg128 after pp512: $(timeout 120 ".gpu-exp/$b" bench --device cuda --model "$model" \
            --prompt-tokens 512 --gen-tokens 128 --repeats 3 2>&1 | tr '\n' ' ')"
    done
} | tee "$out/ab.txt"
