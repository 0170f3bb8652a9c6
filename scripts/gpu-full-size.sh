#!/usr/bin/env bash
# Stages the full-size model checks for the GPU machine in .gpu-full/
# (ignored by git): the encore binary, the `synthetic_model` example that
# writes full-size models there (encore_llm::synthetic; a 7B file never
# travels), the cuda_ops and cuda_engine test binaries, and the script that
# runs them (scripts/gpu-full-size-run.sh). No GPU or CUDA toolkit needed.
#
#   scripts/gpu-full-size.sh [--before REV] [--before-encore FILE] [--peer]
#
# --peer stages llama.cpp's trimmed source (../shared/tools/llama-cpp.sh
# --source) and scripts/peer-bench.sh for the run's `peer-build` and `peer`
# steps (Encore beside llama-bench on each model).
# --before-encore FILE stages FILE, an `encore` built from an earlier
# revision, for the run's `ab` step (the two builds alternated).
# --before REV also stages cuda_ops built with REV's CUDA kernels and
# today's tests (as cuda_ops-before), to show that a new test fails there,
# and REV's encore and synthetic_like (built in a worktree under
# target/before), for the run's `repro` step. Then make the device call it
# prints.
set -euo pipefail
cd "$(dirname "$0")/.."
stage=.gpu-full
before="" before_encore="" peer=no
while (( $# > 0 )); do
    case $1 in
        --before) before=${2:?--before needs a revision}; shift 2 ;;
        --before-encore) before_encore=${2:?--before-encore needs a file}; shift 2 ;;
        --peer) peer=yes; shift ;;
        *) echo "usage: scripts/gpu-full-size.sh [--before REV] [--before-encore FILE] [--peer]" >&2; exit 2 ;;
    esac
done

# The executable of a test target, from cargo's JSON messages.
test_exe() { # package test
    cargo test --release -p "$1" --test "$2" --no-run --message-format=json \
        | jq -r --arg name "$2" 'select(.reason == "compiler-artifact" and .executable != null
                                 and .target.name == $name) | .executable' | tail -n 1
}

rm -rf "$stage"
mkdir -p "$stage/bin"
if [[ -n $before ]]; then
    echo "== cuda_ops with the CUDA kernels of $before" >&2
    saved=$(mktemp -d)
    cp -r crates/encore-ops/src/cuda "$saved/"
    git checkout "$before" -- crates/encore-ops/src/cuda
    exe=$(test_exe encore-ops cuda_ops) || true
    rm -rf crates/encore-ops/src/cuda && cp -r "$saved/cuda" crates/encore-ops/src/ && rm -rf "$saved"
    git reset -q -- crates/encore-ops/src/cuda
    [[ -x $exe ]] || { echo "cuda_ops did not build with $before's kernels" >&2; exit 1; }
    strip -o "$stage/bin/cuda_ops-before" "$exe"
    echo "== encore and synthetic_like of $before" >&2
    tree=target/before/tree
    git worktree remove --force "$tree" 2>/dev/null || rm -rf "$tree"
    git worktree add --force --detach "$tree" "$before" >&2
    (cd "$tree" && CARGO_TARGET_DIR=../target cargo build --release -p encore-cli >&2 \
        && CARGO_TARGET_DIR=../target cargo build --release -p encore-llm --example synthetic_like >&2)
    strip -o "$stage/bin/encore-before" target/before/target/release/encore
    strip -o "$stage/bin/synthetic_like-before" target/before/target/release/examples/synthetic_like
    git worktree remove --force "$tree"
fi
echo "== building (release)" >&2
cargo build --release -p encore-cli >&2
cargo build --release -p encore-llm --example synthetic_model >&2
strip -o "$stage/bin/encore" target/release/encore
strip -o "$stage/bin/synthetic_model" target/release/examples/synthetic_model
for t in encore-ops:cuda_ops encore-llm:cuda_engine; do
    exe=$(test_exe "${t%%:*}" "${t#*:}")
    strip -o "$stage/bin/${t#*:}" "$exe"
done
[[ -n $before_encore ]] && strip -o "$stage/bin/encore-before" "$before_encore"
tar -C "$stage" -cf - bin | xz -6 -T0 >"$stage/bins.tar.xz"
rm -rf "$stage/bin"
cp scripts/gpu-full-size-run.sh "$stage/run.sh"
cp scripts/gguf_header.py "$stage/"
if [[ $peer == yes ]]; then
    "${LLAMA_CPP_SH:-../shared/tools/llama-cpp.sh}" --source "$stage" >&2
    cp scripts/peer-bench.sh scripts/llama-cuda-build.sh "$stage/"
fi
size=$(du -sb "$stage" | cut -f1)
echo "== staged $((size / 1024 / 1024)) MiB in $stage/" >&2
cat <<'CALL'
One device call (or several, naming the steps: cold gemm engine bench
serve repro; see scripts/gpu-full-size-run.sh):
  run(command="bash .gpu-full/run.sh", carry=[".gpu-full"], timeout_s=600)
ENCORE_FULL_MODELS="qwen2.5-7b:q4_k_m llama-3.1-8b:q8_0" (before the command)
picks the shapes and types (default qwen2.5-7b:q4_k_m); logs come back
under $OUT (summary.txt first).
CALL
