"""The three key layouts of expert LoRA found in PEFT files, turned into one form.

1. per-expert modules: `...layers.{n}.mlp.experts.{k}.{gate,up,down}_proj.lora_{A,B}.weight`
   (Mixtral: `w1` gate, `w3` up, `w2` down). A [r, in], B [out, r].
2. shared-outer: the same names without the expert index `{k}` for one factor (e.g. one gate
   A for all experts, vLLM's shared-outer LoRA); the other factor stays per expert.
3. PEFT `target_parameters` on fused 3-D expert tensors (`gate_up_proj`, `down_proj`): two
   wrapped parameters on one module, nested as `experts.lora_*` and
   `experts.base_layer.lora_*`. "natural" orientation (PEFT >= 0.19.1, and gpt-oss with
   any PEFT): A [E*r, in] expert-major, B [out, r*E] expert-minor. "swapped" (PEFT <= 0.18
   on Qwen3-MoE / Mixtral-style [E, out, in] tensors): A [E*r, out], B [in, r*E]. The file
   does not say which parameter each nested pair adapts; the orientation comes from the
   caller or adapter_config.json's peft_version where that decides it (fused.py), else
   both are decided from shapes, with one orientation for the whole layer, and refused
   when more than one reading fits (gate_up alone with H == 2I; non-gated models, where
   w1 natural looks like down swapped).

Every parser returns Projection records: a [E, r, in], b [E, out, r] in fp32, scale in b.
This module holds the shared records, key classification and layouts 1-2; fused.py layout 3.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from ..config import ModelConfig
from ..errors import AdapterError
from .validate import check_shape, lora_scale, peft_name

FUSED_KEY = re.compile(
    r"^(?P<path>(?:.*\.)?layers\.(?P<layer>\d+)\.(?:.+\.)?experts)\."
    r"(?P<nest>(?:base_layer\.)*)lora_(?P<kind>[AB])\.weight$"
)
_PER_EXPERT = re.compile(
    r"^(?P<path>(?:.*\.)?layers\.(?P<layer>\d+)\.(?:.+\.)?experts)\."
    r"(?:(?P<expert>\d+)\.)?(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)"
    r"\.lora_(?P<kind>[AB])\.weight$"
)
_EXPERTS_SEGMENT = re.compile(r"(^|\.)experts\.")
# Module name -> part; gated: gate / up / down, non-gated: w1 / down.
_GATED_PARTS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up"}
_PLAIN_PARTS = {"up_proj": "w1", "w1": "w1"}
_DOWN = {"down_proj", "w2"}


@dataclass
class Projection:
    """One LoRA projection of one MoE layer: a [E, r, in], b [E, out, r], the delta
    scale * b @ a. The fused layout's a and b are views of the file's tensors in its dtype
    (placing them converts and scales in one pass: adapter.py); the per-expert layouts give
    fp32 copies with the scale folded in (scale 1)."""

    layer: int
    part: str  # "gate", "up", "w1" (non-gated) or "down"
    a: torch.Tensor
    b: torch.Tensor
    key: str  # a source key, for error messages
    scale: float = 1.0

    @property
    def rank(self) -> int:
        return self.a.shape[1]


@dataclass(frozen=True)
class Context:
    """What every parser needs: the file (for errors), adapter config and model."""

    file: str
    config: dict[str, Any]
    model: ModelConfig
    fused_orientation: str | None = None

    def dims(self, part: str) -> tuple[int, int]:
        """(in, out) of one part's LoRA product."""
        h, i = self.model.shape.hidden_size, self.model.shape.intermediate_size
        return (i, h) if part == "down" else (h, i)

    def check_layer(self, key: str, layer: int) -> None:
        moe = self.model.moe_layers
        if layer not in moe:
            raise AdapterError(
                self.file,
                key,
                f"layer {layer}",
                f"one of the MoE layers {list(moe)} of '{self.model.name}' "
                f"({self.model.num_layers} layers)",
                "load the adapter for the model it was trained on",
            )


def classify(key: str) -> str:
    """'fused', 'per_expert', 'expert_other' (an unsupported expert key) or 'other'."""
    if FUSED_KEY.match(key):
        return "fused"
    if _PER_EXPERT.match(key):
        return "per_expert"
    return "expert_other" if _EXPERTS_SEGMENT.search(key) else "other"


def is_shared_key(key: str) -> bool:
    """A per-expert-layout key without the expert index: one factor for every expert."""
    m = _PER_EXPERT.match(key)
    return m is not None and m["expert"] is None


