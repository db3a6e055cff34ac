"""Layout 3: PEFT `target_parameters` LoRA on fused 3-D expert tensors (`gate_up_proj`,
`down_proj`; non-gated `up_proj`), saved as two nested wrappers on one module:
`experts.lora_{A,B}.weight` and `experts.base_layer.lora_{A,B}.weight`.

Orientation: "natural" (PEFT >= 0.19.1; gpt-oss with any PEFT): A [E*r, in] expert-major,
B [out, r*E] expert-minor. "swapped" (PEFT <= 0.18 on [E, out, in] tensors such as
Qwen3-MoE and Mixtral): A [E*r, out], B [in, r*E]. The orientation is the caller's
(`fused_orientation`), else the one adapter_config.json's `peft_version` decides, else
read from the shapes; which pair adapts which parameter is read from the shapes (one
orientation per layer). More than one reading is refused, naming how to choose.
"""

from __future__ import annotations

import itertools
import re

import torch

from ..activations import split_gate_up
from ..errors import AdapterError
from .formats import FUSED_KEY, Context, Projection, peft_name
from .validate import check_shape, lora_scale

ORIENTATIONS = ("natural", "swapped")
_OTHER = {"natural": "swapped", "swapped": "natural"}
# Families whose experts transformers stores [E, in, out] WITHOUT an is_transposed flag
# (the same fact as hf/weights.py's ALWAYS_TRANSPOSED): PEFT <= 0.18 read their first
# dimension as `in` (natural), PEFT >= 0.19.1 swaps in / out for an unflagged 3-D
# parameter (swapped). Checked on PEFT 0.21.2's own files in tests/test_hf_generate.py.
STORED_IN_OUT = frozenset({"llama4_text"})
_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?P<rest>.*)$")


def _fused_params(ctx: Context) -> dict[str, tuple[int, int]]:
    """Fused parameter name -> true (in, out) of its per-expert product."""
    s = ctx.model.shape
    first = "gate_up_proj" if s.activation.is_gated else "up_proj"
    params = {first: (s.hidden_size, s.w13_rows), "down_proj": (s.intermediate_size, s.hidden_size)}
    targets = ctx.config.get("target_parameters") or []
    named = {p for p in params if any(str(t).split(".")[-1] == p for t in targets)}
    return {p: v for p, v in params.items() if p in named} if named else params


def _orientations(ctx: Context) -> tuple[str, ...]:
    """The orientations to try: the caller's, else gpt-oss's, else the one adapter_config.json's
    peft_version decides, else both (the shapes decide, or the load is refused as ambiguous)."""
    if ctx.fused_orientation is not None:
        if ctx.fused_orientation not in ORIENTATIONS:
            raise AdapterError(
                ctx.file, "fused_orientation", repr(ctx.fused_orientation), f"one of {ORIENTATIONS}"
            )
        return (ctx.fused_orientation,)
    # gpt-oss stores [E, in, out] (is_transposed): every PEFT version saved it the natural way.
    if ctx.model.model_type == "gpt_oss":
        return ("natural",)
    by_version = orientation_of_version(ctx.config.get("peft_version"))
    if by_version is None:
        return ORIENTATIONS
    if ctx.model.model_type in STORED_IN_OUT:  # PEFT's in / out there is the stored reverse
        return (_OTHER[by_version],)
    return (by_version,)


def orientation_of_version(peft_version: object) -> str | None:
    """The orientation PEFT `peft_version` saved [E, out, in] experts in (every family but
    gpt-oss and STORED_IN_OUT, which read the other way), or None if unknown.

    PEFT <= 0.18.1 read a 3-D parameter as [E, in, out] whatever its layout: "swapped" for
    Qwen3-MoE / Mixtral. Then (peft 5356277d0, #3083, during 0.18.2.dev0; released in
    0.19.0) it swapped in / out when the experts module `is_transposed`, the wrong way
    round; 0.19.1 swaps when it is NOT transposed (peft e84dd8f40, #3165, in v0.19.1 and
    later): "natural". A file from in between depends on whether transformers' own patch of
    PEFT ran (the #3165 message): undecided (0.18.2 dev builds, 0.19.0, 0.19.1 pre-releases),
    as are a missing peft_version (PEFT writes it since 0.18.0, #2782; a hand-written config
    may omit it) and an unreadable one.
    """
    m = _VERSION.match(str(peft_version or "").partition("@")[0])  # dev: "0.19.1.dev0@<sha>"
    if peft_version is None or m is None:
        return None
    release = tuple(int(g) for g in m.group(1, 2, 3))
    pre = re.match(r"\.?(dev|a|b|rc)", m["rest"]) is not None  # "0.19.1.post1" is no pre
    if release <= (0, 18, 1):
        return "swapped"
    if release > (0, 19, 1) or (release == (0, 19, 1) and not pre):
        return "natural"
    return None


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
    orient, names, ranks = _reading(ctx, tensors, pairs)
    out = []
    for pair, name, r in zip(pairs, names, ranks, strict=True):
        a, b = _unfuse(tensors[pair["A"]], tensors[pair["B"]], r, orient)
        scale = lora_scale(ctx.file, ctx.config, f"{peft_name(path)}.{name}", r, pair["A"])
        if name == "down_proj":
            out.append(Projection(layer, "down", a, b, pair["A"], scale))
        elif ctx.model.shape.activation.is_gated:
            gate, up = split_gate_up(ctx.model.shape.activation, b.transpose(1, 2))
            out.append(Projection(layer, "gate", a, gate.transpose(1, 2), pair["A"], scale))
            out.append(Projection(layer, "up", a, up.transpose(1, 2), pair["A"], scale))
        else:
            out.append(Projection(layer, "w1", a, b, pair["A"], scale))
    return out


