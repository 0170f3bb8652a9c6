#!/usr/bin/env bash
# Encore's server and llama.cpp's llama-server side by side on one model
# and device: for each number of concurrent streams, the load of
# scripts/serve-load.py runs against Encore, then against llama-server
# (alternating), and one JSON line per run goes to stdout.
#
#   scripts/serve-bench.sh ENCORE_BIN LLAMA_SERVER_BIN MODEL.gguf DEVICE [STREAMS]
#
# DEVICE is `cpu` (both on all the machine's cores) or `cuda`
# (llama-server with every layer offloaded). STREAMS defaults to 1,8,32,64.
set -euo pipefail
encore=$1 llama=$2 model=$3 device=$4 streams=${5:-1,8,32,64}
here=$(cd "$(dirname "$0")" && pwd)
max=$(tr , '\n' <<<"$streams" | sort -n | tail -1)
ctx=512
threads=$(nproc)
"$encore" serve --model "$model" --device "$device" --port 18431 --parallel "$max" -c "$ctx" \
    >/tmp/encore-serve.log 2>&1 &
epid=$!
ngl=0; [[ $device == cuda* ]] && ngl=99
"$llama" -m "$model" --port 18432 -np "$max" -c $((ctx * max)) -ngl $ngl -t "$threads" -fa on \
    --cont-batching >/tmp/llama-server.log 2>&1 &
lpid=$!
trap 'kill $epid $lpid 2>/dev/null || true' EXIT
for port in 18431 18432; do
    for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
        sleep 0.5
    done
done
for n in ${streams//,/ }; do
    python3 "$here/serve-load.py" http://127.0.0.1:18431 encore --streams "$n"
    python3 "$here/serve-load.py" http://127.0.0.1:18432 llama-server --streams "$n"
done
