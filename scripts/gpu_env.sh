# Sourced first by every scripts/gpu_*.sh: strict mode, $OUT (created), unbuffered Python,
# $PY (PYTHON or python3), the call's deadline TOTAL_S and budget().
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
TOTAL_S=${TOTAL_S:-570}  # the device tool stops a call at 600 s

# budget LIMIT [RESERVE]: the seconds a step may take: LIMIT, capped by what is left before
# TOTAL_S less RESERVE (kept for what must run after it); 1 when under 20 s would be left
# (the step is stopped at once: `timeout 0` would never stop it)
budget() {
  local left=$((TOTAL_S - SECONDS - ${2:-0}))
  local want=$(( $1 < left ? $1 : left ))
  echo $(( want < 20 ? 1 : want ))
}
