#!/usr/bin/env bash
# One GPU call: issue 26's FP8 experts (128x128 block scales, W8A8: activations quantized per
# token and 128-column group, bf16 LoRA) on the Qwen3-30B-A3B and DeepSeek-V3 layers. In
# order, so that a call cut short keeps what matters most: GPU and versions; `moelora
# validate --quantization fp8` (T 1..16384, +LoRA, CUDA graphs, ranks 8-128, the LoRA-free
# path) against the reference (W8A8 on the dequantized experts); `moelora bench --suite fp8-qwen3` and `fp8-deepseek-v3` (bf16 and FP8 rows of the same layer, T by T, the
# floor counting one byte per FP8 weight plus its scales; JSON rewritten after every case).
# Logs and JSON go to $OUT (or ./out): gpu.txt, validate_fp8.log, and per layer
# fp8_bench_{qwen3,deepseek-v3}.json + bench_{qwen3,deepseek-v3}.log.
# Usage (device tool): MOELORA_COMMIT=<sha> bash scripts/gpu_fp8.sh
# Knobs: VALIDATE_S / BENCH_S (each step's limit; 0 skips it), VALIDATE_MODELS, ITERS;
# optional steps (off unless given seconds): CHANNEL_S (validate fp8_channel, quick),
# CEILING_S (benchmarks.gemm_ceiling --fp8 at CEILING_TOKENS: gemm_ceiling_fp8.json / .log),
# PROFILE_S (profile_layer --quantization fp8 at PROFILE_TOKENS), SWEEP_S (fp8_sweep at
# SWEEP_TOKENS: fp8_sweep.json / .log), GENERATE_S (benchmarks.fp8_generate at
# GENERATE_LAYERS, default 48: fp8_generate.json / .log, one JSON line per step and result).
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
  --format=csv 2>&1 | tee "$OUT/gpu.txt"
$PY -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

if [ "${VALIDATE_S:-300}" -gt 0 ]; then
  timeout "${VALIDATE_S:-300}" $PY -m moelora validate --quantization fp8 \
    --models "${VALIDATE_MODELS:-qwen3-30b-a3b,deepseek-v3}" --ref-tokens 1024 \
    2>&1 | tee "$OUT/validate_fp8.log"
  echo "validate exit: ${PIPESTATUS[0]}"
fi
for model in qwen3 deepseek-v3; do
  if [ "${BENCH_S:-130}" -gt 0 ]; then
    timeout "${BENCH_S:-130}" $PY -m moelora bench --suite "fp8-$model" --iters "${ITERS:-30}" \
      --json "$OUT/fp8_bench_$model.json" 2>&1 | tee "$OUT/bench_$model.log"
    echo "bench $model exit: ${PIPESTATUS[0]}"
  fi
done
if [ "${CHANNEL_S:-0}" -gt 0 ]; then  # per-channel scales (whole-row activation scales)
  timeout "$CHANNEL_S" $PY -m moelora validate --quantization fp8_channel --quick \
    --models qwen3-30b-a3b 2>&1 | tee "$OUT/validate_fp8_channel.log"
  echo "validate fp8_channel exit: ${PIPESTATUS[0]}"
fi
if [ "${CEILING_S:-0}" -gt 0 ]; then  # torch's FP8 (and bf16) GEMMs on the layer's shapes
  timeout "$CEILING_S" $PY -m benchmarks.gemm_ceiling --fp8 --tokens "${CEILING_TOKENS:-1024,4096,16384}" \
    --iters 20 --json "$OUT/gemm_ceiling_fp8.json" 2>&1 | tee "$OUT/gemm_ceiling_fp8.log"
fi
if [ "${PROFILE_S:-0}" -gt 0 ]; then  # where the FP8 layer's time goes, kernel by kernel
  timeout "$PROFILE_S" $PY -m benchmarks profile_layer --quantization fp8 \
    --tokens "${PROFILE_TOKENS:-64,4096}" 2>&1 | tee "$OUT/profile_fp8.log"
fi
if [ "${SWEEP_S:-0}" -gt 0 ]; then  # FP8 tiles around the picked ones (benchmarks/fp8_sweep.py)
  timeout $((SWEEP_S + 60)) $PY -m benchmarks fp8_sweep --tokens "${SWEEP_TOKENS:-256,4096}" \
    --budget-s "$SWEEP_S" --json "$OUT/fp8_sweep.json" 2>&1 | tee "$OUT/fp8_sweep.log"
fi
if [ "${GENERATE_S:-0}" -gt 0 ]; then  # model level: an FP8 checkpoint through transformers
  HF_HUB_OFFLINE=1 timeout "$GENERATE_S" $PY -u -m benchmarks.fp8_generate \
    --layers "${GENERATE_LAYERS:-48}" --json "$OUT/fp8_generate.json" > "$OUT/fp8_generate.log" 2>&1
  echo "fp8_generate exit: $?"; grep -v Warning "$OUT/fp8_generate.log" | tail -20
fi
echo "done in ${SECONDS}s"
