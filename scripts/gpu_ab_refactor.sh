#!/usr/bin/env bash
# One H200 call for issue 15 (a redesign with no behaviour change): `moelora validate
# --quick` on this tree (four models, five T), then a same-run A/B of this tree against
# 5b4b1d5 at every T of the qwen3 suite, LoRA-free and +LoRA (benchmarks/ab_trees.py: one
# worker process per tree, measurements alternated new, base, base, new, each checked
# against the reference first), and the table of ratios new / base per T. ~5-7 minutes;
# each step has its own time limit.
#
# Preparation, here in the worktree root (the device gets the tree without .git, so the
# old commit travels as files, in the git-ignored .ab_base/, about 0.5 MB):
#   rm -rf .ab_base && mkdir .ab_base && git archive 5b4b1d5 moelora benchmarks pyproject.toml \
#     ':(exclude)benchmarks/results' | tar -x -C .ab_base
#   .venv/bin/python -m benchmarks.launch_diff --base .ab_base   # CPU check: "0 different"
# Run (device tool, one call, .ab_base carried, this tree's commit in MOELORA_COMMIT):
#   run(kind="nvidia-h200", carry=[".ab_base"], timeout_s=540,
#       command="MOELORA_COMMIT=<sha> bash scripts/gpu_ab_refactor.sh")
# Back in $OUT: gpu.txt (GPU, versions), validate.log, ab.log (the workers' stderr), ab.json
# (every measurement), ab_table.txt (the ratios; one above 1.02 is flagged), and with
# BENCH_S > 0 bench.json / bench.log (`moelora bench` of this tree, for BENCHMARKS.md).
# Knobs: VALIDATE_S (110), VALIDATE_MODELS, VALIDATE_TOKENS, AB_S (330), REPS (2: ABBA; 3:
#   ABBAAB), ITERS (50), TOKENS (a subset of the suite's T), BENCH_S (0: skipped).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ ! -d .ab_base/moelora ]; then
  echo "no .ab_base/moelora: export 5b4b1d5 and carry .ab_base (see this file's header)"
  exit 2
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
  --format=csv 2>&1 | tee "$OUT/gpu.txt"
$PY -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
echo "this tree: ${MOELORA_COMMIT:-unknown}; base: 5b4b1d5 (.ab_base)" | tee -a "$OUT/gpu.txt"

timeout ${VALIDATE_S:-110} $PY -m moelora validate --quick \
  --tokens ${VALIDATE_TOKENS:-1,7,64,1024,4096} \
  --models ${VALIDATE_MODELS:-qwen3-30b-a3b,gpt-oss-20b,nemotron-h,mixtral-8x7b} \
  2>&1 | tee "$OUT/validate.log"
echo "validate exit: ${PIPESTATUS[0]}"

timeout ${AB_S:-330} $PY -m benchmarks.ab_trees --base .ab_base --out "$OUT" --suite qwen3 \
  --reps ${REPS:-2} --iters ${ITERS:-50} ${TOKENS:+--tokens $TOKENS}
echo "ab exit: $?"

if [ "${BENCH_S:-0}" -gt 0 ]; then
  timeout "$BENCH_S" $PY -m moelora bench --suite qwen3 --iters ${ITERS:-50} \
    ${TOKENS:+--tokens $TOKENS} --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  echo "bench exit: $?"; tail -n 10 "$OUT/bench.log"
fi
