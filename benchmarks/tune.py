"""Tile tuning on this GPU: writes the table that moelora/tiling/h200_table.json commits.

For each T (and LoRA off / on) a coordinate search from the heuristic config: the up
kernel's tiles, then the down kernel's, then BLOCK_M halved / doubled; with LoRA the search
also starts from the LoRA-free tiles and ends with the LoRA knobs (expand lanes, shrink
tile rows, shrink K chunks); every search then tries z in the sorted order, and with it the
down GEMM's TMA tiles. At T <= DECODE_MAX_T the decode path's GEMV tiles are searched
too, and win when faster than the aligned best. Each candidate is
the whole layer (alignment to y) under CUDA-graph replay with L2 flushed (the runner's
timer, median of --iters replays), and its output must match the reference on the first
rows, else it is dropped. The fastest candidate is kept; the table lists, per entry, the
heuristic's and the chosen config's time. A time budget stops the search early (T are
visited in the order given; unvisited T keep the heuristic).

LoRA classes (moelora/tiling/lora_class.py): the bank is --adapters L slots of rank --rank R
(default 8 x 16, the REFERENCE class), token t on slot t % L. Another class tunes LoRA
rows only, written with that lora_class: each starts from the row pick_config gives the
class (its nearest tuned neighbour, fitted to the GPU as a forward fits it) and from the
LoRA-free tiles, and takes the T range of the REFERENCE-class row holding its T.
`--search quick` (for class tunes, device time being scarce) tries the starts, the up
tiles, BLOCK_M halved / doubled and the LoRA knobs only. `--table-in` starts from another
table file than the packaged one (e.g. the previous class tune's output).

Usage (GPU): python -m benchmarks.tune --out $OUT/h200_table.json --json $OUT/tune.json
  class tune: ... --adapters 8 --rank 128 --tokens 256,4096,16384 --search quick
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import time

import torch

from moelora.backends.triton import fused_moe_lora
from moelora.bench.runner import commit, time_graph
from moelora.call import MoECall
from moelora.compare import compare
from moelora.device import gpu_limits
from moelora.inputs import build_experts, build_inputs, build_lora
from moelora.presets import resolve_model
from moelora.reference import moe_lora_reference
from moelora.tiling.config import KNOB, KNOB_SPECS, GemmTiles, Search, TileConfig, searched
from moelora.tiling.fit import fit_to_device
from moelora.tiling.heuristic import DECODE_TILES, aligned_config
from moelora.tiling.lora_class import RANK_CLASSES, REFERENCE, SLOT_CLASSES, LoRAClass
from moelora.tiling.pick import H200, pick_config
from moelora.tiling.table import Table, TableRow, load_table
from moelora.tiling.table_file import write_table

from .table_buckets import Buckets

# Candidates (BLOCK_N, BLOCK_K, num_warps, num_stages). Gated up tiles hold gate and up
# accumulators, so an up BLOCK_N of 128 is a 256-wide N tile (vLLM's H200 choice for this
# layer at T >= 1024 is 128 x 256 x 64, 8 warps, 4 stages: peer JSON base_config).
UP = {
    "small": [
        (32, 256, 4, 2),
        (64, 128, 4, 2),
        (64, 256, 4, 2),
        (128, 128, 8, 2),
        (64, 128, 4, 3),
        (32, 128, 4, 3),  # decode: 2x the programs of BLOCK_N 64 (96 at T = 1 on 132 SMs)
        (32, 128, 4, 4),
        (64, 64, 4, 4),
    ],
    "large": [(64, 64, 4, 4), (64, 64, 8, 4), (128, 64, 8, 4), (128, 64, 8, 3), (64, 128, 8, 3)],
}
DOWN = {
    "small": [
        (64, 256, 4, 2),
        (128, 128, 4, 2),
        (256, 128, 8, 2),
        (64, 128, 4, 3),
        (32, 128, 4, 3),
        (64, 64, 4, 4),
    ],
    "large": [(128, 64, 8, 4), (256, 64, 8, 4), (128, 128, 8, 3), (256, 64, 8, 3)],
}
# Decode path (TileConfig.decode, T <= DECODE_MAX_T): GEMV tiles (BLOCK_N rows of each
# pair / token per program, BLOCK_K per step, warps, stages). Up: 4-32 units (x2 rows,
# gate and up) of 2-8 KB per step; down: a [K, BLOCK_N, BLOCK_K] step of 4-16 KB. Chosen
# to span 100-800 programs at T = 1 (P * I / BLOCK_N up, H / BLOCK_N down on 132 SMs).
DECODE_MAX_T = 16  # largest T bucket bound where the decode path is tried
DECODE_UP = [
    (8, 256, 4, 1),
    (4, 512, 4, 1),
    (8, 512, 4, 1),
    (16, 256, 4, 1),
    (16, 512, 8, 1),
    (4, 1024, 4, 1),
    (32, 128, 4, 1),
    (8, 256, 4, 3),
    (2, 2048, 4, 1),  # whole rows per step (b7d7a88 run: up tiles within 3% of each other)
    (4, 2048, 8, 1),
]
DECODE_DOWN = [
    (16, 64, 4, 1),
    (8, 128, 4, 1),
    (4, 256, 4, 1),
    (8, 64, 4, 1),
    (16, 128, 8, 1),
    (32, 64, 8, 1),
    (16, 64, 4, 3),
    (2, 256, 4, 1),  # narrower / longer steps (b7d7a88 run: 4 x 256 won, 2x the default)
    (4, 512, 4, 1),
    (2, 512, 4, 1),
    (2, 1024, 4, 1),  # all of I = 768 in one step: with PDL the whole read starts early
]
DECODE_SHRINK = KNOB["decode_shrink"].values
DEFAULT_TOKENS = (1024, 4096, 16384, 256, 64, 16, 1)
# The knobs' candidates, declared once with each knob (moelora/tiling/config.py): the LoRA
# knobs searched after the tiles, half-height tails, and lora_delta's own knobs (each alone a
# no-op without it: tried as combinations).
TUNED_LORA = searched(Search.LORA)
HALF_TAIL = KNOB["half_tail"].values
DELTA_KNOBS = tuple(searched(Search.DELTA))


def _size(block_m: int) -> str:
    return "small" if block_m <= 32 else "large"


def load_model(name: str, adapters: int = 8, rank: int = 16) -> tuple:
    """(model, dims (E, K, H, I), experts, LoRA bank of `adapters` slots of rank `rank`) on
    the GPU: the setup every tuning tool times against (8 x 16: the REFERENCE class)."""
    model = resolve_model(name)
    shape = model.shape
    dims = (shape.num_experts, shape.top_k, shape.hidden_size, shape.intermediate_size)
    return model, dims, build_experts(model, "cuda"), build_lora(model, adapters, rank, "cuda")


def fit_like_forward(cfg: TileConfig, model, bank) -> TileConfig:
    """cfg fitted to this GPU for `bank` (None: LoRA-free) as a forward of it is fitted
    (backends/triton.py, forward_plan)."""
    rank, slots = (bank.tile_rank, bank.num_slots) if bank is not None else (0, 0)
    limits = gpu_limits(torch.device("cuda"))
    parts = model.shape.activation.width_factor
    return fit_to_device(cfg, parts, model.shape.dtype, limits, rank=rank, num_slots=slots)


class Layer:
    """One model layer at one T: inputs, reference rows, and a timer per tile config."""

    def __init__(self, model, experts, lora, tokens: int, iters: int, ref_experts=None, tol=None):
        """ref_experts: what the reference runs (default: experts; FP8 experts: their
        dequantization), tol: the tolerance table's row (default: the model's dtype)."""
        self.model, self.experts, self.lora, self.iters = model, experts, lora, iters
        self.ref_experts = experts if ref_experts is None else ref_experts
        self.tol = model.shape.dtype if tol is None else tol
        adapters = lora.num_slots
        self.sets = [build_inputs(model, tokens, adapters, "cuda", seed) for seed in range(2)]
        for s in self.sets:  # token t -> slot t % L, as the bench and the vLLM peer do
            s[3].copy_(torch.arange(tokens, device="cuda") % adapters)
        self.n = min(tokens, 256)
        self.refs: dict[bool, torch.Tensor] = {}

    def measure(self, cfg: TileConfig, lora: bool) -> float | None:
        """Median ms, or None when the config fails to build or mismatches the reference."""
        bank = self.lora if lora else None
        shape = self.model.shape

        def fwd(x, ids, w, slots):
            return fused_moe_lora(MoECall(x, ids, w, slots, bank), self.experts, shape, config=cfg)

        static = tuple(t.clone() for t in self.sets[0])
        n = self.n
        if lora not in self.refs:
            self.refs[lora] = moe_lora_reference(
                *(t[:n] for t in static), self.ref_experts, bank, shape, weights_on_input=False
            )
        try:
            out = fwd(*static)
            if not compare(out[:n], self.refs[lora], self.tol).ok:
                print(f"    drop {cfg}: output does not match the reference")
                return None
            return time_graph(fwd, static, self.sets, self.iters)
        except Exception as err:  # out of resources etc.: skip the candidate
            print(f"    skip {cfg}: {type(err).__name__}: {str(err)[:100]}")
            return None


class Coordinate:
    """A coordinate search's state: the best config so far and its time (None: it failed),
    the start's time, and `log`, where every measured config goes (in order)."""

    def __init__(self, layer: Layer, lora: bool, log: list, start: TileConfig) -> None:
        self.layer, self.lora, self.log = layer, lora, log
        self.best, self.best_ms = start, None
        self.measure(start)
        self.base_ms = self.best_ms

    def measure(self, cfg: TileConfig) -> None:
        ms = self.layer.measure(cfg, self.lora)
        self.log.append(dict(cfg=dataclasses.asdict(cfg), ms=ms))
        if cfg is self.best or (ms is not None and (self.best_ms is None or ms < self.best_ms)):
            self.best, self.best_ms = cfg, ms

    def consider(self, cfg: TileConfig) -> None:
        """Measure cfg unless it is the best already; keep it when faster."""
        if cfg != self.best:
            self.measure(cfg)


