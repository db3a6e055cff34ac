#!/usr/bin/env bash
# Set up and run the main job: a transformers MoE model (random weights, built from a config)
# generating one batch whose rows use different PEFT adapters, each row checked against
# HF + PEFT generating it alone (on the CPU when there is no GPU).
# Extra args go to `moelora generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/moelora generate "$@"
