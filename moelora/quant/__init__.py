"""Quantized base experts: the formats (formats.py), the FP8 expert weights container
(fp8_experts.py) and the run-time activation quantization the W8A8 formats model
(activation_quant.py)."""
