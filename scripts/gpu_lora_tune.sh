#!/usr/bin/env bash
# One GPU call: tune the tile table's LoRA rows at several LoRA classes in sequence
# (moelora/tiling/lora_class.py; benchmarks/tune.py --adapters L --rank R), each tune
# starting from the table the one before wrote (--table-in), so $OUT/h200_table.json ends
# with the rows of every class tuned (to commit as moelora/tiling/h200_table.json). Beside
# it: tune_<class>.log / .json and table_<class>.json per class, and gpu.txt.
# Usage (device tool): MOELORA_COMMIT=<sha> bash scripts/gpu_lora_tune.sh [extra tune args]
# Knobs: CLASSES (slots x rank, as the benchmarks name banks; "8x128 8x256 64x16 128x16"),
#   TOKENS (the T tuned, 256,4096,16384: each class row takes the REFERENCE bucket of its
#   T), TUNE_S (search seconds per class, 100), SEARCH (quick | full; quick), MODEL
#   (qwen3-30b-a3b), TABLE_IN (the first tune's start; default the packaged table),
#   TOTAL_S (the call's deadline, 570: no tune starts that could not end before it; the
#   device tool stops a call at 600 s), SLACK_S (a tune's limit past its budget: model
#   load and the step in flight when the budget ends, 45).
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
SLACK_S=${SLACK_S:-45}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv \
  > "$OUT/gpu.txt" 2>&1
start=(${TABLE_IN:+--table-in "$TABLE_IN"})
table=${TABLE_IN:-}
for class in ${CLASSES:-8x128 8x256 64x16 128x16}; do
  slots=${class%x*}; rank=${class#*x}
  limit=$(budget "${TUNE_S:-100}" "$SLACK_S")
  if [ "$limit" -eq 0 ]; then echo "$class: skipped (under 20 s left before TOTAL_S)"; continue; fi
  next="$OUT/table_$class.json"
  echo "== $class: $slots adapters of rank $rank, budget ${limit}s, ${SECONDS}s into the call"
  timeout $((limit + SLACK_S)) $PY -m benchmarks.tune --model "${MODEL:-qwen3-30b-a3b}" \
    --adapters "$slots" --rank "$rank" --tokens "${TOKENS:-256,4096,16384}" \
    --search "${SEARCH:-quick}" --budget-s "$limit" "${start[@]}" --out "$next" \
    --json "$OUT/tune_$class.json" "$@" > "$OUT/tune_$class.log" 2>&1
  echo "$class tune exit: $?"; grep -E "^T=|start |heuristic |budget|skipped|tune:" "$OUT/tune_$class.log"
  if [ -s "$next" ]; then
    table=$next; start=(--table-in "$next")
  else
    echo "$class: no table written; the next class starts from ${table:-the packaged table}"
  fi
done
if [ -n "$table" ]; then cp "$table" "$OUT/h200_table.json"; echo "table: $OUT/h200_table.json"
else echo "no tune wrote a table: nothing to commit"; fi
