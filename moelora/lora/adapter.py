"""`load_adapter`: one PEFT adapter directory -> per-MoE-layer factors in the slot-bank layout.

Legend: E experts, S = 2 gated / 1 non-gated, H hidden, I intermediate, r adapter rank,
R max rank. Scale (alpha / r, or alpha / sqrt(r) for rsLoRA, per rank_pattern /
alpha_pattern) is folded into the B factors here, once.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import ModelConfig, MoEShape
from ..errors import AdapterError
from . import formats
from .formats import Context, Projection
from .fused import parse_fused
from .module_banks import ModuleLoRA
from .safe_io import CONFIG_NAME, read_config, read_tensors
from .targets import check_serves, experts_delta_is_zero, modules_delta_is_zero
from .validate import check_lora_config, check_rank, check_tensor

log = logging.getLogger("moelora.lora")

_PART_SLOT = {"gate": ("w13", 0), "w1": ("w13", 0), "up": ("w13", 1), "down": ("w2", 0)}


@dataclass(frozen=True)
class LayerLoRA:
    """One adapter on one MoE layer (fp32, scale in B); a projection the adapter does not
    train is zero. w13_a [E, S, r, H] (part 0 gate or w1, part 1 up), w13_b [E, S, I, r],
    w2_a [E, r, I], w2_b [E, H, r]."""

    w13_a: torch.Tensor
    w13_b: torch.Tensor
    w2_a: torch.Tensor
    w2_b: torch.Tensor

    @staticmethod
    def zeros(shape: MoEShape, rank: int) -> LayerLoRA:
        e, h, i, s = (
            shape.num_experts,
            shape.hidden_size,
            shape.intermediate_size,
            shape.activation.width_factor,
        )
        return LayerLoRA(
            torch.zeros(e, s, rank, h),
            torch.zeros(e, s, i, rank),
            torch.zeros(e, rank, i),
            torch.zeros(e, h, rank),
        )


@dataclass(frozen=True)
class Adapter:
    """A loaded adapter, ready to be copied into a slot. `layers` maps MoE layer index ->
    factors; a layer the adapter does not touch is absent (its slot rows stay zero)."""

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
) -> Adapter:
    """Read and validate a PEFT adapter directory; raise AdapterError on any defect.

    fused_orientation: "natural" or "swapped", only needed when the fused
    target_parameters factors are ambiguous for this model's sizes (e.g. H == 2I).
    serves_non_expert: the caller applies the adapter's other modules (attention, shared
    experts, ...) elsewhere, so an adapter with no expert LoRA still changes what is served
    (it loads with no layers). False (moelora's MoE layers alone): such an adapter would
    change nothing and is refused. Either way an adapter whose config targets the experts
    but whose file holds no expert tensors is refused (targets.py).
    """
    root = Path(path)
    config = read_config(root)
    check_lora_config(str(root / CONFIG_NAME), config)
    file, tensors = read_tensors(root)
    ctx = Context(str(file), config, model_config, fused_orientation)
    kinds = _classify(ctx, tensors)
    others = tuple(sorted({k.split(".lora_")[0] for k in kinds["other"]}))
    if kinds["fused"]:
        projections, layout = parse_fused(ctx, kinds["fused"]), "fused"
    elif kinds["per_expert"]:
        projections = formats.parse_per_expert(ctx, kinds["per_expert"])
        shared = any(formats.is_shared_key(k) for k in kinds["per_expert"])
        layout = "shared_outer" if shared else "per_expert"
    else:
        check_serves(ctx.file, config, others, serves_non_expert)
        projections, layout = [], "none"
    for p in projections:
        check_rank(ctx.file, p.key, p.rank, max_rank)
    _report(root, projections, kinds["other"], others, serves_non_expert)
    rank = max((p.rank for p in projections), default=0)
    return Adapter(
        name=name or root.resolve().name,
        path=str(root),
        rank=rank,
        layout=layout,
        layers=_to_layers(model_config.shape, projections, rank),
        shape=model_config.shape,
        non_expert_modules=others,
    )


def _classify(ctx: Context, tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    """key -> tensor split into 'fused', 'per_expert' and 'other' (non-expert) entries; the
    expert ones checked (dtype, finite). Refuses unsupported expert keys and mixed layouts."""
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
    for key, t in {**kinds["fused"], **kinds["per_expert"]}.items():
        check_tensor(ctx.file, key, t)
    return kinds


def _report(
    root: Path,
    projections: list[Projection],
    other: dict[str, torch.Tensor],
    others: tuple[str, ...],
    serves_non_expert: bool,
) -> None:
    """Warnings for what loads but deserves a look: modules the MoE layers do not run, and a
    served delta that is zero everywhere (one warning per load)."""
    if others and not serves_non_expert:
        log.warning(
            "adapter %s: %d non-expert modules (e.g. %s) are not served by moelora's expert "
            "layers; apply them in the dense layers",
            root,
            len(others),
            others[0],
        )
    served_zero = experts_delta_is_zero(projections) and (
        not serves_non_expert or modules_delta_is_zero(other)
    )
    if served_zero:
        log.warning(
            "adapter %s: every LoRA delta it serves is zero (a factor, usually lora_B, is all "
            "zeros: PEFT's initialisation before training); it loads but changes nothing. "
            "Check that the trained adapter was saved",
            root,
        )


def _to_layers(shape: MoEShape, projections: list[Projection], rank: int) -> dict[int, LayerLoRA]:
    """Place each projection in its layer's bank layout, zero-padded to `rank`."""
    layers: dict[int, LayerLoRA] = {}
    for p in projections:
        layer = layers.setdefault(p.layer, LayerLoRA.zeros(shape, rank))
        which, part = _PART_SLOT[p.part]
        if which == "w13":
            layer.w13_a[:, part, : p.rank] = p.a
            layer.w13_b[:, part, :, : p.rank] = p.b
        else:
            layer.w2_a[:, : p.rank] = p.a
            layer.w2_b[:, :, : p.rank] = p.b
    return layers


def check_fits(adapter: Adapter, model_config: ModelConfig, max_rank: int) -> None:
    """Refuse an Adapter read for another model, of rank above R, or with non-MoE layers."""
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
            "raise max_lora_rank",
        )
    extra = set(adapter.layers) - set(model_config.moe_layers)
    if extra:
        raise AdapterError(
            adapter.path,
            "<layers>",
            f"layers {sorted(extra)}",
            f"MoE layers {list(model_config.moe_layers)}",
        )
