"""--gpu-memory-utilization (vLLM's name): how much KV cache the engine gets.

After the weights and the adapter slot banks are on the GPU, the KV cache takes what is left
of `utilization` x the GPU's memory, less the activation peak of the longest prefill
(measured). On the decode runner the cache is paged and that budget is a number of blocks
of --block-size positions (vLLM's meaning; --max-num-seqs stays the rows running at most);
on transformers' forward it is whole rows of max_len positions, --max-num-seqs capping them.
A probe engine of one row measures the peak and tells which of the two the served engine
keeps (the same `runner` choice); the bytes of one slab row are measured from its cache (any
attention layout: GQA, MLA, sliding windows), those of one block come from the paged
cache's shapes (paged_cache.bytes_per_block).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError

FIX = "raise --gpu-memory-utilization, or lower --max-model-len or --max-lora-rank"


def min_blocks(max_len: int, block_size: int) -> int:
    """The fewest blocks a paged engine takes: one max_len request's and the null block."""
    return -(-max_len // block_size) + 1


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
            f"with the spare), {_left(budget, utilization, total, used, reserve)}", FIX,
        )  # fmt: skip
    return rows


def blocks_for_budget(
    *, total: int, used: int, reserve: int, utilization: float, block_bytes: int, max_len: int,
    block_size: int,
) -> int:  # fmt: skip
    """The paged cache's num_blocks (the null block among them) that fit in
    utilization*total - used - reserve bytes. ConfigError when fewer than one max_len
    request's blocks and the null block fit."""
    budget = int(utilization * total) - used - reserve
    blocks = max(budget, 0) // block_bytes
    need = min_blocks(max_len, block_size)
    if blocks < need:
        raise ConfigError(
            "--gpu-memory-utilization", utilization,
            f"room for at least {need} KV blocks (one request of --max-model-len {max_len} "
            f"fills {need - 1} of --block-size {block_size}, and the null block): "
            f"{block_bytes / 2**20:.2f} MiB each, "
            f"{_left(budget, utilization, total, used, reserve)}", FIX,
        )  # fmt: skip
    return blocks


def _left(budget: int, utilization: float, total: int, used: int, reserve: int) -> str:
    return (f"{max(budget, 0) / 2**20:.1f} MiB left of {utilization} x {total / 2**30:.1f} GiB "
            f"after {used / 2**30:.2f} GiB of weights and banks and {reserve / 2**20:.1f} MiB "
            "kept for activations and any linear-attention states")  # fmt: skip


@dataclass(frozen=True)
class Probe:
    """What a one-row engine measured: whether the served engine's cache is paged, the bytes
    of its unit (one block when paged, else one row of max_len) and the activation peak of
    a max_len - 1 token prompt (0 on a CPU: not measured)."""

    paged: bool
    unit_bytes: int
    peak: int


def measure(
    handle, max_len: int, *, runner: bool | None = None, block_size: int = 16,
    max_num_batched_tokens: int | None = None,
) -> Probe:  # fmt: skip
    """A one-row engine with the served engine's `runner`, `block_size` and prefill budget
    (a paged one of min_blocks blocks), run once on a max_len - 1 token prompt and closed."""
    from ..engine import Engine, Request, Sampling
    from ..engine.paged_cache import bytes_per_block

    cuda = handle.device.type == "cuda"
    probe = Engine(handle, max_rows=1, max_len=max_len, enforce_eager=True, runner=runner,
                   max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                   num_blocks=min_blocks(max_len, block_size),
                   enable_prefix_caching=False)  # fmt: skip
    try:
        paged = probe.pool is not None
        if paged:
            unit = bytes_per_block(handle.model, block_size, probe.dtype)
        else:
            unit = probe.cache.nbytes() // 2  # the row and the spare row
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
    return Probe(paged, unit, peak)


@dataclass(frozen=True)
class KvSize:
    """The engine's max_rows and num_blocks (None: a slab cache, or the engine's default)."""

    rows: int
    num_blocks: int | None


def engine_size(
    handle, max_len: int, max_rows: int, utilization: float, *, runner: bool | None = None,
    block_size: int = 16, max_num_batched_tokens: int | None = None,
    prefix_caching: bool = True,
) -> KvSize:  # fmt: skip
    """The engine's rows and blocks under --gpu-memory-utilization (a GPU only): blocks
    when its cache is paged (max_rows rows), else rows. prefix_caching: the engine's
    (a model with linear-attention layers keeps a state per row beside its blocks)."""
    if handle.device.type != "cuda":
        raise ConfigError(
            "--gpu-memory-utilization", utilization, "a CUDA device to size the KV cache on",
            "leave it out on a CPU: --max-num-seqs and --max-model-len (and on the decode "
            "runner --num-gpu-blocks-override) size the cache",
        )  # fmt: skip
    probe = measure(handle, max_len, runner=runner, block_size=block_size,
                    max_num_batched_tokens=max_num_batched_tokens)  # fmt: skip
    free, total = torch.cuda.mem_get_info(handle.device)
    budget = dict(total=total, used=total - free, reserve=probe.peak, utilization=utilization)
    if probe.paged:  # linear-attention layers' states (Qwen3.5): one per row and the spare,
        # and with prefix caching their snapshots (engine/state_snapshots.py)
        from ..engine.linear_attention import state_bytes
        from ..engine.state_snapshots import snapshot_rows

        dtype = handle.model.get_input_embeddings().weight.dtype
        rows = max_rows + 1 + snapshot_rows(max_rows, prefix_caching)
        budget["reserve"] += state_bytes(handle.model, dtype) * rows
        blocks = blocks_for_budget(**budget, block_bytes=probe.unit_bytes, max_len=max_len,
                                   block_size=block_size)  # fmt: skip
        return KvSize(max_rows, blocks)
    return KvSize(rows_for_budget(**budget, row_bytes=probe.unit_bytes, max_rows=max_rows), None)


def describe(engine, max_len: int, source: str) -> str:
    """The engine's KV cache in one line, and what sized it (`source`: a flag)."""
    gib = engine.cache.nbytes() / 2**30
    pool = engine.pool
    if pool is None:
        return (f"KV cache of {engine.max_rows} rows x {max_len} positions ({gib:.2f} GiB), "
                f"sized by {source}")  # fmt: skip
    tokens = pool.capacity * pool.block_size
    return (f"KV cache of {pool.capacity} blocks x {pool.block_size} positions ({tokens} "
            f"tokens, {gib:.2f} GiB: {tokens / max_len:.2f} requests of --max-model-len "
            f"{max_len} at once; at most --max-num-seqs {engine.max_rows} running), prefix "
            f"caching {'on' if pool.prefix_caching else 'off'}, sized by {source}")  # fmt: skip
