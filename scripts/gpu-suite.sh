#!/usr/bin/env bash
# Builds the GPU test suite and benchmarks here (no GPU or CUDA toolkit
# needed) and stages them, stripped, in .gpu/ for the device tool.
#
#   scripts/gpu-suite.sh      then make the device call it prints, which
#                             runs scripts/gpu-run.sh on the GPU machine.
#   scripts/gpu-suite.sh --real-model
#                             also stages the default model: three more
#                             calls, listed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

# With --real-model, also split the default model into .gpu-model/ in four
# parts, carried over three device calls beside .gpu (the device tool
# carries 64 MiB a call).
real_model=no
if [[ ${1:-} == --real-model ]]; then
    model=${ENCORE_REAL_MODEL:-${XDG_CACHE_HOME:-$HOME/.cache}/encore/models/SmolLM2-135M-Instruct.Q4_1.gguf}
    [[ -f $model ]] || { echo "set ENCORE_REAL_MODEL to the default model's GGUF file" >&2; exit 1; }
    rm -rf .gpu-model && mkdir -p .gpu-model
    split -b 24M -d "$model" .gpu-model/part-
    ls -l .gpu-model >&2
    real_model=yes
fi

# Test binaries as package:test.
tests=(encore:gpu encore:gpu_fault encore-ops:cuda_ops encore-llm:cuda_engine encore-llm:concurrency encore-llm:memory encore-llm:loading)
# Benchmarks as package:bench.
benches=(encore:cuda encore-ops:cuda_kernels)

echo "== building test binaries (release)" >&2
test_json=""
for pkg in $(printf '%s\n' "${tests[@]}" | cut -d: -f1 | sort -u); do
    test_args=()
    for t in "${tests[@]}"; do
        [[ ${t%%:*} == "$pkg" ]] && test_args+=(--test "${t#*:}")
    done
    test_json+=$(cargo test --release -p "$pkg" "${test_args[@]}" --no-run --message-format=json)
    test_json+=$'\n'
done

echo "== building benchmarks (release)" >&2
bench_json=""
for b in "${benches[@]}"; do
    bench_json+=$(cargo bench -p "${b%%:*}" --bench "${b#*:}" --no-run --message-format=json)
    bench_json+=$'\n'
done

echo "== building the encore binary (release)" >&2
cli=yes
if ! cargo build --release -p encore-cli >&2; then
    echo "warning: the encore binary did not build; staging the runtime suite without it" >&2
    cli=no
fi

# The executable of each named target, from cargo's JSON messages.
executable() { # json kind name
    jq -r --arg kind "$2" --arg name "$3" \
        'select(.reason == "compiler-artifact" and .executable != null
                and .target.name == $name and (.target.kind | index($kind)))
         | .executable' <<<"$1" | tail -n 1
}

rm -rf .gpu
mkdir -p .gpu/tests .gpu/benches .gpu/bin
for t in "${tests[@]#*:}"; do
    exe=$(executable "$test_json" test "$t")
    [[ -n "$exe" && -x "$exe" ]] || { echo "no executable for test $t" >&2; exit 1; }
    strip -o ".gpu/tests/$t" "$exe"
done
for b in "${benches[@]#*:}"; do
    exe=$(executable "$bench_json" bench "$b")
    [[ -n "$exe" && -x "$exe" ]] || { echo "no executable for bench $b" >&2; exit 1; }
    strip -o ".gpu/benches/$b" "$exe"
done
if [[ $cli == yes && -x target/release/encore ]]; then
    strip -o .gpu/bin/encore target/release/encore
fi
cp scripts/gpu-run.sh .gpu/run.sh
# The scheduler's tests run on the default model only; their binary goes
# with the model's last part (.gpu is full).
if [[ $real_model == yes ]]; then
    echo "== building the serving tests (release)" >&2
    json=$(cargo test --release -p encore-llm --test serving --no-run --message-format=json)
    exe=$(executable "$json" test serving)
    [[ -n "$exe" && -x "$exe" ]] || { echo "no executable for test serving" >&2; exit 1; }
    strip -o .gpu-model/serving "$exe"
fi

# The catalog models' headers (metadata and tensor list, a few MiB), with
# each file's full size: gpu-run.sh makes them sparse files of that size,
# and the cuda_engine tests fill models of their shapes and types with
# random weights (the real files are too large to carry).
mkdir -p .gpu/templates
for name in qwen2.5-coder-0.5b gemma-3-270m; do
    path=$(target/release/encore models --json 2>/dev/null | jq -r --arg n "$name" '.models[] | select(.name == $n and .state == "cached") | .path' || true)
    if [[ -z $path || ! -f $path ]]; then
        echo "note: $name is not cached (encore models); its CUDA tests will be skipped" >&2
        continue
    fi
    python3 scripts/gguf_header.py "$path" ".gpu/templates/$name.gguf"
done

# The binaries travel packed (xz takes them to about a quarter);
# gpu-run.sh unpacks them.
echo "== packing the binaries" >&2
tar -C .gpu -cf - tests benches bin | xz -6 -T0 >.gpu/bins.tar.xz
rm -rf .gpu/tests .gpu/benches .gpu/bin

size=$(du -sb .gpu | cut -f1)
echo "== staged $(find .gpu -type f | wc -l) files, $((size / 1024 / 1024)) MiB in .gpu/" >&2
if (( size > 60 * 1024 * 1024 )); then
    echo "error: .gpu is over 60 MiB; the device tool carries at most 64 MiB" >&2
    exit 1
fi
calls="1 device call"
if [[ $real_model == yes ]]; then calls="4 device calls"; fi
cat <<CALL
The GPU suite takes $calls:
  run(command="bash .gpu/run.sh", carry=[".gpu"], timeout_s=600)
CALL
if [[ $real_model == yes ]]; then
    cat <<'CALL'
  then, right after each other (the machine keeps .gpu, the first parts and
  the kernel cache while warm), the default model:
  run(command="true", carry=[".gpu", ".gpu-model/part-00"])
  run(command="true", carry=[".gpu-model/part-01", ".gpu-model/part-02"])
  run(command="bash .gpu/run.sh real", carry=[".gpu-model/part-03", ".gpu-model/serving"], timeout_s=600)
CALL
fi
cat <<'CALL'
The run keeps to 540 s of the call's 600 (ENCORE_GPU_BUDGET) and skips what
does not fit; its summary then names what it skipped and the call that runs
it, such as run(command="bash .gpu/run.sh benches", carry=[".gpu"]).
Logs come back under $OUT: device.txt, test-<name>.log for each test binary,
bench-<name>.log for each benchmark, bench-encore.log (encore bench on a
synthetic SmolLM2), summary.txt (each step's result and wall time).
  run(command="bash .gpu/run.sh cuda_ops cuda_engine", carry=[".gpu"]) runs only
those test binaries and the encore bench; `tests` names every test binary,
`benches` every benchmark.
CALL
