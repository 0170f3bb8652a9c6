#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, what
# scripts/gpu-full-size.sh staged in .gpu-full/ (copied there as run.sh):
#
# 1. writes each full-size model of ENCORE_FULL_MODELS ("SHAPE:TYPE ...",
#    default "qwen2.5-7b:q4_k_m") with realistic random weights
#    (`synthetic_model`, encore_llm::synthetic) into /tmp/encore-full;
# 2. the gemm tests of cuda_ops (and of cuda_ops-before, the kernels of an
#    earlier revision, where staged: a new test should fail there);
# 3. cuda_engine's full_size_models_on_cuda_match_cpu on those models;
# 4. for each model: `encore generate` of 8 tokens from an empty kernel cache
#    and again from a warm one (time to the first token), `encore bench`
#    (pp512, tg128 from a one-token prompt), and `encore serve` answering one
#    chat request.
#
# Logs go to $OUT (summary.txt: one line a step with its result and time).
# The call keeps to ENCORE_GPU_BUDGET seconds (540) of the device tool's 600.
set -uo pipefail
cd "$(dirname "$0")/.."
stage=.gpu-full
out=${OUT:-gpu-out}
work=/tmp/encore-full
budget=${ENCORE_GPU_BUDGET:-540}
mkdir -p "$out" "$work/models"
[[ -f $stage/bins.tar.xz && ! -x $stage/bin/encore ]] && tar -C "$stage" -xJf "$stage/bins.tar.xz"
bin=$stage/bin
export ENCORE_CACHE_DIR=$work/kernels
export RUST_BACKTRACE=1
summary=()
note() { summary+=("$*"); echo "== $*"; }
left() { echo $((budget - SECONDS)); }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"

for spec in ${ENCORE_FULL_MODELS:-qwen2.5-7b:q4_k_m}; do
    model=$work/models/${spec%%:*}-${spec#*:}.gguf
    [[ -f $model ]] && continue
    start=$SECONDS
    "$bin/synthetic_model" "${spec%%:*}" "${spec#*:}" "$model" 2>"$out/write-${spec/:/-}.log"
    note "write $spec: rc=$? $(( SECONDS - start )) s, $(stat -c %s "$model" 2>/dev/null) bytes"
done
models=("$work"/models/*.gguf)

# run NAME LIMIT CMD...: runs CMD with its output in $out/NAME.log, limited
# to LIMIT seconds or what is left of the budget, and notes the result.
run() {
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    (( $(left) < 20 )) && { note "$name: skipped for time"; return; }
    (( limit > $(left) )) && limit=$(left)
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    note "$name: rc=$rc ($(( SECONDS - start )) s) $(grep -E '^test result' "$out/$name.log" | tr '\n' ' ')"
}

# The first generate compiles every kernel it needs: from an empty cache.
for model in "${models[@]}"; do
    m=$(basename "$model" .gguf)
    rm -rf "$ENCORE_CACHE_DIR"
    run "generate-cold-$m" 240 "$bin/encore" generate --model "$model" --device cuda --raw -n 8 "The capital of France is"
    run "generate-warm-$m" 120 "$bin/encore" generate --model "$model" --device cuda --raw -n 8 "The capital of France is"
    summary+=("$(grep -hE 'load|prefill|decode|tok/s' "$out/generate-cold-$m.log" "$out/generate-warm-$m.log" | head -6)")
done
[[ -x $bin/cuda_ops-before ]] &&
    run cuda_ops-before 120 "$bin/cuda_ops-before" --ignored --show-output gemm_keeps_activations_beyond_f16_range_finite
run cuda_ops-gemm 240 "$bin/cuda_ops" --ignored --show-output --test-threads 4 gemm
ENCORE_FULL_SIZE_MODELS=$work/models run cuda_engine-full-size 300 \
    "$bin/cuda_engine" --ignored --show-output --exact full_size_models_on_cuda_match_cpu
summary+=("$(grep -E 'relative error|greedy tokens|panicked' "$out/cuda_engine-full-size.log")")
for model in "${models[@]}"; do
    m=$(basename "$model" .gguf)
    run "bench-pp512-$m" 120 "$bin/encore" bench --model "$model" --device cuda --prompt-tokens 512 --gen-tokens 1 --repeats 3 --json
    run "bench-tg128-$m" 120 "$bin/encore" bench --model "$model" --device cuda --prompt-tokens 1 --gen-tokens 128 --repeats 3 --json
    summary+=("$(cat "$out/bench-pp512-$m.log" "$out/bench-tg128-$m.log" | grep -E '^\{' | python3 -c '
import json, sys
for line in sys.stdin:
    d = json.loads(line)
    print(d["model"], "pp%d %.1f tok/s" % (d["prompt_tokens"], d["prefill_tok_s"]), "tg%d %.1f tok/s" % (d["gen_tokens"], d["decode_tok_s"]), "step %s us" % d["decode_step_device_us"])
')")
    # The server warms up on the model (a prompt through the paged batch), then answers.
    (( $(left) < 60 )) && { note "serve $m: skipped for time"; continue; }
    start=$SECONDS
    setsid "$bin/encore" serve --model "$model" --device cuda --port 8091 --parallel 4 -c 2048 >"$out/serve-$m.log" 2>&1 &
    pid=$!
    ready=no
    for _ in $(seq 120); do
        curl -sf localhost:8091/health >/dev/null 2>&1 && { ready=yes; break; }
        kill -0 $pid 2>/dev/null || break
        sleep 1
    done
    answer=$(curl -s -m 60 localhost:8091/v1/chat/completions -H 'content-type: application/json' \
        -d '{"messages":[{"role":"user","content":"Name three colors."}],"max_tokens":16,"temperature":0}')
    kill -TERM -- -$pid 2>/dev/null; wait $pid 2>/dev/null
    note "serve $m: ready=$ready ($(( SECONDS - start )) s): ${answer:0:300}"
done
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
