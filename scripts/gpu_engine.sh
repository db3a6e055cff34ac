#!/usr/bin/env bash
# One GPU call for the decode engine: the main job on the GPU (fp32: every row equal to HF +
# PEFT alone; bf16: within HF's own noise), the graph / eager check of the engine
# (scripts/gpu_engine_check.py), the runner's families against HF + PEFT
# (scripts/gpu_runner_families.py), Qwen3.5's Gated DeltaNet decode kernels against their
# torch form and timed beside it (scripts/gpu_gated_delta.py), an FP8 checkpoint with FP8 projections through the
# runner (benchmarks/fp8_generate.py --fp8-attention), where a decode step's time goes on both decode paths
# (benchmarks/decode_profile.py), and the GPU check suites (`moelora validate --suite slots
# --suite hf --suite serving`). Usage (device tool): bash scripts/gpu_engine.sh   Knobs: each step's
# seconds (GEN_S, CHECK_S, FAMILIES_S, DELTA_S, FP8_S, PROFILE_S, SUITES_S; 0 leaves it out) and
# FAMILIES (comma-separated runner families, all by default).
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
export HF_HUB_OFFLINE=1
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}  # scripts/*.py import moelora from this tree
nvidia-smi --query-gpu=name,driver_version --format=csv 2>&1 | tee "$OUT/gpu.txt"
$PY -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$OUT/gpu.txt"
timeout "$(budget ${GEN_S:-100} 300)" $PY -m moelora generate 2>&1 | grep -v Warning | tee "$OUT/generate_fp32.log"; echo "generate fp32 exit: ${PIPESTATUS[0]}"
timeout "$(budget ${GEN_S:-100} 280)" $PY -m moelora generate --dtype bf16 2>&1 | grep -v Warning | tee "$OUT/generate_bf16.log"; echo "generate bf16 exit: ${PIPESTATUS[0]}"
timeout "$(budget ${CHECK_S:-150} 240)" $PY scripts/gpu_engine_check.py --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/engine_check.log"; echo "engine check exit: ${PIPESTATUS[0]}"
timeout "$(budget ${FAMILIES_S:-150} 200)" $PY scripts/gpu_runner_families.py ${FAMILIES:+--families "$FAMILIES"} --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/runner_families.log"; echo "runner families exit: ${PIPESTATUS[0]}"
timeout "$(budget ${DELTA_S:-60} 120)" $PY scripts/gpu_gated_delta.py --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/gated_delta.log"; echo "gated delta exit: ${PIPESTATUS[0]}"
timeout "$(budget ${FP8_S:-150} 120)" $PY -m benchmarks.fp8_generate --layers ${LAYERS:-4} --fp8-attention --lora-std 0.05 --json "$OUT/fp8_attention.json" 2>&1 | grep -v Warning | tee "$OUT/fp8_attention.log"; echo "fp8 attention exit: ${PIPESTATUS[0]}"
timeout "$(budget ${PROFILE_S:-200} 60)" $PY -m benchmarks.decode_profile --layers ${LAYERS:-4} --json "$OUT/decode_profile.json" 2>&1 | grep -v "Warning\|USDT" | tee "$OUT/decode_profile.log"; echo "profile exit: ${PIPESTATUS[0]}"
timeout "$(budget ${SUITES_S:-200})" $PY -m moelora validate --suite slots --suite hf --suite serving 2>&1 | grep -v Warning | tee "$OUT/suites.log"; echo "suites exit: ${PIPESTATUS[0]}"
