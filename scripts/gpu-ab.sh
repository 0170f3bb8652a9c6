#!/usr/bin/env bash
# Compares builds of `encore` on the GPU machine, in one call, so that their
# figures come from the same machine and clocks:
#
# - speed on the synthetic SmolLM2: decode tg64 after pp128 (the default
#   bench) and prefill pp512 with decode tg128 after it, the builds
#   alternated round after round (ENCORE_AB_ROUNDS, 3), medians of 5;
# - greedy text: with ENCORE_AB_MODEL naming a GGUF file (the default model,
#   joined from .gpu-model/part-* when present), each build's greedy
#   continuation (32 tokens, raw prompt) of eight prompts on the CPU and on
#   CUDA; every build must give the first build's text, token for token.
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
real=${ENCORE_AB_MODEL:-}
if [[ -z $real ]] && compgen -G ".gpu-model/part-*" >/dev/null; then
    real=/tmp/encore-real/SmolLM2-135M-Instruct.Q4_1.gguf
    mkdir -p "$(dirname "$real")"
    [[ -f $real ]] || cat .gpu-model/part-* >"$real"
fi
rounds=${ENCORE_AB_ROUNDS:-3}
{
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    # One short run each first, so that kernel compiles stay out of the figures.
    for b in "$@"; do timeout 120 ".gpu-exp/$b" generate --model "$model" --device cuda -n 4 hi >/dev/null 2>&1; done
    for round in $(seq "$rounds"); do
        for b in "$@"; do
            echo "$b (round $round), tg64 after pp128: $(timeout 120 ".gpu-exp/$b" bench --device cuda --model "$model" \
                --repeats 5 2>&1 | tr '\n' ' ')"
        done
        for b in "$@"; do
            echo "$b (round $round), pp512 then tg128: $(timeout 120 ".gpu-exp/$b" bench --device cuda --model "$model" \
                --prompt-tokens 512 --gen-tokens 128 --repeats 5 2>&1 | tr '\n' ' ')"
        done
    done
    if [[ -n $real && -f $real ]]; then
        sha256sum "$real"
        for device in cpu cuda; do
            same=0
            total=0
            while IFS= read -r prompt; do
                total=$((total + 1))
                first=""
                agree=1
                for b in "$@"; do
                    text=$(timeout 60 ".gpu-exp/$b" generate --model "$real" --device "$device" --temperature 0 \
                        --raw -n 32 "$prompt" 2>/dev/null)
                    if [[ $b == "$1" ]]; then
                        first=$text
                    elif [[ $text != "$first" ]]; then
                        agree=0
                        echo "DIFF ($device, $b) $prompt"
                        echo "  $1: ${first:0:200}"
                        echo "  $b: ${text:0:200}"
                    fi
                done
                (( agree )) && same=$((same + 1))
            done <scripts/greedy-prompts.txt
            echo "greedy text on $device, every build against $1: $same of $total prompts identical over 32 tokens"
        done
    fi
} | tee "$out/ab.txt"