def search(
    layer: Layer,
    start: TileConfig,
    lora: bool,
    log: list,
    other_starts: tuple = (),
    quick: bool = False,
) -> tuple[TileConfig, float]:
    """Coordinate search from `start` (its time is the heuristic's); other_starts are tried
    first and the search continues from the fastest. quick (--search quick): the starts,
    the up tiles of the size class, BLOCK_M halved / doubled and the LoRA knobs only (no
    down tiles, no layout knobs): about half the candidates, for class tunes."""
    c = Coordinate(layer, lora, log, start)
    for cfg in other_starts:
        c.consider(cfg)
    for up in UP[_size(c.best.block_m)]:
        c.consider(dataclasses.replace(c.best, up=GemmTiles(*up)))
    for down in () if quick else DOWN[_size(c.best.block_m)]:
        c.consider(dataclasses.replace(c.best, down=GemmTiles(*down)))
    for bm in (c.best.block_m // 2, c.best.block_m * 2):
        if 16 <= bm <= 128:
            c.consider(dataclasses.replace(c.best, block_m=bm))
    if lora:
        for knob, values in TUNED_LORA.items():
            for v in values:
                c.consider(dataclasses.replace(c.best, **{knob: v}))
        for on in itertools.product((False, True), repeat=len(DELTA_KNOBS)):
            if any(on):  # lora_delta plus each combination of its knobs
                c.consider(
                    dataclasses.replace(c.best, lora_delta=True, **dict(zip(DELTA_KNOBS, on)))
                )
    if quick:
        print(f"    start {c.base_ms} ms -> {c.best_ms} ms  {c.best}  (quick)")
        return c.best, c.base_ms
    # z layout, then TMA in the down GEMM (which needs the sorted layout)
    c.consider(dataclasses.replace(c.best, z_sorted=not c.best.z_sorted, down_tma=False))
    c.consider(dataclasses.replace(c.best, z_sorted=True, down_tma=True))
    for half_tail in HALF_TAIL:
        c.consider(dataclasses.replace(c.best, half_tail=half_tail))
    c.consider(dataclasses.replace(c.best, up_tma=not c.best.up_tma))
    if not (c.best.lora_delta and c.best.delta_in_reduce) and not c.best.lora_stream:
        # atomic_reduce is a no-op with the reduce adding the down delta (tiling/plan.py)
        c.consider(dataclasses.replace(c.best, atomic_reduce=not c.best.atomic_reduce))
    print(f"    heuristic {c.base_ms:.4f} ms -> {c.best_ms:.4f} ms  {c.best}")
    return c.best, c.base_ms


def search_knobs(layer: Layer, start: TileConfig, lora: bool, log: list):
    """--knobs-only: a coordinate search over the knobs alone (LoRA knobs, z layout / TMA,
    half-height tails) from `start`, the committed row, its tiles kept."""
    c = Coordinate(layer, lora, log, start)
    steps = [("half_tail", v) for v in HALF_TAIL]
    steps += [("z_sorted", not start.z_sorted), ("down_tma", not start.down_tma)]
    steps += [("up_tma", not start.up_tma), ("atomic_reduce", not start.atomic_reduce)]
    if lora:
        steps += [(k, v) for k, values in TUNED_LORA.items() for v in values]
        steps += [(k, v) for k in DELTA_KNOBS for v in (False, True)]
    for knob, value in steps:
        best = c.best
        if knob in DELTA_KNOBS and not best.lora_delta:
            continue  # each acts only with lora_delta
        if knob == "atomic_reduce" and (
            (best.lora_delta and best.delta_in_reduce) or best.lora_stream
        ):
            continue  # a no-op with that reduce pass (tiling/plan.py)
        cfg = dataclasses.replace(best, **{knob: value})
        if knob == "down_tma" and value:
            cfg = dataclasses.replace(cfg, z_sorted=True)
        if not (knob == "z_sorted" and cfg.down_tma):  # down_tma implies z_sorted
            c.consider(cfg)
    print(f"    committed {c.base_ms:.4f} ms -> {c.best_ms:.4f} ms  {c.best}")
    return c.best, c.base_ms


def search_decode(
    layer: Layer, lora: bool, log: list, start: TileConfig
) -> tuple[TileConfig, float | None]:
    """The decode path's tiles: up candidates, then down candidates, then (LoRA) the x
    shrink's, a coordinate search from `start` when it is a decode config (a committed
    row), else from heuristic.DECODE_TILES."""
    c = Coordinate(layer, lora, log, start if start.decode else DECODE_TILES)
    # PDL first (kernels/pdl.py), so the tiles are searched with the launch mode that won
    steps = [("pdl", not c.best.pdl)]
    steps += [("up", GemmTiles(*t)) for t in DECODE_UP]
    steps += [("down", GemmTiles(*t)) for t in DECODE_DOWN]
    if lora:  # rows x BLOCK_K per program of the x shrink
        steps += [("decode_shrink", v) for v in DECODE_SHRINK]
    for field, value in steps:
        c.consider(dataclasses.replace(c.best, **{field: value}))
    best = c.best
    print(
        f"    decode path: {c.best_ms} ms  up {best.up}  down {best.down}  {best.decode_shrink}"
        f"  pdl={best.pdl}"
    )
    return best, c.best_ms


# both modes; written only when on
LAYOUT_KNOBS = tuple(
    k.name
    for k in KNOB_SPECS
    if k.search in (Search.LAYOUT, Search.DECODE) and k.values == (False, True)
)


def _knobs(cfg: TileConfig) -> dict:
    knobs = {k: getattr(cfg, k) for k in TUNED_LORA}
    if cfg.lora_delta:
        knobs.update({k: getattr(cfg, k) for k in DELTA_KNOBS})
    return knobs


def table_row(
    cfg: TileConfig,
    lora: bool,
    key: tuple,
    t: int,
    before_ms: float,
    after_ms: float,
    run: str,
    min_tokens: int | None = None,
) -> TableRow:
    """The table row of `cfg`, tuned at T = t in run `run`, serving the bucket `key` (a key
    with a LoRA class, TableRow.key: a row of that class serving T from min_tokens): its
    tiles and the knobs the search decides (LoRA knobs only with LoRA, layout knobs only
    when on)."""
    knobs = _knobs(cfg) if lora and not cfg.decode else {}  # the decode path has no such knobs
    knobs.update({k: True for k in LAYOUT_KNOBS if getattr(cfg, k)})
    if cfg.down_tma:  # the TMA tiles of z need the sorted rows: down_tma implies z_sorted
        knobs["z_sorted"] = True
    if cfg.half_tail and not cfg.decode:
        knobs["half_tail"] = cfg.half_tail
    if cfg.decode and lora:
        knobs["decode_shrink"] = cfg.decode_shrink
    return TableRow(
        shape=key[:4],
        lora=key[4],
        max_tokens=key[5],
        block_m=cfg.block_m,
        up=cfg.up,
        down=cfg.down,
        knobs=knobs,
        tuned_at=t,
        run=run,
        before_ms=before_ms,
        after_ms=after_ms,
        lora_class=key[6] if len(key) > 6 else REFERENCE,
        min_tokens=min_tokens,
    )


def with_kept_rows(rows: list[TableRow], table: dict[tuple, TableRow]) -> list[TableRow]:
    """rows plus every row of `table` (all shapes, not only the tuned one) that they do not
    re-tune, kept as committed (its run, times and note). A kept row of another LoRA class
    than REFERENCE whose T range overlaps a tuned row of its shape and class gives way to
    it (its bucket came from an older REFERENCE row; the class's rows must not overlap)."""
    tuned = {r.key for r in rows}
    return rows + [r for k, r in table.items() if k not in tuned and not _overlaps(r, rows)]


def _overlaps(kept: TableRow, rows: list[TableRow]) -> bool:
    if kept.lora_class == REFERENCE:
        return False  # REFERENCE buckets are fixed up front (table_buckets.Buckets)
    return any(
        (r.shape, r.lora, r.lora_class) == (kept.shape, kept.lora, kept.lora_class)
        and r.min_tokens <= kept.max_tokens
        and kept.min_tokens <= r.max_tokens
        for r in rows
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options; a class tune (--rank / --adapters other than the REFERENCE 16 / 8) is
    LoRA-only and takes the REFERENCE buckets (args.lora_class: the class tuned)."""
    p = argparse.ArgumentParser(description="Tile tuning on this GPU (module docstring).")
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=150)
    p.add_argument("--out", required=True, help="table file to write (JSON, as h200_table.json)")
    p.add_argument("--json", default=None)
    p.add_argument(
        "--table-in",
        default=None,
        help="start from this table file instead of the packaged one (its rows not re-tuned "
        "are kept), e.g. the previous class tune's output",
    )
    p.add_argument(
        "--adapters",
        type=int,
        default=8,
        help=f"LoRA slots L of the bank, token t on slot t %% L; a slot class {SLOT_CLASSES}",
    )
    p.add_argument(
        "--rank",
        type=int,
        default=16,
        help=f"LoRA rank R of the bank (adapters alternate R and R/2); a rank class {RANK_CLASSES}",
    )
    p.add_argument(
        "--search",
        choices=("full", "quick"),
        default="full",
        help="quick: starts, up tiles, BLOCK_M and the LoRA knobs only (search(quick=True))",
    )
    p.add_argument(
        "--lora-only",
        action="store_true",
        help="tune the LoRA rows only (rows not re-tuned are kept from the committed table)",
    )
    p.add_argument(
        "--knobs-only",
        action="store_true",
        help="keep each committed row's tiles and search its knobs only (search_knobs); "
        "decode rows and T without a committed row are skipped",
    )
    p.add_argument(
        "--own-buckets",
        action="store_true",
        help="each tuned T gets its own bucket (upper bound T) instead of the committed "
        "bucket it falls in, e.g. to split a bucket where the decode path wins only below; "
        "T above the largest tuned one keep the committed rows (or the heuristic)",
    )
    args = p.parse_args(argv)
    if args.rank not in RANK_CLASSES:
        p.error(f"--rank {args.rank}: expected a rank class, one of {list(RANK_CLASSES)}")
    if args.adapters not in SLOT_CLASSES:
        p.error(f"--adapters {args.adapters}: expected a slot class, one of {list(SLOT_CLASSES)}")
    args.lora_class = LoRAClass(args.rank, args.adapters)
    if args.lora_class != REFERENCE:
        if args.knobs_only or args.own_buckets:
            p.error(
                f"--knobs-only / --own-buckets with the LoRA class {args.lora_class}: a class "
                "tune searches from its nearest class's row into the REFERENCE buckets; "
                "drop the option (or tune --rank 16 --adapters 8)"
            )
        args.lora_only = True  # a class has LoRA rows only
    return args


def starts(
    t: int, dims: tuple, on: bool, table: Table, args: argparse.Namespace, fit
) -> tuple[TileConfig, TileConfig, tuple]:
    """(chosen, start, other starts) of the search at T: `chosen` the row pick_config gives
    this class (the committed row, its nearest class's, or the heuristic), `start` its
    aligned side, and with LoRA the LoRA-free tiles with start's LoRA knobs, and in a class
    tune the row of every other class holding T (the 32 x 16 tune at T = 16384 started from
    64 x 16's row alone and ended 4% slower than the 8 x 16 row, e2a0cf6 run). `fit` fits a
    class tune's starts to the GPU as a forward fits them (identity otherwise)."""
    lora_class = args.lora_class
    chosen = pick_config(
        t, *dims, lora=on, table=table, rank=lora_class.rank, slots=lora_class.slots
    )
    start = fit(aligned_config(chosen, t, dims[0], dims[1], on))
    # with LoRA, also start from the LoRA-free tiles (their knobs from the rules)
    base = aligned_config(pick_config(t, *dims, table=table), t, dims[0], dims[1], False)
    others = (fit(dataclasses.replace(base, **_knobs(start))),) if on else ()
    if on and lora_class != REFERENCE:
        for c in sorted(r.lora_class for r in table.holding(dims[:4], True, t)):
            if c != lora_class:
                cfg = pick_config(t, *dims, lora=True, table=table, rank=c.rank, slots=c.slots)
                cfg = fit(aligned_config(cfg, t, dims[0], dims[1], True))
                if cfg != start and cfg not in others:
                    others += (cfg,)
    return chosen, start, others


def main() -> int:
    args = parse_args()
    import json

    import triton

    start = time.time()
    lora_class, is_class = args.lora_class, args.lora_class != REFERENCE
    table = H200 if args.table_in is None else load_table(args.table_in)
    model, dims, experts, lora = load_model(args.model, args.adapters, args.rank)
    tokens = [int(t) for t in args.tokens.split(",")]
    header = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        commit=commit(),
        time=time.strftime("%Y-%m-%d"),
        iters=args.iters,
    )
    entries, log = [], []
    modes = (True,) if args.lora_only else (False, True)
    # Rows of the committed table that this run does not re-tune are kept (all shapes, with
    # their notes); a tuned T takes the committed bucket it falls in, split when that
    # bucket's row was measured at another T (table_buckets.Buckets); a class row takes
    # the REFERENCE-class bucket holding its T, unsplit.
    buckets = Buckets(dims, table.by_key(), tokens, header["commit"], () if is_class else modes)

    def key_of(t: int, on: bool) -> tuple:
        if is_class:
            return buckets.class_bucket(t, lora_class)[0]
        return (*dims, on, t) if args.own_buckets else buckets.key(t, on)

    def rows() -> list:
        return with_kept_rows(entries, buckets.table)

    def fit(cfg: TileConfig) -> TileConfig:  # a class tune starts where a forward would
        return fit_like_forward(cfg, model, lora) if is_class else cfg

    for t in tokens:
        layer = Layer(model, experts, lora, t, args.iters)
        for on in modes:
            if time.time() - start > args.budget_s:
                print(f"budget reached: T={t} lora={on} and later keep the heuristic")
                break
            print(f"T={t} lora={on}" + (f" class {lora_class}" if is_class else ""), flush=True)
            if is_class and buckets.class_bucket(t, lora_class) is None:
                print("    no REFERENCE-class LoRA row holds T: tune that class first; skipped")
                continue
            chosen, heur, others = starts(t, dims, on, table, args, fit)
            steps: list = []
            if args.knobs_only:
                committed_row = (
                    (*dims, on, t) in table.by_key()  # --own-buckets: a row bounded at T itself
                    if args.own_buckets
                    else buckets.containing(t, on) is not None
                )
                if chosen.decode or not committed_row:
                    print("    no committed aligned row: skipped (--knobs-only)")
                    continue
                if any(e.key == key_of(t, on) for e in entries):
                    print(f"    T={t} falls in the bucket of an earlier T here: not tuned")
                    continue
                best, h_ms = search_knobs(layer, chosen, on, steps)
                ms = min((s["ms"] for s in steps if s["ms"] is not None), default=float("nan"))
                log.append(dict(T=t, lora=on, steps=steps))
                entries.append(table_row(best, on, key_of(t, on), t, h_ms, ms, header["commit"]))
                write_table(args.out, rows(), header)
                continue
            best, h_ms = search(layer, heur, on, steps, others, quick=args.search == "quick")
            # the decode path competes with the aligned best where its whole bucket is in the
            # decode range (a win measured at T must not stand for larger T unmeasured)
            if key_of(t, on)[5] <= DECODE_MAX_T:
                aligned_ms = min((s["ms"] for s in steps if s["ms"] is not None), default=None)
                dec, dec_ms = search_decode(layer, on, steps, chosen)
                if dec_ms is not None and (aligned_ms is None or dec_ms < aligned_ms):
                    best = dec
            ms = min((s["ms"] for s in steps if s["ms"] is not None), default=float("nan"))
            log.append(dict(T=t, lora=on, lora_class=str(lora_class), steps=steps))
            key = key_of(t, on)
            if any(e.key == key for e in entries):  # two tuned T in one committed bucket
                print(f"    T={t} falls in the bucket of an earlier T here: not written")
                continue
            low = buckets.class_bucket(t, lora_class)[1] if is_class else None
            entries.append(table_row(best, on, key, t, h_ms, ms, header["commit"], low))
            write_table(args.out, rows(), header)  # after each step: a timeout keeps it
        del layer
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(header=header, log=log), f, indent=1)
    print(f"tune: {len(entries)} entries tuned in {time.time() - start:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
