"""Picked tile configs fitted to the GPU (tiling/fit.py): unchanged on the H200
the table was measured on, shrunk to fit elsewhere (fp32 inputs, LoRA rank 128, smaller
shared memory), TMA knobs off below sm_90.

Run as a script with the interpreter off, this file compiles the fitted worst cases for
sm_90 (tests/sm90_launches.py) and prints each launch's shared memory as JSON; the
compile tests read that."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from sm90_child import run_compile_child

from moelora.call import MoECall
from moelora.device import GpuLimits
from moelora.tiling import heuristic
from moelora.tiling.config import GemmTiles, TileConfig
from moelora.tiling.fit import (
    MARGIN,
    dot_lanes,
    expand_bytes,
    fit_config,
    fit_expand,
    fit_shrink,
    fit_tiles,
    fit_to_device,
    shrink_bytes,
    stage_bytes,
)
from moelora.tiling.heuristic import DECODE_TILES
from moelora.tiling.pick import H200 as H200_TABLE
from moelora.tiling.pick import pick_config

H200 = 232448  # max shared memory per block (opt-in) on an H200 / H100: 227 KB
A100 = 166912  # 163 KB
L40S = 101376  # 99 KB
QWEN3 = (128, 8, 2048, 768)
TOKENS = (1, 2, 4, 8, 16, 64, 256, 1024, 4096, 16384)


def _picked() -> list[TileConfig]:
    """Every config pick_config returns for the Qwen3 shape (the table's rows) and for a
    shape without rows (the heuristics), both modes."""
    shapes = (QWEN3, (8, 2, 4096, 14336), (256, 8, 7168, 2048))
    return [pick_config(t, *s, lora=lora) for s in shapes for t in TOKENS for lora in (0, 1)]


def _fits(cfg: TileConfig, parts: int, elem: int, limit: int, rank: int = 0, slots: int = 0):
    """Every phase of the stage model within limit - MARGIN (the expand and the shrink with
    LoRA, rank > 0)."""
    phases = [
        t.num_stages * stage_bytes(cfg.block_m, t, p, elem)
        for t, p in ((cfg.up, parts), (cfg.down, 1))
    ]
    if rank:
        lanes = dot_lanes(cfg, rank, slots)
        phases += [
            expand_bytes(cfg.block_m, t.block_n, lanes, p, elem, cfg.expand_first)
            for t, p in ((cfg.up, parts), (cfg.down, 1))
        ]
        phases.append(shrink_bytes(cfg, parts, elem, rank))
    return max(phases) <= limit - MARGIN


@pytest.mark.parametrize("parts", [1, 2])
def test_h200_16bit_configs_are_unchanged(parts: int) -> None:
    """What was measured on the H200 runs as measured there: every picked config fits."""
    for cfg in _picked():
        assert fit_config(cfg, parts, 2, H200, tma=True) == cfg


def test_stage_bytes_match_what_triton_allocated_on_the_h200() -> None:
    """The model against the shared memory the compiled H200 rows used (lora_cost at
    afe8054: up 196608 bytes, down 196640 with its TMA barriers)."""
    row = H200_TABLE.by_key()[(*QWEN3, True, 8192)].config()
    assert row.up.num_stages * stage_bytes(row.block_m, row.up, 2, 2) == 196608
    assert 196640 - MARGIN <= row.down.num_stages * stage_bytes(row.block_m, row.down, 1, 2)


@pytest.mark.parametrize(
    "elem,limit,tma", [(4, H200, True), (2, A100, False), (4, A100, False), (2, L40S, False)]
)
@pytest.mark.parametrize("parts", [1, 2])
def test_fit_config_fits_the_stage_model(elem, limit, tma, parts) -> None:
    """fit_config itself, for any limit: the result fits the model and only the pipeline
    (and, without tma, the TMA knobs) changes. The forward applies it on sm_90+ only."""
    shrunk = 0
    for cfg in _picked():
        got = fit_config(cfg, parts, elem, limit, tma)
        if cfg.decode:
            assert got == cfg
            continue
        assert _fits(got, parts, elem, limit), (cfg, got)
        for before, after in ((cfg.up, got.up), (cfg.down, got.down)):
            assert after.block_n == before.block_n and after.num_warps == before.num_warps
            assert after.num_stages <= before.num_stages and after.block_k <= before.block_k
            shrunk += after != before
        # only the pipeline and the TMA knobs change
        same = dataclasses.replace(got, up=cfg.up, down=cfg.down)
        assert same == (cfg if tma else dataclasses.replace(cfg, up_tma=False, down_tma=False))
        assert tma or not (got.up_tma or got.down_tma)
    assert shrunk  # these limits / dtypes do need smaller pipelines under the model


def test_fit_tiles_order_and_floor() -> None:
    """Stages go first, then BLOCK_K halves; at 1 stage of 16 it stops (no endless loop)."""
    tiles = GemmTiles(128, 64, 8, 4)
    per_stage = stage_bytes(128, tiles, 2, 2)  # 48 KB
    assert fit_tiles(128, tiles, 2, 2, 3 * per_stage + MARGIN).num_stages == 3
    one = fit_tiles(128, tiles, 2, 2, per_stage // 2 + MARGIN)
    assert (one.num_stages, one.block_k) == (1, 32)
    assert fit_tiles(128, tiles, 2, 2, 0) == GemmTiles(128, 16, 8, 1)


RANKS = (8, 16, 32, 64, 128)
SLOTS = (1, 2, 8, 32)


def _only_shrunk(cfg: TileConfig, got: TileConfig) -> bool:
    """Only the knobs the fit reduces moved, each downwards (expand_first: on to off)."""
    tiles_ok = all(
        after.num_warps == before.num_warps
        and after.block_n <= before.block_n
        and after.block_k <= before.block_k
        and after.num_stages <= before.num_stages
        for before, after in ((cfg.up, got.up), (cfg.down, got.down))
    )
    knobs_ok = (
        got.expand_lanes <= cfg.expand_lanes
        and got.expand_first <= cfg.expand_first
        and got.shrink_block_k <= cfg.shrink_block_k
    )
    fitted = ("up", "down", "expand_lanes", "expand_first", "shrink_block_k")
    rest = dataclasses.replace(got, **{k: getattr(cfg, k) for k in fitted})
    return tiles_ok and knobs_ok and rest == cfg


@pytest.mark.parametrize("elem", [2, 4], ids=["16-bit", "fp32"])
@pytest.mark.parametrize("parts", [1, 2])
def test_fit_config_with_lora_fits_every_phase(elem, parts) -> None:
    """Every picked config at LoRA rank 8-128 with 1-32 slots, fitted to the H200: every
    phase (pipelines, expand, shrink) fits the model, and only the fitted knobs moved,
    downwards."""
    for cfg in _picked():
        for rank in RANKS:
            for slots in SLOTS:
                got = fit_config(cfg, parts, elem, H200, True, rank=rank, num_slots=slots)
                if cfg.decode:
                    assert got == cfg
                    continue
                assert _fits(got, parts, elem, H200, rank, slots), (cfg, got, rank, slots)
                assert _only_shrunk(cfg, got), (cfg, got)


@pytest.mark.parametrize("rank", [8, 16, 32, 64])
def test_h200_16bit_configs_with_lora_are_unchanged(rank) -> None:
    """16-bit with LoRA up to rank 64 (the table was tuned at 16), 1-32 slots: every picked
    config runs as measured."""
    for cfg in _picked():
        for slots in SLOTS:
            for parts in (1, 2):
                assert fit_config(cfg, parts, 2, H200, True, rank=rank, num_slots=slots) == cfg


def test_h200_16bit_rank_128_turns_expand_first_off_only() -> None:
    """16-bit at rank 128: a pipelined expand in a 128-row block does not fit (the Qwen3
    T >= 4096 rows: 262144 bytes in the up GEMM's sm_90 compile, SM90_CASES); the fit turns
    expand_first off and changes nothing else; every other picked config stays as is."""
    changed = 0
    for cfg in _picked():
        got = fit_config(cfg, 2, 2, H200, True, rank=128, num_slots=8)
        if got != cfg:
            assert got == dataclasses.replace(cfg, expand_first=False), (cfg, got)
            changed += 1
    row = pick_config(4096, *QWEN3, lora=True)
    assert row.expand_first and changed
    assert not fit_config(row, 2, 2, H200, True, rank=128, num_slots=8).expand_first


def test_fit_expand_order_and_floor() -> None:
    """Slots per dot go first, then expand_first (16-bit only), then the BLOCK_N of the
    GEMM that does not fit; at BLOCK_N 16 it stops."""
    cfg = TileConfig(128, GemmTiles(128, 64, 8, 4), GemmTiles(256, 64, 8, 4), expand_first=True)
    wide = dataclasses.replace(cfg, expand_lanes=128)  # 8 slots of rank 16 per dot
    assert fit_expand(wide, 2, 4, H200, 16, 8) == dataclasses.replace(cfg, expand_lanes=64)
    assert fit_expand(cfg, 2, 2, H200, 128, 8) == dataclasses.replace(cfg, expand_first=False)
    # fp32: the pipelined and the plain expand hold the same bytes, so the up BLOCK_N halves
    # (down: 128 x (128 + 256) lanes x 4 bytes fits)
    got = fit_expand(cfg, 2, 4, H200, 128, 8)
    assert got == dataclasses.replace(cfg, up=GemmTiles(64, 64, 8, 4))
    floor = fit_expand(cfg, 2, 4, 0, 128, 8)
    assert (floor.up.block_n, floor.down.block_n, floor.expand_first) == (16, 16, True)


def test_fit_shrink_halves_its_block_k() -> None:
    cfg = dataclasses.replace(pick_config(4096, *QWEN3, lora=True), shrink_block_k=256)
    assert cfg.shrink_block_m == 64
    # R = 128 runs in rank chunks of 32 lanes, both parts per program (64 lanes): fp32 is
    # 2 copies of (64 + 64) x 256 x 4 bytes, over the H200's; 16-bit 3 x 128 x 256 x 2 fits
    assert fit_shrink(cfg, 2, 4, H200, 128).shrink_block_k == 128
    assert fit_shrink(cfg, 2, 2, H200, 128) == cfg
    assert fit_shrink(cfg, 2, 4, 0, 128).shrink_block_k == 16
    assert fit_shrink(cfg, 2, 2, H200, 16) == cfg  # fits: 3 x (64 + 32) x 256 x 2 bytes
    # the expanding shrink needs the whole rank in one program: 128 lanes of one part
    whole = dataclasses.replace(cfg, lora_delta=True, shrink_expand=True)
    assert fit_shrink(whole, 2, 2, H200, 128).shrink_block_k == 128


def test_decode_and_cpu_configs_are_left_alone() -> None:
    assert fit_config(DECODE_TILES, 2, 4, L40S, tma=False) == DECODE_TILES
    cfg = pick_config(4096, *QWEN3, lora=True)
    assert fit_to_device(cfg, 2, torch.float32, None) == cfg  # no GPU: gpu_limits is None


def test_fused_moe_lora_fits_picked_configs_only(monkeypatch) -> None:
    """The forward fits the config it picked (for its dtype, parts and the GPU's limits:
    none on cpu), and launches a caller's explicit config as given."""
    from moelora.activations import Activation
    from moelora.backends import triton as moe_lora
    from moelora.config import MoEShape
    from moelora.weights import random_expert_weights, random_lora_bank

    calls = []

    def spy(cfg, parts, dtype, limits, **lora):
        calls.append((parts, dtype, "cpu" if limits is None else limits, lora))
        return cfg

    monkeypatch.setattr(moe_lora, "fit_to_device", spy)
    shape = MoEShape(4, 2, 32, 32, Activation.SILU, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    experts = random_expert_weights(shape, generator=g)
    x = torch.randn(3, 32, generator=g)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)
    w = torch.rand(3, 2, generator=g)
    moe_lora.fused_moe_lora(MoECall(x, ids, w, None, None), experts, shape)
    assert calls == [(2, torch.float32, "cpu", dict(rank=0, num_slots=0))]
    # with LoRA: the bank's B rank (its largest adapter's, zero-padded) and its slot count
    bank = random_lora_bank(shape, 3, 24, ranks=[24, 8, 16], generator=g)
    slots = torch.tensor([0, 2, -1], dtype=torch.int32)
    moe_lora.fused_moe_lora(MoECall(x, ids, w, slots, bank), experts, shape)
    assert calls[1] == (2, torch.float32, "cpu", dict(rank=24, num_slots=3))
    explicit = TileConfig(16, GemmTiles(32, 32), GemmTiles(32, 32))
    moe_lora.fused_moe_lora(MoECall(x, ids, w, None, None), experts, shape, config=explicit)
    assert len(calls) == 2


@pytest.mark.parametrize(
    "major,dtype",
    [(9, torch.bfloat16), (9, torch.float32), (8, torch.float32), (0, torch.bfloat16)],
)
def test_fit_to_device_by_capability(major, dtype) -> None:
    """sm_90+: stages fitted (16-bit configs unchanged, fp32 shrunk to fit), TMA kept;
    below sm_90 (and ROCm, major 0): TMA knobs off, and the same fit (the H200 limit
    here, so the 16-bit config keeps its stages)."""
    cfg = pick_config(4096, *QWEN3, lora=True)
    assert cfg.up_tma and cfg.down_tma and cfg.up.num_stages == 4  # the H200 row
    got = fit_to_device(cfg, 2, dtype, GpuLimits(H200, major))
    if dtype == torch.bfloat16:
        assert got == (
            cfg if major >= 9 else dataclasses.replace(cfg, up_tma=False, down_tma=False)
        )
    else:
        assert got.up.num_stages < cfg.up.num_stages and _fits(got, 2, 4, H200)
        assert (got.up_tma and got.down_tma) == (major >= 9)


@pytest.mark.parametrize("limit", [L40S, A100])
def test_below_sm90_the_heuristic_and_table_tiles_are_fitted(limit) -> None:
    """An sm_8x GPU (L40S 99 KB, A100 163 KB per block) gets the stages fitted too:
    Triton multi-buffers these loops there as well (review: 147456 bytes compiled for
    sm_80 / 89 at the BLOCK_M 128 tiles in bf16), so nothing is left as picked."""
    cuda = GpuLimits(limit, 8)
    for cfg in (heuristic.heuristic(200.0), pick_config(4096, *QWEN3, lora=True)):
        for dtype in (torch.bfloat16, torch.float32):
            got = fit_to_device(cfg, 2, dtype, cuda, rank=16, num_slots=8)
            assert not (got.up_tma or got.down_tma)
            assert _fits(got, 2, dtype.itemsize, limit, 16, 8)
            if limit == L40S:  # 4 stages of the 128 x 64 x (2 x 128) up tiles: 196608
                assert got.up.num_stages < cfg.up.num_stages
    # fp32 at rank 128 on the L40S: the up GEMM's two [128, 128] fp32 intermediates alone
    # (131072 bytes) overflow at any BLOCK_N, so the last lever halves BLOCK_M
    got = fit_to_device(heuristic.heuristic(200.0), 2, torch.float32, cuda, rank=128, num_slots=8)
    assert _fits(got, 2, 4, limit, 128, 8)
    assert (got.block_m < 128) == (limit == L40S)


def test_fit_to_device_fits_the_lora_bank() -> None:
    """The bank's rank and slots reach the fit (sm_90, fp32, rank 128: the up BLOCK_N
    halves for the expand); a rank without slots is refused, naming the fix."""
    cfg = pick_config(4096, *QWEN3, lora=True)
    cuda = GpuLimits(H200, 9)
    got = fit_to_device(cfg, 2, torch.float32, cuda, rank=128, num_slots=8)
    assert got.up.block_n == cfg.up.block_n // 2 and _fits(got, 2, 4, H200, 128, 8)
    assert fit_to_device(cfg, 2, torch.float32, cuda).up.block_n == cfg.up.block_n
    with pytest.raises(ValueError, match="num_slots"):
        fit_config(cfg, 2, 4, H200, True, rank=16)


# sm_90 compiles (tests/sm90_launches.py) of the fitted worst cases, LoRA rank 128, 8 slots,
# fitted to the H200: case -> (dtype, T, changes to the picked Qwen3 config, the kernels
# compiled: each one's first launch; the shrink's is of x, which has the z shrink's tiles
# or larger)
UP, DOWN, SHRINK = "_expert_up_kernel", "_expert_down_kernel", "_lora_shrink_kernel"
SM90_CASES = {
    # fp32 up GEMM, pipelined expand + up TMA, 4 stages; the shrink at its largest picked
    # tiles (64 rows)
    "fp32-T4096": ("fp32", 4096, {}, (UP, DOWN, SHRINK)),
    # fp32 up GEMM without TMA, 16 expand lanes, 3 stages
    "fp32-T16384": ("fp32", 16384, {}, (UP, DOWN)),
    # 16-bit: the up GEMM's pipelined expand (the rest is the table's, unchanged)
    "bf16-T4096": ("bf16", 4096, {}, (UP,)),
    # the expanding shrink (lora_delta, shrink_expand) with 256-wide K steps
    "fp32-T4096-shrink-k256": (
        "fp32",
        4096,
        dict(shrink_block_k=256, lora_delta=True, shrink_expand=True),
        (SHRINK,),
    ),
}
# the launch compiled as picked too, where it overflows (so these cases need the fit, and
# the compile test fails without it): fp32 expand 327736 bytes (fp32-T16384: 262144, not
# compiled, 8 s), 16-bit expand 262144, shrink 393216
SM90_PICKED = {"fp32-T4096": UP, "bf16-T4096": UP, "fp32-T4096-shrink-k256": SHRINK}
SM90_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _sm90_jobs() -> list[tuple[str, str, int]]:
    """(case, "fitted" / "picked", launch index) of every launch to compile."""
    from sm90_launches import forward_launches

    jobs = []
    for case, (dtype, _, _, kernels) in SM90_CASES.items():
        for label, cfg in _sm90_configs(case).items():
            names = [fn.__name__ for fn, _ in forward_launches(cfg, SM90_DTYPES[dtype], 128, 8)]
            if label == "fitted":
                jobs += [(case, label, names.index(kernel)) for kernel in kernels]
            elif case in SM90_PICKED:
                jobs.append((case, label, names.index(SM90_PICKED[case])))
    return jobs


def _sm90_configs(case: str) -> dict[str, TileConfig]:
    dtype, tokens, change, _ = SM90_CASES[case]
    picked = dataclasses.replace(pick_config(tokens, *QWEN3, lora=True), **change)
    elem = SM90_DTYPES[dtype].itemsize
    fitted = fit_config(picked, 2, elem, H200, True, rank=128, num_slots=8)
    return {"fitted": fitted, "picked": picked}


def _sm90_compile(job: tuple[str, str, int]) -> tuple[str, int]:
    """('case/label/kernel#index', shared bytes) of one launch."""
    from sm90_launches import forward_launches, shared_bytes

    case, label, index = job
    cfg = _sm90_configs(case)[label]
    fn, kwargs = forward_launches(cfg, SM90_DTYPES[SM90_CASES[case][0]], 128, 8)[index]
    return f"{case}/{label}/{fn.__name__}#{index}", shared_bytes(fn, kwargs)


@pytest.fixture(scope="module")
def sm90_shared() -> dict:
    return run_compile_child(__file__)


def test_fitted_worst_cases_fit_the_h200_when_compiled_for_sm90(sm90_shared) -> None:
    fitted = {k: v for k, v in sm90_shared.items() if "/fitted/" in k}
    assert len(fitted) == sum(len(case[3]) for case in SM90_CASES.values())
    assert {k: v for k, v in fitted.items() if v > H200} == {}


def test_worst_cases_overflow_as_picked(sm90_shared) -> None:
    """The SM90_PICKED launches, compiled as picked, need more than the H200 has: without
    the fit the test above fails."""
    picked = {k: v for k, v in sm90_shared.items() if "/picked/" in k}
    assert len(picked) == len(SM90_PICKED)
    assert all(v > H200 for v in picked.values()), picked


if __name__ == "__main__":
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import moelora

    # two workers (the compiles are single-threaded), spawned: a worker forked from this
    # process after its torch calls can hang on a lock held at the fork
    spawn = multiprocessing.get_context("spawn")
    # the longest compiles first (fp32, and the picked tiles: 4-9 s each, the rest 1-6 s),
    # so that both workers end together
    jobs = sorted(
        _sm90_jobs(), key=lambda job: (SM90_CASES[job[0]][0] != "fp32", job[1] != "picked")
    )
    with ProcessPoolExecutor(max_workers=2, mp_context=spawn) as pool:
        out = dict(pool.map(_sm90_compile, jobs))
    out["moelora"] = os.path.abspath(moelora.__file__)
    print(json.dumps(out))
