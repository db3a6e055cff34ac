#!/usr/bin/env bash
# One H200 call for issue 19's real-rank kernels: scripts/gpu_ranks_check.py, a same-run A/B of this tree against
# 83b9b60 (the kernels before real ranks; benchmarks/ab_trees.py, every slot at the case's
# rank in both trees, measurements alternated new, base, base, new) at 8 x 16 (T = 256,
# 4096, 16384, LoRA-free and +LoRA), 64 x 16 and 8 x 128 (T = 4096, +LoRA); then the
# lora-sweep bench of this tree and the vLLM peer at the configs named in PEERS. Everything
# lands in $OUT/ranks_ab.tgz (the device returns few files).
# Preparation here (the base tree travels as files, carried with .peer):
#   rm -rf .ab_base && mkdir .ab_base && git archive 83b9b60 moelora benchmarks pyproject.toml \
#     ':(exclude)benchmarks/results' | tar -x -C .ab_base
# Run: run(carry=[".ab_base", ".peer"], timeout_s=600,
#          command="MOELORA_COMMIT=<sha> bash scripts/gpu_ranks_ab.sh")
# Knobs: AB_S (each A/B's limit), BENCH_S, PEER_S, PEERS ("LxR:T,T ..."), ITERS, REPS.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; W=$(mktemp -d); mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu,power.draw --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "this tree: ${MOELORA_COMMIT:-unknown}; base: 83b9b60 (.ab_base)"; } > "$W/gpu.txt" 2>&1
# the real-rank kernels against the reference, garbage past each slot's rank (CHECK_S: 0 skips)
if [ "${CHECK_S:-110}" -gt 0 ]; then
  timeout "${CHECK_S:-110}" $PY scripts/gpu_ranks_check.py > "$W/ranks_check.log" 2>&1
  echo "ranks check exit: $?"; tail -n 1 "$W/ranks_check.log"; grep FAIL "$W/ranks_check.log" | head
fi
ab() {  # ab NAME ARGS...: one A/B into $W/NAME
  timeout "${AB_S:-150}" $PY -m benchmarks.ab_trees --base .ab_base --out "$W/$1" \
    --suite qwen3 --reps "${REPS:-2}" --iters "${ITERS:-30}" "${@:2}" > "$W/$1.log" 2>&1
  echo "ab $1 exit: $?"; cat "$W/$1/ab_table.txt" 2>/dev/null
}
ab ab_8x16 --tokens 256,4096,16384
ab ab_64x16 --tokens 4096 --adapters 64 --rank 16 --modes lora
ab ab_8x128 --tokens 4096 --adapters 8 --rank 128 --modes lora
timeout "${BENCH_S:-150}" $PY -m moelora bench --suite lora-sweep --iters "${ITERS:-30}" \
  --json "$W/sweep.json" > "$W/bench.log" 2>&1
echo "bench exit: $?"
PEERS=${PEERS:-"8x64:4096,16384 8x256:256,4096"}
for entry in $PEERS; do
  config=${entry%%:*}; tokens=${entry#*:}; L=${config%%x*}; R=${config#*x}
  timeout "${PEER_S:-60}" $PY .peer/vllm_moe_lora_bench.py --max-loras "$L" --rank "$R" \
    --tokens "$tokens" --iters 30 --warmup 5 --check-max-tokens 4096 \
    --json "$W/vllm_peer_L${L}_R${R}.json" > "$W/peer_L${L}_R${R}.log" 2>&1
  echo "peer $config exit: $?"
done
$PY -m benchmarks.lora_sweep_report --bench "$W/sweep.json" --peers "$W"/vllm_peer_*.json \
  --out "$W/sweep.md" > "$W/report.log" 2>&1; echo "report exit: $?"
tar -czf "$OUT/ranks_ab.tgz" -C "$W" .
echo "done in ${SECONDS}s"
