"""Picked tile configs fitted to the GPU (kernels/device_fit.py): unchanged on the H200
the table was measured on, shrunk to fit elsewhere (fp32 inputs, smaller shared memory),
TMA knobs off below sm_90."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moelora.kernels import configs
from moelora.kernels.configs import DECODE_TILES, GemmTiles, TileConfig, pick_config
from moelora.kernels.device_fit import MARGIN, fit_config, fit_tiles, fit_to_device, stage_bytes

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


def _fits(cfg: TileConfig, parts: int, elem: int, limit: int) -> bool:
    return all(
        t.num_stages * stage_bytes(cfg.block_m, t, p, elem) <= limit - MARGIN
        for t, p in ((cfg.up, parts), (cfg.down, 1))
    )


@pytest.mark.parametrize("parts", [1, 2])
def test_h200_16bit_configs_are_unchanged(parts: int) -> None:
    """What was measured on the H200 runs as measured there: every picked config fits."""
    for cfg in _picked():
        assert fit_config(cfg, parts, 2, H200, tma=True) == cfg


def test_stage_bytes_match_what_triton_allocated_on_the_h200() -> None:
    """The model against the shared memory the compiled H200 rows used (lora_cost at
    afe8054: up 196608 bytes, down 196640 with its TMA barriers)."""
    row = configs.H200_TABLE[(*QWEN3, True, 8192)]
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


def test_decode_and_cpu_configs_are_left_alone() -> None:
    assert fit_config(DECODE_TILES, 2, 4, L40S, tma=False) == DECODE_TILES
    cfg = pick_config(4096, *QWEN3, lora=True)
    assert fit_to_device(cfg, 2, torch.float32, torch.device("cpu")) == cfg


def test_fused_moe_lora_fits_picked_configs_only(monkeypatch) -> None:
    """The forward fits the config it picked (for its dtype, parts and device), and
    launches a caller's explicit config as given."""
    from moelora.activations import Activation
    from moelora.config import MoEShape
    from moelora.kernels import moe_lora
    from moelora.weights import random_expert_weights

    calls = []

    def spy(cfg, parts, dtype, device):
        calls.append((parts, dtype, device.type))
        return cfg

    monkeypatch.setattr(moe_lora, "fit_to_device", spy)
    shape = MoEShape(4, 2, 32, 32, Activation.SILU, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    experts = random_expert_weights(shape, generator=g)
    x = torch.randn(3, 32, generator=g)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)
    w = torch.rand(3, 2, generator=g)
    moe_lora.fused_moe_lora(x, ids, w, None, experts, None, shape)
    assert calls == [(2, torch.float32, "cpu")]
    explicit = TileConfig(16, GemmTiles(32, 32), GemmTiles(32, 32))
    moe_lora.fused_moe_lora(x, ids, w, None, experts, None, shape, config=explicit)
    assert len(calls) == 1


@pytest.mark.parametrize(
    "major,dtype",
    [(9, torch.bfloat16), (9, torch.float32), (8, torch.float32), (0, torch.bfloat16)],
)
def test_fit_to_device_by_capability(monkeypatch, major, dtype) -> None:
    """sm_90+: stages fitted (16-bit configs unchanged, fp32 shrunk to fit), TMA kept;
    below sm_90 (and ROCm, major 0): TMA knobs off, stages left alone."""
    from moelora.kernels import device_fit

    monkeypatch.setattr(device_fit, "_device_limits", lambda index: (H200, major))
    cfg = pick_config(4096, *QWEN3, lora=True)
    assert cfg.up_tma and cfg.down_tma and cfg.up.num_stages == 4  # the H200 row
    got = fit_to_device(cfg, 2, dtype, torch.device("cuda", 0))
    if major < 9:
        assert got == dataclasses.replace(cfg, up_tma=False, down_tma=False)
    elif dtype == torch.bfloat16:
        assert got == cfg
    else:
        assert got.up.num_stages < cfg.up.num_stages and _fits(got, 2, 4, H200)
        assert got.up_tma and got.down_tma
