"""The outside truth for rows served on FP8 (W8A8) experts: transformers' eager experts
loop, each base GEMM fed its input quantized per token and per group of `bk` columns (as
transformers' FP8Experts, vLLM and SGLang run a `activation_scheme: dynamic` checkpoint),
plus the LoRA part on the unquantized rows, from PEFT's own delta weight for the adapter.

Why not PEFT on the model: PEFT merges its delta into the expert weight it wraps, which
an e4m3 weight cannot hold, and a merged bf16 weight minus the base loses the delta to
rounding. So the base GEMM reads the FP8 weights dequantized exactly (fp32), and the LoRA
part is `v @ delta.T` with `delta` from peft's ParamWrapper.get_delta_weight, built one
layer at a time (a layer's deltas are 2.4 GB in fp32 at Qwen3-30B-A3B's shape). Nothing
here calls moelora's kernels or its reference.

Legend: T tokens, K top-k, E experts, H hidden, I intermediate, r rank, bn x bk the block.
"""

from __future__ import annotations

import contextlib
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

NAME = "moelora_w8a8_truth"
E4M3_MAX = 448.0


@dataclass(frozen=True)
class FP8Layer:
    """One layer's e4m3 experts [E, N, K] with fp32 block scales [E, N/bn, K/bk]."""

    w13: Tensor
    s13: Tensor
    w2: Tensor
    s2: Tensor
    block: tuple[int, int]

    def expert(self, e: int) -> tuple[Tensor, Tensor]:
        """Expert e's (w13 [2I, H], w2 [H, I]) dequantized exactly in fp32."""
        return _dequantize(self.w13[e], self.s13[e], self.block), _dequantize(
            self.w2[e], self.s2[e], self.block
        )


def _dequantize(w: Tensor, scale: Tensor, block: tuple[int, int]) -> Tensor:
    full = scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return w.float() * full[: w.shape[0], : w.shape[1]]


