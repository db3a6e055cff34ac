#!/usr/bin/env bash
# Issue 16 in one GPU call per machine kind: scripts/parallel_bench.py under torchrun on every
# GPU of the machine (NCCL), i.e. TP / fully sharded LoRA / EP / EP x TP of the Qwen3-30B-A3B and
# DeepSeek-V3 layers at T = 1, 64, 1024, 16384, each checked against one GPU, timed (layer,
# collectives alone, compute alone, one GPU) and set beside `moelora plan`'s verdict; first the
# README's torchrun library example on 2 of the GPUs, as a user would run it.
# Usage (device tool, kind nvidia-h200-x2, -x4 or -x8, nothing carried):
#   MOELORA_COMMIT=<sha> bash scripts/gpu_parallel.sh
# Writes $OUT/gpu.txt, $OUT/readme_example.log, $OUT/parallel_x<N>.json and .log (N = the GPUs
# seen). Budgets (seconds; EXAMPLE_S 60 + BENCH_S 500 stay under the tool's 600 per command):
# BENCH_S the whole bench, BUDGET_S its layouts' share (layouts past it are skipped, their
# plan verdict kept); MODELS, TOKENS, ITERS, LAYOUTS pass through to the bench.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
# NVLink multicast stays off, also in torchrun's children (KINDS.md: it can take the host's
# GPUs out of service)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
N=$($PY -c 'import torch; print(torch.cuda.device_count())')
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvidia-smi topo -m; } 2>&1 | tee "$OUT/gpu.txt"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())" 2>&1 | tee -a "$OUT/gpu.txt"
if [ "$N" -lt 2 ]; then echo "gpu_parallel: needs 2 or more GPUs, found $N"; exit 2; fi

# the README's "Running on several GPUs" library example, extracted as it is printed
$PY - <<'EOF'
text = open("README.md").read().split("### Running on several GPUs")[1]
open("/tmp/tp_layer.py", "w").write(text.split("```python\n")[1].split("```")[0])
EOF
PYTHONPATH=. CUDA_VISIBLE_DEVICES=0,1 timeout ${EXAMPLE_S:-60} \
  $PY -m torch.distributed.run --standalone --nproc-per-node 2 /tmp/tp_layer.py 2>&1 | tee "$OUT/readme_example.log"
echo "readme example exit: ${PIPESTATUS[0]}"

PYTHONPATH=. timeout ${BENCH_S:-500} $PY -m torch.distributed.run --standalone --nproc-per-node "$N" \
  scripts/parallel_bench.py --models ${MODELS:-qwen3-30b-a3b,deepseek-v3} \
  --tokens ${TOKENS:-1,64,1024,16384} --iters ${ITERS:-20} --budget-s ${BUDGET_S:-400} \
  --layouts "${LAYOUTS:-*}" --json "$OUT/parallel_x$N.json" 2>&1 | tee "$OUT/parallel_x$N.log"
echo "parallel bench exit: ${PIPESTATUS[0]}"
