"""H200 tile table: written by benchmarks/tune.py on the GPU, not by hand.

Run: NVIDIA H200, torch 2.11.0+cu130, triton 3.6.0, kernels at commit 9db1f65, 2026-11-30.
How chosen: per (shape, LoRA on/off, T) a coordinate search from the heuristic (up
tiles, then down tiles, then BLOCK_M x0.5 / x2); each candidate timed as the whole
layer under CUDA-graph replay, L2 flushed, median of 20 replays, output
checked against the reference; fastest kept. A T bucket runs from the geometric mean
of its T and the previous tuned T. Comments: heuristic ms -> chosen ms at that T.

(E, K, H, I, LoRA on, T bucket upper bound) -> (BLOCK_M, up (BLOCK_N, BLOCK_K,
warps, stages), down (same)).
"""

H200_ROWS: dict[tuple[int, int, int, int, bool, int], tuple] = {
    (128, 8, 2048, 768, False, 4): (
        16,
        (64, 128, 4, 3),
        (64, 128, 4, 3),
    ),  # T=1: 0.0406 -> 0.0406 ms
    (128, 8, 2048, 768, False, 32): (
        16,
        (64, 256, 4, 2),
        (64, 128, 4, 3),
    ),  # T=16: 0.2239 -> 0.2238 ms
    (128, 8, 2048, 768, False, 128): (
        16,
        (64, 256, 4, 2),
        (64, 128, 4, 3),
    ),  # T=64: 0.3049 -> 0.3043 ms
    (128, 8, 2048, 768, False, 512): (
        32,
        (64, 128, 4, 2),
        (256, 128, 8, 2),
    ),  # T=256: 0.3315 -> 0.3291 ms
    (128, 8, 2048, 768, False, 2048): (
        128,
        (128, 64, 8, 4),
        (256, 64, 8, 4),
    ),  # T=1024: 0.4346 -> 0.3853 ms
    (128, 8, 2048, 768, False, 8192): (
        128,
        (128, 64, 8, 4),
        (256, 64, 8, 4),
    ),  # T=4096: 0.9093 -> 0.7780 ms
    (128, 8, 2048, 768, False, 2147483647): (
        128,
        (128, 64, 8, 4),
        (256, 64, 8, 3),
    ),  # T=16384: 2.9228 -> 2.6283 ms
    (128, 8, 2048, 768, True, 4): (
        16,
        (64, 128, 4, 3),
        (64, 128, 4, 3),
    ),  # T=1: 0.0593 -> 0.0593 ms
    (128, 8, 2048, 768, True, 32): (
        16,
        (64, 128, 4, 3),
        (128, 128, 4, 2),
    ),  # T=16: 0.2731 -> 0.2728 ms
    (128, 8, 2048, 768, True, 128): (
        16,
        (64, 128, 4, 3),
        (128, 128, 4, 2),
    ),  # T=64: 0.4175 -> 0.4165 ms
    (128, 8, 2048, 768, True, 512): (
        32,
        (64, 128, 4, 2),
        (128, 128, 4, 2),
    ),  # T=256: 0.5024 -> 0.4778 ms
    (128, 8, 2048, 768, True, 2048): (
        32,
        (64, 128, 4, 2),
        (128, 128, 4, 2),
    ),  # T=1024: 0.7331 -> 0.6537 ms
    (128, 8, 2048, 768, True, 8192): (
        64,
        (64, 64, 4, 4),
        (128, 64, 4, 4),
    ),  # T=4096: 1.2200 -> 1.2200 ms
    (128, 8, 2048, 768, True, 2147483647): (
        128,
        (128, 64, 8, 4),
        (256, 64, 8, 4),
    ),  # T=16384: 4.0698 -> 3.2180 ms
}