def quantized_input(v: Tensor, group: int) -> Tensor:
    """v [N, K] -> its W8A8 quantization dequantized (fp32): per row, each group of `group`
    columns scaled by its amax / 448, rounded to e4m3 (nearest even), scaled back."""
    n, k = v.shape
    pad = -k % group
    g = torch.nn.functional.pad(v.float(), (0, pad)).reshape(n, -1, group)
    scale = g.abs().amax(dim=2, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    q = (g / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return (q * scale).reshape(n, -1)[:, :k]


@dataclass
class PeftDeltas:
    """The adapter the truth runs (`current`, None: the base), its LoRA factors read from
    its PEFT directory (kept for the current adapter only), and PEFT's delta weights built
    per layer on demand."""

    adapters: dict[str, Path]
    current: str | None = None
    _factors: dict = field(default_factory=dict)  # (name, layer) -> [(A, B), (A, B)]
    _wrappers: dict = field(default_factory=dict)

    def select(self, name: str | None) -> None:
        if name != self.current:
            self._factors.clear()
        self.current = name

    def deltas(self, layer: int, shapes: tuple, device) -> list[Tensor] | None:
        """[delta13 [E, 2I, H], delta2 [E, H, I]] fp32 for `layer`, or None (the base)."""
        if self.current is None:
            return None
        key = (self.current, layer)
        if key not in self._factors:
            self._factors[key] = _layer_factors(self.adapters[self.current], layer, shapes)
        config = _lora_config(self.adapters[self.current])
        return [
            self._delta(config, shape, a.to(device), b.to(device))
            for shape, (a, b) in zip(shapes, self._factors[key])
        ]

    def _delta(self, config, shape: tuple[int, int, int], a: Tensor, b: Tensor) -> Tensor:
        """PEFT's ParamWrapper.get_delta_weight for factors A [E*r, in], B [out, r*E] of
        an expert parameter [E, out, in] (one wrapper per shape, its factors replaced)."""
        from peft.tuners.lora.layer import ParamWrapper

        slot = (shape, config.r, config.lora_alpha, a.device)
        if slot not in self._wrappers:
            base = nn.Module()  # a stand-in holding a parameter of the expert's shape
            stand_in = torch.empty(1, 1, 1, device=a.device).expand(*shape)
            base.weight = nn.Parameter(stand_in, requires_grad=False)
            wrapper = ParamWrapper(base, "truth", parameter_name="weight", config=config,
                                   r=config.r, lora_alpha=config.lora_alpha)  # fmt: skip
            self._wrappers[slot] = wrapper.to(a.device)
        wrapper = self._wrappers[slot]
        with torch.no_grad():
            wrapper.lora_A["truth"].weight.copy_(a.float())
            wrapper.lora_B["truth"].weight.copy_(b.float())
            return wrapper.get_delta_weight("truth").float()


def _lora_config(path: Path):
    from peft import LoraConfig

    return LoraConfig.from_pretrained(str(path))


def _layer_factors(path: Path, layer: int, shapes: tuple) -> list[tuple[Tensor, Tensor]]:
    """Layer `layer`'s (A, B) for the gate_up and the down parameter, told apart by A's
    input width (H for gate_up, I for down): PEFT nests the two wrappers' keys."""
    from safetensors import safe_open

    marker = f"layers.{layer}.mlp.experts."
    found: dict[str, dict[str, Tensor]] = {}
    with safe_open(str(path / "adapter_model.safetensors"), framework="pt") as f:
        for key in f.keys():
            if marker in key and ".lora_" in key:
                prefix, _, rest = key.rpartition(".lora_")
                found.setdefault(prefix, {})[rest[0]] = f.get_tensor(key)
    by_input = {pair["A"].shape[1]: (pair["A"], pair["B"]) for pair in found.values()}
    (_, _, hidden), (_, _, inter) = shapes
    if set(by_input) != {hidden, inter}:
        raise ValueError(f"{path}: layer {layer} expert LoRA inputs {sorted(by_input)}")
    return [by_input[hidden], by_input[inter]]


def fp8_linear(module: nn.Module, x: Tensor) -> Tensor:
    """transformers' FP8Linear (block scales `weight_scale_inv`, `activation_scheme:
    dynamic`) as its kernels compute it: x [..., K] quantized per token and per group of bk
    columns, times the e4m3 weight dequantized exactly, in fp32, rounded to x's dtype, then
    + bias in that dtype (transformers' order: the product rounded, the bias added after).
    Its own kernels come from the Hub (the `kernels` package) at first use, which an offline
    machine cannot reach; this is their arithmetic in torch."""
    block = tuple(module.block_size)
    v = x.reshape(-1, x.shape[-1])
    w = _dequantize(module.weight, module.weight_scale_inv, block)
    y = (quantized_input(v, block[1]) @ w.t()).to(x.dtype)
    if module.bias is not None:
        y = y + module.bias.to(x.dtype)
    return y.reshape(*x.shape[:-1], -1)


@contextlib.contextmanager
def fp8_linears_as_truth(model: nn.Module):
    """Within: every Linear of `model` holding e4m3 weights with block scales computes
    fp8_linear (whatever forward it had: transformers' Hub kernels, or moelora's kernel
    while attached); after: its forward as before."""
    found = [m for m in model.modules() if isinstance(m, nn.Linear)
             and m.weight.dtype == torch.float8_e4m3fn
             and getattr(m, "block_size", None) is not None]  # fmt: skip
    before = [m.__dict__.get("forward") for m in found]
    for m in found:
        m.forward = functools.partial(fp8_linear, m)
    try:
        yield
    finally:
        for m, forward in zip(found, before):
            if forward is None:
                del m.forward
            else:
                m.forward = forward


def _linear(v: Tensor, w: Tensor, delta: Tensor | None, group: int) -> Tensor:
    """v [N, K] through one expert's weight w [M, K]: the base GEMM on v quantized (W8A8),
    the LoRA part (delta [M, K]) on v itself."""
    y = quantized_input(v, group) @ w.t()
    return y if delta is None else y + v @ delta.t()


def w8a8_experts(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor):
    """The experts implementation NAME: hidden_states [T, H], top_k_index / weights [T, K]
    -> [T, H]. Reads the module's `_w8a8_truth` (layer index, FP8Layer, PeftDeltas)."""
    index, fp8, peft = self._w8a8_truth
    shapes = (tuple(fp8.w13.shape), tuple(fp8.w2.shape))
    deltas = peft.deltas(index, shapes, hidden_states.device)
    x = hidden_states.float()
    out = torch.zeros_like(x)
    group = fp8.block[1]
    for e in torch.unique(top_k_index).tolist():
        if e >= fp8.w13.shape[0]:  # expert parallel's foreign experts
            continue
        tok, pos = torch.where(top_k_index == e)
        w13, w2 = fp8.expert(e)
        d13, d2 = (None, None) if deltas is None else (deltas[0][e], deltas[1][e])
        gate, up = _linear(x[tok], w13, d13, group).chunk(2, dim=-1)
        o = _linear(self.act_fn(gate) * up, w2, d2, group)
        out.index_add_(0, tok, o * top_k_weights[tok, pos, None].float())
    return out.to(hidden_states.dtype)


def register() -> None:
    """NAME in transformers' experts interfaces (the FP8 one too, where it exists)."""
    from transformers.integrations.moe import ExpertsInterface

    from ..hf.experts import fp8_experts_interfaces

    for interface in [ExpertsInterface, *fp8_experts_interfaces()]:
        interface.register(NAME, w8a8_experts)


def install(model: nn.Module, layers: dict[int, FP8Layer], adapters: dict[str, Path]):
    """Give each experts module of `model` its layer's FP8 weights and the shared
    PeftDeltas (returned: select an adapter on it); select NAME with
    model.set_experts_implementation(NAME)."""
    register()
    peft = PeftDeltas(dict(adapters))
    for index, layer in enumerate(model.model.layers):
        layer.mlp.experts._w8a8_truth = (index, layers[index], peft)
    return peft


def fp8_layer_from_module(experts: nn.Module, block: tuple[int, int]) -> FP8Layer | None:
    """The module's own e4m3 tensors (transformers' FP8Experts), or None (dequantized)."""
    w13 = getattr(experts, "gate_up_proj", None)
    if w13 is None or w13.dtype != torch.float8_e4m3fn:
        return None
    return FP8Layer(w13, experts.gate_up_proj_scale_inv, experts.down_proj,
                    experts.down_proj_scale_inv, block)  # fmt: skip


def fp8_layer_from_files(root: Path, layer: int, block: tuple[int, int], device) -> FP8Layer:
    """Layer `layer`'s FP8 experts read from `root`'s safetensors: fused (transformers'
    FP8Experts names) or per expert (`{e}.{gate,up,down}_proj.weight[_scale_inv]`, gate and
    up rows stacked, then the experts)."""
    from safetensors import safe_open

    base = f"model.layers.{layer}.mlp.experts."
    index = root / "model.safetensors.index.json"
    where = json.loads(index.read_text())["weight_map"] if index.is_file() else {}

    def get(key: str) -> Tensor:
        with safe_open(str(root / where.get(key, "model.safetensors")), framework="pt") as f:
            return f.get_tensor(key).to(device)

    if base + "gate_up_proj" in where:
        names = ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv")
        return FP8Layer(*(get(base + n) for n in names), block)
    experts = len({k.split(".")[5] for k in where if k.startswith(base)})
    parts = [[], [], [], []]
    for e in range(experts):
        for suffix, at in (("weight", 0), ("weight_scale_inv", 1)):
            gate_up = [get(f"{base}{e}.{p}.{suffix}") for p in ("gate_proj", "up_proj")]
            parts[at].append(torch.cat(gate_up))
            parts[at + 2].append(get(f"{base}{e}.down_proj.{suffix}"))
    return FP8Layer(*(torch.stack(p) for p in parts), block)
