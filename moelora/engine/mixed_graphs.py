"""Unified steps (the running rows' decode tokens beside prompt chunks, vLLM V1's batch) as CUDA
graphs, one per bucket of tokens, so that a step carrying a prompt is not bound by Python
launches either.

Measured on the H200 (BENCHMARKS.md, "Prompt chunks beside decodes"): with 64 rows decoding,
an eager step with a 16-token chunk took 16.7 ms on 8 layers of Qwen3-30B-A3B's shape against
4.7 ms for the replayed decode-only step, its kernels busy 4.1 ms: the host's launches
(~1.5 ms a layer) were the step. Under a serving load nearly every step carries a chunk.

A step of T tokens (decodes and chunks, packed: runner.packed) replays the graph of the
smallest bucket >= T (BUCKETS, capped by the step's token budget); the tokens past T are
padding: token 0 at positions 0, 1, ... of the spare block-table row (all null blocks, what
padding decode rows write), slot -1, in sequences of at most max_len tokens, so every
padded token attends over finite values and writes only the null block. The varlen table
is padded to a fixed grid (kernels/prefill_attention.py: programs past the real ones take an
empty sequence) and the logits are those of a fixed number of sequence ends (the real
prompts' first, then index 0). Larger steps, prompt-logprob prefills and the one-row
retries after a failure run eagerly. A bucket whose capture fails runs eagerly from then on
(logged).
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from .. import cuda_graphs
from ..kernels.prefill_attention import VarlenTable, block_size, programs_for, varlen_table
from ..lora.rows import RowAdapters
from . import step_graphs

log = logging.getLogger("moelora.engine")

# token buckets: where the measured eager step was host-bound (up to ~1-2k tokens beside 64
# decoding rows); a larger step's kernels outlast its launches
BUCKETS = (128, 256, 512, 1024, 2048)
# A step's fixed cost (reading the weights) in tokens of its per-token cost: 8 layers of
# Qwen3-30B-A3B's shape beside 64 decoding rows took ~6 ms + ~5 us a token on the H200
# (mixed_step, 22nd session: buckets 128 / 512 / 2048 in 6.5 / 9.1 / 16.0 ms). Reasoned
# from that one measurement, not tuned.
STEP_FIXED_TOKENS = 1200


def fit_to_bucket(buckets: tuple[int, ...], tokens: int, least: int) -> int:
    """The tokens a graphed step of `tokens` real ones should carry (more than `least`, its
    decode tokens): the bucket below when its prompt tokens per unit of step cost beat
    those of the bucket above with its padding (cost ~ bucket + STEP_FIXED_TOKENS); the
    tokens cut wait for the next step. 16 decoding rows beside a 512-token chunk (528
    tokens) then run the 512 bucket, not the 1024 one (the 22nd session's long-prompt
    steps, ~56 ms)."""
    if tokens > buckets[-1] or tokens in buckets:
        return tokens
    above = min(b for b in buckets if b > tokens)
    below = max((b for b in buckets if b < tokens), default=0)
    if below <= least:
        return tokens
    gain = (below - least) * (above + STEP_FIXED_TOKENS)
    return below if gain > (tokens - least) * (below + STEP_FIXED_TOKENS) else tokens


def buckets_for(budget: int) -> tuple[int, ...]:
    """The token buckets of an engine whose steps carry at most `budget` tokens."""
    return tuple(sorted({*(b for b in BUCKETS if b < budget), min(budget, BUCKETS[-1])}))


class MixedGraphs:
    """The static buffers and graphs of an engine's steps with prompt chunks on the runner."""

    def __init__(self, engine, budget: int) -> None:
        self.runner, self.max_len = engine.runner, engine.max_len
        self.cache, self.table = engine.cache, engine._table
        self.spare = engine.max_rows  # the block-table row of null blocks
        self.snapshot = engine._base.snapshot
        self.buckets = buckets_for(budget)
        top, dev = self.buckets[-1], engine.device
        # real sequences (one per row), padding pieces of max_len, the empty one
        self.sequences = engine.max_rows + -(-top // self.max_len) + 1
        self.ids = torch.zeros(top, dtype=torch.long, device=dev)
        self.positions = torch.zeros(top, dtype=torch.long, device=dev)
        self.write_rows = torch.full((top,), self.spare, dtype=torch.long, device=dev)
        self.slots = torch.full((top,), -1, dtype=torch.int32, device=dev)
        self.token_slots = torch.full((top,), -1, dtype=torch.int32, device=dev)
        self.last = torch.zeros(self.sequences, dtype=torch.long, device=dev)
        self.spans = torch.zeros(4, self.sequences, dtype=torch.int32, device=dev)
        self.spans_blocks = torch.zeros(2, self._programs(top), dtype=torch.int32, device=dev)
        self.graphs = step_graphs.StepGraphs(
            engine.max_rows, self.step, self.buckets, "prompt-step graph of %d tokens"
        )
        self._eager: set[tuple[int, frozenset[str]]] = set()  # whose capture failed

    def fits(self, tokens: int) -> bool:
        return tokens <= self.buckets[-1]

    def run(self, prompts: list[list[int]], starts: list[int], rows: list[int],
            slots: list[int], modules: frozenset[str]) -> Tensor | None:  # fmt: skip
        """Logits [len(prompts), V] of each prompt's last token (prompts: token lists at
        positions starts[i].. of block-table rows rows[i], adapter slots slots[i]), from the
        graph of the step's bucket; None when that bucket's capture failed (run it eagerly)."""
        bucket = self.graphs.bucket(sum(len(p) for p in prompts))
        if (bucket, modules) in self._eager:
            return None
        self._fill(bucket, prompts, starts, rows, slots)
        try:
            return self.graphs.run(bucket, modules)[: len(prompts)]
        except step_graphs.CaptureFailed as err:
            log.warning("%s; that bucket runs eagerly from now on", err)
            self._eager.add((bucket, modules))
            return None

    def capture_all(self, modules: frozenset[str]) -> step_graphs.CaptureReport:
        """Capture every bucket now, from padding-only steps (nothing may run)."""
        return self.graphs.capture_all(self.prepare, modules)

    def prepare(self, bucket: int) -> None:
        """The static buffers for a padding-only step of `bucket` tokens."""
        self._fill(bucket, [], [], [], [])

    def _programs(self, bucket: int) -> int:
        return programs_for(bucket, self.sequences, self.runner.group)

    def _fill(self, bucket: int, prompts, starts, rows, slots) -> None:
        """The static buffers for a step of `bucket` tokens: the prompts, then padding."""
        lengths = [len(p) for p in prompts]
        pad, pieces = bucket - sum(lengths), []
        while pad > 0:
            pieces.append(min(pad, self.max_len))
            pad -= pieces[-1]
        ids = [t for p in prompts for t in p] + [0] * (bucket - sum(lengths))
        positions = [a + i for a, n in zip(starts, lengths) for i in range(n)]
        positions += [i for n in pieces for i in range(n)]
        writes = [r for r, n in zip(rows, lengths) for _ in range(n)]
        writes += [self.spare] * (bucket - len(writes))
        token_slots = [s for s, n in zip(slots, lengths) for _ in range(n)]
        token_slots += [-1] * (bucket - len(token_slots))
        host = torch.tensor([ids, positions, writes, token_slots])
        ends, at = [], 0
        for n in lengths:
            at += n
            ends.append(at - 1)
        ends += [0] * (self.sequences - len(ends))
        table = varlen_table(lengths + pieces, list(rows) + [self.spare] * len(pieces),
                             list(starts) + [0] * len(pieces), self.runner.group, "cpu",
                             programs=self._programs(bucket), sequences=self.sequences)  # fmt: skip
        dev = self.ids.device
        host, ends_t = host.to(dev, non_blocking=True), torch.tensor(ends).to(dev)
        self.ids[:bucket].copy_(host[0])
        self.positions[:bucket].copy_(host[1])
        self.write_rows[:bucket].copy_(host[2])
        self.slots[:bucket].copy_(host[3])
        self.last.copy_(ends_t)
        self.spans.copy_(table.sequences.to(dev))
        self.spans_blocks[:, : self._programs(bucket)].copy_(table.blocks.to(dev))

    def step(self, bucket: int, modules: frozenset[str]) -> Tensor:
        """The packed forward of `bucket` tokens from the static buffers (what is captured)."""
        rows = RowAdapters(
            row_slots=self.slots[:bucket], snapshot=self.snapshot, expert_lora=True,
            lora_modules=modules, token_buffer=self.token_slots[:bucket],
        )  # fmt: skip
        spans = VarlenTable(bucket, self.spans, self.spans_blocks[:, : self._programs(bucket)],
                            block_size(self.runner.group))  # fmt: skip
        with torch.no_grad(), cuda_graphs.inline():
            return self.runner.packed(self.ids[:bucket], self.positions[:bucket],
                                      self.write_rows[:bucket], spans, self.last, rows,
                                      self.cache, self.table)  # fmt: skip
