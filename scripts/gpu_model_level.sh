#!/usr/bin/env bash
# One GPU call for issue 36's proof at full depth: `moelora bench --model-level` (moelora/bench/model_level.py) on the
# 48-layer Qwen3-30B-A3B shape (random bf16, 12 adapters of rank 16, 4 with q/k/v/o LoRA):
# transformers eager and its static-cache compiled generate (LoRA-free; HF_STATIC=0 leaves it
# out), moelora LoRA-free and with adapters, batch 1 / 16 / 64, prompt 256, 64 new tokens,
# the floor measured in the same run, each phase's wall time reported; then where a decode
# step's time goes at 4 layers (`benchmarks/decode_profile.py`); and, with MIXED_S > 0 first,
# what a prompt chunk beside 64 decoding rows costs at 16 layers (`benchmarks/mixed_step.py`).
# A step whose seconds knob is 0 is left out. Usage (device tool):
# bash scripts/gpu_model_level.sh   Knobs: LAYERS, BATCHES, HF_STATIC, BENCH_S, PROFILE_S,
# MIXED_S, WARM_S (a second process: the startup with Triton's cache warm), CHECK_NEW (the
# HF + PEFT check's new tokens; 0 leaves the check out: ~90 s at 48 layers).
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
export HF_HUB_OFFLINE=1
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
$PY -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$OUT/gpu.txt"
if [ "${MIXED_S:-0}" != 0 ]; then
  timeout "$(budget "$MIXED_S")" $PY -m benchmarks.mixed_step --layers 16 \
      --json "$OUT/mixed_step.json" 2>&1 | grep -v "Warning\|USDT" | tee "$OUT/mixed_step.log"
  echo "mixed_step exit: ${PIPESTATUS[0]}"
fi
static=(); [ "${HF_STATIC:-1}" = 1 ] && static=(--hf-static)
timeout "$(budget ${BENCH_S:-480} $(( ${PROFILE_S:-60} + ${WARM_S:-0} )))" $PY -m moelora bench --model-level \
    --layers "${LAYERS:-48}" --batches "${BATCHES:-1,16,64}" --prompt 256 --new 64 --repeats 2 \
    --check-new "${CHECK_NEW:-8}" \
    "${static[@]}" --json "$OUT/model_level.json" 2>&1 | grep -v Warning | tee "$OUT/model_level.log"
echo "model_level exit: ${PIPESTATUS[0]}"
if [ "${WARM_S:-0}" != 0 ]; then  # the startup again, Triton's cache now warm (a restart)
  timeout "$(budget "$WARM_S" ${PROFILE_S:-60})" $PY -m moelora bench --model-level \
      --layers "${LAYERS:-48}" --batches "${BATCHES:-1,16,64}" --prompt 256 --new 64 --repeats 1 --check-new 0 \
      --configs moelora_free --json "$OUT/model_level_warm.json" 2>&1 | grep -v Warning \
      | tee "$OUT/model_level_warm.log"
  echo "warm startup exit: ${PIPESTATUS[0]}"
fi
if [ "${PROFILE_S:-60}" != 0 ]; then
  timeout "$(budget ${PROFILE_S:-60})" $PY -m benchmarks.decode_profile --layers 4 \
      --json "$OUT/decode_profile.json" 2>&1 | grep -v "Warning\|USDT" | tee "$OUT/decode_profile.log"
  echo "profile exit: ${PIPESTATUS[0]}"
fi
