#!/usr/bin/env bash
# One H200 call for issue 19 item 5 (tile rows per LoRA class), after scripts/gpu_lora_stream.sh:
# the class tunes of CLASSES (scripts/gpu_lora_tune.sh, quick search, from the committed
# table), then a knobs-only re-tune of the REFERENCE class (8 x 16) at REF_TOKENS (the
# knobs the class tunes found: lora_delta, shrink_expand, lora_stream), the result
# installed in this (device-side) tree, then benchmarks/class_neighbours.py on banks whose
# class the table lacks (does the nearest tuned class's row run no slower than the other
# classes' rows?). Everything lands in $OUT/lora_classes.tgz.
# Run: run(command="MOELORA_COMMIT=<sha> bash scripts/gpu_lora_classes.sh", timeout_s=600)
# Knobs: CLASSES, TOKENS, TUNE_S, REF_TOKENS, REF_S, BANKS, NB_TOKENS, NB_S.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; W=$(mktemp -d); mkdir -p "$OUT" "$W/tune"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
echo "tree: ${MOELORA_COMMIT:-unknown}" > "$W/gpu.txt"
CLASSES=${CLASSES:-"8x256 128x16"} TOKENS=${TOKENS:-4096,16384} TUNE_S=${TUNE_S:-100} \
  TOTAL_S=${CLASS_TOTAL_S:-260} TABLE_IN=moelora/tiling/h200_table.json OUT="$W/tune" \
  bash scripts/gpu_lora_tune.sh > "$W/tune.log" 2>&1
echo "class tunes exit: $?"; cat "$W/tune.log"
table=moelora/tiling/h200_table.json
[ -s "$W/tune/h200_table.json" ] && table="$W/tune/h200_table.json"
if [ "${REF_S:-90}" -gt 0 ]; then  # REF_S=0: no reference re-tune
  timeout $((${REF_S:-90} + 30)) $PY -m benchmarks.tune --lora-only --knobs-only \
    --tokens "${REF_TOKENS:-4096,16384}" --budget-s "${REF_S:-90}" --table-in "$table" \
    --out "$W/h200_table.json" --json "$W/tune_ref.json" > "$W/tune_ref.log" 2>&1
  echo "reference knobs tune exit: $?"; grep -E "^T=|committed|budget|tune:" "$W/tune_ref.log"
fi
if [ -s "$W/h200_table.json" ]; then cp "$W/h200_table.json" moelora/tiling/h200_table.json
elif [ "$table" != moelora/tiling/h200_table.json ]; then
  cp "$table" moelora/tiling/h200_table.json; cp "$table" "$W/h200_table.json"; fi
timeout "${NB_S:-150}" $PY -m benchmarks.class_neighbours --banks "${BANKS:-8x64,32x16,8x32}" \
  --tokens "${NB_TOKENS:-4096,16384}" > "$W/neighbours.log" 2>&1
echo "neighbours exit: $?"; cat "$W/neighbours.log"
tar -czf "$OUT/lora_classes.tgz" -C "$W" .
echo "done in ${SECONDS}s"
