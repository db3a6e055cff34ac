#!/usr/bin/env bash
# One GPU call: validate (bf16 vs reference) + bench (Qwen3-30B-A3B, graph replay) + the
# vLLM peer, all on the same GPU in one run. Logs and JSON go to $OUT (or ./out).
# Usage (device tool, .peer carried): MOELORA_COMMIT=<sha> bash scripts/gpu_check.sh [quick]
# Knobs: VALIDATE_S / PEER_S / BENCH_S (step time limits), VALIDATE_MODELS (quick mode's
# models, comma-separated), TOKENS, ITERS / PEER_ITERS.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
MODE=${1:-full}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
  --format=csv 2>&1 | tee "$OUT/gpu.txt"
$PY -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

if [ "$MODE" = quick ]; then
  VALIDATE_ARGS="--quick --tokens 1,7,64,1024 ${VALIDATE_MODELS:+--models $VALIDATE_MODELS}"
else
  VALIDATE_ARGS="--ref-tokens 1024"
fi
# Budgets keep the three steps inside one 10-minute device call.
timeout ${VALIDATE_S:-290} $PY -m moelora validate $VALIDATE_ARGS 2>&1 | tee "$OUT/validate.log"
echo "validate exit: ${PIPESTATUS[0]}"

if [ -d .peer ]; then
  timeout ${PEER_S:-130} $PY .peer/vllm_moe_lora_bench.py --tokens ${TOKENS:-1,16,64,256,1024,4096,16384} \
    --iters ${PEER_ITERS:-50} --json "$OUT/vllm_peer.json" > "$OUT/peer.log" 2>&1
  echo "peer exit: $?"; tail -n 12 "$OUT/peer.log"
else
  echo "no .peer folder: peer skipped (see shared/peer/README.md)"
fi

timeout ${BENCH_S:-150} $PY -m moelora bench --suite qwen3 --iters ${ITERS:-50} \
  ${TOKENS:+--tokens $TOKENS} --json "$OUT/bench.json" --peer-json "$OUT/vllm_peer.json" \
  2>&1 | tee "$OUT/bench.log"
echo "bench exit: ${PIPESTATUS[0]}"
