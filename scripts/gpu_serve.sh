#!/usr/bin/env bash
# One GPU call for serving at full depth: `benchmarks/serve_load.py` against a real `moelora
# serve` on the 48-layer Qwen3-30B-A3B shape (random weights, --load-format dummy), paged
# cache (--block-size 16, prefix caching on), 32 adapter names over 8 slots with Zipf
# popularity, concurrency 64 / 16 / 1 (each LoRA-free then with adapters), then the 16k-token
# prompt arriving beside 16 streams. The server compiles its prompt steps at start
# (Engine.warm_prompts) and its step budget is vllm serve's (8192). Run
# scripts/device_wheels.sh here first and carry .whl (the image has no fastapi / uvicorn /
# openai). Usage (device tool): bash scripts/gpu_serve.sh   Knobs: LAYERS, NAMES, SLOTS,
# LEVELS, THRESHOLD (--long-prefill-token-threshold), PREEMPT=1 (--adapter-preemption), SERVE_S.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
export HF_HUB_OFFLINE=1
if compgen -G ".whl/*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=.:${PYTHONPATH}
$PY -c "import fastapi, uvicorn, openai" || { echo "no fastapi / uvicorn / openai: run scripts/device_wheels.sh here and carry .whl"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
(while true; do echo "$SECONDS $(free -m | awk 'NR==2{print $3}')" >> "$OUT/host_mem_mib.txt"; sleep 10; done) &
extra=()
[ -n "${THRESHOLD:-}" ] && extra+=(--long-prefill-token-threshold "$THRESHOLD")
[ "${PREEMPT:-0}" = 1 ] && extra+=(--adapter-preemption)
timeout "$(budget ${SERVE_S:-560})" $PY -m benchmarks.serve_load --layers "${LAYERS:-48}" \
    --concurrency "${LEVELS:-64,16,1}" --adapter-names "${NAMES:-32}" --max-loras "${SLOTS:-8}" \
    --block-size 16 --enable-prefix-caching --work /tmp/serve_load "${extra[@]}" \
    --json "$OUT/serve_load.json" 2>&1 | grep -v Warning | tee "$OUT/serve_load.log"
echo "serve_load exit: ${PIPESTATUS[0]}"
grep -v "adapter lora" /tmp/serve_load/server.log | tail -40 > "$OUT/server_tail.log"
