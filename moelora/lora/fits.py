"""check_fits: does an in-memory Adapter fit a slot manager's banks? Run before any slot is
written, so a refused adapter changes nothing (the name's previous version stays served).

An Adapter built in memory has not been through load_adapter's checks, so every factor is
checked here as a file's would be: the model it was read for, its rank against R, its
layers, and each tensor's shape (for the Adapter's declared rank), dtype and values.
Legend: E experts, S = 2 gated / 1 non-gated, H hidden, I intermediate, r adapter rank.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig, MoEShape
from ..errors import AdapterError
from .adapter import Adapter
from .refusals import Refusals
from .validate import check_tensor


def check_fits(adapter: Adapter, model_config: ModelConfig, max_rank: int) -> None:
    """Refuse an Adapter read for another model, of rank above R, with non-MoE layers, or
    whose factors disagree with its rank (every such factor named in one error)."""
    s, a = model_config.shape, adapter.shape
    dims = ("num_experts", "hidden_size", "intermediate_size")
    if any(getattr(s, d) != getattr(a, d) for d in dims) or (
        s.activation.width_factor != a.activation.width_factor
    ):
        raise AdapterError(
            adapter.path,
            "<model>",
            f"an adapter loaded for {a}",
            f"one for {s}",
            "load the adapter with this manager's model config",
        )
    if adapter.rank > max_rank:
        raise AdapterError(
            adapter.path,
            "<rank>",
            f"rank {adapter.rank}",
            f"at most R = {max_rank}",
            "raise max_rank",
        )
    extra = set(adapter.layers) - set(model_config.moe_layers)
    if extra:
        raise AdapterError(
            adapter.path,
            "<layers>",
            f"layers {sorted(extra)}",
            f"MoE layers {list(model_config.moe_layers)}",
        )
    refusals = Refusals()
    for layer, lora in sorted(adapter.layers.items()):
        for factor, want in _shapes(s, adapter.rank).items():
            with refusals.check():
                _check_factor(adapter, f"layers[{layer}].{factor}", getattr(lora, factor), want)
    refusals.raise_any()


def _shapes(shape: MoEShape, r: int) -> dict[str, tuple[int, ...]]:
    """LayerLoRA's factor shapes at rank r: w13_a [E, S, r, H], w13_b [E, S, I, r],
    w2_a [E, r, I], w2_b [E, H, r]."""
    e, h, i = shape.num_experts, shape.hidden_size, shape.intermediate_size
    s = shape.activation.width_factor
    return {"w13_a": (e, s, r, h), "w13_b": (e, s, i, r), "w2_a": (e, r, i), "w2_b": (e, h, r)}


def _check_factor(adapter: Adapter, key: str, t: object, want: tuple[int, ...]) -> None:
    """One factor: a tensor of shape `want`, a float dtype, finite values."""
    file = adapter.path or f"<in-memory adapter {adapter.name!r}>"
    got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
    if got != want:
        raise AdapterError(
            file,
            key,
            f"shape {got}" if isinstance(t, torch.Tensor) else f"a {got}",
            f"shape {want} for the Adapter's rank r = {adapter.rank}",
            "build every LayerLoRA at the Adapter's rank (LayerLoRA.zeros(shape, rank) pads a "
            "lower one), or read the adapter with load_adapter()",
        )
    check_tensor(file, key, t)
