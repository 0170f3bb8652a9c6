#!/usr/bin/env bash
# Perplexity of the default model requantized to every weight type Encore
# reads, by llama.cpp's llama-perplexity and by `encore perplexity`, side by
# side on the same files, text and chunk size (CPU, 2 threads).
#
#   scripts/quant-ppl.sh LLAMA_CPP_BIN_DIR [TEXT]
#
# LLAMA_CPP_BIN_DIR holds llama-quantize and llama-perplexity (built by
# ../shared/tools/llama-cpp.sh). Prints one table row per type: the two
# perplexities and their relative difference.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:?usage: scripts/quant-ppl.sh LLAMA_CPP_BIN_DIR [TEXT]}
text=${2:-crates/encore-llm/tests/data/perplexity.txt}
cargo build --release -q -p encore-cli
encore=target/release/encore
src=$("$encore" models --json 2>/dev/null | python3 -c 'import json,sys; print(next(m["path"] for m in json.load(sys.stdin)["models"] if m["name"]=="smollm2-135m"))' 2>/dev/null || true)
[ -n "$src" ] && [ -f "$src" ] || src=$HOME/.cache/encore/models/SmolLM2-135M-Instruct.Q4_1.gguf
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
ppl() { grep -oE 'PPL = [0-9.]+' | tail -1 | cut -d' ' -f3; }
echo "| type | llama.cpp | Encore | difference |"
echo "| --- | --- | --- | --- |"
for t in F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q2_K Q3_K_M Q4_K_M Q5_K_M Q6_K IQ4_NL IQ4_XS; do
    f=$work/$t.gguf
    "$bin/llama-quantize" --allow-requantize "$src" "$f" "$t" 2 >"$work/q.log" 2>&1 || { echo "| $t | quantize failed | | |"; continue; }
    ref=$("$bin/llama-perplexity" -m "$f" -f "$text" -c 512 -t 2 2>&1 | ppl)
    ours=$("$encore" perplexity --model "$f" --device cpu "$text" 2>/dev/null | ppl)
    diff=$(python3 -c "print(f'{abs($ours/$ref-1)*100:.2f}%')")
    echo "| $t | $ref | $ours | $diff |"
    rm -f "$f"
done
