"""What `moelora bench` runs, installed with the package: the case registry (cases.py),
the floor and the ceilings it is measured against (floors.py), the timer and the checked
runner (runner.py), and the vLLM peer's shape rules (peer.py). The developer-only tools
(tune, A/Bs, profiles) are benchmarks/ in the source tree; they import this, never the
reverse."""
