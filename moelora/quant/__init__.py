"""Quantized base experts: the FP8 expert weights container (fp8_experts.py), the run-time
activation quantization the W8A8 formats model (activation_quant.py) and the reading of FP8
experts from a checkpoint (checkpoint.py, module_fp8.py). The formats themselves are
config-tier data: moelora/quantization.py."""
