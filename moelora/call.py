"""`MoECall`: one forward's per-call data (its inputs and where y goes), built and checked
once.

The layer's forward (the boundary every path goes through: direct calls, the parallel
layer, transformers' experts op) builds one record, checks it against its deployment
(layer_checks.py) and hands it, unchanged, to the backend; the triton backend passes it to
the fused entry (kernels/moe_lora.py), the reference backend to the reference. Nothing
downstream re-checks or re-casts these tensors.

The record checks what it can see by itself (ranks of the tensors, T and K agreeing,
dtypes, one device, contiguous layout); what a deployment fixes (H, K, the serving dtype,
the weights' device, the bank's shapes, the value ranges) is the layer's to check.

Legend: T tokens, K top-k, H hidden, L slots.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from .comm import LoRAComm
from .config import AddInputs
from .errors import InputError
from .weights import LoRABank


@dataclass(frozen=True)
class MoECall:
    """x [T, H]; topk_ids [T, K] int32 (or int64); topk_weights [T, K] fp32; token_slots [T]
    int32, each token's slot (-1 = base model), or None (no adapter on any token).

    lora: the slot bank the slots index (e.g. a SlotManager snapshot's bank); LoRA runs
    when both it and token_slots are given (`has_lora`). weights_on_input: Llama-4 routing,
    the weight scales the expert input, not its output. lora_comm: fully sharded LoRA's
    collectives; the bank then holds this process's shards (w13_a [L, E, S, R/tp, H],
    w2_b [L, E, H/tp, R]). out [T, H]: where y goes (None: a new tensor is returned), by
    add_inputs (OVERWRITE writes y into it, ADD adds y to it; out is returned).
    """

    x: Tensor
    topk_ids: Tensor
    topk_weights: Tensor
    token_slots: Tensor | None = None
    lora: LoRABank | None = None
    weights_on_input: bool = False
    lora_comm: LoRAComm | None = None
    out: Tensor | None = None
    add_inputs: AddInputs = AddInputs.OVERWRITE

    def __post_init__(self) -> None:
        x, ids = self.x, self.topk_ids
        if x.dim() != 2:
            raise InputError("x", f"shape {list(x.shape)}", "[T, H]")
        if ids.dtype not in (torch.int32, torch.int64):
            raise InputError("topk_ids", f"dtype {ids.dtype}", "int32")
        if ids.dim() != 2 or ids.shape[0] != x.shape[0]:
            raise InputError("topk_ids", f"shape {list(ids.shape)}", f"[T = {x.shape[0]}, K]")
        check_tensor("topk_weights", self.topk_weights, tuple(ids.shape), torch.float32)
        if self.token_slots is not None:
            check_tensor("token_slots", self.token_slots, (x.shape[0],), torch.int32)
        if self.out is not None and (self.out.dim() != 2 or self.out.shape[0] != x.shape[0]):
            raise InputError("out", f"shape {list(self.out.shape)}", f"[T = {x.shape[0]}, H]")
        for name in ("topk_ids", "topk_weights", "token_slots"):
            t = getattr(self, name)
            if t is not None and t.device != x.device:
                raise InputError(name, f"on {t.device}", f"on {x.device}, where x is")
        # one contiguous layout for every backend and kernel (a no-op when already so); out
        # is written in place, as the caller laid it out
        for name in ("x", "topk_ids", "topk_weights", "token_slots"):
            t = getattr(self, name)
            if t is not None and not t.is_contiguous():
                object.__setattr__(self, name, t.contiguous())

    @property
    def num_tokens(self) -> int:
        return self.x.shape[0]

    @property
    def top_k(self) -> int:
        return self.topk_ids.shape[1]

    @property
    def adds(self) -> bool:
        """Whether y is added into `out` (ADD with an out given)."""
        return self.out is not None and self.add_inputs is AddInputs.ADD

    @property
    def has_lora(self) -> bool:
        """Whether adapters run: a bank and the tokens' slots are both given."""
        return self.lora is not None and self.token_slots is not None

    def head(self, tokens: int) -> MoECall:
        """The same call on its first `tokens` tokens (the bank and settings unchanged)."""
        rows = ("x", "topk_ids", "topk_weights", "token_slots", "out")
        cut = {n: getattr(self, n)[:tokens] for n in rows if getattr(self, n) is not None}
        return dataclasses.replace(self, **cut)


def check_tensor(
    name: str, t: Tensor | None, shape: tuple[int, ...], dtype: torch.dtype | None = None
) -> None:
    """Raise InputError naming `name` unless t has this shape (and dtype, when given)."""
    if t is None:
        raise InputError(name, None, f"a tensor of shape {list(shape)}")
    if tuple(t.shape) != shape:
        raise InputError(name, f"shape {list(t.shape)}", f"shape {list(shape)}")
    if dtype is not None and t.dtype != dtype:
        raise InputError(name, f"dtype {t.dtype}", f"{dtype}")
