"""H200 tile table: written by benchmarks/tune.py on the GPU, not by hand (empty until a run).

(E, K, H, I, LoRA on, T bucket upper bound) -> (BLOCK_M, up (BLOCK_N, BLOCK_K, warps,
stages), down (same)).
"""

H200_ROWS: dict[tuple[int, int, int, int, bool, int], tuple] = {}
