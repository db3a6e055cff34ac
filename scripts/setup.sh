#!/usr/bin/env bash
# Create .venv and install moelora with its test extras. Idempotent; CPU torch on machines
# without a GPU (torch==2.13.0 is named in the same pip command as everything that depends
# on torch, so pip never resolves a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q "torch==${MOELORA_TORCH:-2.13.0}" -e ".[test]" 2>&1 \
  | grep -v "is ignored: it is neither a file nor a directory" || true
.venv/bin/python -c "import moelora, torch; print('moelora ready: torch', torch.__version__)"
