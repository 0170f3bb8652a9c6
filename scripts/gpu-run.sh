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
    timeout 300 "$t" --ignored --test-threads=1 --show-output 2>&1 | tee "$out/test-$name.log"
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

# Decode speed of the engine on CUDA: graph replay (the default), eager
# steps, and graph replay with per-dispatch GPU times.
if [[ -x .gpu/bin/encore && -f $ENCORE_SYNTHETIC_GGUF ]]; then
    echo "== bench encore"
    bench=(.gpu/bin/encore bench --device cuda --model "$ENCORE_SYNTHETIC_GGUF")
    {
        echo "-- graph replay"
        timeout 120 "${bench[@]}" 2>&1
        rc=$?
        echo "-- eager (ENCORE_GRAPHS=0)"
        ENCORE_GRAPHS=0 timeout 120 "${bench[@]}" 2>&1
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
