#!/usr/bin/env bash
# Runs the staged GPU suite on the GPU machine, from the repository root:
# every test binary in .gpu/tests with --ignored --show-output (what passing
# tests print, such as seeds and speeds), then the benchmarks in
# .gpu/benches, then `encore bench` on CUDA with the synthetic SmolLM2 that
# the cuda_engine test writes. Logs go to $OUT (or ./gpu-out without it).
# Staged by scripts/gpu-suite.sh, which copies this script to .gpu/run.sh.
#
#   bash .gpu/run.sh                  everything (one device call)
#   bash .gpu/run.sh NAME...          only the named test binaries and
#                                     benchmarks, then the encore bench;
#                                     `tests` names every test binary,
#                                     `benches` every benchmark
#
# The device tool ends a call after 600 s, so the run keeps to a budget
# (ENCORE_GPU_BUDGET, 540 s): each step's time limit is its own or what is
# left of the budget, whichever is less, and a step that finds under 20 s
# left is skipped; the summary names what was skipped and the call that
# runs it.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
export RUST_BACKTRACE=1
# The binaries come packed (scripts/gpu-suite.sh).
if [[ -f .gpu/bins.tar.xz ]]; then
    tar -C .gpu -xJf .gpu/bins.tar.xz
fi
# The catalog models' headers, made sparse files of their full size, for
# the cuda_engine tests (which write models of their shapes and types with
# random weights to ENCORE_SYNTHETIC_DIR, for the benchmarks).
if compgen -G ".gpu/templates/*.gguf" >/dev/null; then
    mkdir -p /tmp/encore-templates
    for t in .gpu/templates/*.gguf; do
        cp "$t" /tmp/encore-templates/ && truncate -s "$(cat "$t.size")" "/tmp/encore-templates/${t##*/}"
    done
    export ENCORE_MODEL_TEMPLATES=/tmp/encore-templates
fi
export ENCORE_SYNTHETIC_DIR=${ENCORE_SYNTHETIC_DIR:-/tmp/encore-synthetic}
# The cuda_engine test writes the synthetic SmolLM2 here for the encore bench.
export ENCORE_SYNTHETIC_GGUF=${ENCORE_SYNTHETIC_GGUF:-/tmp/encore-synthetic/smollm2-135m-q4_1.gguf}
# One kernel cache for the whole run: the CLI and the GPU tests take
# ENCORE_CACHE_DIR, programs on Config::default() the user cache dir. The
# first test binary compiles every kernel's generic code at once, and a
# shape variant compiled once serves every later binary (the cache is
# content-addressed: a kernel's source, options and compiler are its key).
export XDG_CACHE_HOME=/tmp/encore-gpu-cache
export ENCORE_CACHE_DIR=$XDG_CACHE_HOME/encore
budget=${ENCORE_GPU_BUDGET:-540}

# Whether a staged binary was asked for (every one when no names are given):
# wanted NAME GROUP ARG...
wanted() {
    (( $# == 2 )) && return 0
    local name=$1 group=$2 w
    shift 2
    for w in "$@"; do [[ $w == "$name" || $w == "$group" ]] && return 0; done
    return 1
}

# fits LIMIT NAME: sets step_limit to LIMIT or what is left of the budget,
# whichever is less; with under 20 s left, records NAME as skipped and fails.
skipped=()
fits() {
    local left=$((budget - SECONDS))
    if (( left < 20 )); then
        skipped+=("$2")
        return 1
    fi
    step_limit=$(( $1 < left ? $1 : left ))
}

# Test threads of a binary. Tests that only compare results run at once:
# they share the GPU, and most of their time is NVRTC compiling kernels, a
# core a compilation. A binary whose tests measure memory or count what a
# device or its cache did runs them one at a time, and tests named in
# `alone` (speed) run by themselves after the rest of their binary.
test_threads() {
    case $1 in
        cuda_ops) echo 8 ;;
        cuda_engine) echo 4 ;;
        *) echo 1 ;;
    esac
}
alone=decode_speed

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1
    [[ -x .gpu/bin/encore ]] && .gpu/bin/encore devices 2>&1
} | tee "$out/device.txt"