def _part_of(ctx: Context, key: str, proj: str) -> str:
    if proj in _DOWN:
        return "down"
    table = _GATED_PARTS if ctx.model.shape.activation.is_gated else _PLAIN_PARTS
    if proj not in table:
        kind = "gated" if ctx.model.shape.activation.is_gated else "non-gated"
        raise AdapterError(
            ctx.file,
            key,
            f"module '{proj}'",
            f"one of {sorted([*table, *_DOWN])} for a {kind} model",
        )
    return table[proj]


# ---- layouts 1 and 2: per-expert modules, optionally with one shared factor ----------------


def parse_per_expert(ctx: Context, tensors: dict[str, torch.Tensor]) -> list[Projection]:
    """Layouts 1 and 2. tensors: key -> A [r, in] or B [out, r] of one expert (or all)."""
    groups: dict[tuple[int, str], dict[str, dict[int | None, str]]] = {}
    paths: dict[tuple[int, str], str] = {}
    for key in tensors:
        m = _PER_EXPERT.match(key)
        layer, proj = int(m["layer"]), m["proj"]
        ctx.check_layer(key, layer)
        part = _part_of(ctx, key, proj)
        if paths.setdefault((layer, part), m["path"]) != m["path"]:
            raise AdapterError(
                ctx.file, key, "a second experts module", f"only '{paths[(layer, part)]}'"
            )
        expert = None if m["expert"] is None else int(m["expert"])
        found = groups.setdefault((layer, part), {"A": {}, "B": {}})[m["kind"]]
        if expert in found:  # e.g. gate_proj and w1 both given for one expert's gate
            raise AdapterError(
                ctx.file, key, f"a second lora_{m['kind']} for {part}", f"only '{found[expert]}'"
            )
        found[expert] = key
    return [
        _assemble(ctx, tensors, layer, part, g, paths[(layer, part)])
        for (layer, part), g in sorted(groups.items())
    ]


def _expert_keys(ctx: Context, found: dict[int | None, str], example: str) -> list[str]:
    """One key per expert (a shared key repeated E times); refuses gaps and extra experts."""
    e = ctx.model.shape.num_experts
    if None in found:
        if len(found) > 1:
            raise AdapterError(
                ctx.file, found[None], "a shared factor and per-expert ones", "one or the other"
            )
        return [found[None]] * e
    extra = [k for k in found if k >= e]
    if extra:
        raise AdapterError(
            ctx.file,
            found[extra[0]],
            f"expert {extra[0]}",
            f"expert ids below E = {e}",
            "load the adapter for the model it was trained on",
        )
    missing = [k for k in range(e) if k not in found]
    if missing:
        name = re.sub(r"experts\.\d+\.", f"experts.{missing[0]}.", example)
        raise AdapterError(
            ctx.file,
            name,
            "no such key",
            f"a factor for each of the {e} experts (missing {missing})",
        )
    return [found[k] for k in range(e)]


def _assemble(
    ctx: Context, tensors: dict[str, torch.Tensor], layer: int, part: str, group: dict, path: str
) -> Projection:
    for kind, other in (("A", "B"), ("B", "A")):
        if not group[kind]:
            example = next(iter(group[other].values()))
            raise AdapterError(
                ctx.file,
                example.replace(f"lora_{other}", f"lora_{kind}"),
                "no such key",
                f"lora_{kind} next to lora_{other}",
            )
    a_keys = _expert_keys(ctx, group["A"], next(iter(group["A"].values())))
    b_keys = _expert_keys(ctx, group["B"], next(iter(group["B"].values())))
    d_in, d_out = ctx.dims(part)
    ranks = []
    for a_key, b_key in zip(a_keys, b_keys, strict=True):
        r = tensors[a_key].shape[0] if tensors[a_key].dim() == 2 else -1
        check_shape(ctx.file, a_key, tensors[a_key], ("r", d_in))
        check_shape(ctx.file, b_key, tensors[b_key], (d_out, r))
        ranks.append(r)
    rank = max(ranks)
    a = torch.zeros(len(a_keys), rank, d_in)
    b = torch.zeros(len(a_keys), d_out, rank)
    for e, (a_key, b_key, r) in enumerate(zip(a_keys, b_keys, ranks, strict=True)):
        scaled_key = a_key if None in group["B"] else b_key  # the per-expert one, if any
        name = peft_name(scaled_key.rsplit(".lora_", 1)[0])
        scale = lora_scale(ctx.file, ctx.config, name, r, scaled_key)
        a[e, :r] = tensors[a_key].float()
        b[e, :, :r] = tensors[b_key].float() * scale
    return Projection(layer, part, a, b, a_keys[0])
