"""The Triton backend against the reference, under TRITON_INTERPRET=1 on CPU (fp16/fp32).

Case table: each case names the edge it covers. Shapes are tiny and blocks cover whole
dimensions, so each forward is a handful of interpreted programs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest
import torch

from moelora.activations import Activation
from moelora.backends.registry import REGISTRY
from moelora.backends.triton import fused_moe_lora
from moelora.call import MoECall
from moelora.compare import assert_close, poison_
from moelora.config import AddInputs, MoEShape
from moelora.kernels.align import align_pairs
from moelora.reference import moe_lora_reference
from moelora.tiling.align_launch import align_launch
from moelora.tiling.config import GemmTiles, TileConfig
from moelora.tiling.heuristic import DECODE_TILES
from moelora.weights import random_expert_weights, random_lora_bank

# One block of 16 rows, N/K tiles of 32: H = I = 32 are one tile, 48 leaves a masked tail.
TILES = TileConfig(16, GemmTiles(32, 32), GemmTiles(32, 32), shrink_block_k=32)
A = Activation


@dataclass(frozen=True)
class Case:
    id: str
    act: Activation = A.SILU
    tokens: int = 5
    experts: int = 4
    top_k: int = 2
    hidden: int = 32
    inter: int = 32
    slots: tuple[int, ...] = (0, -1, 2, 1, 0)  # token t uses slots[t % len]
    ranks: tuple[int, ...] | None = (16, 16, 16)  # None: no LoRA bank
    max_rank: int = 16
    bias: bool = False
    weights_on_input: bool = False
    dtype: torch.dtype = torch.float32
    drop_ids: bool = False  # expert parallel: some ids outside [0, E)
    split_k: int = 1  # LoRA shrink K chunks (fp32 atomic adds into a zeroed intermediate)
    expand_lanes: int = 128  # K lanes of one expand dot: 128 // R slots per dot
    z_sorted: bool = False  # z rows in the sorted pair order (contiguous per block)
    down_tma: bool = False  # down GEMM's z and w2 tiles by TMA descriptors (z_sorted)
    decode: bool = False  # the decode path: GEMV kernels from the top-k ids, no alignment
    lora_delta: bool = False  # LoRA expand over the shrink tiles, added by the GEMMs
    delta_in_reduce: bool = False  # with lora_delta: the down delta added by the reduce
    shrink_expand: bool = False  # with lora_delta: the shrink kernels write the delta rows
    extra: dict = field(default_factory=dict)


# Edges that several paths are checked on, spelled once; a case adds its path's knobs.
SWIGLU_BIAS_FP16 = dict(act=A.SWIGLUOAI, bias=True, dtype=torch.float16)  # gpt-oss, 16-bit
RANK_NOT_POW2 = dict(ranks=(24, 8), max_rank=24, slots=(1, 0, -1))  # BLOCK_R > R lanes
MANY_SLOTS = dict(slots=tuple(range(-1, 9)), ranks=(16,) * 9, tokens=10)  # 9 slots and -1
RANK_128 = dict(ranks=(128, 5, 64), max_rank=128)  # the widest rank
WEIGHTS_ON_INPUT = dict(top_k=1, weights_on_input=True)  # Llama-4
MULTI_BLOCK = dict(experts=2, top_k=1, tokens=40)  # an expert over several blocks
THREE_LAUNCH = dict(tokens=300, top_k=8, experts=16, slots=(0, 1, 2, -1))  # P > single
ONE_PAIR_DROP = dict(experts=32, tokens=2, drop_ids=True)  # P <= E/4 layout, dropped ids
MASKED_TAILS = dict(hidden=48, inter=40, act=A.GELU)  # H, I not tile multiples
BEYOND_BANK = dict(slots=(0, 5, -1, 1, 3))  # slots >= L: no adapter, as slot -1
# knob groups of the paths (TileConfig fields; `extra` keys: test_forward_matches_reference)
IN_REDUCE = dict(lora_delta=True, delta_in_reduce=True)  # the down delta added by the reduce
SHRINK_EXPAND = dict(lora_delta=True, shrink_expand=True)  # the shrink writes the delta rows
EXPAND_FIRST = dict(extra={"ef": True})

CASES = [
    # every activation, mixed slots (one of them -1)
    *[Case(f"act-{a.value}", act=a) for a in Activation],
    Case("swigluoai-bias", act=A.SWIGLUOAI, bias=True),  # gpt-oss: interleaved + biases
    Case("silu-bias-fp16", bias=True, dtype=torch.float16),
    Case("relu2-fp16", act=A.RELU2_NO_MUL, dtype=torch.float16),
    Case("slot-minus1-only", slots=(-1,)),  # LoRA bank present, nobody uses it
    Case("no-lora-bank", ranks=None),  # base path
    Case("rank-below-R", ranks=(8, 4, 16), max_rank=16),  # zero-padded adapters
    Case("rank-not-pow2", **RANK_NOT_POW2),
    Case("T1", tokens=1, slots=(2,)),  # decode
    Case("T-lt-block", tokens=3, slots=(0, 1, 2)),
    Case("K-eq-E", experts=4, top_k=4),
    Case("empty-experts", experts=16, top_k=2, tokens=2),  # most experts get no pair
    Case("multi-block-expert", **MULTI_BLOCK, slots=(0, 1, 2, -1, 1)),
    Case("weights-on-input", **WEIGHTS_ON_INPUT, bias=True),
    Case("masked-tails", **MASKED_TAILS),
    Case("expert-parallel-drop", drop_ids=True),  # ids -1 / >= E contribute nothing
    Case("many-slots", **MANY_SLOTS),
    Case("decode-one-pair-blocks-drop", **ONE_PAIR_DROP),
    # shrink split-K: H = 96 -> 3 chunks of one 32-wide tile; I = 48 -> chunks 32 + masked 16
    Case("shrink-split-k", hidden=96, inter=48, split_k=4),
    Case("shrink-split-k-swigluoai-bias", act=A.SWIGLUOAI, bias=True, hidden=64, split_k=2),
    Case("shrink-split-k-more-than-tiles", act=A.RELU2_NO_MUL, split_k=8),  # 1 tile: no split
    # expand groups: one slot per dot (9 groups), 2 slots per dot with absent groups skipped
    Case("expand-one-slot-per-dot", **MANY_SLOTS, expand_lanes=16),
    Case("expand-two-slots-per-dot", slots=(5, -1, 0, 4), ranks=(8,) * 6, expand_lanes=32),
    # z in the sorted order, with and without TMA tile copies in the down GEMM
    Case("z-sorted", z_sorted=True),
    Case("z-sorted-split-k", z_sorted=True, hidden=96, inter=48, split_k=4),
    Case("down-tma", down_tma=True),
    Case("down-tma-swigluoai-bias-fp16", **SWIGLU_BIAS_FP16, down_tma=True),
    Case("down-tma-masked-tails", hidden=48, inter=48, act=A.GELU, down_tma=True),
    Case("down-tma-decode-drop", **ONE_PAIR_DROP, down_tma=True),
    Case("down-tma-no-lora", ranks=None, down_tma=True),
    Case("down-tma-multi-block", **MULTI_BLOCK, down_tma=True),
    Case("slot-beyond-bank", **BEYOND_BANK),
    # P = 2400 > SINGLE_PROGRAM_PAIRS: alignment and shrink tiles in three launches
    Case("three-launch-align", **THREE_LAUNCH),
    # shrink tiles: buckets of ~20 pairs -> two 16-row tiles each; 32-row tiles
    Case("shrink-two-tiles-per-bucket", experts=2, top_k=1, tokens=80, slots=(0, 1)),
    Case("shrink-tile-32-rows", experts=2, top_k=2, tokens=40, slots=(0, -1), extra={"tm": 32}),
    # LoRA expand over the shrink tiles (delta rows added in the GEMM epilogues)
    Case("delta-silu", lora_delta=True),
    Case("delta-swigluoai-bias-fp16", **SWIGLU_BIAS_FP16, lora_delta=True),
    Case("delta-relu2-rank-not-pow2", act=A.RELU2_NO_MUL, **RANK_NOT_POW2, lora_delta=True),
    Case("delta-weights-on-input", **WEIGHTS_ON_INPUT, bias=True, lora_delta=True),
    Case("delta-many-slots-split-k", **MANY_SLOTS, split_k=4, lora_delta=True),
    Case("delta-masked-tails-drop", hidden=48, inter=40, drop_ids=True, lora_delta=True),
    Case("delta-slot-beyond-bank", **BEYOND_BANK, lora_delta=True),
    Case("delta-down-tma-multi-block", **MULTI_BLOCK, down_tma=True, lora_delta=True),
    Case("delta-shrink-two-tiles", experts=2, top_k=1, tokens=80, slots=(0, 1), lora_delta=True),
    # delta with the one-pair-per-block alignment (P <= E/4), and with three align launches
    Case("delta-one-pair-blocks-drop", **ONE_PAIR_DROP, lora_delta=True),
    Case("delta-three-launch-align", **THREE_LAUNCH, lora_delta=True),
    Case("delta-rank-128", **RANK_128, lora_delta=True),
    # the down delta added (weighted) by the top-k reduce, the down GEMM LoRA-free
    Case("delta-in-reduce", **IN_REDUCE),
    Case("delta-in-reduce-swigluoai-bias-fp16", **SWIGLU_BIAS_FP16, **IN_REDUCE),
    Case("delta-in-reduce-weights-on-input", **WEIGHTS_ON_INPUT, bias=True, **IN_REDUCE),
    Case("delta-in-reduce-drop-beyond-bank", **BEYOND_BANK, drop_ids=True, **IN_REDUCE),
    # lora_stream: the down side on the DELTA path, its delta added by the reduce, with the
    # gate/up side expanding in the GEMM (or on the DELTA path too); the CPU runs in order
    Case("lora-stream", extra={"ls": True}),
    Case("lora-stream-z-sorted-fp16", z_sorted=True, dtype=torch.float16, extra={"ls": True}),
    Case(
        "lora-stream-swigluoai-bias-drop",
        act=A.SWIGLUOAI,
        bias=True,
        drop_ids=True,
        extra={"ls": True},
    ),
    Case("lora-stream-weights-on-input", **WEIGHTS_ON_INPUT, extra={"ls": True}),
    Case("lora-stream-delta", lora_delta=True, extra={"ls": True}),
    Case("lora-stream-rank-128", **RANK_128, extra={"ls": True}),
    # the shrink programs expand their intermediate themselves (no delta launches)
    Case("shrink-expand", **SHRINK_EXPAND),
    # split_k 4 over 3 K chunks (H = 96) must be ignored: the delta needs the whole K
    Case("shrink-expand-split-ignored", hidden=96, inter=48, split_k=4, **SHRINK_EXPAND),
    # N = 2 * 80 and 160 columns: several 64-column expand steps with a masked tail
    Case(
        "shrink-expand-n-steps-z-sorted",
        act=A.SWIGLUOAI,
        hidden=160,
        inter=80,
        z_sorted=True,
        **SHRINK_EXPAND,
    ),
    Case("shrink-expand-swigluoai-bias-fp16", **SWIGLU_BIAS_FP16, **SHRINK_EXPAND),
    Case("shrink-expand-relu2-rank-not-pow2", act=A.RELU2_NO_MUL, **RANK_NOT_POW2, **SHRINK_EXPAND),
    Case("shrink-expand-rank-128-one-part-per-prog", **RANK_128, **SHRINK_EXPAND),
    Case(
        "shrink-expand-z-sorted-in-reduce",
        z_sorted=True,
        hidden=48,
        inter=40,
        **SHRINK_EXPAND,
        delta_in_reduce=True,
    ),
    Case("shrink-expand-weights-on-input-drop", **WEIGHTS_ON_INPUT, drop_ids=True, **SHRINK_EXPAND),
    Case("delta-in-reduce-many-tokens", tokens=9, slots=(2, -1, 0, 1), hidden=48, **IN_REDUCE),
    # the decode path (GEMV up with the z shrink by atomics, down with the top-k sum)
    *[Case(f"decode-act-{a.value}", act=a, decode=True) for a in Activation],
    Case("decode-T1", tokens=1, slots=(2,), decode=True),
    Case("decode-swigluoai-bias-fp16", **SWIGLU_BIAS_FP16, decode=True),
    Case("decode-weights-on-input", **WEIGHTS_ON_INPUT, bias=True, decode=True),
    Case("decode-drop-ids", drop_ids=True, decode=True),  # ids -1 / >= E contribute nothing
    Case("decode-rank-not-pow2", **RANK_NOT_POW2, decode=True),
    Case("decode-slot-minus1-only", slots=(-1,), decode=True),
    Case("decode-slot-beyond-bank", **BEYOND_BANK, decode=True),
    Case("decode-no-lora-bank", ranks=None, bias=True, decode=True),
    Case("decode-masked-tails", **MASKED_TAILS, decode=True),  # 2 K steps
    Case("decode-K-eq-E-odd-K", experts=3, top_k=3, decode=True),  # K not a power of two
    # x shrink: 4 A rows per program, 2 K steps of 16 (H = 32), z zeroing spread thinner
    Case("decode-shrink-tiles", hidden=32, decode=True, extra={"ds": (4, 16)}),
    Case("decode-shrink-one-row", hidden=48, decode=True, extra={"ds": (1, 32)}),  # 1 A row
    # the committed decode tiles (2-unit GEMV programs, 2-column down tiles, 1-row shrink)
    Case(
        "decode-committed-tiles", act=A.SWIGLUOAI, bias=True, decode=True, extra={"cfg": "DECODE"}
    ),
    Case("decode-top-k-10", experts=12, top_k=10, tokens=2, decode=True),  # K > 8: narrower K step
    Case("decode-rank-128", **RANK_128, decode=True, extra={"ds": (16, 32)}),
    Case(
        "decode-32-slots",
        slots=(-2, 0, 31, 33, 5, -1, 16),
        ranks=(8,) * 32,
        max_rank=8,
        tokens=7,
        decode=True,
    ),
    Case(
        "decode-shared-experts", experts=4, top_k=2, tokens=12, decode=True
    ),  # pairs share experts
    # pdl requested: the first weight step loads early (the PDL instructions themselves
    # cannot run in the interpreter); 2 K steps up and down, and a single one
    Case("decode-pdl-requested", act=A.SWIGLUOAI, bias=True, decode=True, extra={"pdl": True}),
    Case("decode-pdl-2-steps", **MASKED_TAILS, decode=True, extra={"pdl": True}),
    Case("decode-pdl-no-lora", ranks=None, hidden=48, decode=True, extra={"pdl": True}),
    Case("decode-pdl-drop-ids", drop_ids=True, decode=True, extra={"pdl": True}),
    Case(
        "decode-pdl-weights-on-input",
        **WEIGHTS_ON_INPUT,
        bias=True,
        decode=True,
        extra={"pdl": True},
    ),
    Case("decode-pdl-top-k-10", experts=12, top_k=10, tokens=2, decode=True, extra={"pdl": True}),
    # expand_first: the in-GEMM expand as a pipelined loop before the K loop (no group
    # skip: absent groups load nothing and add zeros)
    Case("expand-first", **EXPAND_FIRST),
    Case("expand-first-swigluoai-bias-fp16", **SWIGLU_BIAS_FP16, **EXPAND_FIRST),
    Case("expand-first-relu2", act=A.RELU2_NO_MUL, **EXPAND_FIRST),
    Case("expand-first-one-slot-per-dot", **MANY_SLOTS, expand_lanes=16, **EXPAND_FIRST),
    Case(
        "expand-first-absent-group",
        slots=(5, -1, 0, 4),
        ranks=(8,) * 6,
        expand_lanes=32,
        **EXPAND_FIRST,
    ),
    Case("expand-first-rank-not-pow2", **RANK_NOT_POW2, **EXPAND_FIRST),
    Case(
        "expand-first-down-tma-multi-block",
        **MULTI_BLOCK,
        slots=(0, 1, 2, -1, 1),
        down_tma=True,
        **EXPAND_FIRST,
    ),
    Case("expand-first-drop-slot-beyond-bank", **BEYOND_BANK, drop_ids=True, **EXPAND_FIRST),
    Case("expand-first-weights-on-input", **WEIGHTS_ON_INPUT, bias=True, **EXPAND_FIRST),
    # up_tma: w13 tiles by TMA descriptors (gate / up rows in two blocks; the interleaved
    # swigluoai layout falls back to pointer loads)
    Case("up-tma", extra={"ut": True}),
    Case("up-tma-relu2", act=A.RELU2_NO_MUL, extra={"ut": True}),
    Case("up-tma-masked-tails", **MASKED_TAILS, extra={"ut": True}),
    Case("up-tma-swigluoai-bias-fp16", **SWIGLU_BIAS_FP16, extra={"ut": True}),
    Case(
        "up-tma-expand-first-multi-block",
        **MULTI_BLOCK,
        slots=(0, 1, 2, -1, 1),
        extra={"ut": True, "ef": True},
    ),
    Case("up-tma-no-lora", ranks=None, extra={"ut": True}),
    # atomic_reduce: the down GEMM adds the pairs into an fp32 [T, H] sum; fp32 outputs are
    # summed into directly (zeroed first: out is poisoned), 16-bit ones by a finishing pass
    Case("atomic-reduce-fp32-out", extra={"ar": True}),
    Case(
        "atomic-reduce-multi-block-bias-fp16",
        experts=3,
        tokens=40,
        bias=True,
        dtype=torch.float16,
        extra={"ar": True},
    ),
    Case("atomic-reduce-drop-ids-fp16", drop_ids=True, dtype=torch.float16, extra={"ar": True}),
    Case(
        "atomic-reduce-weights-on-input-fp16",
        **WEIGHTS_ON_INPUT,
        dtype=torch.float16,
        extra={"ar": True},
    ),
    Case("atomic-reduce-no-lora-fp16", ranks=None, dtype=torch.float16, extra={"ar": True}),
    Case("atomic-reduce-delta-fp16", lora_delta=True, dtype=torch.float16, extra={"ar": True}),
    # the knob is ignored here: the reduce pass adds the delta rows
    Case(
        "atomic-reduce-delta-in-reduce-fp16", **IN_REDUCE, dtype=torch.float16, extra={"ar": True}
    ),
    Case(
        "atomic-reduce-swigluoai-down-tma-fp16",
        **SWIGLU_BIAS_FP16,
        down_tma=True,
        z_sorted=True,
        extra={"ar": True, "ef": True},
    ),
    # pdl on the aligned path: no PDL in the interpreter, the launchers' plumbing runs
    Case("aligned-pdl-requested", bias=True, **IN_REDUCE, extra={"pdl": True}),
]


def _inputs(case: Case, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = MoEShape(
        case.experts,
        case.top_k,
        case.hidden,
        case.inter,
        case.act,
        has_bias=case.bias,
        dtype=case.dtype,
    )
    experts = random_expert_weights(shape, generator=g)
    lora = None
    if case.ranks is not None:
        lora = random_lora_bank(
            shape, len(case.ranks), case.max_rank, ranks=list(case.ranks), generator=g
        )
    x = torch.randn(case.tokens, case.hidden, generator=g).to(case.dtype)
    logits = torch.randn(case.tokens, case.experts, generator=g)
    weights, ids = torch.topk(logits.softmax(-1), case.top_k)
    ids = ids.to(torch.int32)
    if case.drop_ids:
        ids[0, 0] = -1
        ids[-1, -1] = case.experts + 3
    slots = torch.tensor(
        [case.slots[t % len(case.slots)] for t in range(case.tokens)], dtype=torch.int32
    )
    return shape, experts, lora, x, ids, weights, slots


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_forward_matches_reference(case: Case, seed: int) -> None:
    shape, experts, lora, x, ids, weights, slots = _inputs(case, seed)
    num_slots = len(case.ranks or ())
    ref_slots = torch.where((slots >= 0) & (slots < num_slots), slots, -1)  # the kernels' rule
    ref = moe_lora_reference(
        x, ids, weights, ref_slots, experts, lora, shape, weights_on_input=case.weights_on_input
    )
    out = poison_(torch.empty_like(x))
    fused_moe_lora(
        MoECall(x, ids, weights, slots, lora, weights_on_input=case.weights_on_input, out=out),
        experts,
        shape,
        config=dataclasses.replace(
            DECODE_TILES if case.extra.get("cfg") == "DECODE" else TILES,
            shrink_split_k=case.split_k,
            expand_lanes=case.expand_lanes,
            z_sorted=case.z_sorted,
            down_tma=case.down_tma,
            shrink_block_m=case.extra.get("tm", TILES.shrink_block_m),
            decode=case.decode,
            lora_delta=case.lora_delta,
            delta_in_reduce=case.delta_in_reduce,
            shrink_expand=case.shrink_expand,
            decode_shrink=case.extra.get("ds", TILES.decode_shrink),
            pdl=case.extra.get("pdl", False),
            expand_first=case.extra.get("ef", False),
            up_tma=case.extra.get("ut", False),
            atomic_reduce=case.extra.get("ar", False),
            lora_stream=case.extra.get("ls", False),
        ),
    )
    assert_close(out, ref, what=case.id)


@pytest.mark.parametrize(
    "path",
    ["aligned", "expand-first", "delta", "delta-in-reduce", "shrink-expand", "decode", "stream"],
)
def test_slot_minus1_rows_equal_base_exactly(path: str, seed: int) -> None:
    """Slot -1 tokens in a mixed batch get bit-for-bit the base output, on every path."""
    shape, experts, lora, x, ids, weights, slots = _inputs(Case("mixed", tokens=8), seed)
    cfg = dataclasses.replace(
        TILES,
        lora_delta=path.startswith("delta") or path == "shrink-expand",
        delta_in_reduce=path == "delta-in-reduce",
        shrink_expand=path == "shrink-expand",
        decode=path == "decode",
        expand_first=path == "expand-first",
        lora_stream=path == "stream",
    )
    mixed = fused_moe_lora(MoECall(x, ids, weights, slots, lora), experts, shape, config=cfg)
    base = fused_moe_lora(MoECall(x, ids, weights, None, None), experts, shape, config=cfg)
    rows = slots < 0
    assert rows.any()
    if x.is_cuda:
        assert torch.equal(mixed[rows], base[rows])
    else:
        # Triton's interpreter runs tl.dot as numpy's BLAS matmul, whose sum order for a row
        # depends on the row's place in the tile, and the LoRA path orders a block's rows by
        # slot: about 1 seed in 60 moves a base row and rounds it 1 ulp apart (4.5e-8 at
        # 353886130). A GPU MMA sums every row in one order: bitwise there. Here: 2 ulp.
        diff = (mixed[rows] - base[rows]).abs()
        assert (diff <= 2 * torch.finfo(x.dtype).eps * base[rows].abs().clamp(min=1)).all(), diff
    assert not torch.equal(mixed[~rows], base[~rows])


@pytest.mark.parametrize("mode", list(AddInputs), ids=[m.value for m in AddInputs])
def test_backend_add_inputs(mode: AddInputs, seed: int) -> None:
    """The registered backend honours out / add_inputs; OVERWRITE writes every element."""
    shape, experts, lora, x, ids, weights, slots = _inputs(Case("io", bias=True), seed)
    ref = moe_lora_reference(x, ids, weights, slots, experts, lora, shape)
    prior = torch.randn_like(x)
    out = prior.clone() if mode is AddInputs.ADD else poison_(torch.empty_like(x))
    got = REGISTRY["triton"].forward(
        MoECall(x, ids, weights, slots, lora, out=out, add_inputs=mode), experts, shape
    )
    assert got is out
    want = ref + prior if mode is AddInputs.ADD else ref
    assert_close(out, want, what=mode.value)


@pytest.mark.parametrize(
    "knobs",
    [
        {"decode": True},
        {"decode": True, "pdl": True},
        {"lora_delta": True, "delta_in_reduce": True},
        {"lora_stream": True, "atomic_reduce": True},
        {"atomic_reduce": True},
        {"atomic_reduce": True, "_dtype": torch.float16},
    ],
    ids=["decode", "decode-pdl", "delta-in-reduce", "stream", "atomic-fp32", "atomic-fp16"],
)
def test_add_into_out(knobs: dict, seed: int) -> None:
    """The decode path's down kernel, the reduce with the delta and the atomic reduce
    (fp32 out summed into directly, 16-bit out by the finishing pass) add into `out`
    (add=True) as the aligned path does."""
    knobs = dict(knobs)
    dtype = knobs.pop("_dtype", torch.float32)
    shape, experts, lora, x, ids, weights, slots = _inputs(
        Case("dec-add", bias=True, dtype=dtype), seed
    )
    ref = moe_lora_reference(x, ids, weights, slots, experts, lora, shape)
    prior = torch.randn_like(x)
    out = prior.clone()
    cfg = dataclasses.replace(TILES, **knobs)
    fused_moe_lora(
        MoECall(x, ids, weights, slots, lora, out=out, add_inputs=AddInputs.ADD),
        experts,
        shape,
        config=cfg,
    )
    assert_close(out, ref + prior, what=f"add {knobs}")


HALF_TAIL_KNOBS = {
    "plain": {},
    "no-lora": {"_no_lora": True},
    "z-sorted": {"z_sorted": True},
    "down-tma": {"down_tma": True},
    "expand-first": {"expand_first": True},
    "up-tma-down-tma": {"up_tma": True, "down_tma": True},
    "delta-in-reduce": {"lora_delta": True, "delta_in_reduce": True},
    "swigluoai-bias-fp16": {"_case": {"act": A.SWIGLUOAI, "bias": True, "dtype": torch.float16}},
}


@pytest.mark.parametrize("name", list(HALF_TAIL_KNOBS))
def test_half_tail_matches_reference(name: str, seed: int) -> None:
    """half_tail with 32-row blocks: expert 0 has 40 pairs (a full block, then a tail of 8:
    the half variant), expert 1 has 20 (one full-variant block: 20 > 16 rows), expert 2 has
    10 (the half variant only); every path that reads the blocks matches the reference."""
    knobs = dict(HALF_TAIL_KNOBS[name])
    case = Case("half-tail", experts=3, top_k=1, tokens=70, **knobs.pop("_case", {}))
    no_lora = knobs.pop("_no_lora", False)
    shape, experts, lora, x, _, weights, slots = _inputs(case, seed)
    if no_lora:
        lora, slots = None, None
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([0] * 40 + [1] * 20 + [2] * 10, dtype=torch.int32)
    ids = ids[torch.randperm(70, generator=g)].view(70, 1)
    tails = torch.bincount(ids.flatten().long()) % 32
    assert ((tails > 0) & (tails <= 16)).any() and (tails > 16).any()  # both variants run
    ref = moe_lora_reference(x, ids, weights, slots, experts, lora, shape)
    out = poison_(torch.empty_like(x))
    cfg = dataclasses.replace(TILES, block_m=32, half_tail=3, **knobs)  # both GEMMs
    fused_moe_lora(MoECall(x, ids, weights, slots, lora, out=out), experts, shape, config=cfg)
    assert_close(out, ref, what=f"half_tail {name}")


def test_half_tail_runs_both_row_variants(monkeypatch, seed: int) -> None:
    """The half-height variant really runs (a wrong choice would still be correct, only
    slower): every GEMM dot's row count is recorded, and with half_tail both heights
    appear in each kernel, only the full one without it."""
    import moelora.kernels.expert_down as down_mod
    import moelora.kernels.expert_up as up_mod

    shape, experts, lora, x, _, weights, slots = _inputs(
        Case("ht", experts=3, top_k=1, tokens=70), seed
    )
    ids = torch.tensor([0] * 40 + [1] * 20 + [2] * 10, dtype=torch.int32).view(70, 1)
    for half_tail in (0, 3):
        rows: dict[str, set] = {"up": set(), "down": set()}
        for name, mod in (("up", up_mod), ("down", down_mod)):

            def record(a, b, acc, ieee, _orig=mod.mma, _seen=rows[name]):
                _seen.add(int(a.shape[0]))
                return _orig(a, b, acc, ieee)

            monkeypatch.setattr(mod, "mma", record)
        cfg = dataclasses.replace(TILES, block_m=32, half_tail=half_tail)
        fused_moe_lora(MoECall(x, ids, weights, slots, lora), experts, shape, config=cfg)
        want = {32, 16} if half_tail else {32}
        assert rows == {"up": want, "down": want}, (half_tail, rows)


@pytest.mark.parametrize(
    "knobs",
    [{}, {"expand_lanes": 16, "expand_first": True}, {"lora_delta": True}, {"decode": True}],
    ids=["two-slots-per-dot", "expand-first-absent-groups", "delta", "decode"],
)
def test_unused_slots_do_not_leak(knobs: dict, seed: int) -> None:
    """Slots no token uses contribute nothing on any path: their factors hold large finite
    garbage, and the output matches the reference. Slots 0 and 3 are used: with two slots
    per dot slot 1 shares a group with slot 0; with one slot per dot the pipelined expand
    passes the absent groups 1 and 2. The paths that never read an unused slot (the expand
    over the shrink tiles, the decode path) also pass with inf there; the in-GEMM expand
    multiplies a touched group's unused B by zero, so there the bank must be finite
    (weights.LoRABank)."""
    shape, experts, lora, x, ids, weights, _ = _inputs(Case("unused", tokens=8), seed)
    lora = random_lora_bank(shape, 4, 16, generator=torch.Generator().manual_seed(seed))
    slots = torch.tensor([0, 3] * 4, dtype=torch.int32)
    ref = moe_lora_reference(x, ids, weights, slots, experts, lora, shape)
    garbage = [1e30] + ([float("inf")] if knobs.get("lora_delta") or knobs.get("decode") else [])
    for value in garbage:
        for t in (lora.w13_a, lora.w13_b, lora.w2_a, lora.w2_b):
            t[1:3] = value
        out = poison_(torch.empty_like(x))
        cfg = dataclasses.replace(TILES, **knobs)
        fused_moe_lora(MoECall(x, ids, weights, slots, lora, out=out), experts, shape, config=cfg)
        assert_close(out, ref, what=f"unused slots = {value} {knobs}")


ALIGN_CASES = [  # (T, K, E, L, BLOCK_M, id)
    (1, 2, 4, 2, 16, "decode"),
    (37, 3, 5, 4, 16, "several-blocks"),
    (8, 8, 8, 1, 4, "K-eq-E"),
    (3, 2, 64, 3, 16, "mostly-empty"),
    (300, 8, 16, 3, 16, "multi-program"),  # P > SINGLE_PROGRAM_PAIRS: three launches
    (200, 6, 16, 3, 16, "wide-single"),  # WIDE_SINGLE_PAIRS < P <= SINGLE_PROGRAM_PAIRS
    (2, 2, 32, 3, 16, "one-pair-blocks"),  # P <= E/4: the decode layout
    (400, 4, 200, 32, 16, "expert-chunks"),  # E * (L + 1) > 4096: several OFFSETS chunks
]


@pytest.mark.parametrize(
    "tokens,top_k,experts,slots_n,block_m,case_id", ALIGN_CASES, ids=[c[-1] for c in ALIGN_CASES]
)
def test_align_invariants(tokens, top_k, experts, slots_n, block_m, case_id, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    ids = ids.to(torch.int32)
    slots = torch.randint(-1, slots_n, (tokens,), generator=g, dtype=torch.int32)
    if tokens > 1:  # expert parallel drops, and a slot beyond the bank (= no adapter)
        ids[0, 0], ids[-1, -1], slots[-1] = -1, experts + 3, slots_n + 2
    for tile_m in (1, 8, 64):
        launch = align_launch(ids.numel(), experts)
        al = align_pairs(ids, slots, experts, slots_n, block_m, lora_tile_m=tile_m, launch=launch)
        _check_blocks(al, ids, slots, slots_n, experts, block_m)
        _check_lora_tiles(al, ids, slots, slots_n, experts)


def _check_blocks(al, ids, slots, slots_n: int, experts: int, block_m: int) -> None:
    """Every routed pair exactly once, blocks of one expert, slots sorted inside a block."""
    top_k = ids.shape[1]
    pairs = ids.numel()
    flat = ids.reshape(-1).long()
    routed = [p for p in range(pairs) if 0 <= flat[p] < experts]
    sp = al.sorted_pair_ids.long()
    used = int(al.num_padded)
    assert used % block_m == 0 and used <= sp.numel()
    eff = torch.where((slots >= 0) & (slots < slots_n), slots, -1).long()
    real = []  # entries past the used length, or in blocks of expert -1, are never read
    for b in range(used // block_m):
        rows = sp[b * block_m : (b + 1) * block_m]
        assert ((rows >= 0) & (rows <= pairs)).all()  # every used entry written
        rows = rows[rows < pairs]
        if al.block_experts[b] < 0:  # decode layout: a dropped pair's block, skipped
            continue
        real += rows.tolist()
        assert (flat[rows] == al.block_experts[b]).all()  # block routes to its expert
        s = eff[rows // top_k]
        assert (s[1:] >= s[:-1]).all()  # slots sorted inside a block
    assert (al.block_experts[used // block_m :] == -1).all()
    assert sorted(real) == routed  # every routed pair in exactly one block


def _check_lora_tiles(al, ids, slots, slots_n: int, experts: int) -> None:
    """The shrink tiles cover every pair with an adapter and a local expert exactly once,
    each tile a run of sorted pairs of one (expert, slot) with at most lora_tile_m rows."""
    top_k = ids.shape[1]
    pairs = ids.numel()
    flat = ids.reshape(-1).long()
    n = int(al.num_lora_tiles)
    assert 0 <= n <= al.max_lora_tiles  # 0 when every token has slot -1
    seen = []
    for start, end, expert, slot in al.lora_tiles[:n].tolist():
        if expert < 0 or slot < 0:  # decode layout: a pair without work
            continue
        assert 0 < end - start <= al.lora_tile_m
        rows = al.sorted_pair_ids[start:end].long()
        assert (rows < pairs).all()
        assert (flat[rows] == expert).all()
        assert (slots.long()[rows // top_k] == slot).all()
        seen += rows.tolist()
    want = [p for p in range(pairs) if 0 <= slots[p // top_k] < slots_n and 0 <= flat[p] < experts]
    assert sorted(seen) == want


def test_launcher_errors_name_the_input(seed: int) -> None:
    shape, experts, lora, x, ids, weights, slots = _inputs(Case("err"), seed)
    with pytest.raises(ValueError, match="'x'"):
        REGISTRY["triton"].forward(MoECall(x[:, :16], ids, weights, slots, lora), experts, shape)
    with pytest.raises(ValueError, match="token_slots"):
        REGISTRY["triton"].forward(MoECall(x, ids, weights, slots[:2], lora), experts, shape)


def test_zero_tokens(seed: int) -> None:
    """T = 0 (an empty batch bucket): an empty y, and ADD leaves `out` as it was."""
    shape, experts, lora, x, ids, weights, slots = _inputs(Case("empty", tokens=4), seed)
    got = REGISTRY["triton"].forward(
        MoECall(x[:0], ids[:0], weights[:0], slots[:0], lora), experts, shape
    )
    assert got.shape == (0, shape.hidden_size)
    out = torch.randn(0, shape.hidden_size)
    fused_moe_lora(
        MoECall(x[:0], ids[:0], weights[:0], slots[:0], lora, out=out, add_inputs=AddInputs.ADD),
        experts,
        shape,
    )


@pytest.mark.parametrize(
    "knobs,dtype,want",
    [
        ({"atomic_reduce": True}, torch.float16, "atomic+finish"),
        ({"atomic_reduce": True}, torch.float32, "atomic"),  # the fp32 sum is the result
        ({"atomic_reduce": True, "_no_lora": True}, torch.float16, "atomic+finish"),
        ({"atomic_reduce": False}, torch.float16, "reduce"),
        # ignored with delta_in_reduce: that reduce pass adds the delta rows
        ({"atomic_reduce": True, "lora_delta": True, "delta_in_reduce": True}, torch.float16,
         "reduce"),
    ],
    ids=["fp16", "fp32", "fp16-no-lora", "off", "delta-in-reduce"],
)  # fmt: skip
def test_atomic_reduce_takes_the_atomic_path(monkeypatch, knobs, dtype, want, seed) -> None:
    """Which top-k sum ran (the outputs match either way, so the reference cases alone
    cannot tell): the down GEMM's atomic adds (sum_into given, topk_reduce never called),
    then the finishing pass only for 16-bit results."""
    import moelora.kernels.moe_lora as mod

    calls = []

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            if name == "down":
                calls.append("atomic" if kwargs.get("sum_into") is not None else "down")
            else:
                calls.append(name)
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(mod, "expert_down", spy("down", mod.expert_down))
    monkeypatch.setattr(mod, "topk_reduce", spy("reduce", mod.topk_reduce))
    monkeypatch.setattr(mod, "finish_sum", spy("finish", mod.finish_sum))
    knobs = dict(knobs)
    no_lora = knobs.pop("_no_lora", False)
    shape, experts, lora, x, ids, weights, slots = _inputs(Case("spy", dtype=dtype), seed)
    if no_lora:
        lora, slots = None, None
    ref = moe_lora_reference(x, ids, weights, slots, experts, lora, shape)
    out = fused_moe_lora(
        MoECall(x, ids, weights, slots, lora),
        experts,
        shape,
        config=dataclasses.replace(TILES, **knobs),
    )
    assert_close(out, ref, what=want)
    assert out.dtype == dtype
    expected = {
        "atomic+finish": ["atomic", "finish"],
        "atomic": ["atomic"],
        "reduce": ["down", "reduce"],
    }[want]
    assert calls == expected
