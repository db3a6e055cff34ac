#!/usr/bin/env bash
# Create .venv and install moelora with its test extras. Idempotent; CPU torch on machines
# without a GPU (torch==2.13.0 is named in the same pip command as everything that depends
# on torch, so pip never resolves a multi-GB CUDA build).
#
# Quiet on success: setuptools' editable-install note ("Editable installation. Please be
# careful with folders ... same name as your package") and pip's harmless "is ignored"
# line are dropped, because a newcomer has nothing to do about them. Everything else pip
# prints (errors, conflicts) is shown, and a failed install fails this script.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# Drops the editable-install warning block (from its "BuildBackendWarning: Editable
# installation." line to the line after its closing "!!") and pip's "is ignored" line.
quiet() {
  awk '
    /BuildBackendWarning: Editable installation/ { skip = 1; bangs = 0; next }
    skip && /^[[:space:]]*!!/ { if (++bangs == 2) { tail = 1 }; next }
    skip && tail { skip = 0; tail = 0; next }
    skip { next }
    /is ignored: it is neither a file nor a directory/ { next }
    { print }
  '
}

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# PYTHONWARNINGS reaches the build backend, which then skips the note at its source; the
# filter covers setuptools versions that word or emit it differently.
set +e
PYTHONWARNINGS="ignore:Editable installation" \
  .venv/bin/python -m pip install -q "torch==${MOELORA_TORCH:-2.13.0}" -e ".[test]" 2>&1 | quiet
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ]; then
  echo "setup.sh: pip install failed (exit $status); its errors are above" >&2
  exit "$status"
fi
.venv/bin/python -c "import moelora, torch; print('moelora ready: torch', torch.__version__)"
