"""The decode step and the prefill as moelora runs them, for the families it knows
(Qwen3-MoE, Qwen3.5-MoE, OLMoE, Mixtral, gpt-oss, DeepSeek-V2 / V3, Llama 4: FAMILIES, what
differs between them as data): the model's own
weights read in place, few kernels per layer, every LoRA module per token in moelora's
kernels; the engine replays a decode step as one CUDA graph per bucket of rows and runs a
prefill eagerly, the waiting prompts of any lengths packed into one forward (varlen: no
padding, no mask tensor).

Per layer: the residual add fused into each RMSNorm (kernels/rms_norm.py); the q / k / v
projections as one GEMM over the model's three weights, their LoRA over the slots the rows
name in its epilogue (kernels/dense_linear.py, the shrink one launch before); q / k norm,
rotary and the KV-cache write in one kernel in the family's form (kernels/rope_cache.py:
Qwen3's, Qwen3.5's zero-centered and partial, Llama 4's complex pairs with the norm after,
DeepSeek's rotary parts beside its latent;
into the paged cache's block and offset of each token, found once per forward from the
block table); attention
over each row's blocks up to its own length (kernels/decode_attention.py at decode,
kernels/prefill_attention.py causal over each packed prompt at prefill; a sliding-window
layer reads its window, gpt-oss's sinks join each softmax); o_proj and its LoRA alike; the router (its
logits on cuBLAS, their LoRA, softmax / top-k / renormalization in one kernel,
kernels/router_topk.py; DeepSeek's sigmoid and grouped top-k in fp32, moelora/routing.py); the
experts on moelora's layer, and a shared-experts MLP where the family has one; a dense layer
(DeepSeek's first ones) runs its gated MLP, gate and up in one GEMM. DeepSeek's multi-head
latent attention (_mla) runs its projections the same way, caches each position's normed
latent and rotary key (rank + rope numbers, as FlashMLA-style engines do) and attends in
the absorbed form (kernels/mla_attention.py: kv_b's key half moved onto each query, its
value half onto each head's output). Then the final norm and the LM head
(cuBLAS; at prefill over each prompt's last token only, or every token when prompt
logprobs are asked) with its LoRA (kernels/dense_lora.py). Each step keeps transformers'
roundings (the kernels' docstrings say how), so a row equals the model's eager forward
within its dtype's tolerance (tests/test_engine_runner.py, against HF + PEFT alone).

Families or configurations it does not know keep transformers' forward (runner_support()
says why). Legend: B rows, H hidden, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import from_hf
from ..kernels.decode_attention import decode_attention
from ..kernels.dense_linear import MAX_MODULES, dense_linear, lora_shrink
from ..kernels.dense_lora import add_dense_lora
from ..kernels.fp8_linear import fp8_linear, quantize_input
from ..kernels.mla_attention import mla_decode_attention, mla_prefill_attention
from ..kernels.prefill_attention import VarlenTable, prefill_attention, varlen_table
from ..kernels.rms_norm import add_rms_norm
from ..kernels.rope_cache import rope_and_cache
from ..kernels.router_topk import router_topk
from ..lora.module_banks import ModuleBanks
from ..lora.rows import RowAdapters
from ..quant.module_fp8 import dequantize_block, fp8_block
from ..routing import route
from . import linear_attention
from .linear_attention import is_linear
from .norm_eps import norm_eps


@dataclass(frozen=True)
class Family:
    """What a family's decode layer does differently, as transformers writes it."""

    qk_norm: str  # "head": RMSNorm per head (Qwen3); "full": over the whole projection
    # (OLMoE); "after_rope": a weightless RMSNorm per head after rotary (Llama 4); "none"
    # (Mixtral, gpt-oss)
    round_router: bool  # the top-k weights rounded to the logits' dtype (else kept fp32)
    renorm: bool | None  # the top-k weights divided by their sum; None: config.norm_topk_prob
    # (gpt-oss's softmax over the top-k logits is the softmax renormalized over the top k)
    router: str = "gate"  # the router's name in the MLP (its weight, and its bias if any)
    half_rope: bool = False  # cos / sin of half the head width, for both halves (gpt-oss)
    sinks: bool = False  # a sink logit per query head in every softmax (gpt-oss)
    windows: bool = False  # sliding-window layers (attn.sliding_window) are run as such
    round_normed: bool = True  # RMSNorm rounds the normalized row before its weight (not
    # gpt-oss's: weight x the fp32 row, one rounding)
    mla: bool = False  # DeepSeek's multi-head latent attention (q_a / q_b or q, kv_a, kv_b)
    routing: str = "softmax"  # "softmax": router_topk's kernel; "deepseek_v3" / "deepseek_v2":
    # the config's DeepSeek routing (moelora.routing, in fp32); "llama4": the top-k logits'
    # sigmoid, rounded to their dtype
    shared: str | None = None  # the MoE block's shared-experts MLP, added to the experts'
    complex_rope: bool = False  # rotary_emb gives complex frequencies (DeepSeek-V2, Llama 4),
    # not cos / sin: pairs rotated as complex numbers
    mlp: str = "mlp"  # the decoder layer's MLP (Llama 4: feed_forward)
    chunks: bool = False  # chunked-attention layers (layer_types "chunked_attention", Llama 4)
    # read their own chunk of config.attention_chunk_size positions
    zero_centered: bool = False  # RMSNorms scale by 1 + weight in fp32, one rounding (Qwen3.5)
    gated_attention: bool = False  # q_proj gives each head's q and an output gate (its
    # sigmoid scales the attention's output), q / k norms zero-centered, rotary over the
    # first cos.shape[-1] of each head (Qwen3.5's full-attention layers)
    linear: bool = False  # linear-attention layers (Gated DeltaNet: linear_attention.py)
    shared_gate: str | None = None  # a Linear whose sigmoid scales the shared experts' MLP
    mrope: bool = False  # rotary_emb takes position ids per grid, [3, batch, T] (Qwen3.5:
    # transformers 5.17 indexes three grids; later versions broadcast one)


