"""--gpu-memory-utilization (vLLM's name): how many rows of KV cache the engine gets.

After the weights and the adapter slot banks are on the GPU, the KV cache takes what is left
of `utilization` x the GPU's memory, less the activation peak of the longest prefill
(measured), in whole rows of max_len positions; --max-num-seqs caps it. The bytes of one row
are measured too: a one-row engine allocates its cache (one row and the spare row padding
writes) and reports it, for any attention layout (GQA, MLA, sliding windows).
"""

from __future__ import annotations

import torch

from ..errors import ConfigError


def rows_for_budget(
    *, total: int, used: int, reserve: int, utilization: float, row_bytes: int, max_rows: int
) -> int:
    """Rows that fit in utilization*total - used - reserve bytes, at most max_rows; the
    engine keeps one spare row besides them. ConfigError when not one row fits."""
    budget = int(utilization * total) - used - reserve
    rows = min(max_rows, budget // row_bytes - 1)
    if rows < 1:
        raise ConfigError(
            "--gpu-memory-utilization", utilization,
            f"room for the KV cache of at least one row: {row_bytes / 2**20:.1f} MiB each (two "
            f"with the spare), {max(budget, 0) / 2**20:.1f} MiB left of {utilization} x "
            f"{total / 2**30:.1f} GiB after {used / 2**30:.2f} GiB of weights and banks and "
            f"{reserve / 2**20:.1f} MiB of activations",
            "raise --gpu-memory-utilization, or lower --max-model-len or --max-lora-rank",
        )  # fmt: skip
    return rows


def measure(handle, max_len: int) -> tuple[int, int]:
    """(bytes of one KV row of max_len positions, activation peak of a max_len - 1 token
    prefill): a one-row engine, run once and closed. On a CPU the peak is 0 (not measured)."""
    from ..engine import Engine, Request, Sampling

    cuda = handle.device.type == "cuda"
    probe = Engine(handle, max_rows=1, max_len=max_len, enforce_eager=True)
    try:
        row_bytes = probe.cache.nbytes() // 2  # the row and the spare row
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if cuda else 0
        probe.add(Request("kv-probe", (0,) * (max_len - 1), None, Sampling(max_new_tokens=1)))
        while probe.has_work:
            probe.step()
        peak = torch.cuda.max_memory_allocated() - before if cuda else 0
    finally:
        probe.close()
    del probe
    if cuda:
        torch.cuda.empty_cache()
    return row_bytes, peak


def engine_rows(handle, max_len: int, max_rows: int, utilization: float) -> int:
    """The engine's max_rows under --gpu-memory-utilization (a GPU only)."""
    if handle.device.type != "cuda":
        raise ConfigError(
            "--gpu-memory-utilization", utilization, "a CUDA device to size the KV cache on",
            "leave it out on a CPU: --max-num-seqs and --max-model-len size the cache",
        )  # fmt: skip
    row_bytes, reserve = measure(handle, max_len)
    free, total = torch.cuda.mem_get_info(handle.device)
    return rows_for_budget(
        total=total, used=total - free, reserve=reserve, utilization=utilization,
        row_bytes=row_bytes, max_rows=max_rows,
    )  # fmt: skip
