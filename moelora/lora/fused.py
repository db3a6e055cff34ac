"""Layout 3: PEFT `target_parameters` LoRA on fused 3-D expert tensors (`gate_up_proj`,
`down_proj`; non-gated `up_proj`), saved as two nested wrappers on one module:
`experts.lora_{A,B}.weight` and `experts.base_layer.lora_{A,B}.weight`.

Orientation: "natural" (PEFT 0.21; gpt-oss with any PEFT): A [E*r, in] expert-major,
B [out, r*E] expert-minor. "swapped" (PEFT 0.17 on [E, out, in] tensors such as Qwen3-MoE
and Mixtral): A [E*r, out], B [in, r*E]. Which pair adapts which parameter, and the
orientation, are read from the shapes (one orientation per layer); more than one reading
is refused unless the caller names the orientation.
"""

from __future__ import annotations

import itertools

import torch

from ..activations import split_gate_up
from ..errors import AdapterError
from .formats import FUSED_KEY, Context, Projection, peft_name
from .validate import check_shape, lora_scale

ORIENTATIONS = ("natural", "swapped")


def _fused_params(ctx: Context) -> dict[str, tuple[int, int]]:
    """Fused parameter name -> true (in, out) of its per-expert product."""
    s = ctx.model.shape
    first = "gate_up_proj" if s.activation.is_gated else "up_proj"
    params = {first: (s.hidden_size, s.w13_rows), "down_proj": (s.intermediate_size, s.hidden_size)}
    targets = ctx.config.get("target_parameters") or []
    named = {p for p in params if any(str(t).split(".")[-1] == p for t in targets)}
    return {p: v for p, v in params.items() if p in named} if named else params


def _orientations(ctx: Context) -> tuple[str, ...]:
    if ctx.fused_orientation is not None:
        if ctx.fused_orientation not in ORIENTATIONS:
            raise AdapterError(
                ctx.file, "fused_orientation", repr(ctx.fused_orientation), f"one of {ORIENTATIONS}"
            )
        return (ctx.fused_orientation,)
    # gpt-oss stores [E, in, out] (is_transposed): every PEFT version saved it the natural way.
    return ("natural",) if ctx.model.model_type == "gpt_oss" else ORIENTATIONS


def parse_fused(ctx: Context, tensors: dict[str, torch.Tensor]) -> list[Projection]:
    """Layout 3. tensors: key -> A [E*r, d_a] or B [d_b, r*E] of one nested wrapper."""
    groups: dict[tuple[int, str], dict[int, dict[str, str]]] = {}
    for key in tensors:
        m = FUSED_KEY.match(key)
        layer = int(m["layer"])
        ctx.check_layer(key, layer)
        depth = m["nest"].count("base_layer")
        groups.setdefault((layer, m["path"]), {}).setdefault(depth, {})[m["kind"]] = key
    out: list[Projection] = []
    layers_seen: set[int] = set()
    for (layer, path), pairs in sorted(groups.items()):
        if layer in layers_seen:
            raise AdapterError(ctx.file, path, "a second experts module", "one per layer")
        layers_seen.add(layer)
        out += _fused_layer(ctx, tensors, layer, path, [pairs[d] for d in sorted(pairs)])
    return out


def _pair_shapes(ctx: Context, tensors: dict[str, torch.Tensor], pair: dict[str, str]):
    for kind, other in (("A", "B"), ("B", "A")):
        if kind not in pair:
            raise AdapterError(
                ctx.file,
                pair[other].replace(f"lora_{other}", f"lora_{kind}"),
                "no such key",
                f"lora_{kind} next to lora_{other}",
            )
    a, b = tensors[pair["A"]], tensors[pair["B"]]
    e = ctx.model.shape.num_experts
    check_shape(ctx.file, pair["A"], a, ("E*r", "in"))
    check_shape(ctx.file, pair["B"], b, ("out", a.shape[0]))
    if a.shape[0] % e:
        raise AdapterError(
            ctx.file,
            pair["A"],
            f"shape {tuple(a.shape)}",
            f"a first dimension E*r divisible by E = {e}",
            "load the adapter for the model it was trained on",
        )
    return a.shape[1], b.shape[0], a.shape[0] // e


def _fused_layer(ctx: Context, tensors, layer: int, path: str, pairs: list) -> list[Projection]:
    params = _fused_params(ctx)
    if len(pairs) > len(params):
        raise AdapterError(
            ctx.file,
            pairs[-1]["A"],
            f"{len(pairs)} nested LoRA pairs",
            f"at most {len(params)} ({', '.join(params)})",
        )
    shapes = [_pair_shapes(ctx, tensors, p) for p in pairs]
    fits = []
    for orient in _orientations(ctx):
        for names in itertools.permutations(params, len(pairs)):
            dims = [params[n] if orient == "natural" else params[n][::-1] for n in names]
            if all((d_a, d_b) == d for (d_a, d_b, _), d in zip(shapes, dims, strict=True)):
                fits.append((orient, names))
    found = ", ".join(
        f"A {tuple(tensors[p['A']].shape)} B {tuple(tensors[p['B']].shape)}" for p in pairs
    )
    if not fits:
        want = "; ".join(f"{n}: A (E*r, {i}) B ({o}, r*E)" for n, (i, o) in params.items())
        raise AdapterError(
            ctx.file,
            pairs[0]["A"],
            found,
            f"natural layout {want} (or swapped)",
            "load the adapter for the model it was trained on",
        )
    if len(fits) > 1:
        raise AdapterError(
            ctx.file,
            pairs[0]["A"],
            f"{found}, which fits {fits}",
            "one reading of the shapes",
            "the fused orientation changed between PEFT versions and these sizes cannot tell: "
            "pass fused_orientation='natural' (saved by PEFT 0.21) or 'swapped' (PEFT 0.17)",
        )
    orient, names = fits[0]
    out = []
    for pair, name, (_, _, r) in zip(pairs, names, shapes, strict=True):
        a, b = _unfuse(tensors[pair["A"]].float(), tensors[pair["B"]].float(), r, orient)
        b = b * lora_scale(ctx.file, ctx.config, f"{peft_name(path)}.{name}", r, pair["A"])
        if name == "down_proj":
            out.append(Projection(layer, "down", a, b, pair["A"]))
        elif ctx.model.shape.activation.is_gated:
            gate, up = split_gate_up(ctx.model.shape.activation, b.transpose(1, 2))
            out.append(Projection(layer, "gate", a, gate.transpose(1, 2).contiguous(), pair["A"]))
            out.append(
                Projection(layer, "up", a.clone(), up.transpose(1, 2).contiguous(), pair["A"])
            )
        else:
            out.append(Projection(layer, "w1", a, b, pair["A"]))
    return out


def _unfuse(
    a: torch.Tensor, b: torch.Tensor, r: int, orient: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused factors -> (a [E, r, in], b [E, out, r]). A is expert-major, B expert-minor."""
    e = a.shape[0] // r
    if orient == "natural":  # A [E*r, in], B [out, r*E]
        return a.reshape(e, r, -1).contiguous(), b.reshape(b.shape[0], r, e).permute(
            2, 0, 1
        ).contiguous()
    # swapped: A [E*r, out], B [in, r*E]; delta_e = A_e^T B_e^T
    return (
        b.reshape(b.shape[0], r, e).permute(2, 1, 0).contiguous(),
        a.reshape(e, r, -1).transpose(1, 2).contiguous(),
    )