# cuda_ops first: it compiles every kernel's generic code at once into the
# shared cache. Then the rest, in name order.
tests=()
for name in cuda_ops cuda_engine; do
    [[ -x .gpu/tests/$name ]] && tests+=(".gpu/tests/$name")
done
for t in .gpu/tests/*; do
    [[ " ${tests[*]} " == *" $t "* ]] || tests+=("$t")
done
summary=()
status=0
for t in "${tests[@]}"; do
    name=$(basename "$t")
    wanted "$name" tests "$@" || continue
    fits 300 "$name" || continue
    echo "== test $name"
    start=$SECONDS
    log=$out/test-$name.log
    threads=$(test_threads "$name")
    # The default model's tests run with the real model below.
    skip=(--skip real_model_on_cuda)
    (( threads > 1 )) && skip+=(--skip "$alone")
    timeout "$step_limit" "$t" --ignored --test-threads="$threads" --show-output "${skip[@]}" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    if (( threads > 1 )) && "$t" --ignored --list 2>/dev/null | grep -q "$alone"; then
        if fits $((300 - (SECONDS - start))) "$name:$alone"; then
            timeout "$step_limit" "$t" --ignored --test-threads=1 --show-output "$alone" 2>&1 | tee -a "$log"
            (( rc == 0 )) && rc=${PIPESTATUS[0]}
        fi
    fi
    (( rc == 0 )) || status=1
    summary+=("test $name: rc=$rc ($((SECONDS - start)) s, $threads threads) $(grep -E '^test result' "$log" | tr '\n' ' ')")
    summary+=("$(grep -E '^test .* \.\.\. ' "$log")")
done
for b in .gpu/benches/*; do
    name=$(basename "$b")
    wanted "$name" benches "$@" || continue
    fits 240 "$name" || continue
    echo "== bench $name"
    start=$SECONDS
    timeout "$step_limit" "$b" 2>&1 | tee "$out/bench-$name.log"
    rc=${PIPESTATUS[0]}
    (( rc == 0 )) || status=1
    summary+=("bench $name: rc=$rc ($((SECONDS - start)) s)")
done

# within LIMIT CMD...: runs CMD with LIMIT or what is left of the budget as
# its time limit, whichever is less, or says it was skipped (for steps made
# of several commands, inside one log).
within() {
    local limit=$1 left=$((budget - SECONDS))
    shift
    if (( left < 10 )); then
        echo "skipped for time: $*"
        return 124
    fi
    timeout $(( limit < left ? limit : left )) "$@"
}

# Decode speed of the engine on CUDA: graph replay (the default), with the
# kernels' generic code instead of shape-specialized variants, without
# early launch, again with both (to see the run-to-run spread), eager steps,
# and graph replay with per-dispatch GPU times.
if [[ -x .gpu/bin/encore && -f $ENCORE_SYNTHETIC_GGUF ]] && fits 300 encore; then
    echo "== bench encore"
    start=$SECONDS
    bench=(.gpu/bin/encore bench --device cuda --model "$ENCORE_SYNTHETIC_GGUF")
    {
        echo "-- graph replay"
        within 120 "${bench[@]}" 2>&1
        rc=$?
        echo "-- graph replay, generic kernels (ENCORE_SPECIALIZE=0)"
        ENCORE_SPECIALIZE=0 within 120 "${bench[@]}" 2>&1
        echo "-- graph replay, early launch off (ENCORE_EARLY_LAUNCH=0)"
        ENCORE_EARLY_LAUNCH=0 within 120 "${bench[@]}" 2>&1
        echo "-- graph replay again"
        within 120 "${bench[@]}" 2>&1
        echo "-- eager (ENCORE_GRAPHS=0)"
        ENCORE_GRAPHS=0 within 120 "${bench[@]}" 2>&1
        echo "-- graph replay, exact kernels (--exact)"
        within 120 "${bench[@]}" --exact 2>&1
        echo "-- graph replay, per-dispatch profile"
        within 120 "${bench[@]}" --repeats 1 --profile dispatches 2>&1
        echo "-- continuous batching (the serving scheduler, no HTTP)"
        within 180 "${bench[@]}" --parallel 1,8,32,64 --gen-tokens 128 --repeats 3 2>&1
        exit $rc
    } | tee "$out/bench-encore.log"
    rc=${PIPESTATUS[0]}
    (( rc == 0 )) || status=1
    summary+=("bench encore: rc=$rc ($((SECONDS - start)) s) $(grep -c '^skipped for time' "$out/bench-encore.log") runs skipped for time")
elif [[ ! -x .gpu/bin/encore || ! -f $ENCORE_SYNTHETIC_GGUF ]]; then
    summary+=("bench encore: skipped (no encore binary or no $ENCORE_SYNTHETIC_GGUF)")
fi

# The default model, when staged in parts by `scripts/gpu-suite.sh
# --real-model`: greedy continuations on CUDA against the CPU backend's
# (first 32 tokens of several raw prompts), with the default kernels and
# with the exact ones (which must all be equal), and the CUDA bench on it.
if [[ -x .gpu/bin/encore ]] && compgen -G ".gpu-model/part-*" >/dev/null && wanted real - "$@" \
    && fits 600 real; then
    echo "== real model"
    start=$SECONDS
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
                cpu=$(within 60 .gpu/bin/encore generate --model "$model" --device cpu --temperature 0 --raw -n 32 "$prompt" 2>/dev/null)
                gpu=$(within 60 .gpu/bin/encore generate --model "$model" --device cuda "${flags[@]}" --temperature 0 --raw -n 32 "$prompt" 2>/dev/null)
                if [[ "$cpu" == "$gpu" ]]; then
                    same=$((same + 1))
                    echo "SAME ($mode) $prompt"
                else
                    echo "DIFF ($mode) $prompt"
                    echo "  cpu:  ${cpu:0:200}"
                    echo "  cuda: ${gpu:0:200}"
                fi
            done <scripts/greedy-prompts.txt
            echo "greedy CPU vs CUDA ($mode kernels) on the real model: $same of $total identical over 32 tokens"
        done
        ENCORE_TEST_MODEL=$model within 300 .gpu/tests/cuda_engine --ignored real_model_on_cuda \
            --show-output --test-threads=1
        # The serving scheduler on CUDA: the same tokens alone and in a
        # batch, after preemption and from the prefix cache.
        ENCORE_TEST_DEVICE=cuda ENCORE_TEST_MODEL=$model within 300 .gpu-model/serving \
            --show-output --test-threads=1
        within 180 .gpu/bin/encore bench --device cuda --model "$model" --parallel 1,8,32,64 \
            --gen-tokens 128 --repeats 3
        within 120 .gpu/bin/encore bench --device cuda --model "$model" --repeats 5
        within 120 .gpu/bin/encore bench --device cuda --model "$model" --prompt-tokens 512 --gen-tokens 128 --repeats 5
        within 120 .gpu/bin/encore bench --device cuda --model "$model" --exact --repeats 5
    } 2>&1 | tee "$out/real-model.log"
    summary+=("real model: $((SECONDS - start)) s")
    summary+=("$(grep -E 'greedy CPU vs CUDA|fed the CPU|exact kernels:|^test result|^test .* \.\.\. |^skipped for time' "$out/real-model.log")")
    summary+=("$(grep -E '^device' "$out/real-model.log" | sed 's/^/real model: /')")
fi

# The one-shot capture under an Nsight tool: the captured decode step must
# appear as an NVTX range with one range per dispatch inside it. With Nsight
# Systems the ranges are listed; with Nsight Compute, kernels are profiled
# only inside the captured step's range, so profiled kernels prove the range.
if [[ -x .gpu/bin/encore && -f $ENCORE_SYNTHETIC_GGUF ]] && wanted nvtx - "$@" && fits 300 nvtx; then
    echo "== nvtx capture"
    start=$SECONDS
    gen=(.gpu/bin/encore generate --model "$ENCORE_SYNTHETIC_GGUF" --device cuda --temperature 0 --raw -n 8 hi)
    export ENCORE_CAPTURE=/tmp/encore-step3.json ENCORE_CAPTURE_AT=3
    if command -v nsys >/dev/null; then
        {
            within 180 nsys profile --capture-range=cudaProfilerApi --trace=cuda,nvtx \
                --force-overwrite=true -o /tmp/encore-nvtx "${gen[@]}"
            within 120 nsys stats --report nvtx_sum --force-export=true /tmp/encore-nvtx.nsys-rep
        } >"$out/nvtx.log" 2>&1
    elif command -v ncu >/dev/null; then
        for filter in "encore@encore graph replay 3/" "encore graph replay 3/"; do
            echo "-- ncu --nvtx-include '$filter'"
            within 180 ncu --nvtx --nvtx-include "$filter" --launch-count 4 --section LaunchStats "${gen[@]}" 2>&1 \
                | grep -E "^  [a-z_]+|NVTX|==PROF==|==WARNING==|==ERROR==" | head -40
        done >"$out/nvtx.log" 2>&1
    fi
    unset ENCORE_CAPTURE ENCORE_CAPTURE_AT
    ranges=$(grep -cE "graph replay 3|fused_matmul|attention|rope" "$out/nvtx.log" 2>/dev/null)
    summary+=("nvtx capture: ${ranges:-0} matching lines (nvtx.log, $((SECONDS - start)) s)")
fi

# Nsight Compute over a dozen kernels of replayed decode steps, when asked
# for by name: each kernel's duration, occupancy and where its warps stall,
# into ncu.log.
if [[ -x .gpu/bin/encore && -f $ENCORE_SYNTHETIC_GGUF ]] && (( $# > 0 )) && wanted ncu - "$@" \
    && command -v ncu >/dev/null && fits 300 ncu; then
    echo "== ncu"
    start=$SECONDS
    # Skips the prefill's and the first steps' launches: what follows are
    # nodes of replayed decode graphs, profiled one kernel at a time.
    timeout "$step_limit" ncu -k regex:'fused_matmul|attention_step|^matmul|argmax' --launch-skip 400 \
        --launch-count ${ENCORE_NCU_KERNELS:-12} \
        --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
        --section MemoryWorkloadAnalysis \
        .gpu/bin/encore generate --model "$ENCORE_SYNTHETIC_GGUF" --device cuda --temperature 0 --raw -n 16 hi \
        >"$out/ncu.log" 2>&1
    summary+=("ncu: $(grep -c 'Duration' "$out/ncu.log") kernels profiled (ncu.log, $((SECONDS - start)) s)")
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
            fits 240 "sanitizer-$tool-$name" || continue
            echo "== compute-sanitizer --tool $tool $name"
            start=$SECONDS
            log=$(mktemp)
            # API errors are not reported: the backend counts a kernel's
            # parameters by probing cuFuncGetParamInfo until it answers
            # CUDA_ERROR_INVALID_VALUE, which memcheck would list as errors.
            timeout "$step_limit" compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 99 \
                "$t" --ignored --test-threads=1 >"$log" 2>&1
            rc=$?
            (( rc == 0 )) || status=1
            sanitized+=("sanitizer $tool $name: rc=$rc ($((SECONDS - start)) s) $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|^test result' "$log" | tr '\n' ' ')")
            tail -n 5 "$log"
        done
    done
fi

echo "== summary"
summary+=("total: $SECONDS s of the ${budget} s budget")
if (( ${#skipped[@]} > 0 )); then
    status=1
    summary+=("skipped for time: ${skipped[*]}; run them in another call: bash .gpu/run.sh ${skipped[*]%%:*}")
fi
printf '%s\n' "${summary[@]}" "${sanitized[@]}" | tee "$out/summary.txt"
for b in .gpu/benches/*; do
    [[ -f "$out/bench-$(basename "$b").log" ]] || continue
    grep -vE '^\{' "$out/bench-$(basename "$b").log" | grep -E '^[a-z]+ +' || true
done | tee -a "$out/summary.txt"
grep -hE 'tok/s' "$out"/test-*.log "$out/bench-encore.log" 2>/dev/null | tee -a "$out/summary.txt"
exit $status
