#!/usr/bin/env bash
# Set up and run the end-to-end demo (CPU when there is no GPU). Extra args go to `moelora demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/moelora demo "$@"
