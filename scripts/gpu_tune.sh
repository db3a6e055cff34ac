#!/usr/bin/env bash
# One GPU call: re-tune the H200 table, install it in this (device-side) tree, then check
# the installed table (quick validate) and time it (bench). $OUT gets the new table file to
# commit as moelora/tiling/h200_table.json, the tune log / JSON, and the validate and bench
# results of that same table.
# Usage (device tool): MOELORA_COMMIT=<sha> bash scripts/gpu_tune.sh [extra tune args]
#   e.g. `--tokens 1024,4096,16384` to re-tune some T only (other rows are kept).
# Knobs: TUNE_S / VALIDATE_S / BENCH_S (step time limits), TOKENS (bench T list).
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
budget=${TUNE_S:-300}
timeout $((budget + 30)) $PY -m benchmarks.tune --budget-s "$budget" --out "$OUT/h200_table.json" \
  --json "$OUT/tune.json" "$@" > "$OUT/tune.log" 2>&1
echo "tune exit: $?"; grep -E "heuristic|budget|tune:" "$OUT/tune.log"
if [ -s "$OUT/h200_table.json" ]; then
  cp "$OUT/h200_table.json" moelora/tiling/h200_table.json
else
  echo "no table written: the committed table stays"
fi
timeout ${VALIDATE_S:-120} $PY -m moelora validate --quick --tokens 1,7,64,1024,4096,16384 \
  --models qwen3-30b-a3b,gpt-oss-20b,nemotron-h > "$OUT/validate.log" 2>&1
echo "validate exit: $?"; grep -E "fail|passed" "$OUT/validate.log" | tail -5
timeout ${BENCH_S:-120} $PY -m moelora bench --suite qwen3 --iters 50 \
  ${TOKENS:+--tokens $TOKENS} --json "$OUT/bench.json" 2>&1 | grep -E "^triton|backend|ceil|match"
echo "bench exit: ${PIPESTATUS[0]}"
