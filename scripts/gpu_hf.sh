#!/usr/bin/env bash
# One GPU call for the transformers integration: the main job on the GPU, the CUDA-graph /
# torch.compile checks (`moelora validate --suite hf`), the model-level benchmark and the HF + PEFT peer in the same run.
# Usage (device tool, .peer carried): MOELORA_COMMIT=<sha> bash scripts/gpu_hf.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
export HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version --format=csv 2>&1 | tee "$OUT/gpu.txt"
$PY -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$OUT/gpu.txt"
timeout ${GEN_S:-120} $PY -m moelora generate 2>&1 | tee "$OUT/generate.log"; echo "generate exit: ${PIPESTATUS[0]}"
timeout ${CHECK_S:-120} $PY -m moelora validate --suite hf 2>&1 | tee "$OUT/hf_check.log"; echo "hf check exit: ${PIPESTATUS[0]}"
# the model-level benchmark as the peer runs it: 8 expert-only adapters, 128-token prompts
timeout ${BENCH_S:-200} $PY -m moelora bench --model-level --layers 4 --batches ${BATCHES:-1,16,64} \
  --prompt 128 --attention-adapters 0 --configs hf_eager,moelora_experts \
  --json "$OUT/model_level.json" 2>&1 | grep -v Warning | tee "$OUT/model_level.log"; echo "bench exit: ${PIPESTATUS[0]}"
if [ -d .peer ]; then
  timeout ${PEER_S:-200} $PY .peer/hf_peft_generate.py --layers 4 --batches ${BATCHES:-1,16,64} \
    --json "$OUT/hf_peft_peer.json" 2>&1 | grep -v Warning | tee "$OUT/hf_peft_peer.log"; echo "peer exit: ${PIPESTATUS[0]}"
else
  echo "no .peer folder: HF+PEFT peer skipped"
fi
