#!/usr/bin/env bash
# Runs the staged GPU suite on the GPU machine, from the repository root:
# every test binary in .gpu/tests with --ignored --test-threads=1, then the
# benchmarks in .gpu/benches. Logs go to $OUT (or ./gpu-out without it).
# Staged by scripts/gpu-suite.sh, which copies this script to .gpu/run.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
export RUST_BACKTRACE=1

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1
    [[ -x .gpu/bin/encore ]] && .gpu/bin/encore devices 2>&1
} | tee "$out/device.txt"

summary=()
status=0
for t in .gpu/tests/*; do
    name=$(basename "$t")
    echo "== test $name"
    start=$(date +%s)
    timeout 300 "$t" --ignored --test-threads=1 2>&1 | tee "$out/test-$name.log"
    rc=${PIPESTATUS[0]}
    (( rc == 0 )) || status=1
    summary+=("test $name: rc=$rc ($(( $(date +%s) - start )) s) $(grep -E '^test result' "$out/test-$name.log" | tail -n 1)")
    summary+=("$(grep -E '^test .* \.\.\. ' "$out/test-$name.log")")
done
for b in .gpu/benches/*; do
    name=$(basename "$b")
    echo "== bench $name"
    timeout 240 "$b" 2>&1 | tee "$out/bench-$name.log"
    rc=${PIPESTATUS[0]}
    (( rc == 0 )) || status=1
    summary+=("bench $name: rc=$rc")
done

echo "== summary"
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
for b in .gpu/benches/*; do
    grep -vE '^\{' "$out/bench-$(basename "$b").log" | grep -E '^[a-z]+ +' || true
done | tee -a "$out/summary.txt"
exit $status
