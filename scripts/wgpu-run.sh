#!/usr/bin/env bash
# Runs the staged wgpu suite on the GPU machine (see scripts/wgpu-suite.sh):
# installs the Vulkan loader, runs the wgpu tests on the first hardware
# adapter (NVIDIA's Vulkan driver), writes a synthetic SmolLM2 (the default
# model's shapes and types, random weights: the same speed as the real
# weights), and benchmarks Encore on wgpu and on CUDA, each beside
# llama.cpp's Vulkan backend when staged. Logs go to $OUT.
#
#   bash .gpu-wgpu/wgpu-run.sh [tests] [bench]    both when neither is named
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
stage=.gpu-wgpu
export RUST_BACKTRACE=1 XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp}
export XDG_CACHE_HOME=/tmp/encore-gpu-cache
want() { (( $# == 1 )) || [[ " ${*:2} " == *" $1 "* ]]; }

for f in "$stage"/gl/*.deb; do dpkg -x "$f" /; done
[[ -f $stage/peer/llama-bench.xz ]] && xz -d -f "$stage/peer/llama-bench.xz"
ldconfig
if ! "$stage/bin/encore" devices 2>/dev/null | grep -q '^wgpu'; then
    for icd in /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json /usr/share/vulkan/icd.d/nvidia_icd.json \
        /etc/vulkan/icd.d/nvidia_icd.json; do
        [[ -f $icd ]] && export VK_DRIVER_FILES=$icd && break
    done
fi
{ nvidia-smi --query-gpu=name,driver_version --format=csv 2>&1; "$stage/bin/encore" devices 2>&1; } \
    | tee "$out/devices.txt"
export ENCORE_TEST_WGPU=wgpu
summary=()
status=0

if want tests "$@"; then
    for t in "$stage"/tests/*; do
        name=$(basename "$t")
        if [[ $name == wgpu_engine ]]; then
            # The default model, when staged in parts (wgpu-suite.sh --real-model).
            compgen -G ".gpu-wgpu-model/part-*" >/dev/null || continue
            mkdir -p /tmp/encore-real
            cat .gpu-wgpu-model/part-* >/tmp/encore-real/model.gguf
            export ENCORE_TEST_MODEL=/tmp/encore-real/model.gguf
        fi
        echo "== test $name"
        start=$SECONDS
        timeout 240 "$t" --test-threads=1 --show-output 2>&1 | tee "$out/test-$name.log"
        rc=${PIPESTATUS[0]}
        (( rc == 0 )) || status=1
        summary+=("test $name: rc=$rc ($((SECONDS - start)) s) $(grep -E '^test result' "$out/test-$name.log" | tr '\n' ' ')")
    done
fi

if want bench "$@"; then
    model=/tmp/encore-synthetic/smollm2-135m-q4_1.gguf
    ENCORE_SYNTHETIC_GGUF=$model "$stage/tests/wgpu_engine" --ignored write_the_synthetic_default_model \
        >/dev/null 2>&1
    {
        for device in wgpu cuda; do
            echo "-- encore bench --device $device, pp512 tg128 (decode after the prompt)"
            # CUDA compiles its kernels on first use, a minute or two.
            timeout 300 "$stage/bin/encore" bench --device "$device" --model "$model" \
                --prompt-tokens 512 --gen-tokens 128 --repeats 3 2>&1
            echo "-- encore bench --device $device, tg128 after a one-token prompt (llama-bench's tg128)"
            timeout 300 "$stage/bin/encore" bench --device "$device" --model "$model" \
                --prompt-tokens 1 --gen-tokens 128 --repeats 3 2>&1
        done
        echo "-- encore bench --device wgpu without subgroups and f16 (ENCORE_SUBGROUPS=0 ENCORE_SHADER_F16=0)"
        ENCORE_SUBGROUPS=0 ENCORE_SHADER_F16=0 timeout 300 "$stage/bin/encore" bench --device wgpu \
            --model "$model" --prompt-tokens 512 --gen-tokens 128 --repeats 3 2>&1
        echo "-- replay versus eager encoding, empty kernels (per step of N dispatches)"
        ENCORE_BENCH_DEVICES=wgpu timeout 120 "$stage/benches/replay" --bench step \
            --warm-up-time 1 --measurement-time 3 2>&1 | grep -E '^step|time:'
        echo "-- per-dispatch profile on wgpu"
        timeout 120 "$stage/bin/encore" bench --device wgpu --model "$model" --repeats 1 \
            --profile dispatches 2>&1 | head -60
        echo "-- per-submission profile on wgpu"
        timeout 120 "$stage/bin/encore" bench --device wgpu --model "$model" --repeats 1 \
            --profile submissions 2>&1 | head -40
        if [[ -x $stage/peer/llama-bench ]]; then
            echo "-- side by side with llama.cpp's Vulkan backend"
            LD_LIBRARY_PATH=$stage/peer${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
                timeout 400 bash "$stage/peer-bench.sh" "$stage/bin/encore" "$stage/peer" "$model" wgpu 512 128 3 2>&1
        fi
    } | tee "$out/bench.log"
    summary+=("$(grep -E 'tok/s|ratio' "$out/bench.log")")
fi
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
exit $status
