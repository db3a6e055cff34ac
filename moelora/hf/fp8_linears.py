"""An FP8 checkpoint's block-scaled Linears (transformers' FP8Linear: e4m3 weight, fp32
`weight_scale_inv` per [bn, bk] block, activations quantized at run time) computed by
moelora's W8A8 kernel (kernels/fp8_linear.py) while attached: transformers' own kernels for
them come from the Hugging Face Hub at their first call, which a machine without internet
cannot reach, and the decode runner computes them with this kernel too, so the engine's two
paths (the runner, transformers' forward) agree. Each module's forward is replaced on the
instance (its class and tensors untouched); remove() gives the modules back."""

from __future__ import annotations

from torch import Tensor, nn

from ..kernels.fp8_linear import fp8_linear, quantize_input
from ..quant.module_fp8 import fp8_block


class FP8Linears:
    """The model's block-scaled FP8 Linears served by moelora's kernel (none: a no-op)."""

    def __init__(self, model: nn.Module) -> None:
        blocks = {m: b for m in model.modules() if (b := fp8_block(m)) is not None}
        self.modules = list(blocks)
        for module, block in blocks.items():
            module.forward = _Forward(module, block)

    def remove(self) -> None:
        for module in self.modules:
            if isinstance(module.__dict__.get("forward"), _Forward):
                del module.forward  # the class's forward again
        self.modules = []


class _Forward:
    """x [..., K] -> [..., N] in x's dtype through one FP8 Linear, W8A8."""

    def __init__(self, module: nn.Module, block: tuple[int, int]) -> None:
        self.module, self.block = module, block

    def __call__(self, x: Tensor) -> Tensor:
        m, block = self.module, self.block
        rows = x.reshape(-1, x.shape[-1])
        if not rows.is_contiguous():
            rows = rows.contiguous()
        out = fp8_linear(quantize_input(rows, block), m.weight, m.weight_scale_inv, block,
                         m.bias, x.dtype)  # fmt: skip
        return out.reshape(*x.shape[:-1], out.shape[-1])
