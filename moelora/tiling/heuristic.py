"""Tile configs for shapes and token counts the H200 table has no row for, and the LoRA
rules a table row falls back on for the knobs it does not set.

m = T*K/E is the expected number of (token, expert) pairs per expert under uniform
routing. Each constant says how it was chosen; the measurements are docs/history/kernel_log.md's.
"""

from __future__ import annotations

import dataclasses

from .config import GemmTiles, TileConfig

# The decode path's starting tiles (the Qwen3 T = 1 tune's choice, 7c66a6a and b7d7a88
# runs): where benchmarks/tune.py starts its decode search. Off the table the decode path
# is never picked: with these tiles it lost on other shapes (docs/history/kernel_log.md v9).
DECODE_TILES = TileConfig(
    16, GemmTiles(2, 2048, 4, 1), GemmTiles(2, 256, 4, 1), decode=True, decode_shrink=(1, 2048)
)


def heuristic(pairs_per_expert: float) -> TileConfig:
    """LoRA-free tiles by m.

    BLOCK_M: the power of two >= 1.5 m (1.5 covers the busier experts), from 16 (the
    smallest dot) to 128, so most experts fit one block and their weights are read once:
    below m ~ 184 (the H200 ridge) the layer is weight-bandwidth bound, and v1's 32 rows
    at m = 64 measured 2.3x the floor at T = 1024 (docs/history/kernel_log.md v1, v2).
    BLOCK_N x BLOCK_K: 64 x 128 at small m (weight streaming, 256-byte rows), the Triton
    tutorial's 4 warps / 3 stages; BLOCK_M 64: 64 x 64 up (two accumulators when gated)
    and 128 x 64 down, 4 stages; BLOCK_M 128: up 128 x 64, down 256 x 64, 8 warps, 4
    stages, z sorted with the down GEMM's tiles by TMA: the tiles the H200 tunes of
    Qwen3-30B-A3B and Mixtral-8x7B had chosen at every T >= 1024 when this rule was set
    (docs/history/kernel_log.md v18: Mixtral T = 4096 +LoRA 6.99 ms with the older 64 x 64 / 128 x 64
    tiles, 5.77 tuned).
    """
    block_m = 16
    while block_m < 128 and block_m < 1.5 * pairs_per_expert:
        block_m *= 2
    if block_m <= 32:
        return TileConfig(block_m, GemmTiles(64, 128), GemmTiles(64, 128))
    if block_m == 64:
        return TileConfig(64, GemmTiles(64, 64, 4, 4), GemmTiles(128, 64, 4, 4))
    return TileConfig(
        128, GemmTiles(128, 64, 8, 4), GemmTiles(256, 64, 8, 4), z_sorted=True, down_tma=True
    )


def lora_heuristic(pairs_per_expert: float) -> TileConfig:
    """Tiles with LoRA by m. BLOCK_M also sets how many slots share a block, and the
    in-GEMM expand loops over them with full-block dots: below m = 48 smaller blocks
    measured faster on the H200 (docs/history/kernel_log.md v1 vs v2, LoRA keeps v1's steps there);
    from m = 64 on, since the v7 shrink and expand, the LoRA-free tiles won (v7 tune at
    T = 1024 / 4096 / 16384)."""
    if pairs_per_expert >= 48:
        return heuristic(pairs_per_expert)
    if pairs_per_expert < 24:
        return TileConfig(16, GemmTiles(64, 128), GemmTiles(64, 128))
    return TileConfig(32, GemmTiles(64, 128), GemmTiles(64, 128))


def shrink_block_m_rule(pairs_per_expert: float) -> int:
    """Rows of a LoRA shrink tile. A tile is a run of one (expert, slot) bucket, m/L rows on
    average at L adapters: 16 rows (the smallest dot) up to m = 256, 32 up to 1024, then
    64, so a bucket is one or two tiles at 8 adapters. Reasoned; the H200 tunes chose
    16-64 per T (docs/history/kernel_log.md v7)."""
    for max_m, rows in ((256, 16), (1024, 32)):
        if pairs_per_expert < max_m:
            return rows
    return 64


def shrink_split_rule(pairs: int) -> int:
    """K chunks of the LoRA shrink: 8 / 4 / 2 / 1 for P = T*K pairs <= 2048 / 8192 / 32768
    / above, so the shrink grid reaches thousands of programs at small T while the fp32
    atomic traffic (P * S*R * 4 bytes per chunk) stays a few MB. Predicted from the v5
    numbers, then measured against split 1 on the H200 (docs/history/kernel_log.md v6)."""
    for max_pairs, split in ((2048, 8), (8192, 4), (32768, 2)):
        if pairs <= max_pairs:
            return split
    return 1


def lora_rules(num_tokens: int, num_experts: int, top_k: int) -> dict:
    """The LoRA knobs set by rule (a table row's own knobs override them)."""
    return dict(
        shrink_split_k=shrink_split_rule(num_tokens * top_k),
        shrink_block_m=shrink_block_m_rule(num_tokens * top_k / num_experts),
    )


def off_table_config(num_tokens: int, num_experts: int, top_k: int, lora: bool) -> TileConfig:
    """The heuristic config with the LoRA rules applied: what a shape without a table row
    runs. The other knobs keep TileConfig's defaults (off)."""
    m = num_tokens * top_k / num_experts
    if not lora:
        return heuristic(m)
    return dataclasses.replace(lora_heuristic(m), **lora_rules(num_tokens, num_experts, top_k))


def aligned_config(cfg: TileConfig, num_tokens: int, num_experts: int, top_k: int, lora: bool):
    """cfg itself on the aligned path; for a decode cfg, the config the aligned path would
    take off the table: what the tune and the decode A/B compare against. (A decode row's
    own LoRA knobs are not tuned.)"""
    if not cfg.decode:
        return cfg
    return off_table_config(num_tokens, num_experts, top_k, lora)
