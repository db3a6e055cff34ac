#!/usr/bin/env bash
# One GPU call for a model other than the Qwen3 target: the vLLM peer on that model's layer,
# our bench with the committed configs (before), a tune of that shape (rows of other
# shapes kept), then the bench again with the new table installed (after), all in one run.
# $OUT gets the logs, the JSON files and the new table (commit it as
# moelora/tiling/h200_table.json).
# Usage (device tool, .peer carried): MOELORA_COMMIT=<sha> bash scripts/gpu_model.sh SUITE
#   SUITE: a case list in moelora/bench/cases.py of one model (mixtral, deepseek-v3, ...).
#   The peer runs SiLU-gated experts without biases only: for other layers (gpt-oss-20b,
#   nemotron-h) it is skipped and the bench runs without peer columns.
# Knobs: TOKENS (a subset of the suite's T for the peer, benches and tune), TUNE_TOKENS
#   (default: those T, largest first), TUNE_S, ITERS, BENCH_S, PEER_S.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
SUITE=${1:?usage: gpu_model.sh SUITE}
read -r MODEL TOKENS PEER_ARGS < <($PY - "$SUITE" "${TOKENS:-}" <<'PYEOF'
import sys
from moelora.bench.cases import CASES
from moelora.bench.peer import peer_can_run, peer_shape
cases = CASES[sys.argv[1]]
keep = {int(t) for t in sys.argv[2].split(",")} if sys.argv[2] else None
if keep and not keep <= {c.tokens for c in cases}:
    sys.exit(f"TOKENS={sys.argv[2]}: not all in suite {sys.argv[1]}'s T")
cases = [c for c in cases if keep is None or c.tokens in keep]
s = peer_shape(cases[0])
tokens = ",".join(str(c.tokens) for c in cases)
print(cases[0].model, tokens, f"--experts={s['E']} --topk={s['top_k']} --hidden={s['H']} "
      f"--inter={s['I']} --max-loras={s['max_loras']} --rank={s['rank']} --dtype={s['dtype']}"
      if peer_can_run(cases[0]) else "none")
PYEOF
)
[ -n "$MODEL" ] || exit 2
echo "suite $SUITE: model $MODEL, T $TOKENS, peer $PEER_ARGS"
PEER_JSON=()
if [ "$PEER_ARGS" != none ]; then
  timeout ${PEER_S:-150} $PY .peer/vllm_moe_lora_bench.py $PEER_ARGS --tokens "$TOKENS" \
    --iters ${ITERS:-30} --json "$OUT/vllm_peer.json" > "$OUT/peer.log" 2>&1
  echo "peer exit: $?"
  PEER_JSON=(--peer-json "$OUT/vllm_peer.json")
fi
timeout ${BENCH_S:-120} $PY -m moelora bench --suite "$SUITE" --tokens "$TOKENS" --iters ${ITERS:-30} \
  --json "$OUT/bench_before.json" "${PEER_JSON[@]}" > "$OUT/bench_before.log" 2>&1
echo "bench (before) exit: $?"; grep -E "^triton|ceil|match" "$OUT/bench_before.log"
TT=${TUNE_TOKENS:-$(echo "$TOKENS" | tr , '\n' | sort -rn | paste -sd,)}
budget=${TUNE_S:-180}
timeout $((budget + 60)) $PY -m benchmarks.tune --model "$MODEL" --tokens "$TT" \
  --budget-s "$budget" --out "$OUT/h200_table.json" --json "$OUT/tune.json" > "$OUT/tune.log" 2>&1
echo "tune exit: $?"; grep -E "heuristic|budget|decode path|tune:" "$OUT/tune.log"
if [ -s "$OUT/h200_table.json" ]; then cp "$OUT/h200_table.json" moelora/tiling/h200_table.json; fi
timeout ${BENCH_S:-120} $PY -m moelora bench --suite "$SUITE" --tokens "$TOKENS" --iters ${ITERS:-30} \
  --json "$OUT/bench_after.json" "${PEER_JSON[@]}" > "$OUT/bench_after.log" 2>&1
echo "bench (after) exit: $?"; grep -E "^triton|ceil|match" "$OUT/bench_after.log"
