#!/usr/bin/env bash
# Builds the wgpu suite here and stages it, stripped, in .gpu-wgpu/ for the
# device tool: the wgpu test binaries, the encore binary, the Vulkan loader
# (Debian's packages, which the GPU machine lacks) and, when LLAMA_VULKAN_BIN
# names a folder holding llama.cpp's llama-bench built with -DGGML_VULKAN=ON,
# the peer. Then make the one device call it prints, which runs
# scripts/wgpu-run.sh there: the tests on NVIDIA's Vulkan driver, and
# Encore on wgpu and on CUDA beside llama.cpp's Vulkan backend.
#
#   scripts/wgpu-suite.sh [--real-model]
#
# With --real-model, the default model is staged too, in three parts
# carried by three calls made right after each other (the machine keeps
# what earlier calls left while it is warm), for the engine tests.
set -euo pipefail
cd "$(dirname "$0")/.."

tests=(encore:wgpu encore-ops:wgpu_ops encore-llm:wgpu_engine)
echo "== building test binaries (release)" >&2
json=""
for t in "${tests[@]}"; do
    json+=$(cargo test --release -p "${t%%:*}" --test "${t#*:}" --no-run --message-format=json)
    json+=$'\n'
done
echo "== building the replay benchmark (release)" >&2
json+=$(cargo bench -p encore --bench replay --no-run --message-format=json)
json+=$'\n'
echo "== building the encore binary (release)" >&2
cargo build --release -p encore-cli >&2

rm -rf .gpu-wgpu
mkdir -p .gpu-wgpu/tests .gpu-wgpu/bin .gpu-wgpu/gl
messages=$(mktemp)
printf '%s\n' "$json" >"$messages"
for t in "${tests[@]#*:}" replay; do
    exe=$(python3 - "$t" "$messages" <<'PY'
import json, sys
name, found = sys.argv[1], ""
for line in open(sys.argv[2]):
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == name:
        found = m["executable"]
print(found)
PY
)
    [[ -n $exe && -x $exe ]] || { echo "no executable for test $t" >&2; exit 1; }
    if [[ $t == replay ]]; then
        mkdir -p .gpu-wgpu/benches && strip -o .gpu-wgpu/benches/replay "$exe"
    else
        strip -o ".gpu-wgpu/tests/$t" "$exe"
    fi
done
strip -o .gpu-wgpu/bin/encore target/release/encore
cp scripts/wgpu-run.sh scripts/peer-bench.sh .gpu-wgpu/

# The Vulkan loader and the GL dispatch libraries NVIDIA's driver loads.
o=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/encore-amd64-lists)
mkdir -p /tmp/encore-amd64-lists/partial
apt-get "${o[@]}" update >/dev/null 2>&1 || true
(cd .gpu-wgpu/gl && apt-get "${o[@]}" download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2 >/dev/null 2>&1) \
    || echo "warning: could not download the Vulkan loader; wgpu will find no adapter there" >&2

if [[ -n ${LLAMA_VULKAN_BIN:-} && -x $LLAMA_VULKAN_BIN/llama-bench ]]; then
    # Its embedded SPIR-V shaders make it large; compressed, it is small.
    mkdir -p .gpu-wgpu/peer
    strip -o .gpu-wgpu/peer/llama-bench "$LLAMA_VULKAN_BIN/llama-bench"
    xz -T0 -6 .gpu-wgpu/peer/llama-bench
    # The OpenMP runtime it links, which the GPU machine may lack.
    for lib in $(ldd "$LLAMA_VULKAN_BIN/llama-bench" | awk '/libgomp/ {print $3}'); do
        cp "$lib" .gpu-wgpu/peer/
    done
else
    echo "note: LLAMA_VULKAN_BIN unset or without llama-bench; no peer figures" >&2
fi

size=$(du -sb .gpu-wgpu | cut -f1)
echo "== staged $(find .gpu-wgpu -type f | wc -l) files, $((size / 1024 / 1024)) MiB in .gpu-wgpu/" >&2
if (( size > 60 * 1024 * 1024 )); then
    echo "error: .gpu-wgpu is over 60 MiB; the device tool carries at most 64 MiB" >&2
    exit 1
fi
rm -rf .gpu-wgpu-model
if [[ ${1:-} == --real-model ]]; then
    model=${ENCORE_REAL_MODEL:-${XDG_CACHE_HOME:-$HOME/.cache}/encore/models/SmolLM2-135M-Instruct.Q4_1.gguf}
    [[ -f $model ]] || { echo "set ENCORE_REAL_MODEL to the default model's GGUF file" >&2; exit 1; }
    mkdir -p .gpu-wgpu-model
    # The first call carries the staged suite, so its part is small.
    mib=$((1 << 20))
    dd if="$model" of=.gpu-wgpu-model/part-0 bs=$mib count=4 status=none
    dd if="$model" of=.gpu-wgpu-model/part-1 bs=$mib skip=4 count=52 status=none
    dd if="$model" of=.gpu-wgpu-model/part-2 bs=$mib skip=56 status=none
    cat <<'CALL'
The wgpu suite with the default model takes three device calls, right after each other:
  run(command="true", carry=[".gpu-wgpu", ".gpu-wgpu-model/part-0"])
  run(command="true", carry=[".gpu-wgpu-model/part-1"])
  run(command="bash .gpu-wgpu/wgpu-run.sh", carry=[".gpu-wgpu-model/part-2"], timeout_s=600)
CALL
else
    cat <<'CALL'
The wgpu suite takes one device call:
  run(command="bash .gpu-wgpu/wgpu-run.sh", carry=[".gpu-wgpu"], timeout_s=600)
CALL
fi
echo 'Logs come back under $OUT: devices.txt, test-<name>.log, bench.log, summary.txt.'
