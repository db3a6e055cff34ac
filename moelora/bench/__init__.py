"""What `moelora bench` runs, installed with the package: the case registry (cases.py),
the floor and the ceilings it is measured against (floors.py), the timer and the checked
runner (runner.py), the vLLM peer's shape rules (peer.py), and the model-level run
(`moelora bench --model-level`: model_level.py over qwen3_model.py's model). The developer-only tools
(tune, A/Bs, profiles) are benchmarks/ in the source tree; they import this, never the
reverse."""
