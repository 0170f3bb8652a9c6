#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, what
# scripts/gpu-full-size.sh staged in .gpu-full/ (copied there as run.sh):
#
#   bash .gpu-full/run.sh [STEP...]      every step, or the named ones:
#
#   cold    `encore generate` of 8 tokens from an empty kernel cache, then
#           again from a warm one (time to the first token)
#   gemm    the tests of cuda_ops of the tiled product (and of cuda_ops-before, built with
#           an earlier revision's kernels, where staged: a new test should
#           fail there)
#   dense   the tests of cuda_ops of the long prompts' products on
#           dequantized tiles
#   ops     the tests of cuda_ops of the decode products (8-bit
#           activations, full-size rows, fused blocks, output heads)
#   engine  cuda_engine's full_size_models_on_cuda_match_cpu: prefill,
#           decode and the paged batch against the CPU
#   bench   `encore bench`: pp512, and tg128 from a one-token prompt
#   profile `encore bench --profile` of 32 decode steps: time by dispatch
#   ab      where an earlier encore is staged (`--before-encore`): decode
#           tg128 and prefill pp512 of ENCORE_AB_MODEL (a path; the first
#           model by default) by it and by this one, alternated
#           ENCORE_AB_ROUNDS times (3), each build's figures
#   serve   `encore serve` warms up on the model and answers a chat request
#   peer-build  where llama.cpp's trimmed source is staged (`--peer`):
#           starts its CUDA build (llama-bench) in the background; make the
#           `peer` call while the machine is warm (the build takes about
#           five minutes; NVRTC compiles beside it are slow, so benchmarks
#           wait for `peer`)
#   peer    waits for that build, then Encore against llama-bench on each
#           model (scripts/peer-bench.sh, alternated, ENCORE_PEER_ROUNDS
#           rounds, default 2): pp512 with tg128, and pp4096
#   repro   where an earlier revision's encore and synthetic_like are staged
#           (`--before`): a 7B-shaped file made by the earlier generator
#           (biased weights whose feed-forward outputs pass f16's range),
#           then its prefill by the earlier encore (which failed with NaN
#           logits) and by this one, and this one's server warming up on it
#
# The models are ENCORE_FULL_MODELS ("SHAPE:TYPE ...", default
# "qwen2.5-7b:q4_k_m"), written with realistic random weights by
# `synthetic_model` (encore_llm::synthetic) into /tmp/encore-full/models.
# Logs go to $OUT (summary.txt: a line a step with its result and time).
# The call keeps to ENCORE_GPU_BUDGET seconds (540) of the device tool's 600.
set -uo pipefail
cd "$(dirname "$0")/.."
stage=.gpu-full
out=${OUT:-gpu-out}
work=/tmp/encore-full
budget=${ENCORE_GPU_BUDGET:-540}
steps=${*:-cold gemm dense ops engine bench serve repro ab}
mkdir -p "$out" "$work/models"
[[ -f $stage/bins.tar.xz && ! -x $stage/bin/encore ]] && tar -C "$stage" -xJf "$stage/bins.tar.xz"
bin=$stage/bin
export ENCORE_CACHE_DIR=$work/kernels
export RUST_BACKTRACE=1
summary=()
note() { summary+=("$*"); echo "== $*"; }
left() { echo $((budget - SECONDS)); }
wants() { [[ " $steps " == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"

# run NAME LIMIT CMD...: runs CMD with its output in $out/NAME.log, limited
# to LIMIT seconds or what is left of the budget, and notes the result.
run() {
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    (( $(left) < 20 )) && { note "$name: skipped for time"; return 1; }
    (( limit > $(left) )) && limit=$(left)
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    note "$name: rc=$rc ($(( SECONDS - start )) s) $(grep -E '^test result' "$out/$name.log" | tr '\n' ' ')"
    return $rc
}

# serve NAME MODEL [ENCORE]: starts the server on MODEL, waits for it to
# warm up, asks one chat question and stops it.
serve() {
    local name=$1 model=$2 encore=${3:-$bin/encore} start=$SECONDS ready=no answer=""
    (( $(left) < 60 )) && { note "$name: skipped for time"; return; }
    setsid "$encore" serve --model "$model" --device cuda --port 8091 --parallel 4 -c 2048 >"$out/$name.log" 2>&1 &
    local pid=$!
    for _ in $(seq 120); do
        curl -sf localhost:8091/health >/dev/null 2>&1 && { ready=yes; break; }
        kill -0 $pid 2>/dev/null || break
        sleep 1
    done
    [[ $ready == yes ]] && answer=$(curl -s -m 60 localhost:8091/v1/chat/completions \
        -H 'content-type: application/json' \
        -d "{\"model\":\"$(basename "$model" .gguf)\",\"messages\":[{\"role\":\"user\",\"content\":\"Name three colors.\"}],\"max_tokens\":16,\"temperature\":0}")
    kill -TERM -- -$pid 2>/dev/null; wait $pid 2>/dev/null
    note "$name: ready=$ready ($(( SECONDS - start )) s): ${answer:0:200} $(grep -m1 -iE 'error|not finite' "$out/$name.log")"
}

for spec in ${ENCORE_FULL_MODELS:-qwen2.5-7b:q4_k_m}; do
    model=$work/models/${spec%%:*}-${spec#*:}.gguf
    [[ -f $model ]] && continue
    start=$SECONDS
    "$bin/synthetic_model" "${spec%%:*}" "${spec#*:}" "$model" 2>"$out/write-${spec/:/-}.log"
    note "write $spec: rc=$? $(( SECONDS - start )) s, $(stat -c %s "$model" 2>/dev/null) bytes"
done
models=("$work"/models/*.gguf)

if wants repro && [[ -x $bin/encore-before && -x $bin/synthetic_like-before ]]; then
    biased=$work/biased-7b.gguf
    if [[ ! -f $biased ]]; then
        "$bin/synthetic_model" qwen2.5-7b q4_k_m "$work/template.gguf" 2>/dev/null
        python3 "$stage/gguf_header.py" "$work/template.gguf" "$work/header.gguf"
        truncate -s "$(cat "$work/header.gguf.size")" "$work/header.gguf"
        "$bin/synthetic_like-before" "$work/header.gguf" "$biased"
        rm -f "$work/template.gguf"
    fi
    # The earlier encore compiles its own kernels (their sources differ).
    run repro-prefill-before 200 env ENCORE_CACHE_DIR=$work/kernels-before "$bin/encore-before" bench \
        --model "$biased" --device cuda --prompt-tokens 64 --gen-tokens 1 --repeats 1
    summary+=("$(tail -n 2 "$out/repro-prefill-before.log")")
    run repro-prefill 150 "$bin/encore" bench --model "$biased" --device cuda --prompt-tokens 64 --gen-tokens 1 --repeats 1
    summary+=("$(tail -n 3 "$out/repro-prefill.log")")
    serve repro-serve "$biased"
fi
if wants cold; then
    for model in "${models[@]}"; do
        m=$(basename "$model" .gguf)
        rm -rf "$ENCORE_CACHE_DIR"
        run "generate-cold-$m" 240 "$bin/encore" generate --model "$model" --device cuda --raw -n 8 "The capital of France is"
        run "generate-warm-$m" 120 "$bin/encore" generate --model "$model" --device cuda --raw -n 8 "The capital of France is"
        summary+=("$(grep -hE 'loaded|prefill' "$out/generate-cold-$m.log" "$out/generate-warm-$m.log")")
    done
fi
if wants gemm; then
    [[ -x $bin/cuda_ops-before ]] &&
        run cuda_ops-before 150 "$bin/cuda_ops-before" --ignored --show-output gemm_keeps_activations_beyond_f16_range_finite
    run cuda_ops-gemm 240 "$bin/cuda_ops" --ignored --show-output --test-threads 4 gemm tiled matmul_rows
    summary+=("$(grep -hE 'panicked|vs' "$out"/cuda_ops-*.log | head -4)")
fi
if wants dense; then
    run cuda_ops-dense 300 "$bin/cuda_ops" --ignored --show-output --test-threads 4 long_prompt_products
    summary+=("$(grep -hE 'panicked|^test result' "$out/cuda_ops-dense.log" | head -6)")
fi
if wants ops; then
    run cuda_ops-decode 300 "$bin/cuda_ops" --ignored --show-output --test-threads 4 \
        super_block_decode eight_bit matmul_matches_cpu matmul_with_a_large fused_block split_decode \
        specialized_graph row_fused paged_decode_step
    summary+=("$(grep -hE 'panicked|^test result' "$out/cuda_ops-decode.log" | head -6)")
fi
if wants engine; then
    ENCORE_FULL_SIZE_MODELS=$work/models run cuda_engine-full-size 300 \
        "$bin/cuda_engine" --ignored --show-output --exact full_size_models_on_cuda_match_cpu
    summary+=("$(grep -E 'relative error|greedy tokens|panicked' "$out/cuda_engine-full-size.log")")
fi
if wants bench; then
    for model in "${models[@]}"; do
        m=$(basename "$model" .gguf)
        run "bench-pp512-$m" 120 "$bin/encore" bench --model "$model" --device cuda --prompt-tokens 512 --gen-tokens 1 --repeats 5 --json
        run "bench-tg128-$m" 120 "$bin/encore" bench --model "$model" --device cuda --prompt-tokens 1 --gen-tokens 128 --repeats 5 --json
        summary+=("$(cat "$out/bench-pp512-$m.log" "$out/bench-tg128-$m.log" | grep -E '^\{' | python3 -c '
import json, sys
for line in sys.stdin:
    d = json.loads(line)
    print(d["model"], "pp%d %.1f tok/s" % (d["prompt_tokens"], d["prefill_tok_s"]),
          "tg%d %.1f tok/s" % (d["gen_tokens"], d["decode_tok_s"]), "step %s us" % d["decode_step_device_us"],
          "host rss %s" % d.get("host_rss_bytes"))
')")
    done
fi
if wants profile; then
    for model in "${models[@]}"; do
        m=$(basename "$model" .gguf)
        run "profile-$m" 120 "$bin/encore" bench --model "$model" --device cuda --prompt-tokens 1 --gen-tokens 32 --repeats 1 --profile
    done
fi
if wants ab && [[ -x $bin/encore-before ]]; then
    model=${ENCORE_AB_MODEL:-${models[0]}}
    for b in encore-before encore; do
        run "ab-warm-$b" 200 "$bin/$b" bench --model "$model" --device cuda --prompt-tokens 512 --gen-tokens 8 --repeats 1
    done
    for round in $(seq "${ENCORE_AB_ROUNDS:-3}"); do
        for b in encore-before encore; do
            for shape in "1 128" "512 1"; do
                set -- $shape
                timeout 120 "$bin/$b" bench --model "$model" --device cuda --prompt-tokens "$1" --gen-tokens "$2" \
                    --repeats 5 --json 2>/dev/null | grep -E '^\{' | sed "s/^/$b /" >>"$out/ab.log"
            done
        done
    done
    summary+=("$(python3 -c '
import json, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    build, record = line.split(" ", 1)
    d = json.loads(record)
    key = (build, "tg%d" % d["gen_tokens"] if d["prompt_tokens"] == 1 else "pp%d" % d["prompt_tokens"])
    runs.setdefault(key, []).append(d["decode_tok_s"] if key[1].startswith("tg") else d["prefill_tok_s"])
for (build, work), v in sorted(runs.items()):
    print("ab", build, work, "median %.1f tok/s of %s" % (statistics.median(v), ", ".join("%.1f" % x for x in v)))
' "$out/ab.log")")
fi
llama=$work/llama
if wants peer-build && [[ -f $stage/llama-src.tgz && ! -f $llama/started ]]; then
    bash "$stage/llama-cuda-build.sh" "$stage/llama-src.tgz" "$llama"
    note "peer-build: started"
fi
if wants peer && [[ -f $llama/started ]]; then
    while [[ ! -f $llama/finished ]] && (( $(left) > 200 )); do sleep 5; done
    if [[ -x $llama/build/bin/llama-bench ]]; then
        for model in "${models[@]}"; do
            timeout 200 "$bin/encore" generate --model "$model" --device cuda -n 4 hi >/dev/null 2>&1
            for shape in "512 128" "4096 16"; do
                set -- $shape
                run "peer-$(basename "$model" .gguf)-pp$1" 300 bash "$stage/peer-bench.sh" "$bin/encore" \
                    "$llama/build/bin" "$model" cuda "$1" "$2" "${ENCORE_PEER_ROUNDS:-2}"
                summary+=("$(cat "$out/peer-$(basename "$model" .gguf)-pp$1.log")")
            done
        done
    else
        note "peer: llama.cpp did not build in time ($(tail -c 200 "$llama/build.log" 2>/dev/null | tail -n 1))"
    fi
fi
if wants serve; then
    for model in "${models[@]}"; do serve "serve-$(basename "$model" .gguf)" "$model"; done
fi
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