_DEEPSEEK = Family(
    qk_norm="none", round_router=False, renorm=None, mla=True, routing="deepseek_v3",
    shared="shared_experts",
)  # fmt: skip
FAMILIES = {
    "qwen3_moe": Family(qk_norm="head", round_router=True, renorm=None),
    "olmoe": Family(qk_norm="full", round_router=True, renorm=None),
    "mixtral": Family(qk_norm="none", round_router=False, renorm=True),
    "deepseek_v2": dataclasses.replace(_DEEPSEEK, routing="deepseek_v2", complex_rope=True),
    "deepseek_v3": _DEEPSEEK,
    "gpt_oss": Family(
        qk_norm="none",
        round_router=True,
        renorm=True,
        router="router",
        half_rope=True,
        sinks=True,
        windows=True,
        round_normed=False,
    ),
    # Llama 4: rotary (complex pairs) on all but its NoPE layers, then the weightless L2 norm
    # of q and k ("after_rope") where attn.qk_norm exists; attention temperature on NoPE
    # layers; chunked attention on the rotary ones; top-1 sigmoid routing with the weight on
    # the experts' input (the experts' layer applies it); a shared expert; dense layers
    # between MoE ones
    "llama4_text": Family(
        qk_norm="after_rope",
        round_router=True,
        renorm=False,
        router="router",
        routing="llama4",
        shared="shared_expert",
        complex_rope=True,
        mlp="feed_forward",
        chunks=True,
    ),
    # Qwen3.5-MoE: linear-attention (Gated DeltaNet) layers between gated full-attention
    # ones, zero-centered RMSNorms, a shared expert scaled by its sigmoid gate
    "qwen3_5_moe_text": Family(
        qk_norm="none",
        round_router=True,
        renorm=True,
        round_normed=False,
        shared="shared_expert",
        zero_centered=True,
        gated_attention=True,
        linear=True,
        shared_gate="shared_expert_gate",
        mrope=True,
    ),
}


def runner_support(model: nn.Module) -> list[str]:
    """Why the runner cannot run `model`'s decode step (empty: it can)."""
    config = model.config
    if config.model_type not in FAMILIES:
        return [f"model_type {config.model_type!r}: the runner knows {list(FAMILIES)}"]
    reasons = []
    family = FAMILIES[config.model_type]
    for i, layer in enumerate(model.model.layers):  # a dense layer: a gated MLP
        mlp = getattr(layer, family.mlp)
        if not _is_moe(mlp, family) and not all(hasattr(mlp, n) for n in _MLP):
            reasons.append(f"layer {i}'s MLP {type(mlp).__name__} (neither the family's MoE "
                           "block nor a gate / up / down MLP)")  # fmt: skip
            break
    if not family.windows and (getattr(config, "use_sliding_window", False) or (
        config.model_type == "mixtral" and getattr(config, "sliding_window", None) is not None
    )):  # fmt: skip
        reasons.append("sliding-window attention")
    kinds = set(getattr(config, "layer_types", None) or ())
    known = {"full_attention"} | ({"sliding_attention"} if family.windows else set()) | (
        {"chunked_attention"} if family.chunks else set()) | (
        {"linear_attention"} if family.linear else set())  # fmt: skip
    if (family.windows or family.chunks or family.linear) and not kinds <= known:
        reasons.append(f"layer types {sorted(kinds)} (the runner knows {sorted(known)} for "
                       f"{config.model_type})")  # fmt: skip
    if family.mla and any(layer.self_attn.kv_b_proj.bias is not None
                          for layer in model.model.layers):  # fmt: skip
        reasons.append("kv_b_proj with a bias (the absorbed latent attention has none)")
    if getattr(config, "clip_qkv", None) is not None:
        reasons.append(f"clip_qkv {config.clip_qkv} (q / k / v clamped)")
    # an FP8 checkpoint's experts run on moelora's layer like any others; the projections
    # and LM head the runner reads itself are plain Linears or block-scaled FP8 ones
    others = sorted({type(m).__name__ for n, m in model.named_modules()
                     if n.endswith(_LINEARS) and type(m) is not nn.Linear
                     and fp8_block(m) is None})  # fmt: skip
    if others:
        reasons.append(f"attention projections or LM head of {others}: not plain nn.Linear "
                       "nor transformers' FP8Linear with block scales and dynamic activation "
                       "scales")  # fmt: skip
    return reasons


