"""Launcher-side checks (shapes, dtypes) with errors that name the input, the value and
what was expected, plus the precision flags every launcher passes to its kernel."""

from __future__ import annotations

import os

import torch

from ..device import triton_interpreted
from ..errors import InputError
from .launch_args import QuantRows


def precision_flags(t: torch.Tensor) -> tuple[bool, bool]:
    """(UPCAST, IEEE). UPCAST: the interpreter computes bf16 wrongly, so bf16 tiles are cast
    to fp32 right after loading there. IEEE: fp32 inputs use exact fp32 dots, not tf32."""
    upcast = t.dtype == torch.bfloat16 and triton_interpreted()
    return upcast, t.dtype == torch.float32


POISON_ENV = "MOELORA_POISON_WORKSPACES"


def workspace(*shape: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """An uninitialised buffer a kernel writes only in part (rows of pairs without an
    adapter, padding, dropped pairs): torch.empty, or NaN-filled (floats) when
    MOELORA_POISON_WORKSPACES=1 (the CPU tests set it), so that a kernel reading a row
    nobody wrote shows up as NaN instead of passing on leftover memory."""
    if os.environ.get(POISON_ENV, "0") in ("", "0") or not dtype.is_floating_point:
        return torch.empty(*shape, dtype=dtype, device=device)
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def check_shape(name: str, t: torch.Tensor, expected: tuple[int | None, ...]) -> None:
    """None in `expected` matches any size."""
    ok = t.dim() == len(expected) and all(
        e is None or s == e for s, e in zip(t.shape, expected, strict=True)
    )
    if not ok:
        want = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        raise InputError(name, f"shape {list(t.shape)}", f"shape {want}")


def check_dtype_match(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    if t.dtype != like.dtype:
        raise InputError(name, f"dtype {t.dtype}", f"{like.dtype} (the dtype of x); cast it")
    if t.device != like.device:
        raise InputError(name, f"on {t.device}", f"on {like.device} (the device of x)")


def check_fp8_weight(
    name: str,
    w: torch.Tensor,
    scale: torch.Tensor | None,
    block: tuple[int, int],
    block_k: int,
    any_step: bool = False,
) -> None:
    """An e4m3 weight [E, N, K] with block scales [E, ceil(N / bn), ceil(K / bk)], its K
    loop one step per K block (W8A8: a step's products scaled by one activation group's and
    one weight block's scales), any step where the scales can act on the input's columns
    (`any_step`: a decode GEMV whose rows share a scale block), or with per-channel scales
    [E, N] (any step)."""
    if scale is None:
        raise InputError(f"{name} scale", None, f"the scales of the e4m3 {name}")
    e, n, k = w.shape
    bn, bk = block
    if scale.dim() == 2:
        check_shape(f"{name} scale", scale, (e, n))
    else:
        check_shape(f"{name} scale", scale, (e, -(-n // bn), -(-k // bk)))
    if scale.dtype != torch.float32 or scale.device != w.device:
        raise InputError(f"{name} scale", f"{scale.dtype} on {scale.device}", f"fp32 on {w.device}")
    if scale.dim() == 3 and block_k != bk and not any_step:
        raise InputError(
            "BLOCK_K", block_k, f"the scale block's K side {bk} (tiling/quantized.py fits it)"
        )


def fp8_scale_args(
    w_scale: torch.Tensor | None, scale_block: tuple[int, int], block_k: int, dummy: torch.Tensor
) -> dict:
    """A weight GEMM / GEMV kernel's scale arguments: e4m3 weights with block scales
    [E, nb, kb] (FP8_BLOCK: activation groups of a K step), per-channel scales [E, N]
    (FP8_CHANNEL: one scale per row; the input's whole-row scales), or none
    (serving-dtype weights: the block's defaults, never read)."""
    if w_scale is None:
        return dict(ws_ptr=dummy, stride_se=0, stride_sn=0, stride_sk=0, W_FP8=False,
                    SCALE_N=scale_block[0], SCALE_K=scale_block[1])  # fmt: skip
    if w_scale.dim() == 2:  # the step's scale index k0 // SCALE_K meets a zero stride
        return dict(ws_ptr=w_scale, stride_se=w_scale.stride(0), stride_sn=w_scale.stride(1),
                    stride_sk=0, W_FP8=True, SCALE_N=1, SCALE_K=block_k)  # fmt: skip
    return dict(ws_ptr=w_scale, stride_se=w_scale.stride(0), stride_sn=w_scale.stride(1),
                stride_sk=w_scale.stride(2), W_FP8=True, SCALE_N=scale_block[0],
                SCALE_K=scale_block[1])  # fmt: skip


def quantized_input_args(
    name: str,
    inp: torch.Tensor,
    quant: tuple[torch.Tensor, torch.Tensor] | None,
    fp8: bool,
    w_scale: torch.Tensor | None,
    scale_block: tuple[int, int],
) -> dict:
    """A weight GEMM / GEMV kernel's quantized input, which e4m3 weights need: {"<name>_quant":
    QuantRows} (W8A8; quant_rows.py: the input `name` [M, K] as e4m3 [M, K] and fp32 scales
    [M, G], G = ceil(K / bk) for block scales, 1 for per-channel ones, read at stride 0 by
    every K step); none for serving-dtype weights (the kernel's default None, never read)."""
    if quant is None:
        if fp8:
            raise InputError(
                f"{name}_quant", None, f"{name} quantized for the e4m3 weights (quant_rows)"
            )
        return {}
    if not fp8:
        raise InputError(f"{name}_quant", "given with serving-dtype weights", "e4m3 weights")
    values, scales = quant
    groups = 1 if w_scale.dim() == 2 else -(-inp.shape[1] // scale_block[1])
    check_shape(f"{name}_quant values", values, tuple(inp.shape))
    check_shape(f"{name}_quant scales", scales, (inp.shape[0], groups))
    if values.dtype != torch.float8_e4m3fn or scales.dtype != torch.float32:
        raise InputError(
            f"{name}_quant", f"({values.dtype}, {scales.dtype})", "(float8_e4m3fn, float32)"
        )
    rows = QuantRows(values, scales, values.stride(0), values.stride(1), scales.stride(0),
                     scales.stride(1) if groups > 1 else 0)  # fmt: skip
    return {f"{name}_quant": rows}


def check_weight_dtype(name: str, w: torch.Tensor, x: torch.Tensor, fp8: bool) -> None:
    """w in x's dtype, or e4m3 when `fp8` (block-scaled experts); on x's device."""
    if not fp8:
        check_dtype_match(name, w, x)
    elif w.dtype != torch.float8_e4m3fn or w.device != x.device:
        raise InputError(name, f"{w.dtype} on {w.device}", f"torch.float8_e4m3fn on {x.device}")


def tma_tiles_ok(
    a: torch.Tensor, b: torch.Tensor, block_m: int, block_n: int, block_k: int
) -> bool:
    """Whether a [M, K] and b [E, N, K] can be read by TMA tile copies of [block_m, block_k]
    and [1, block_n, block_k] (tma_box_ok for each)."""
    return tma_box_ok(a, (block_m, block_k)) and tma_box_ok(b, (1, block_n, block_k))


def tma_box_ok(t: torch.Tensor, box: tuple[int, ...]) -> bool:
    """Whether t can be read by TMA tile copies of `box`: a 16-byte aligned base and
    strides, a contiguous last dim, power-of-two box sides of at most 256, at least 16
    bytes per box row."""
    tensor_ok = (
        t.stride(-1) == 1
        and t.data_ptr() % 16 == 0
        and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1])
    )
    box_ok = all(v <= 256 and v & (v - 1) == 0 for v in box)
    return tensor_ok and box_ok and box[-1] * t.element_size() >= 16
