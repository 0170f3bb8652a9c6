#!/usr/bin/env bash
# Encore against llama.cpp's llama-bench, side by side on one model file:
# the two alternate, ROUNDS times, and each figure is the median of its
# rounds.
#
#   scripts/peer-bench.sh ENCORE LLAMA_BIN_DIR MODEL DEVICE [PP] [TG] [ROUNDS]
#
# DEVICE is `cpu` (2 threads for both, as ENCORE_THREADS and -t) or `cuda`
# (llama.cpp with every layer on the GPU, CUDA graphs on). PP and TG are the
# prompt and generated token counts (default 128 and 64). llama-bench runs
# with flash attention on and measures decode from an empty context, and so
# does Encore here: its decode figure comes from a run of its own after a
# prompt of one token (ENCORE_PEER_DECODE_PROMPT=PP takes it after the
# prompt instead, a longer context). Prints one line per figure: Encore,
# llama.cpp, ratio.
set -euo pipefail
encore=${1:?usage: peer-bench.sh ENCORE LLAMA_BIN_DIR MODEL DEVICE [PP] [TG] [ROUNDS]}
bin=${2:?}; model=${3:?}; device=${4:?}
pp=${5:-128}; tg=${6:-64}; rounds=${7:-3}
decode_prompt=${ENCORE_PEER_DECODE_PROMPT:-1}
threads=2
llama_args=(-m "$model" -p "$pp" -n "$tg" -fa 1 -r 3 -o json)
if [[ $device == cpu ]]; then
    llama_args+=(-t "$threads" -ngl 0)
    export ENCORE_THREADS=$threads
else
    llama_args+=(-ngl 99)
fi
median() { sort -g | awk '{v[NR]=$1} END {print (NR % 2) ? v[(NR+1)/2] : (v[NR/2] + v[NR/2+1]) / 2}'; }
# A value from JSON text ($1) by a Python expression over it as `d` ($2).
field() { python3 -c "import json,sys; d = json.loads(sys.argv[1]); print($2)" "$1"; }
ours_pp=(); ours_tg=(); peer_pp=(); peer_tg=()
for r in $(seq "$rounds"); do
    j=$("$bin/llama-bench" "${llama_args[@]}" 2>/dev/null)
    peer_pp+=("$(field "$j" "next(r['avg_ts'] for r in d if r['n_prompt'] == $pp and r['n_gen'] == 0)")")
    peer_tg+=("$(field "$j" "next(r['avg_ts'] for r in d if r['n_gen'] == $tg and r['n_prompt'] == 0)")")
    j=$("$encore" bench --model "$model" --device "$device" --prompt-tokens "$pp" --gen-tokens "$tg" --repeats 3 --json 2>/dev/null)
    ours_pp+=("$(field "$j" "d['prefill_tok_s']")")
    if [[ $decode_prompt != "$pp" ]]; then
        j=$("$encore" bench --model "$model" --device "$device" --prompt-tokens "$decode_prompt" --gen-tokens "$tg" \
            --repeats 3 --json 2>/dev/null)
    fi
    ours_tg+=("$(field "$j" "d['decode_tok_s']")")
    echo "round $r: llama.cpp pp$pp ${peer_pp[-1]} tg$tg ${peer_tg[-1]}; encore pp$pp ${ours_pp[-1]} tg$tg ${ours_tg[-1]}" >&2
done
for what in pp tg; do
    n=$([[ $what == pp ]] && echo "$pp" || echo "$tg")
    declare -n o=ours_$what p=peer_$what
    a=$(printf '%s\n' "${o[@]}" | median); b=$(printf '%s\n' "${p[@]}" | median)
    printf '%s %s%s: encore %.1f tok/s, llama.cpp %.1f tok/s, ratio %.2fx (medians of %d rounds)\n' \
        "$(basename "$model")" "$what" "$n" "$a" "$b" "$(python3 -c "print($a / $b)")" "$rounds"
done