def _reading(ctx: Context, tensors, pairs: list) -> tuple[str, tuple[str, ...], list[int]]:
    """(orientation, parameter name of each pair, rank of each pair): the one reading of the
    layer's shapes; refused when none or several fit."""
    params = _fused_params(ctx)
    if len(pairs) > len(params):
        raise AdapterError(
            ctx.file,
            pairs[-1]["A"],
            f"{len(pairs)} nested LoRA pairs",
            f"at most {len(params)} ({', '.join(params)})",
        )
    shapes = [_pair_shapes(ctx, tensors, p) for p in pairs]
    tried = _orientations(ctx)
    fits = [
        (orient, names)
        for orient in tried
        for names in itertools.permutations(params, len(pairs))
        if all(
            (d_a, d_b) == _dims(params[n], orient)
            for (d_a, d_b, _), n in zip(shapes, names, strict=True)
        )
    ]
    found = ", ".join(
        f"A {tuple(tensors[p['A']].shape)} B {tuple(tensors[p['B']].shape)}" for p in pairs
    )
    if not fits:
        raise AdapterError(
            ctx.file,
            pairs[0]["A"],
            found,
            " or ".join(_layout(params, o) for o in tried) + _told(ctx, tried),
            _unfit_fix(ctx, tried),
        )
    if len(fits) > 1:
        raise AdapterError(
            ctx.file,
            pairs[0]["A"],
            f"{found}, which fits {fits}",
            "one reading of the shapes",
            "the fused orientation changed in PEFT 0.19.1 and neither these sizes nor "
            f"adapter_config.json's peft_version ({ctx.config.get('peft_version')!r}) tells: "
            "pass fused_orientation='natural' (saved by PEFT >= 0.19.1) or 'swapped' (PEFT "
            "<= 0.18), or --fused-orientation natural|swapped on the command line",
        )
    orient, names = fits[0]
    return orient, names, [r for _, _, r in shapes]


def _dims(in_out: tuple[int, int], orient: str) -> tuple[int, int]:
    """(A's second, B's first dimension) of a parameter with true (in, out) as saved."""
    return in_out if orient == "natural" else in_out[::-1]


def _layout(params: dict[str, tuple[int, int]], orient: str) -> str:
    """The factor shapes `orient` expects, for the error."""
    shapes = [(n, *_dims(in_out, orient)) for n, in_out in params.items()]
    return f"{orient} layout " + "; ".join(f"{n}: A (E*r, {a}) B ({b}, r*E)" for n, a, b in shapes)


def _told(ctx: Context, tried: tuple[str, ...]) -> str:
    """Where a single orientation tried came from, for the error."""
    if ctx.fused_orientation is not None:
        return " (the orientation named by fused_orientation)"
    if len(tried) > 1 or ctx.model.model_type == "gpt_oss":
        return ""
    version = ctx.config.get("peft_version")
    return f" (what PEFT {version} saves, from adapter_config.json's peft_version)"


def _unfit_fix(ctx: Context, tried: tuple[str, ...]) -> str:
    """The fix when no orientation tried fits: the other one, when only one was tried."""
    fix = "load the adapter for the model it was trained on"
    if len(tried) == 1 and ctx.model.model_type != "gpt_oss":
        other = "swapped" if tried[0] == "natural" else "natural"
        fix = (
            f"if a PEFT version other than the one assumed saved it, read it {other} "
            f"(fused_orientation={other!r}, --fused-orientation {other}); else {fix}"
        )
    return fix


def _unfuse(
    a: torch.Tensor, b: torch.Tensor, r: int, orient: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused factors -> views (a [E, r, in], b [E, out, r]). A is expert-major, B
    expert-minor."""
    e = a.shape[0] // r
    if orient == "natural":  # A [E*r, in], B [out, r*E]
        return a.reshape(e, r, -1), b.reshape(b.shape[0], r, e).permute(2, 0, 1)
    # swapped: A [E*r, out], B [in, r*E]; delta_e = A_e^T B_e^T
    return b.reshape(b.shape[0], r, e).permute(2, 1, 0), a.reshape(e, r, -1).transpose(1, 2)
