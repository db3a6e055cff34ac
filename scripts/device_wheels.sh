#!/usr/bin/env bash
# Here (a machine with PyPI), before a GPU call that serves: download into .whl/ (ignored by
# git) the wheels `moelora serve` and its load benchmark need beyond the H200 image's packages
# (fastapi, uvicorn, the openai client and what they require; the image has torch,
# transformers, peft, httpx, prometheus-client), at the versions this checkout's .venv runs,
# for the device's Python 3.12. Carry `.whl` in the call; scripts/gpu_serve.sh installs them.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
NAMES="fastapi starlette pydantic pydantic_core annotated-types typing-inspection annotated-doc
opentelemetry-api uvicorn openai httpx2 httpcore2 truststore distro jiter sniffio anyio
typing_extensions h11 idna"
pins=$(.venv/bin/python - $NAMES <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, version
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:  # not needed by the versions installed here
        pass
PYEOF
)
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl $pins
ls .whl && du -sh .whl