_MLP = ("gate_proj", "up_proj", "down_proj")
_MLA = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
_DELTA = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")  # Gated DeltaNet's inputs
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "lm_head", *_MLP, *_MLA, *_DELTA,
            "out_proj", "shared_expert_gate")  # fmt: skip


def _is_moe(mlp: nn.Module, family: Family) -> bool:
    return hasattr(mlp, "experts") and hasattr(mlp, family.router)


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's pieces, the model's own modules and weights."""

    index: int
    attn: nn.Module  # q_proj, k_proj, v_proj, o_proj, q_norm, k_norm (or MLA's)
    norm_in: Tensor
    norm_post: Tensor
    gate: Tensor | None  # the router's weight [E, H] (None: a dense layer)
    experts: nn.Module | None  # the MoELoRALayer serving this layer's experts
    path: str  # "model.layers.<i>"
    mlp: nn.Module  # the layer's MLP: the MoE block, or a dense gate / up / down MLP
    gate_bias: Tensor | None = None  # the router's bias [E] (gpt-oss)
    window: int = 0  # a sliding window's positions (0: full attention)
    sinks: Tensor | None = None  # a sink logit per query head [Hq] (gpt-oss)
    correction_bias: Tensor | None = None  # DeepSeek's e_score_correction_bias [E]
    chunk: int = 0  # chunked attention's positions per chunk (0: none)
    rope: bool = True  # rotary on q and k (Llama 4's NoPE layers: none)
    temperature: tuple[float, float] | None = None  # Llama 4's NoPE layers: (floor_scale,
    # attn_scale) of the attention temperature q is scaled by
    head_norms: tuple[Tensor, Tensor] | None = None  # q_norm / k_norm weights per head
    # (Qwen3's; Qwen3.5's zero-centered ones as 1 + weight in fp32)
    absorbed: tuple[Tensor, Tensor] | None = None  # MLA: kv_b's weight per head, its key
    # rows [H, nope, rank] and value rows [H, v, rank] (views of it; an FP8 one dequantized)


class DecodeRunner:
    """decode(...) -> logits [B, V] of one token per row, from the engine's static buffers."""

    def __init__(self, model: nn.Module, experts: dict[int, nn.Module], banks: ModuleBanks):
        config = model.config
        self.model, self.banks = model, banks
        self.eps = config.rms_norm_eps
        self.family = FAMILIES[config.model_type]
        self.round_normed = self.family.round_normed
        self.top_k = config.num_experts_per_tok
        renorm = self.family.renorm
        self.renorm = config.norm_topk_prob if renorm is None else renorm
        # the linear-attention layers (Qwen3.5's Gated DeltaNet), their states in the cache
        self.linear = frozenset(i for i, layer in enumerate(model.model.layers)
                                if is_linear(layer))  # fmt: skip
        self.layers = [self._layer(i, layer, experts.get(i))
                       for i, layer in enumerate(model.model.layers)]  # fmt: skip
        self.final_norm = self._norm_weight(model.model.norm)
        # linear-attention decodes in kernels/gated_delta.py (False: torch ops, the form a
        # GPU check compares them with)
        self.fused_linear = True
        self.first_moe = min(experts)
        # MLA: one latent "KV head" for every query head (paged_cache.py)
        self.group = config.num_attention_heads // (
            1 if self.family.mla else config.num_key_value_heads)  # fmt: skip
        # DeepSeek's routing as moelora reads it from the config (hf_keys: groups, scaling,
        # renormalization per family); the others' on the logits in their dtype (Llama 4's
        # top-k sigmoid in _moe)
        self.routing = None if self.family.routing in ("softmax", "llama4") else from_hf(
            config.to_dict()).routing  # fmt: skip
        self.paths = self._paths()
        # the block-scaled FP8 Linears' scale blocks, read once (not per forward)
        self.fp8 = {m: b for m in model.modules() if (b := fp8_block(m)) is not None}

    def _layer(self, index: int, layer: nn.Module, experts: nn.Module | None) -> _Layer:
        family, config = self.family, self.model.config
        attn = layer.linear_attn if is_linear(layer) else layer.self_attn
        mlp = getattr(layer, family.mlp)
        router = getattr(mlp, family.router) if experts is not None else None
        window = (getattr(attn, "sliding_window", None) or 0) if family.windows else 0
        kind = (getattr(config, "layer_types", None) or ["full_attention"] * (index + 1))[index]
        chunk = config.attention_chunk_size if kind == "chunked_attention" else 0
        rope = bool(getattr(attn, "use_rope", True))
        tuned = not rope and getattr(attn, "attn_temperature_tuning", False)
        norm_in, norm_post = (self._norm_weight(n) for n in (layer.input_layernorm,
                                                             layer.post_attention_layernorm))  # fmt: skip
        return _Layer(
            index, attn, norm_in, norm_post,
            None if router is None else router.weight, experts, f"model.layers.{index}",
            mlp, gate_bias=getattr(router, "bias", None), window=int(window),
            sinks=attn.sinks if family.sinks else None,
            correction_bias=getattr(router, "e_score_correction_bias", None),
            chunk=int(chunk or 0), rope=rope,
            temperature=(attn.floor_scale, attn.attn_scale) if tuned else None,
            head_norms=(self._norm_weight(attn.q_norm), self._norm_weight(attn.k_norm))
            if (family.qk_norm == "head" or family.gated_attention) and not is_linear(layer)
            else None,
            absorbed=_absorbed(attn, self.model.model.embed_tokens.weight.dtype)
            if family.mla else None,
        )  # fmt: skip

    def _norm_weight(self, norm: nn.Module) -> Tensor:
        """An RMSNorm's weight as add_rms_norm takes it: zero-centered ones (Qwen3.5) as
        1 + weight in fp32 (their one rounding after that product: round_normed False)."""
        if self.family.zero_centered:
            return 1.0 + norm.weight.detach().float()
        return norm.weight

    def _paths(self) -> frozenset[str]:
        """Every module path whose LoRA the runner applies (the engine refuses the runner
        for a served module outside them: its LoRA would be dropped)."""
        paths = {"lm_head"}
        for layer in self.layers:
            attn = f"{layer.path}.self_attn"
            names = (*_MLA, "q_proj", "o_proj") if self.family.mla else (
                "q_proj", "k_proj", "v_proj", "o_proj")  # fmt: skip
            if layer.index in self.linear:
                attn, names = f"{layer.path}.linear_attn", (*_DELTA, "out_proj")
            paths |= {f"{attn}.{n}" for n in names}
            mlp = f"{layer.path}.{self.family.mlp}"
            if layer.experts is None:
                paths |= {f"{mlp}.{n}" for n in _MLP}
                continue
            paths.add(f"{mlp}.{self.family.router}")
            if self.family.shared:
                paths |= {f"{mlp}.{self.family.shared}.{n}" for n in _MLP}
            if self.family.shared_gate:
                paths.add(f"{mlp}.{self.family.shared_gate}")
        return frozenset(paths)

    def decode(
        self,
        ids: Tensor,
        positions: Tensor,
        write_rows: Tensor,
        rows: RowAdapters,
        cache,
        kv_len: int,
        table: Tensor,
    ) -> Tensor:
        """ids / positions / write_rows [B, 1]: each row's token, its position, the block-table
        row its k / v go to (batch row b reads table row b; padding rows write a row of null
        blocks); rows: the call context; cache: the engine's PagedCache; kv_len: the most
        positions any row reads; table [R, MB] int32: each row's blocks."""
        lengths = positions[:, 0] + 1

        def attend(q, cache_layer, scaling, layer):
            if layer.absorbed is not None:
                return mla_decode_attention(q, cache_layer.keys, table, lengths, scaling,
                                            layer.attn.kv_lora_rank, kv_len)  # fmt: skip
            return decode_attention(q, cache_layer.keys, cache_layer.values, table, lengths,
                                    scaling, kv_len, layer.window, layer.sinks, layer.chunk)  # fmt: skip

        write = _slots(table, write_rows[:, 0], positions[:, 0], cache.block_size)
        return self._forward(ids[:, 0], positions[:, 0], write, rows, cache, attend,
                             states=write_rows[:, 0])  # fmt: skip

    def prefill(
        self,
        ids: Tensor,
        positions: Tensor,
        write_rows: Tensor,
        lengths: list[int],
        cache_rows: list[int],
        rows: RowAdapters,
        cache,
        table: Tensor,
        every: bool = False,
        pos0: list[int] | None = None,
    ) -> Tensor:
        """Prompts of any lengths packed one after another (varlen, no padding): ids /
        positions / write_rows [T] (each token, its position, its block-table row), lengths
        and cache_rows (block-table rows) per prompt, rows: the call context with one slot
        per token (row_slots [T]), table [R, MB] int32 (every block written or read
        allocated), pos0: each prompt's first position (read from `positions` when None).
        Logits [len(lengths), V] of each prompt's last token, or [T, V] of every token with
        `every`."""
        starts = [0]
        for n in lengths[:-1]:
            starts.append(starts[-1] + n)
        if pos0 is None:
            pos0 = [int(p) for p in positions[starts].tolist()] if lengths else []
        spans = varlen_table(lengths, cache_rows, pos0, self.group, ids.device)  # every layer's
        last = None if every else torch.tensor([a + n - 1 for a, n in zip(starts, lengths)],
                                               device=ids.device)  # fmt: skip
        sequences = list(zip(starts, lengths, cache_rows, pos0))  # linear attention's
        return self.packed(ids, positions, write_rows, spans, last, rows, cache, table,
                           sequences)  # fmt: skip

    def packed(
        self,
        ids: Tensor,
        positions: Tensor,
        write_rows: Tensor,
        spans: VarlenTable,
        last: Tensor | None,
        rows: RowAdapters,
        cache,
        table: Tensor,
        sequences: list[tuple[int, int, int, int]] | None = None,
    ) -> Tensor:
        """prefill's forward from tensors already on the device, nothing read back (what a
        CUDA graph of a step captures): spans, the packed prompts' table (varlen_table, built
        for this runner's group of query heads); last [S]: the tokens whose logits are
        returned ([S, V]; every token's when None). sequences: each one's (first token,
        length, block-table row, first position) on the host, which linear-attention layers
        need (a model with them is not graphed with prompts: MixedGraphs stays off)."""

        def attend(q, cache_layer, scaling, layer):
            if layer.absorbed is not None:
                return mla_prefill_attention(q, cache_layer.keys, spans, table, scaling,
                                             layer.attn.kv_lora_rank)  # fmt: skip
            return prefill_attention(q, cache_layer.keys, cache_layer.values, spans, table,
                                     scaling, layer.window, layer.sinks, layer.chunk)  # fmt: skip

        write = _slots(table, write_rows, positions, cache.block_size)
        states = linear_attention.pack(sequences, ids.device) if self.linear else None
        return self._forward(ids, positions, write, rows, cache, attend, last, states)

    def _forward(self, ids, positions, write, rows, cache, attend, last=None,
                 states=None) -> Tensor:  # fmt: skip
        """The layers over tokens ids [T] at positions [T] writing their k / v at `write`
        (blocks [T], offsets [T]); logits of the tokens `last` selects (all when None).
        states: where linear-attention layers keep each row's state: a decode's state rows
        [T] (a tensor), or a prefill's packed sequences (linear_attention.Packed)."""
        model = self.model
        h = model.model.embed_tokens(ids)
        if self.family.complex_rope:  # DeepSeek-V2: e^(i angle) per pair, [T, r / 2]
            freqs = model.model.rotary_emb(h[None], positions[None])[0]
            cos, sin = freqs.real, freqs.imag
        elif self.family.mrope:  # one position per grid (text: the same three)
            cos, sin = model.model.rotary_emb(h[None], positions[None, None].expand(3, 1, -1))
            cos, sin = cos[0], sin[0]
        else:
            cos, sin = model.model.rotary_emb(h[None], positions[None])
            cos, sin = cos[0], sin[0]
        if self.family.half_rope:  # each half rotated by the same angles: rotate_half's form
            cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        slots = rows.row_slots[: ids.shape[0]]
        residual = None
        for layer in self.layers:
            x, residual = add_rms_norm(h, residual, layer.norm_in, self.eps, self.round_normed)
            if layer.index in self.linear:
                att = self._linear_attention(layer, x, slots, rows, cache, states)
            else:
                attention = self._mla if self.family.mla else self._attention
                att = attention(layer, x, cos, sin, cache.layers[layer.index], write, slots,
                                rows, attend, positions)  # fmt: skip
            x, residual = add_rms_norm(att, residual, layer.norm_post, self.eps, self.round_normed)
            h = self._moe(layer, x, slots, rows)
        x, _ = add_rms_norm(h, residual, self.final_norm, self.eps, self.round_normed)
        if last is not None:
            x, slots = x[last], slots[last]
        return self._linear(model.lm_head, "lm_head", x, slots, rows)

    def _linear(self, module: nn.Linear, path: str, x: Tensor, slots, rows) -> Tensor:
        if module in self.fp8:
            return self._fp8_projections([module], [path], x, slots, rows)[0]
        out = F.linear(x, module.weight, module.bias)
        if path in rows.lora_modules:
            add_dense_lora(out, x, slots, self.banks.a[path], self.banks.bt[path])
        return out

    def _fp8_projections(self, modules, paths, x, slots, rows) -> list[Tensor]:
        """Linears of one input x, the block-scaled FP8 ones W8A8 (kernels/fp8_linear.py: x
        quantized once per scale block), each with its LoRA on the unquantized x."""
        quantized, outs = {}, []
        for module, path in zip(modules, paths):
            block = self.fp8.get(module)
            if block is None:  # a plain Linear beside them
                out = F.linear(x, module.weight, module.bias)
            else:
                if block not in quantized:
                    quantized[block] = quantize_input(x, block)
                out = fp8_linear(quantized[block], module.weight, module.weight_scale_inv,
                                 block, module.bias, x.dtype)  # fmt: skip
            if path in rows.lora_modules:
                add_dense_lora(out, x, slots, self.banks.a[path], self.banks.bt[path])
            outs.append(out)
        return outs

    def _projections(self, modules: list[nn.Linear], paths: list[str], x: Tensor, slots,
                     rows) -> list[Tensor]:  # fmt: skip
        """Linears of one input x in one GEMM launch (kernels/dense_linear.py), with the
        LoRA of those in rows.lora_modules (their shrink one launch before); one Linear
        without LoRA on cuBLAS (faster there for o_proj's shape on the H200: BENCHMARKS.md,
        "Decode step")."""
        if any(m in self.fp8 for m in modules):
            return self._fp8_projections(modules, paths, x, slots, rows)
        if len(modules) > MAX_MODULES:  # (Gated DeltaNet's four) in launches of at most three
            return [out for at in range(0, len(modules), MAX_MODULES)
                    for out in self._projections(modules[at : at + MAX_MODULES],
                                                 paths[at : at + MAX_MODULES], x, slots, rows)]  # fmt: skip
        on = [p in rows.lora_modules for p in paths]
        if len(modules) == 1 and not on[0]:
            return [F.linear(x, modules[0].weight, modules[0].bias)]
        z = bt = None
        if any(on):
            z = lora_shrink(x, slots, [self.banks.a[p] if o else None for p, o in zip(paths, on)])
            bt = [self.banks.bt[p] if o else None for p, o in zip(paths, on)]
        weights = [m.weight for m in modules]
        return dense_linear(x, weights, [m.bias for m in modules], slots, z, bt)

    def _attention(self, layer, x, cos, sin, cache_layer, write, slots, rows, attend,
                   positions) -> Tensor:  # fmt: skip
        """q / k / v in one GEMM with their LoRA; q ready and k / v cached (_qk_and_cache);
        attention over each row's cache; Qwen3.5's output gate; o_proj with its LoRA."""
        attn, path = layer.attn, f"{layer.path}.self_attn"
        names = ("q_proj", "k_proj", "v_proj")
        q, k, v = self._projections([getattr(attn, n) for n in names],
                                    [f"{path}.{n}" for n in names], x, slots, rows)  # fmt: skip
        q, gate = self._qk_and_cache(layer, q, k, v, cos, sin, cache_layer, write, positions)
        out = attend(q, cache_layer, attn.scaling, layer).view(x.shape[0], -1)
        if gate is not None:  # Qwen3.5: the output scaled by its gate's sigmoid
            out = out * torch.sigmoid(gate)
        (o,) = self._projections([attn.o_proj], [f"{path}.o_proj"], out, slots, rows)
        return o

    def _qk_and_cache(self, layer, q, k, v, cos, sin, cache_layer, write, positions):
        """(q [T, Hq, D] ready for attention, Qwen3.5's output gate or None), k / v written
        to the cache at `write`: q / k norms, rotary and the write in one kernel
        (kernels/rope_cache.py, in the family's form: Qwen3's norms before rotate_half,
        Qwen3.5's zero-centered ones and partial rotary over q interleaved with its gate,
        Llama 4's complex pairs with the weightless norm after; OLMoE's norm over the whole
        projection before it); Llama 4's NoPE layers with attention temperature scale q by
        log1p(floor((p + 1) / floor_scale)) x attn_scale + 1 of each position p in it."""
        attn, family, keys, values = layer.attn, self.family, cache_layer.keys, cache_layer.values
        if family.complex_rope:  # Llama 4
            normed, scale = hasattr(attn, "qk_norm"), None
            if layer.temperature is not None:
                floor_scale, attn_scale = layer.temperature
                scale = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale))
                scale = scale * attn_scale + 1.0
            q = rope_and_cache(q, k, v, cos, sin, keys, values, *write,
                               eps=norm_eps(attn.qk_norm) if normed else self.eps,
                               norm="after" if normed else "none",
                               rope="pairs" if layer.rope else "none", head_dim=attn.head_dim,
                               q_scale=scale)  # fmt: skip
            return q, None
        if family.gated_attention:  # Qwen3.5: q_proj gives each head's q, then its gate
            width = attn.head_dim
            out = rope_and_cache(q, k, v, cos, sin, keys, values, *write, *layer.head_norms,
                                 norm_eps(attn.q_norm), round_normed=False, head_dim=width,
                                 q_head_stride=2 * width)  # fmt: skip
            gate = q.view(q.shape[0], -1, 2 * width)[..., width:].reshape(q.shape[0], -1)
            return out, gate
        if family.qk_norm == "full":
            q, _ = add_rms_norm(q, None, attn.q_norm.weight, norm_eps(attn.q_norm))
            k, _ = add_rms_norm(k, None, attn.k_norm.weight, norm_eps(attn.k_norm))
        q = rope_and_cache(q, k, v, cos, sin, keys, values, *write,
                           *(layer.head_norms or (None, None)), self.eps)  # fmt: skip
        return q, None

    def _linear_attention(self, layer, x, slots, rows, cache, states) -> Tensor:
        """A Gated DeltaNet layer (linear_attention.py): its input projections in one GEMM
        with their LoRA, the update of each row's state, out_proj with its LoRA."""
        mixer, path = layer.attn, f"{layer.path}.linear_attn"
        qkv, z, b, a = self._projections([getattr(mixer, n) for n in _DELTA],
                                         [f"{path}.{n}" for n in _DELTA], x, slots, rows)  # fmt: skip
        state = cache.states[layer.index]
        if isinstance(states, Tensor):
            out = linear_attention.decode(mixer, state, states, qkv, z, b, a, self.fused_linear)
        else:
            out = linear_attention.prefill(mixer, state, states, qkv, z, b, a, self.fused_linear)
        (o,) = self._projections([mixer.out_proj], [f"{path}.out_proj"], out, slots, rows)
        return o

    def _moe(self, layer: _Layer, x: Tensor, slots: Tensor, rows: RowAdapters) -> Tensor:
        """The router as transformers' (its logits and their LoRA; softmax in fp32, top-k,
        renormalized, rounded to the logits' dtype, in one kernel; DeepSeek's in fp32 through
        moelora.routing), then the experts on moelora's layer, and the shared experts' MLP
        where the family has one. A dense layer: its MLP."""
        mlp = f"{layer.path}.{self.family.mlp}"
        if layer.experts is None:
            return self._mlp(layer.mlp, mlp, x, slots, rows)
        path = f"{mlp}.{self.family.router}"
        if self.routing is not None:  # DeepSeek: logits in fp32 from the fp32 row
            logits = F.linear(x.float(), layer.gate.float())
        else:
            logits = F.linear(x, layer.gate, layer.gate_bias)
        if path in rows.lora_modules:
            add_dense_lora(logits, x, slots, self.banks.a[path], self.banks.bt[path])
        if self.family.routing == "llama4":  # Llama4Router: sigmoid of the top-k logits
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            weights = torch.sigmoid(top.float()).to(top.dtype).float()
            ids = ids.to(torch.int32)
        elif self.routing is not None:
            ids, weights = route(logits, self.routing, self.top_k, layer.correction_bias)
        else:
            weights, ids = router_topk(logits, self.top_k, self.renorm, self.family.round_router)
        if not rows.expert_lora:
            out = layer.experts(x, ids, weights)
        else:
            token_slots = rows.token_slots(x.shape[0], refresh=layer.index == self.first_moe)
            out = layer.experts(x, ids, weights, token_slots, rows.snapshot.banks[layer.index])
        if self.family.shared:
            name = self.family.shared
            shared = self._mlp(getattr(layer.mlp, name), f"{mlp}.{name}", x, slots, rows)
            if self.family.shared_gate:  # Qwen3.5: scaled by its gate's sigmoid
                gate = self.family.shared_gate
                scale = self._linear(getattr(layer.mlp, gate), f"{mlp}.{gate}", x, slots, rows)
                shared = torch.sigmoid(scale) * shared
            out = out + shared
        return out

    def _mlp(self, mlp: nn.Module, path: str, x: Tensor, slots, rows) -> Tensor:
        """A gated MLP as transformers' (down(act(gate(x)) * up(x))), gate and up in one
        GEMM, each with its LoRA."""
        gate, up = self._projections([mlp.gate_proj, mlp.up_proj],
                                     [f"{path}.gate_proj", f"{path}.up_proj"], x, slots, rows)  # fmt: skip
        act = mlp.act_fn if hasattr(mlp, "act_fn") else mlp.activation_fn  # (Llama 4's name)
        (out,) = self._projections([mlp.down_proj], [f"{path}.down_proj"], act(gate) * up,
                                   slots, rows)  # fmt: skip
        return out

    def _mla(self, layer, x, cos, sin, cache_layer, write, slots, rows, attend, positions
             ) -> Tensor:  # fmt: skip
        """DeepSeek's multi-head latent attention as transformers' DeepseekV3Attention: q
        through q_a / its norm / q_b (or q_proj), the latent and the shared rotary key from
        kv_a, the latent's norm; rotary on the last qk_rope_head_dim of q and k (interleaved
        pairs when config.rope_interleave). The cache takes each position's [latent, rotary
        key]; attention runs absorbed (kernels/mla_attention.py): each head's q_nope times
        kv_b's key rows for that head gives its query over the latents (q_nope . k_nope =
        (W_UK^T q_nope) . c), and its latent output times kv_b's value rows its values'
        mix; kv_b's LoRA goes the same two ways (_absorbed_lora_query / _values)."""
        attn, path = layer.attn, f"{layer.path}.self_attn"
        tokens, heads = x.shape[0], attn.num_heads
        nope, rope = attn.qk_nope_head_dim, attn.qk_rope_head_dim
        if attn.q_lora_rank is None:
            q, ckv = self._projections([attn.q_proj, attn.kv_a_proj_with_mqa],
                                       [f"{path}.q_proj", f"{path}.kv_a_proj_with_mqa"], x,
                                       slots, rows)  # fmt: skip
        else:
            q_a, ckv = self._projections([attn.q_a_proj, attn.kv_a_proj_with_mqa],
                                         [f"{path}.q_a_proj", f"{path}.kv_a_proj_with_mqa"], x,
                                         slots, rows)  # fmt: skip
            norm = attn.q_a_layernorm
            q_a, _ = add_rms_norm(q_a, None, norm.weight, norm_eps(norm))
            (q,) = self._projections([attn.q_b_proj], [f"{path}.q_b_proj"], q_a, slots, rows)
        rank, norm = attn.kv_lora_rank, attn.kv_a_layernorm
        latent, _ = add_rms_norm(ckv[:, :rank].contiguous(), None, norm.weight, norm_eps(norm))
        blocks, offsets = write
        cache_layer.keys[blocks, 0, offsets, :rank] = latent
        # the rotary parts of q (each head's last rope) and of the shared key, the key into
        # the cache after the latent: one kernel (kernels/rope_cache.py, no values)
        layout = "pairs" if self.family.complex_rope else (
            "deinterleaved" if getattr(self.model.config, "rope_interleave", False) else "halves")  # fmt: skip
        q_rot = rope_and_cache(q[:, nope:], ckv[:, rank:], None, cos, sin,
                               cache_layer.keys[..., rank:], None, blocks, offsets, rope=layout,
                               head_dim=rope, q_head_stride=nope + rope, q_heads=heads)  # fmt: skip
        q_pass = q.view(tokens, heads, nope + rope)[..., :nope]
        w_uk, w_uv = layer.absorbed
        q_latent = torch.bmm(q_pass.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, rank]
        kv_b = f"{path}.kv_b_proj"
        lora = kv_b in rows.lora_modules
        if lora:
            q_latent = q_latent + _absorbed_lora_query(self.banks, kv_b, nope, slots, q_pass)
        out = attend(torch.cat([q_latent, q_rot], dim=-1), cache_layer, attn.scaling, layer)
        values = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        if lora:  # [T, H, v]
            values = values + _absorbed_lora_values(self.banks, kv_b, nope, slots, out)
        (o,) = self._projections([attn.o_proj], [f"{path}.o_proj"],
                                 values.reshape(tokens, -1), slots, rows)  # fmt: skip
        return o


