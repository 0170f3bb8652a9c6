#!/usr/bin/env bash
# Runs the staged GPU suite on the GPU machine, from the repository root:
# every test binary in .gpu/tests with --ignored --test-threads=1
# --show-output (what passing tests print, such as seeds and speeds), then the
# benchmarks in .gpu/benches, then `encore bench` on CUDA with the synthetic
# SmolLM2 that the cuda_engine test writes. Logs go to $OUT (or ./gpu-out
# without it). Staged by scripts/gpu-suite.sh, which copies this script to
# .gpu/run.sh.
#
#   bash .gpu/run.sh                  everything
#   bash .gpu/run.sh NAME...          only the named test binaries and
#                                     benchmarks, then the encore bench
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
export RUST_BACKTRACE=1
# The cuda_engine test writes the synthetic SmolLM2 here for the encore bench.
export ENCORE_SYNTHETIC_GGUF=${ENCORE_SYNTHETIC_GGUF:-/tmp/encore-synthetic/smollm2-135m-q4_1.gguf}

# Whether a staged binary was asked for (every one when no names are given).
wanted() {
    (( $# == 1 )) && return 0
    local name=$1 w
    shift
    for w in "$@"; do [[ $w == "$name" ]] && return 0; done
    return 1
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1
    [[ -x .gpu/bin/encore ]] && .gpu/bin/encore devices 2>&1
} | tee "$out/device.txt"

summary=()
status=0
for t in .gpu/tests/*; do
    name=$(basename "$t")
    wanted "$name" "$@" || continue
    echo "== test $name"
    start=$(date +%s)
    # The default model's test runs with the real model below.
    # cuda_ops compiles many kernel variants on a fresh machine (about 350 s).
    timeout 480 "$t" --ignored --test-threads=1 --show-output --skip real_model_on_cuda 2>&1 | tee "$out/test-$name.log"
    rc=${PIPESTATUS[0]}
    (( rc == 0 )) || status=1
    summary+=("test $name: rc=$rc ($(( $(date +%s) - start )) s) $(grep -E '^test result' "$out/test-$name.log" | tail -n 1)")
    summary+=("$(grep -E '^test .* \.\.\. ' "$out/test-$name.log")")
done
for b in .gpu/benches/*; do
    name=$(basename "$b")
    wanted "$name" "$@" || continue
    echo "== bench $name"
    timeout 240 "$b" 2>&1 | tee "$out/bench-$name.log"
    rc=${PIPESTATUS[0]}
    (( rc == 0 )) || status=1
    summary+=("bench $name: rc=$rc")
done

# Decode speed of the engine on CUDA: graph replay (the default), with the
# kernels' generic code instead of shape-specialized variants, without
# early launch, again with both (to see the run-to-run spread), eager steps,
# and graph replay with per-dispatch GPU times.
if [[ -x .gpu/bin/encore && -f $ENCORE_SYNTHETIC_GGUF ]]; then
    echo "== bench encore"
    bench=(.gpu/bin/encore bench --device cuda --model "$ENCORE_SYNTHETIC_GGUF")
    {
        echo "-- graph replay"
        timeout 120 "${bench[@]}" 2>&1
        rc=$?
        echo "-- graph replay, generic kernels (ENCORE_SPECIALIZE=0)"
        ENCORE_SPECIALIZE=0 timeout 120 "${bench[@]}" 2>&1
        echo "-- graph replay, early launch off (ENCORE_EARLY_LAUNCH=0)"
        ENCORE_EARLY_LAUNCH=0 timeout 120 "${bench[@]}" 2>&1
        echo "-- graph replay again"
        timeout 120 "${bench[@]}" 2>&1
        echo "-- eager (ENCORE_GRAPHS=0)"
        ENCORE_GRAPHS=0 timeout 120 "${bench[@]}" 2>&1
        echo "-- graph replay, exact kernels (--exact)"
        timeout 120 "${bench[@]}" --exact 2>&1
        echo "-- graph replay, per-dispatch profile"
        timeout 120 "${bench[@]}" --repeats 1 --profile dispatches 2>&1
        exit $rc
    } | tee "$out/bench-encore.log"
    rc=${PIPESTATUS[0]}
    (( rc == 0 )) || status=1
    summary+=("bench encore: rc=$rc")
else
    summary+=("bench encore: skipped (no encore binary or no $ENCORE_SYNTHETIC_GGUF)")
fi

# The default model, when staged in parts by `scripts/gpu-suite.sh
# --real-model`: greedy continuations on CUDA against the CPU backend's
# (first 32 tokens of several raw prompts), with the default kernels and
# with the exact ones (which must all be equal), and the CUDA bench on it.
if [[ -x .gpu/bin/encore ]] && compgen -G ".gpu-model/part-*" >/dev/null && wanted real "$@"; then
    echo "== real model"
    model=/tmp/encore-real/SmolLM2-135M-Instruct.Q4_1.gguf
    mkdir -p "$(dirname "$model")"
    cat .gpu-model/part-* >"$model"
    {
        sha256sum "$model"
        for mode in default exact; do
            flags=()
            [[ $mode == exact ]] && flags=(--exact)
            same=0
            total=0
            while IFS= read -r prompt; do
                total=$((total + 1))
                cpu=$(.gpu/bin/encore generate --model "$model" --device cpu --temperature 0 --raw -n 32 "$prompt" 2>/dev/null)
                gpu=$(.gpu/bin/encore generate --model "$model" --device cuda "${flags[@]}" --temperature 0 --raw -n 32 "$prompt" 2>/dev/null)
                if [[ "$cpu" == "$gpu" ]]; then
                    same=$((same + 1))
                    echo "SAME ($mode) $prompt"
                else
                    echo "DIFF ($mode) $prompt"
                    echo "  cpu:  ${cpu:0:200}"
                    echo "  cuda: ${gpu:0:200}"
                fi
            done <<'PROMPTS'
The capital of France is
Once upon a time
def fibonacci(n):
The quick brown fox
In 1969, the first
Water boils at
My favorite food is
The meaning of life is
PROMPTS
            echo "greedy CPU vs CUDA ($mode kernels) on the real model: $same of $total identical over 32 tokens"
        done
        ENCORE_TEST_MODEL=$model timeout 300 .gpu/tests/cuda_engine --ignored real_model_on_cuda \
            --show-output --test-threads=1
        timeout 120 .gpu/bin/encore bench --device cuda --model "$model" --repeats 5
        timeout 120 .gpu/bin/encore bench --device cuda --model "$model" --prompt-tokens 512 --gen-tokens 128 --repeats 5
        timeout 120 .gpu/bin/encore bench --device cuda --model "$model" --exact --repeats 5
    } 2>&1 | tee "$out/real-model.log"
    summary+=("$(grep -E 'greedy CPU vs CUDA|fed the CPU|exact kernels:|^test result' "$out/real-model.log")")
    summary+=("$(grep -E '^device' "$out/real-model.log" | sed 's/^/real model: /')")
fi

# The one-shot capture under an Nsight tool: the captured decode step must
# appear as an NVTX range with one range per dispatch inside it. With Nsight
# Systems the ranges are listed; with Nsight Compute, kernels are profiled
# only inside the captured step's range, so profiled kernels prove the range.
if [[ -x .gpu/bin/encore && -f $ENCORE_SYNTHETIC_GGUF ]] && wanted nvtx "$@"; then
    echo "== nvtx capture"
    gen=(.gpu/bin/encore generate --model "$ENCORE_SYNTHETIC_GGUF" --device cuda --temperature 0 --raw -n 8 hi)
    export ENCORE_CAPTURE=/tmp/encore-step3.json ENCORE_CAPTURE_AT=3
    if command -v nsys >/dev/null; then
        {
            timeout 180 nsys profile --capture-range=cudaProfilerApi --trace=cuda,nvtx \
                --force-overwrite=true -o /tmp/encore-nvtx "${gen[@]}"
            timeout 120 nsys stats --report nvtx_sum --force-export=true /tmp/encore-nvtx.nsys-rep
        } >"$out/nvtx.log" 2>&1
    elif command -v ncu >/dev/null; then
        for filter in "encore@encore graph replay 3/" "encore graph replay 3/"; do
            echo "-- ncu --nvtx-include '$filter'"
            timeout 180 ncu --nvtx --nvtx-include "$filter" --launch-count 4 --section LaunchStats "${gen[@]}" 2>&1 \
                | grep -E "^  [a-z_]+|NVTX|==PROF==|==WARNING==|==ERROR==" | head -40
        done >"$out/nvtx.log" 2>&1
    fi
    unset ENCORE_CAPTURE ENCORE_CAPTURE_AT
    ranges=$(grep -cE "graph replay 3|fused_matmul|attention|rope" "$out/nvtx.log" 2>/dev/null)
    summary+=("nvtx capture: ${ranges:-0} matching lines (nvtx.log)")
fi

# Nsight Compute over a dozen kernels of replayed decode steps, when asked
# for by name: each kernel's duration, occupancy and where its warps stall,
# into ncu.log.
if [[ -x .gpu/bin/encore && -f $ENCORE_SYNTHETIC_GGUF ]] && (( $# > 0 )) && wanted ncu "$@" && command -v ncu >/dev/null; then
    echo "== ncu"
    # Skips the prefill's and the first steps' launches: what follows are
    # nodes of replayed decode graphs, profiled one kernel at a time.
    timeout 300 ncu -k regex:'fused_matmul|attention_step|^matmul|argmax' --launch-skip 400 \
        --launch-count ${ENCORE_NCU_KERNELS:-12} \
        --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
        --section MemoryWorkloadAnalysis \
        .gpu/bin/encore generate --model "$ENCORE_SYNTHETIC_GGUF" --device cuda --temperature 0 --raw -n 16 hi \
        >"$out/ncu.log" 2>&1
    summary+=("ncu: $(grep -c 'Duration' "$out/ncu.log") kernels profiled (ncu.log)")
fi

# compute-sanitizer (memcheck and racecheck) over the CUDA runtime and op
# suites, when asked for with ENCORE_GPU_SANITIZE=1. Its report goes into the
# summary, which keeps the number of files under the device tool's limit.
sanitized=()
if [[ ${ENCORE_GPU_SANITIZE:-0} == 1 ]] && command -v compute-sanitizer >/dev/null; then
    for t in .gpu/tests/*; do
        name=$(basename "$t")
        [[ $name == *gpu_fault* || $name == *cuda_engine* ]] && continue
        for tool in memcheck racecheck; do
            echo "== compute-sanitizer --tool $tool $name"
            log=$(mktemp)
            # API errors are not reported: the backend counts a kernel's
            # parameters by probing cuFuncGetParamInfo until it answers
            # CUDA_ERROR_INVALID_VALUE, which memcheck would list as errors.
            timeout 240 compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 99 \
                "$t" --ignored --test-threads=1 >"$log" 2>&1
            rc=$?
            (( rc == 0 )) || status=1
            sanitized+=("sanitizer $tool $name: rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|^test result' "$log" | tr '\n' ' ')")
            tail -n 5 "$log"
        done
    done
fi

echo "== summary"
printf '%s\n' "${summary[@]}" "${sanitized[@]}" | tee "$out/summary.txt"
for b in .gpu/benches/*; do
    [[ -f "$out/bench-$(basename "$b").log" ]] || continue
    grep -vE '^\{' "$out/bench-$(basename "$b").log" | grep -E '^[a-z]+ +' || true
done | tee -a "$out/summary.txt"
grep -hE 'tok/s' "$out"/test-*.log "$out/bench-encore.log" 2>/dev/null | tee -a "$out/summary.txt"
exit $status
