#!/usr/bin/env bash
# Set up and run the whole test suite: lint, format check, then pytest (Triton kernels run
# through TRITON_INTERPRET=1 when there is no GPU; tests/conftest.py sets it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check moelora tests benchmarks
.venv/bin/ruff format --check moelora tests benchmarks
exec .venv/bin/python -m pytest -n "${MOELORA_TEST_WORKERS:-2}" --durations=15 "$@"
