"""Containers for expert weights and LoRA slot banks, and random builders for demos and tests.

Legend: E experts, H hidden, I intermediate, S = 2 gated / 1 non-gated, R max rank, L slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import MoEShape
from .errors import InputError
from .quantization import QuantConfig

FULL_PRECISION = QuantConfig()  # experts in the serving dtype


@dataclass
class ExpertWeights:
    """w13 [E, S*I, H] (gated: rows [0, I) gate, [I, 2I) up; swigluoai interleaved),
    w2 [E, H, I], optional b13 [E, S*I] and b2 [E, H].

    quantization: the format these weights were dequantized from (FP8ExpertWeights.dequantize);
    under a W8A8 format the reference quantizes each base GEMM's input per token and group,
    as the kernels do. The default (NONE): full-precision weights.
    """

    w13: torch.Tensor
    w2: torch.Tensor
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    quantization: QuantConfig = FULL_PRECISION


@dataclass
class LoRABank:
    """LoRA slot bank (scale already folded into the B factors).

    w13_a [L, E, S, R, H]: part 0 gate (or the non-gated w1), part 1 up.
    w13_b [L, E, S, I, R]
    w2_a  [L, E, R, I]
    w2_b  [L, E, H, R]
    ranks [L] int32 on the factors' device: each slot's real rank r (0 <= r <= R; 0 = an
          empty slot). The kernels read it: a slot's shrink and expand stop at its width
          (r rounded up to 16, the MMA step). A's columns [r, R) are never read; B's
          columns [r, width) meet an exact zero intermediate, so they must be finite, and
          those past the width are never read. None at construction: every slot at R.
    tile_rank: the rank the tile plan is keyed on (host side, performance only): the
          largest real rank loaded; None: R.

    Within its width every slot must be finite, in slots no token uses too: the
    triton backend's in-GEMM expand loads the B of every slot whose lanes share a dot with
    a slot that a block uses, and multiplies the unused ones by zero (0 * inf is NaN).
    SlotManager keeps unloaded slots at rank 0 and the adapter loader rejects non-finite
    factors.
    """

    w13_a: torch.Tensor
    w13_b: torch.Tensor
    w2_a: torch.Tensor
    w2_b: torch.Tensor
    ranks: torch.Tensor | None = None
    tile_rank: int | None = None

    def __post_init__(self) -> None:
        # R from B: under fully sharded LoRA w13_a holds a rank shard (parallel.shard_bank)
        num_slots, max_rank = self.w13_a.shape[0], self.w13_b.shape[4]
        device = self.w13_a.device
        if self.ranks is None:
            self.ranks = torch.full((num_slots,), max_rank, dtype=torch.int32, device=device)
        else:
            self.ranks = torch.as_tensor(self.ranks).to(device=device, dtype=torch.int32)
            check_ranks(self.ranks, num_slots, max_rank)
        if self.tile_rank is None:
            self.tile_rank = max_rank
        elif not 0 <= self.tile_rank <= max_rank:
            raise InputError(
                "LoRABank.tile_rank", self.tile_rank, f"0 <= tile_rank <= R = {max_rank}"
            )

    @property
    def num_slots(self) -> int:
        return self.w13_a.shape[0]

    @property
    def max_rank(self) -> int:
        return self.w13_b.shape[4]

    @staticmethod
    def empty(
        shape: MoEShape, num_slots: int, max_rank: int, *, device=None, dtype=None
    ) -> LoRABank:
        """A bank of zeros with every slot at rank R (fill the factors by hand, or set
        `ranks`); the slot manager starts from it with every rank at 0."""
        e, h, i = shape.num_experts, shape.hidden_size, shape.intermediate_size
        s = shape.activation.width_factor
        kw = {"device": device, "dtype": dtype or shape.dtype}
        return LoRABank(
            w13_a=torch.zeros(num_slots, e, s, max_rank, h, **kw),
            w13_b=torch.zeros(num_slots, e, s, i, max_rank, **kw),
            w2_a=torch.zeros(num_slots, e, max_rank, i, **kw),
            w2_b=torch.zeros(num_slots, e, h, max_rank, **kw),
        )


def check_ranks(ranks: torch.Tensor, num_slots: int, max_rank: int) -> None:
    """ranks must be [L] with every value in [0, R] (reads the values: a host sync)."""
    if tuple(ranks.shape) != (num_slots,):
        raise InputError(
            "LoRABank.ranks", f"shape {list(ranks.shape)}", f"[L = {num_slots}] (one per slot)"
        )
    if num_slots and not bool(((ranks >= 0) & (ranks <= max_rank)).all()):
        raise InputError(
            "LoRABank.ranks",
            f"values {ranks.tolist()}",
            f"each slot's real rank in [0, R = {max_rank}]",
        )


def random_expert_weights(
    shape: MoEShape, *, generator: torch.Generator | None = None, device=None, dtype=None
) -> ExpertWeights:
    """Random weights scaled so activations stay O(1) (std 1/sqrt(fan_in))."""
    e, h, i = shape.num_experts, shape.hidden_size, shape.intermediate_size
    dtype = dtype or shape.dtype

    def rand(*dims: int, fan_in: int) -> torch.Tensor:
        t = torch.randn(*dims, generator=generator) / fan_in**0.5
        return t.to(device=device, dtype=dtype)

    b13 = rand(e, shape.w13_rows, fan_in=4) if shape.has_bias else None
    b2 = rand(e, h, fan_in=4) if shape.has_bias else None
    return ExpertWeights(rand(e, shape.w13_rows, h, fan_in=h), rand(e, h, i, fan_in=i), b13, b2)


def random_lora_bank(
    shape: MoEShape,
    num_slots: int,
    max_rank: int,
    *,
    ranks: list[int] | None = None,
    generator: torch.Generator | None = None,
    device=None,
    dtype=None,
) -> LoRABank:
    """Random non-zero adapters; slot a has rank ranks[a] (zero-padded up to max_rank).

    Scales keep the delta comparable to the base output, so a wrong delta is visible.
    """
    ranks = ranks or [max_rank] * num_slots
    bank = LoRABank.empty(shape, num_slots, max_rank, dtype=torch.float32)
    e, h, i = shape.num_experts, shape.hidden_size, shape.intermediate_size
    s = shape.activation.width_factor
    for slot, r in enumerate(ranks):
        g = generator
        bank.w13_a[slot, :, :, :r] = torch.randn(e, s, r, h, generator=g) / h**0.5
        bank.w13_b[slot, :, :, :, :r] = torch.randn(e, s, i, r, generator=g) / r**0.5
        bank.w2_a[slot, :, :r] = torch.randn(e, r, i, generator=g) / i**0.5
        bank.w2_b[slot, :, :, :r] = torch.randn(e, h, r, generator=g) / r**0.5
    dtype = dtype or shape.dtype
    factors = (
        t.to(device=device, dtype=dtype) for t in (bank.w13_a, bank.w13_b, bank.w2_a, bank.w2_b)
    )
    return LoRABank(*factors, ranks=torch.tensor(ranks, dtype=torch.int32), tile_rank=max(ranks))
