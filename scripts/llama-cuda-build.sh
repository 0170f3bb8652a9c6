#!/usr/bin/env bash
# Starts llama.cpp's CUDA build (llama-bench) on the GPU machine in the
# background, from the trimmed source that ../shared/tools/llama-cpp.sh
# --source packs (llama-src.tgz), once per machine: the build takes about
# five minutes on 16 cores and goes on after the call that started it while
# the machine stays warm. `DIR/finished` appears when it ends (built or
# not); `DIR/build/bin/llama-bench` is the result.
#
#   scripts/llama-cuda-build.sh SRC_TGZ DIR
set -euo pipefail
src=${1:?usage: llama-cuda-build.sh SRC_TGZ DIR}
dir=${2:?usage: llama-cuda-build.sh SRC_TGZ DIR}
[[ -f $dir/started ]] && exit 0
mkdir -p "$dir"
tar xzf "$src" -C "$dir"
touch "$dir/started"
setsid nohup bash -c "cd $dir && cmake -S llama.cpp -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF >cmake.log 2>&1 \
    && cmake --build build -j$(nproc) --target llama-bench >build.log 2>&1; touch finished" \
    </dev/null >/dev/null 2>&1 &
