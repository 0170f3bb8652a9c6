#!/usr/bin/env bash
# Compares builds of `encore` on the GPU machine on the catalog models'
# shapes and types (random weights, written by the `synthetic_like` example
# from the headers that scripts/gpu-peer.sh stages), in one call, so that
# their figures come from the same machine and clocks: prefill pp512 and
# decode tg128 after it, the builds alternated round after round
# (ENCORE_AB_ROUNDS, 3), medians of 3 repeats a round; then, unless
# ENCORE_AB_PROFILE is 0, a per-dispatch profile of a decode run of the
# first and the last build on each model. Models are every header in
# .gpu-peer/templates (add one with scripts/gguf_header.py).
#
# Here: stage with scripts/gpu-peer.sh (llama.cpp's source rides along
# unused), build each variant and copy it, stripped, into .gpu-exp/ (ignored
# by git), e.g. `strip -o .gpu-exp/before target/release/encore` (packed
# as `before.xz` it travels at a quarter of the size). Then on
# the GPU machine (device tool, carrying .gpu-peer and .gpu-exp):
#   bash scripts/gpu-catalog-ab.sh before after
# Figures come back in $OUT/catalog-ab.txt, profiles in $OUT/profile-*.txt.
#
# A build named `NAME@VAR=VALUE` runs binary NAME with that variable set
# (`new@ENCORE_SPECIALIZE=0`, say). ENCORE_AB_DEVICE picks the device
# (cuda, the default, or wgpu, for which the Vulkan loader's packages in
# .gpu-wgpu/gl, staged by scripts/wgpu-suite.sh, are installed first);
# ENCORE_AB_MODELS names the models to run (file names without .gguf;
# default every one); ENCORE_AB_PROMPT the prompt's length (512; the
# decode figure is after it, so a short prompt gives decode from a nearly
# empty context, as llama-bench's tg128).
#
# Each build's first run compiles its kernels, which takes the GPU
# machine's NVRTC a minute or more a build: with more than two builds, or
# after the test suite, keep ENCORE_CACHE_DIR the same across calls made
# while the machine is warm and give the first call the compiles alone.
set -uo pipefail
cd "$(dirname "$0")/.."
(( $# > 0 )) || { echo "usage: scripts/gpu-catalog-ab.sh BUILD... (names of binaries in .gpu-exp/)" >&2; exit 2; }
stage=.gpu-peer
out=${OUT:-gpu-out}
work=/tmp/encore-peer
rounds=${ENCORE_AB_ROUNDS:-3}
device=${ENCORE_AB_DEVICE:-cuda}
prompt=${ENCORE_AB_PROMPT:-512}
mkdir -p "$out"
export ENCORE_CACHE_DIR=${ENCORE_CACHE_DIR:-$work/kernels}
for b in "$@"; do
    bin=${b%%@*}
    [[ -x .gpu-exp/$bin ]] || xz -dkf ".gpu-exp/$bin.xz" || exit 1
done
if [[ $device == wgpu* ]]; then
    for f in .gpu-wgpu/gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
    if ! ".gpu-exp/${1%%@*}" devices 2>/dev/null | grep -q '^wgpu'; then
        export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
    fi
fi
# The repository's copy: a staged copy older than this script may not know
# --models and would run the whole llama.cpp comparison instead.
bash scripts/gpu-peer-run.sh --models || exit 1
models=()
for m in "$work"/models/*.gguf; do
    name=${m##*/}
    [[ -z ${ENCORE_AB_MODELS:-} || " $ENCORE_AB_MODELS " == *" ${name%.gguf} "* ]] && models+=("$m")
done
(( ${#models[@]} > 0 )) || { echo "no model among: $(ls "$work/models")" >&2; exit 2; }

# The variable a build `NAME@VAR=VALUE` sets, if any (for `env`).
vars() { [[ $1 == *@* ]] && echo "${1#*@}"; }

median() { sort -g | awk '{v[NR]=$1} END {print (NR % 2) ? v[(NR+1)/2] : (v[NR/2] + v[NR/2+1]) / 2}'; }
field() { python3 -c "import json,sys; print(json.loads(sys.argv[1])[sys.argv[2]])" "$1" "$2"; }
{
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    echo "device $device"
    # One short run each first, so that kernel compiles stay out of the figures.
    for b in "$@"; do
        for m in "${models[@]}"; do
            timeout 300 env $(vars "$b") ".gpu-exp/${b%%@*}" generate --model "$m" --device "$device" -n 4 hi >/dev/null 2>&1
        done
    done
    declare -A pp tg
    for r in $(seq "$rounds"); do
        for b in "$@"; do
            for m in "${models[@]}"; do
                j=$(timeout 120 env $(vars "$b") ".gpu-exp/${b%%@*}" bench --model "$m" --device "$device" --prompt-tokens "$prompt" \
                    --gen-tokens 128 --repeats 3 --json 2>/dev/null) || { echo "$b ${m##*/}: failed"; continue; }
                key="$b ${m##*/}"
                pp[$key]+="$(field "$j" prefill_tok_s) "
                tg[$key]+="$(field "$j" decode_tok_s) "
                echo "round $r: $key: pp$prompt $(field "$j" prefill_tok_s) tg128 $(field "$j" decode_tok_s)" \
                    "(device $(field "$j" decode_step_device_us) us a step, $(field "$j" decode_graph))"
            done
        done
    done
    for m in "${models[@]}"; do
        for b in "$@"; do
            key="$b ${m##*/}"
            printf '%s: pp%s %.1f tok/s, tg128 %.1f tok/s (medians of %d rounds)\n' "$key" "$prompt" \
                "$(tr ' ' '\n' <<<"${pp[$key]}" | grep . | median)" \
                "$(tr ' ' '\n' <<<"${tg[$key]}" | grep . | median)" "$rounds"
        done
    done
} 2>&1 | tee "$out/catalog-ab.txt"
[[ ${ENCORE_AB_PROFILE:-1} == 0 ]] && exit 0
first=$1
last=${*: -1}
for b in $(printf '%s\n' "$first" "$last" | sort -u); do
    for m in "${models[@]}"; do
        timeout 120 env $(vars "$b") ".gpu-exp/${b%%@*}" bench --model "$m" --device "$device" --prompt-tokens 16 --gen-tokens 64 \
            --repeats 1 --profile dispatches >/dev/null 2>"$out/profile-${b//[@=]/_}-${m##*/}.txt"
    done
done
