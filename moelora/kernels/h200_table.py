"""H200 tile table: written by benchmarks/tune.py on the GPU, not by hand.

Runs: NVIDIA H200, torch 2.11.0+cu130, triton 3.6.0, 2026-11-30, one row per tune run as
each row's comment says: e30482d (`tune --tokens 1,16`: T = 1 and 16, with and without
LoRA), b8a648a (`tune --lora-only`: the other LoRA rows; that run's stamp read 83e8460
from the device's stale git metadata, and its extra expand_fp16 knob never won and is
gone, KERNEL_LOG.md v7), 9db1f65 (the other LoRA-free rows; base kernels unchanged since).
How chosen: per (shape, LoRA on/off, T) a coordinate search from the heuristic (up
tiles, then down tiles, then BLOCK_M x0.5 / x2, then LoRA knobs; LoRA rows also start
from the LoRA-free tiles); each candidate timed as the whole layer under CUDA-graph
replay, L2 flushed, median of 20 replays, output checked against the reference; fastest
kept. Comments: the run's starting config ms -> chosen ms at that T.

(E, K, H, I, LoRA on, T bucket upper bound) -> (BLOCK_M, up (BLOCK_N, BLOCK_K,
warps, stages), down (same)[, LoRA knobs]).
"""

H200_ROWS: dict[tuple[int, int, int, int, bool, int], tuple] = {
    (128, 8, 2048, 768, False, 4): (
        16,
        (32, 128, 4, 4),
        (32, 128, 4, 3),
    ),  # T=1: 0.0404 -> 0.0397 ms (e30482d run)
    (128, 8, 2048, 768, False, 32): (
        16,
        (32, 128, 4, 4),
        (64, 128, 4, 3),
    ),  # T=16: 0.2320 -> 0.2275 ms (e30482d run)
    (128, 8, 2048, 768, False, 128): (16, (64, 256, 4, 2), (64, 128, 4, 3)),  # kept from 9db1f65
    (128, 8, 2048, 768, False, 512): (32, (64, 128, 4, 2), (256, 128, 8, 2)),  # kept from 9db1f65
    (128, 8, 2048, 768, False, 2048): (128, (128, 64, 8, 4), (256, 64, 8, 4)),  # kept from 9db1f65
    (128, 8, 2048, 768, False, 8192): (128, (128, 64, 8, 4), (256, 64, 8, 4)),  # kept from 9db1f65
    (128, 8, 2048, 768, False, 2147483647): (
        128,
        (128, 64, 8, 4),
        (256, 64, 8, 3),
    ),  # kept from 9db1f65
    (128, 8, 2048, 768, True, 4): (
        16,
        (32, 128, 4, 4),
        (64, 128, 4, 3),
        {"expand_lanes": 16, "shrink_block_m": 64, "shrink_split_k": 8},
    ),  # T=1: 0.0528 -> 0.0515 ms (e30482d run)
    (128, 8, 2048, 768, True, 32): (
        16,
        (32, 128, 4, 4),
        (64, 128, 4, 3),
        {"expand_lanes": 16, "shrink_block_m": 16, "shrink_split_k": 4},
    ),  # T=16: 0.2584 -> 0.2555 ms (e30482d run)
    (128, 8, 2048, 768, True, 128): (
        16,
        (64, 128, 4, 3),
        (128, 128, 4, 2),
        {"expand_lanes": 16, "shrink_block_m": 16, "shrink_split_k": 1},
    ),  # T=64: 0.3675 -> 0.3619 ms (b8a648a run)
    (128, 8, 2048, 768, True, 512): (
        16,
        (64, 128, 4, 2),
        (128, 128, 4, 2),
        {"expand_lanes": 32, "shrink_block_m": 16, "shrink_split_k": 1},
    ),  # T=256: 0.4521 -> 0.4494 ms (b8a648a run)
    (128, 8, 2048, 768, True, 2048): (
        128,
        (128, 64, 8, 4),
        (256, 64, 8, 4),
        {"expand_lanes": 32, "shrink_block_m": 16, "shrink_split_k": 4},
    ),  # T=1024: 0.6373 -> 0.5896 ms (b8a648a run)
    (128, 8, 2048, 768, True, 8192): (
        128,
        (128, 64, 8, 4),
        (256, 64, 8, 4),
        {"expand_lanes": 32, "shrink_block_m": 64, "shrink_split_k": 1},
    ),  # T=4096: 1.0552 -> 1.0497 ms (b8a648a run)
    (128, 8, 2048, 768, True, 2147483647): (
        128,
        (128, 64, 8, 3),
        (256, 64, 8, 4),
        {"expand_lanes": 16, "shrink_block_m": 64, "shrink_split_k": 1},
    ),  # T=16384: 3.2886 -> 3.1221 ms (b8a648a run)
}
