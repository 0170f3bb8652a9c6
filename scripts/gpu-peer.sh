#!/usr/bin/env bash
# Stages Encore against llama.cpp's CUDA backend on the catalog models'
# shapes and types, for the GPU machine, in .gpu-peer/ (ignored by git):
# the encore binary, the `synthetic_like` example, the catalog models'
# headers (scripts/gguf_header.py; the models must be cached here, see
# `encore models`), llama.cpp's trimmed source (../shared/tools/llama-cpp.sh
# --source) and the scripts that run there. No GPU or CUDA toolkit needed.
#
#   scripts/gpu-peer.sh        then make the device call it prints
#
# On the GPU machine scripts/gpu-peer-run.sh builds llama.cpp with CUDA,
# writes each catalog model's shapes and types with random weights (speed on
# them equals speed on the real weights), and runs scripts/peer-bench.sh on
# each, Encore and llama-bench alternated.
set -euo pipefail
cd "$(dirname "$0")/.."
llama_cpp_sh=${LLAMA_CPP_SH:-../shared/tools/llama-cpp.sh}
stage=.gpu-peer

echo "== building encore and the synthetic_like example (release)" >&2
cargo build --release -p encore-cli >&2
cargo build --release -p encore-llm --example synthetic_like >&2

rm -rf "$stage"
mkdir -p "$stage/templates"
strip -o "$stage/encore" target/release/encore
xz -T0 -6 "$stage/encore"
strip -o "$stage/synthetic_like" target/release/examples/synthetic_like
for name in smollm2-135m qwen2.5-coder-0.5b gemma-3-270m; do
    path=$(target/release/encore models --json | jq -r --arg n "$name" \
        '.models[] | select(.name == $n and .state == "cached") | .path')
    if [[ -z $path || ! -f $path ]]; then
        echo "error: $name is not cached; fetch it first (encore generate --model $name ...)" >&2
        exit 1
    fi
    python3 scripts/gguf_header.py "$path" "$stage/templates/$name.gguf"
done
"$llama_cpp_sh" --source "$stage" >&2
cp scripts/peer-bench.sh scripts/gpu-peer-run.sh scripts/llama-cuda-build.sh "$stage/"

size=$(du -sb "$stage" | cut -f1)
echo "== staged $((size / 1024 / 1024)) MiB in $stage/" >&2
cat <<'CALL'
Encore against llama.cpp on the catalog models' shapes, one device call (or
two, where llama.cpp's build does not finish in the first: then the second
right after, while the machine is warm):
  run(command="bash .gpu-peer/gpu-peer-run.sh", carry=[".gpu-peer"], timeout_s=600)
Figures come back in $OUT/peer.txt, one line a model and workload.
CALL
