#!/usr/bin/env bash
# One GPU call: issue 19's LoRA sweep on the Qwen3-30B-A3B layer (bf16). In order, so that
# a call cut short keeps what matters most: GPU and versions; `moelora validate` of the
# sweep's banks; `moelora bench --suite lora-sweep` (its JSON rewritten after every case);
# the ceilings its targets name (benchmarks/read_floor.py at the T = 1 layer's bytes,
# benchmarks/gemm_ceiling.py at T = 4096, 16384); the vLLM peer once per (max-loras, rank),
# the reference and the issue's table rows first; the report (markdown table + targets).
# Each step has a time limit, and no step starts past the call's deadline (TOTAL_S, with
# REPORT_S kept for the report). Logs and JSON go to $OUT (or ./out):
#   gpu.txt, validate.log, sweep.json + bench.log, read_floor.log, gemm_ceiling.json + .log,
#   vllm_peer_L{L}_R{R}.json + peer_L{L}_R{R}.log, sweep.md (benchmarks/lora_sweep_report.py)
# Usage (device tool, .peer carried, vendor/ fetched): MOELORA_COMMIT=<sha> bash scripts/gpu_lora_sweep.sh
# Knobs: TOTAL_S (570), VALIDATE_S / BENCH_S / CEILING_S / PEER_S (each step's limit; 0
# skips it), ITERS / PEER_ITERS (timed replays), PEERS (LxR:T,T,... entries, space separated).
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
REPORT_S=${REPORT_S:-15}

# step NAME LIMIT LOG CMD...: runs CMD under its budget (the report's share kept), output
# tee'd to $OUT/LOG
step() {
  local name=$1 limit; limit=$(budget "$2" "$REPORT_S"); local log=$3; shift 3
  if [ "$limit" -eq 0 ]; then echo "$name: skipped (no time left, or its limit is 0)"; return; fi
  echo "== $name (limit ${limit}s, ${SECONDS}s into the call)"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$log"
  echo "$name exit: ${PIPESTATUS[0]}"
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
  --format=csv 2>&1 | tee "$OUT/gpu.txt"
$PY -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

# the sweep's banks (mixed ranks, padded rank 8, 64 and 128 slots, rank 256) plus 8 x 16 at
# T = 2; the bench checks each timed case against the reference too
step validate "${VALIDATE_S:-100}" validate.log $PY -m moelora validate --models qwen3-30b-a3b \
  --quick --tokens 2 --lora-sweep --ref-tokens 1024
step bench "${BENCH_S:-260}" bench.log $PY -m moelora bench --suite lora-sweep \
  --iters "${ITERS:-30}" --json "$OUT/sweep.json"
# the T = 1 layer (8 x 16) reads ~78 MB: its 8 experts' weights (8 x 3 x 2048 x 768 bf16,
# 75.5 MB) and 8 (slot, expert) pairs of rank 16 (2.2 MB)
step read_floor "${CEILING_S:-30}" read_floor.log $PY -m benchmarks.read_floor --mb 78 --iters 30
step gemm_ceiling "${CEILING_S:-30}" gemm_ceiling.log $PY -m benchmarks.gemm_ceiling \
  --tokens 4096,16384 --iters 20 --json "$OUT/gemm_ceiling.json"

# (max-loras x rank : T list); the reference config and the issue's table rows first, the
# rarer configs last. 8 x 16 at the T of the issue's targets only (its full T sweep beside
# the peer is scripts/gpu_check.sh's). All seven take ~5 min: the deadline drops the last
# ones, printed as skipped; a second call runs them (VALIDATE_S=0 BENCH_S=0 CEILING_S=0
# PEERS="..."), and the report is re-run here over both calls' files.
PEERS=${PEERS:-"8x16:1,256,4096,16384 64x16:256,4096,16384 8x128:256,4096,16384 8x8:256,4096,16384 8x64:4096,16384 128x16:256,4096 8x256:256,4096"}
if [ -d .peer/vendor ]; then
  for entry in $PEERS; do
    config=${entry%%:*}; tokens=${entry#*:}; L=${config%%x*}; R=${config#*x}
    # the peer compiles vLLM's kernels afresh in each process: ~15 s per T
    step "peer L=$L R=$R" "${PEER_S:-110}" "peer_L${L}_R${R}.log" $PY .peer/vllm_moe_lora_bench.py \
      --max-loras "$L" --rank "$R" --tokens "$tokens" --iters "${PEER_ITERS:-30}" --warmup 5 \
      --check-max-tokens 4096 --json "$OUT/vllm_peer_L${L}_R${R}.json"
  done
else
  echo "no .peer/vendor: peer skipped (cp -r ../shared/peer .peer && bash .peer/fetch_vendor.sh, then carry .peer)"
fi

if [ -s "$OUT/sweep.json" ]; then
  shopt -s nullglob
  peers=("$OUT"/vllm_peer_L*_R*.json)
  gemm=(); [ -s "$OUT/gemm_ceiling.json" ] && gemm=(--gemm "$OUT/gemm_ceiling.json")
  timeout "$REPORT_S" $PY -m benchmarks.lora_sweep_report --bench "$OUT/sweep.json" \
    --peers "${peers[@]}" "${gemm[@]}" --out "$OUT/sweep.md"
  echo "report exit: $?"
else
  echo "no $OUT/sweep.json: no report"
fi
echo "done in ${SECONDS}s"