def _absorbed(attn: nn.Module, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """kv_b_proj's weight [H x (nope + v), rank] as its key rows [H, nope, rank] and value
    rows [H, v, rank] per head: views of the weight, or of its copy dequantized to `dtype`
    (the model's) when it is a block-scaled FP8 Linear (the absorbed products need it
    dense, as vLLM's MLA does)."""
    kv_b, nope = attn.kv_b_proj, attn.qk_nope_head_dim
    weight = kv_b.weight.detach()
    if (block := fp8_block(kv_b)) is not None:
        weight = dequantize_block(weight, kv_b.weight_scale_inv, block).to(dtype)
    per_head = weight.view(attn.num_heads, -1, weight.shape[1])
    return per_head[:, :nope], per_head[:, nope:]


def _lora_banks(banks: ModuleBanks, path: str, heads: int, slots: Tensor):
    """kv_b's bank as the absorbed LoRA reads it (W + B A, the scale in B): B per head
    [L, R, H, nope + v] and each token's own A [T, R, rank] in fp32 (slot -1: slot 0's,
    masked by the callers)."""
    a, bt = banks.a[path], banks.bt[path]  # [L, R, rank], [L, R, H x (nope + v)]
    return bt.view(a.shape[0], bt.shape[1], heads, -1), a[slots.clamp(min=0).long()].float()


def _absorbed_lora_query(banks: ModuleBanks, path: str, nope: int, slots: Tensor,
                         q_pass: Tensor) -> Tensor:  # fmt: skip
    """kv_b's LoRA moved onto the query as its weight is: A^T (B_K[h]^T q_nope) [T, H, rank]
    for q_pass [T, H, nope]. The per-head B products over every slot, masked per token (no
    host sync: graphable; slot -1 exactly 0), A over each token's own slot; in fp32,
    rounded once to q's dtype."""
    per_head, own = _lora_banks(banks, path, q_pass.shape[1], slots)
    u, x = torch.zeros(*q_pass.shape[:2], own.shape[1], device=own.device), q_pass.float()
    for s in range(per_head.shape[0]):
        u += (slots == s)[:, None, None] * torch.einsum(
            "thn,rhn->thr", x, per_head[s, :, :, :nope].float())  # fmt: skip
    return torch.bmm(u, own).to(q_pass.dtype)


def _absorbed_lora_values(banks: ModuleBanks, path: str, nope: int, slots: Tensor,
                          latent_out: Tensor) -> Tensor:  # fmt: skip
    """kv_b's LoRA moved onto each head's latent output: B_V[h] (A o) [T, H, v] for
    latent_out [T, H, rank], as _absorbed_lora_query forms it."""
    per_head, own = _lora_banks(banks, path, latent_out.shape[1], slots)
    w = torch.bmm(latent_out.float(), own.transpose(1, 2)) * (slots >= 0)[:, None, None]
    out = torch.zeros(*w.shape[:2], per_head.shape[3] - nope, device=w.device)
    for s in range(per_head.shape[0]):
        out += (slots == s)[:, None, None] * torch.einsum(
            "thr,rhv->thv", w, per_head[s, :, :, nope:].float())  # fmt: skip
    return out.to(latent_out.dtype)


def _slots(table: Tensor, rows: Tensor, positions: Tensor, block_size: int):
    """Where tokens at `positions` of block-table rows `rows` ([T] each) are cached: their
    blocks and offsets in them ([T] long each), once per forward for every layer."""
    blocks = table[rows, torch.div(positions, block_size, rounding_mode="floor")]
    return blocks.long(), positions % block_size
