"""`load_adapter`: one PEFT adapter directory -> per-MoE-layer factors in the slot-bank layout.

Legend: E experts, S = 2 gated / 1 non-gated, H hidden, I intermediate, r adapter rank,
R max rank. Scale (alpha / r, or alpha / sqrt(r) for rsLoRA, per rank_pattern /
alpha_pattern) is folded into the B factors here, once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig, MoEShape
from ..errors import AdapterError
from . import formats
from .formats import Context, Projection
from .fused import parse_fused
from .module_banks import ModuleLoRA
from .refusals import Refusals
from .safe_io import CONFIG_NAME, read_config, read_tensors
from .targets import check_serves, experts_delta_is_zero, modules_delta_is_zero
from .validate import (
    check_lora_config,
    check_module_rank,
    check_rank,
    check_tensor,
    module_factors,
    zero_alphas,
)

log = logging.getLogger("moelora.lora")

_PART_SLOT = {"gate": ("w13", 0), "w1": ("w13", 0), "up": ("w13", 1), "down": ("w2", 0)}


@dataclass(frozen=True)
class LayerLoRA:
    """One adapter on one MoE layer (scale in B); a projection the adapter does not
    train is zero. w13_a [E, S, r, H] (part 0 gate or w1, part 1 up), w13_b [E, S, I, r],
    w2_a [E, r, I], w2_b [E, H, r]."""

    w13_a: torch.Tensor
    w13_b: torch.Tensor
    w2_a: torch.Tensor
    w2_b: torch.Tensor

    @staticmethod
    def zeros(shape: MoEShape, rank: int) -> LayerLoRA:
        return LayerLoRA(*(torch.zeros(size) for size in LayerLoRA.sizes(shape, rank)))

    @staticmethod
    def sizes(shape: MoEShape, rank: int) -> tuple[tuple[int, ...], ...]:
        """The four factors' sizes (w13_a, w13_b, w2_a, w2_b)."""
        e, h, i, s = (
            shape.num_experts,
            shape.hidden_size,
            shape.intermediate_size,
            shape.activation.width_factor,
        )
        return (e, s, rank, h), (e, s, i, rank), (e, rank, i), (e, h, rank)

    def part(self, which: str, part: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(a [E, rank, in], b [E, out, rank]) of one projection: views into the factors."""
        if which == "w13":
            return self.w13_a[:, part], self.w13_b[:, part]
        return self.w2_a, self.w2_b


@dataclass(frozen=True)
class Adapter:
    """A loaded adapter, ready to be copied into a slot. `layers` maps MoE layer index ->
    factors (fp32, or the bank dtype when parsed into a slot manager's host form); a layer
    the adapter does not touch is absent (its slot rows stay zero)."""

    name: str
    path: str
    rank: int  # r: the largest rank of any expert projection (others zero-padded to it)
    layout: str  # "per_expert", "shared_outer", "fused", or "none" (no expert LoRA; loaded
    # only for a caller that serves the other modules: load_adapter(serves_non_expert=True))
    layers: dict[int, LayerLoRA]
    shape: MoEShape
    non_expert_modules: tuple[str, ...] = field(default=())  # e.g. attention: not served here
    # module path -> factors of a dense Linear (scale in b), served from the module banks
    # (module_banks.py); filled by a caller that serves them (moelora.hf), else empty
    modules: Mapping[str, ModuleLoRA] = field(default_factory=dict)


def load_adapter(
    path: str | Path,
    model_config: ModelConfig,
    max_rank: int,
    *,
    name: str | None = None,
    fused_orientation: str | None = None,
    serves_non_expert: bool = False,
    reader: Callable[[], tuple[Path, dict[str, torch.Tensor]]] | None = None,
    allocate: Callable[[list[tuple[int, ...]]], list[torch.Tensor]] | None = None,
) -> Adapter:
    """Read and validate a PEFT adapter directory; raise AdapterError on any defect.

    fused_orientation: "natural" or "swapped", only needed when the fused
    target_parameters factors are ambiguous for this model's sizes (e.g. H == 2I).
    serves_non_expert: the caller applies the adapter's other modules (attention, shared
    experts, ...) elsewhere, so an adapter with no expert LoRA still changes what is served
    (it loads with no layers). False (moelora's MoE layers alone): such an adapter would
    change nothing and is refused. Either way an adapter whose config targets the experts
    but whose file holds no expert tensors is refused (targets.py).
    reader: returns (file, tensors) of the directory, for a caller that reads the file once
    for other uses too (default: read_tensors(path)).
    allocate: empty tensors of the given sizes that the expert factors are written into
    (default: fp32 host tensors): a slot manager's HostCache.allocate parses the adapter
    straight into its host form (bank dtype, pinned on CUDA), one pass over the factors and
    the same values as converting the fp32 form (b times its scale rounded once).
    """
    root = Path(path)
    config = read_config(root)
    check_lora_config(str(root / CONFIG_NAME), config)
    file, tensors = reader() if reader is not None else read_tensors(root)
    ctx = Context(str(file), config, model_config, fused_orientation)
    kinds = _classify(ctx, tensors)
    others = tuple(sorted({k.split(".lora_")[0] for k in kinds["other"]}))
    # Independent checks: the error lists every problem they find, not only the first.
    refusals = Refusals()
    _check_values(ctx, tensors, kinds["other"], refusals)
    projections, layout = [], "none"
    with refusals.check():
        projections, layout = _parse(ctx, kinds, others, serves_non_expert)
        for p in projections:
            check_rank(ctx.file, p.key, p.rank, max_rank)
    refusals.raise_any()
    _report(root, config, projections, kinds["other"], others, serves_non_expert)
    rank = max((p.rank for p in projections), default=0)
    return Adapter(
        name=name or root.resolve().name,
        path=str(root),
        rank=rank,
        layout=layout,
        layers=_to_layers(model_config.shape, projections, rank, allocate or _fp32),
        shape=model_config.shape,
        non_expert_modules=others,
    )


def _classify(ctx: Context, tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    """key -> tensor split into 'fused', 'per_expert' and 'other' (non-expert) entries.
    Refuses unsupported expert keys and mixed layouts."""
    kinds: dict[str, dict[str, torch.Tensor]] = {"fused": {}, "per_expert": {}, "other": {}}
    for key, t in tensors.items():
        kind = formats.classify(key)
        if kind == "expert_other":
            raise AdapterError(
                ctx.file,
                key,
                "an expert entry moelora cannot serve",
                "only lora_A / lora_B .weight factors on the experts",
                "train without lora_bias, DoRA or modules_to_save on the experts",
            )
        kinds[kind][key] = t
    if not tensors:
        raise AdapterError(ctx.file, "<tensors>", "an empty file", "LoRA factors")
    if kinds["fused"] and kinds["per_expert"]:
        raise AdapterError(
            ctx.file,
            next(iter(kinds["per_expert"])),
            "per-expert keys next to fused ones",
            "one layout per adapter",
        )
    return kinds


def _check_values(
    ctx: Context,
    tensors: dict[str, torch.Tensor],
    other: dict[str, torch.Tensor],
    refusals: Refusals,
) -> None:
    """Every tensor, expert or not: a float dtype and finite values; every non-expert factor:
    the rank the config gives its module (read before anything is applied)."""
    for key, t in tensors.items():
        with refusals.check():
            check_tensor(ctx.file, key, t)
    for module, factors in sorted(module_factors(other).items()):
        with refusals.check():
            check_module_rank(ctx.file, ctx.config, module, factors)


def _parse(
    ctx: Context, kinds: dict[str, dict], others: tuple[str, ...], serves_non_expert: bool
) -> tuple[list[Projection], str]:
    """(projections, layout) of the expert tensors; an adapter without any must serve
    something (targets.check_serves)."""
    if kinds["fused"]:
        return parse_fused(ctx, kinds["fused"]), "fused"
    if kinds["per_expert"]:
        shared = any(formats.is_shared_key(k) for k in kinds["per_expert"])
        layout = "shared_outer" if shared else "per_expert"
        return formats.parse_per_expert(ctx, kinds["per_expert"]), layout
    check_serves(ctx.file, ctx.config, others, serves_non_expert)
    return [], "none"


def _report(
    root: Path,
    config: dict[str, Any],
    projections: list[Projection],
    other: dict[str, torch.Tensor],
    others: tuple[str, ...],
    serves_non_expert: bool,
) -> None:
    """Warnings for what loads but deserves a look: modules the MoE layers do not run, an
    alpha of 0, and a served delta that is zero everywhere (one warning each per load)."""
    if others and not serves_non_expert:
        log.warning(
            "adapter %s: %d non-expert modules (e.g. %s) are not served by moelora's expert "
            "layers; apply them in the dense layers",
            root,
            len(others),
            others[0],
        )
    zeros = zero_alphas(config)
    patterns = (config.get("alpha_pattern") or {}).values()
    all_zero_alpha = "lora_alpha" in zeros and all(v == 0 for v in patterns)
    if zeros:
        log.warning(
            "adapter %s: %s = 0 scales %s by 0, so %s as the base model. Set the alpha the "
            "adapter was trained with",
            root,
            ", ".join(zeros),
            "every LoRA delta" if all_zero_alpha else "the LoRA delta of the modules it names",
            "it serves" if all_zero_alpha else "those modules serve",
        )
    served_zero = experts_delta_is_zero(projections) and (
        not serves_non_expert or modules_delta_is_zero(other)
    )
    if served_zero and not all_zero_alpha:  # an alpha of 0 has been named as the cause
        log.warning(
            "adapter %s: every LoRA delta it serves is zero (a factor, usually lora_B, is all "
            "zeros: PEFT's initialisation before training); it loads but changes nothing. "
            "Check that the trained adapter was saved",
            root,
        )


def _fp32(sizes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    return [torch.empty(size, dtype=torch.float32) for size in sizes]


def _to_layers(
    shape: MoEShape, projections: list[Projection], rank: int, allocate
) -> dict[int, LayerLoRA]:
    """Place each projection in its layer's bank layout (b times its scale), zero-padded to
    `rank`, in the tensors `allocate` gives (every layer's four factors in one call); a
    projection the adapter does not train is zero. Each factor's memory is written once
    (zeroing it first doubled the time of a large adapter's load, page faults included)."""
    indices = sorted({p.layer for p in projections})
    sizes = LayerLoRA.sizes(shape, rank)
    factors = iter(allocate([size for _ in indices for size in sizes]))
    layers = {index: LayerLoRA(*(next(factors) for _ in sizes)) for index in indices}
    filled: dict[tuple[int, str, int], int] = {}
    for p in projections:
        which, part = _PART_SLOT[p.part]
        a, b = layers[p.layer].part(which, part)
        a[:, : p.rank].copy_(p.a)
        _place_scaled(b[:, :, : p.rank], p.b, p.scale)
        filled[(p.layer, which, part)] = p.rank
    parts = [("w13", k) for k in range(shape.activation.width_factor)] + [("w2", 0)]
    for index, layer in layers.items():
        for which, part in parts:
            r = filled.get((index, which, part), 0)
            a, b = layer.part(which, part)
            a[:, r:].zero_()
            b[:, :, r:].zero_()
    return layers


def _place_scaled(out: torch.Tensor, b: torch.Tensor, scale: float) -> None:
    """out = b * scale, the product rounded once to out's dtype: in place after an exact copy
    (fp32 out, or b already in out's dtype), else through an fp32 product."""
    if scale == 1.0:
        out.copy_(b)
    elif out.dtype == torch.float32 or b.dtype == out.dtype:
        out.copy_(b).mul_(scale)
    else:
        out.copy_(b.float() * scale)
