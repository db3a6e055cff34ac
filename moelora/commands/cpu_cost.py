"""What a demo or validate run costs on a CPU, estimated from the shapes before it starts:
the Triton interpreter's time, the reference's time, and the memory of the weights, the
slot banks and the adapter files. The commands warn above FAST_S or LARGE_BYTES.

How the constants were chosen: `moelora demo` on four config.json shapes (H 256-1024,
I 128-512, E 8-16, K 2-4, 2 and 16 layers; T 8 and 48) on the project's CPU machine (2
shared cores, ENVIRONMENT.md). The interpreter's forward took 1 s plus 4-6e-7 s per token
block and weight element (blocks: one per active expert plus one per BLOCK_PAIRS pairs);
the peak RSS was 0.38 GB (torch and triton imported) plus twice the expert weights (the
interpreter copies its arguments) plus 1.5 times the slot banks (the adapter files are
written and read back): within 20% of each run. At full model sizes the per-element time
is higher: the gpt-oss-20b demo took 19 minutes there (issue 18), 1e-6 s per element, which
is the figure used (the small shapes then come out about 2x too slow, the safe side). The
same model gives 15 GB for the qwen3-30b-a3b demo; issue 18 measured 14 GB.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig, MoEShape

INTERPRETER_S_PER_ELEMENT = 1e-6  # s per (token block x weight element): see above
INTERPRETER_START_S = 1.0  # first launch: the interpreter's set-up, measured on `tiny`
BLOCK_PAIRS = 16  # (token, expert) pairs per block at small T, as the fit counts them
REFERENCE_FLOP_S = 1e10  # fp32 matmul on the CPU machine, about (the reference's loop)
BASE_BYTES = 0.38e9  # RSS of the demo on `tiny`
FAST_S = 30.0  # warn above: "sizes that finish in seconds" is the default
LARGE_BYTES = 4e9  # warn above: a sixth of the CPU machine's 24 GiB


@dataclass(frozen=True)
class Cost:
    seconds: float
    bytes: float

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.seconds + other.seconds, self.bytes + other.bytes)

    @property
    def large(self) -> bool:
        return self.seconds > FAST_S or self.bytes > LARGE_BYTES

    def describe(self) -> str:
        """'about 12 min and 15 GB of memory'."""
        s = self.seconds
        when = (
            "under a second"
            if s < 1
            else f"{s:.0f} s"
            if s < 120
            else f"{s / 60:.0f} min"
            if s < 7200
            else f"{s / 3600:.1f} h"
        )
        return f"{'' if s < 1 else 'about '}{when} and {self.bytes / 1e9:.1f} GB of memory"


def expert_elements(shape: MoEShape) -> int:
    """Weight elements of one expert: w13 [S*I, H] and w2 [H, I]."""
    return shape.w13_rows * shape.hidden_size + shape.hidden_size * shape.intermediate_size


def interpreter_seconds(shape: MoEShape, tokens: int) -> float:
    """One forward of the triton backend through TRITON_INTERPRET=1."""
    pairs = tokens * shape.top_k
    experts = shape.num_experts
    active = experts * (1 - (1 - 1 / experts) ** pairs)  # expected experts with a pair
    blocks = active + pairs / BLOCK_PAIRS
    return INTERPRETER_START_S + blocks * expert_elements(shape) * INTERPRETER_S_PER_ELEMENT


def reference_seconds(shape: MoEShape, tokens: int) -> float:
    return 2 * tokens * shape.top_k * expert_elements(shape) / REFERENCE_FLOP_S


def bank_bytes(shape: MoEShape, num_slots: int, max_rank: int, element_bytes: int = 4) -> int:
    """One layer's slot bank: A13 [L, E, S, R, H], B13 [L, E, S, I, R], A2 [L, E, R, I],
    B2 [L, E, H, R]."""
    s, h, i = shape.activation.width_factor, shape.hidden_size, shape.intermediate_size
    per_slot_expert = max_rank * (s * h + s * i + i + h)
    return num_slots * shape.num_experts * per_slot_expert * element_bytes


def demo_cost(
    model: ModelConfig, tokens: int, num_slots: int, max_rank: int, interpreted: bool
) -> Cost:
    """`moelora demo` in fp32: experts, every MoE layer's bank (and its adapter files), one
    forward and the reference twice (with and without LoRA)."""
    shape = model.shape
    weights = 4 * shape.num_experts * expert_elements(shape)
    banks = len(model.moe_layers) * bank_bytes(shape, num_slots, max_rank)
    seconds = 2 * reference_seconds(shape, tokens)
    if interpreted:
        seconds += interpreter_seconds(shape, tokens)
        weights *= 2
    return Cost(seconds, BASE_BYTES + weights + 1.5 * banks)


def validate_cost(
    model: ModelConfig, cases: list, ref_tokens: int, interpreted: bool, element_bytes: int
) -> Cost:
    """`moelora validate --device cpu` for one model: its experts, and per case a bank, a
    forward and the reference on the first ref_tokens rows. cases: validate.Case."""
    shape = model.shape
    weights = element_bytes * shape.num_experts * expert_elements(shape)
    seconds, bank = 0.0, 0
    for case in cases:
        seconds += reference_seconds(shape, min(case.tokens, ref_tokens))
        if interpreted:
            seconds += interpreter_seconds(shape, case.tokens)
        bank = max(bank, bank_bytes(shape, case.adapters, case.rank, element_bytes))
    factor = 2 if interpreted else 1
    return Cost(seconds, BASE_BYTES + factor * (weights + bank))


def parallel_bench_cost(model: ModelConfig, tokens: list[int], layouts: int, calls: int) -> Cost:
    """scripts/parallel_bench.py on CPUs (gloo, triton interpreted) for one model: `calls`
    interpreted forwards per (layout, T), each counted at the full layer's size (the safe
    side: a rank computes its shard, but the ranks share the same cores), and the weights
    held once per rank (2 ranks counted). The interpreter's set-up is paid once."""
    shape = model.shape
    per_call = [interpreter_seconds(shape, t) - INTERPRETER_START_S for t in tokens]
    seconds = INTERPRETER_START_S + layouts * calls * sum(per_call)
    weights = 2 * 4 * shape.num_experts * expert_elements(shape)
    return Cost(seconds, BASE_BYTES + 2 * weights)
