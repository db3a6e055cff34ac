#!/usr/bin/env bash
# One H200 call for issue 19 item 4 (the down LoRA beside the down GEMM, TileConfig.lora_stream):
# same-run A/B of lora_stream off / on (benchmarks/ab_knob.py: the picked and fitted config
# of each case, output checked against the reference first, eager and under graph replay;
# the values alternated over --reps) at the bank sizes of the sweep, +LoRA, and the
# LoRA-free layer at the same T for the +LoRA / LoRA-free ratio. Then (TUNE=1) the LoRA
# class tune (scripts/gpu_lora_tune.sh) with its own env. Everything lands in
# $OUT/lora_stream.tgz (the device returns few files).
# Run: run(command="MOELORA_COMMIT=<sha> bash scripts/gpu_lora_stream.sh", timeout_s=600)
# Knobs: AB_S (each A/B's limit), CASES ("LxR:T,T ..."), ITERS, REPS.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; W=$(mktemp -d); mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu,power.draw --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "tree: ${MOELORA_COMMIT:-unknown}"; } > "$W/gpu.txt" 2>&1
CASES=${CASES:-"8x16:1024,4096,16384 64x16:4096,16384 8x128:4096,16384"}
for entry in $CASES; do
  config=${entry%%:*}; tokens=${entry#*:}; L=${config%%x*}; R=${config#*x}
  timeout "${AB_S:-100}" $PY -m benchmarks.ab_knob --knob lora_stream --values 0,1 \
    --tokens "$tokens" --adapters "$L" --rank "$R" --iters "${ITERS:-30}" --reps "${REPS:-2}" \
    > "$W/ab_L${L}_R${R}.log" 2>&1
  echo "ab ${config} exit: $?"; cat "$W/ab_L${L}_R${R}.log"
done
timeout "${AB_S:-100}" $PY -m benchmarks.ab_knob --knob atomic_reduce --values 0 --base \
  --tokens 1024,4096,16384 --iters "${ITERS:-30}" > "$W/ab_base.log" 2>&1
echo "lora-free exit: $?"; cat "$W/ab_base.log"
if [ "${TUNE:-0}" = 1 ]; then
  OUT="$W/tune" bash scripts/gpu_lora_tune.sh > "$W/tune.log" 2>&1
  echo "tune exit: $?"; tail -n 30 "$W/tune.log"
fi
tar -czf "$OUT/lora_stream.tgz" -C "$W" .
echo "done in ${SECONDS}s"
