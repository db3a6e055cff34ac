"""Prefix caching for models with linear-attention layers (Qwen3.5): state snapshots, the
layers' states at a prefix's block boundary, beside the prefix cache's blocks.

A full-attention layer's prefix is its cached blocks; a linear-attention layer's is its
state after the prefix's last token, which blocks do not hold. So the engine takes, per
prompt, a snapshot of every linear-attention layer's state at the last block boundary before
the prompt's last token (its chunks are cut there: vLLM's "align" form), keyed by that
block's digest (tokens and adapter version, blocks.py). A later prompt with the same leading
blocks starts from the longest run of cached blocks whose last block has a snapshot: the
snapshot is copied into its row and the prefill goes on from that boundary. Snapshots live in
extra rows of the cache's state tensors (rows first .. first + count - 1), the least
recently used given up first; a digest names its tokens, so a snapshot stays right whatever
happens to the blocks it was taken beside. Legend: B block size, L a prompt's tokens (with
any outputs being recomputed).
"""

from __future__ import annotations

from collections import OrderedDict

from .linear_attention import LinearState


def snapshot_rows(max_rows: int, kept: bool) -> int:
    """The snapshots an engine of max_rows rows holds (`kept`: prefix caching on a model with
    linear-attention layers): one per row, so every running prompt's can be taken."""
    return max_rows if kept else 0


def boundary(tokens: int, block_size: int) -> int:
    """Where a snapshot of `tokens` tokens is taken: the last block boundary before the last
    token (which is always computed), 0 for none."""
    return (tokens - 1) // block_size * block_size


class StateSnapshots:
    """Up to `count` snapshots, in rows first .. first + count - 1 of `states` (every
    linear-attention layer's, by layer index)."""

    def __init__(self, states: dict[int, LinearState], first: int, count: int) -> None:
        if count < 1:
            raise ValueError(f"StateSnapshots: count {count}; at least 1")
        self.states, self.count = states, count
        self._free = list(range(first + count - 1, first - 1, -1))  # popped from the end
        self._row_of: OrderedDict[bytes, int] = OrderedDict()  # digest -> row, oldest first
        self.saved = self.restored = 0

    def __contains__(self, block_digest: bytes) -> bool:
        return block_digest in self._row_of

    def __len__(self) -> int:
        return len(self._row_of)

    def save(self, block_digest: bytes, row: int) -> None:
        """Row's states as the snapshot after the block `block_digest` names (a digest with
        a snapshot already is only marked used)."""
        if block_digest in self._row_of:
            self._row_of.move_to_end(block_digest)
            return
        if self._free:
            at = self._free.pop()
        else:
            _, at = self._row_of.popitem(last=False)
        for state in self.states.values():
            state.conv[at] = state.conv[row]
            state.recurrent[at] = state.recurrent[row]
        self._row_of[block_digest] = at
        self.saved += 1

    def restore(self, block_digest: bytes, row: int) -> None:
        """Row's states set to the snapshot of `block_digest` (which must have one)."""
        at = self._row_of[block_digest]
        self._row_of.move_to_end(block_digest)
        for state in self.states.values():
            state.conv[row] = state.conv[at]
            state.recurrent[row] = state.recurrent[at]
        self.restored += 1

    def longest(self, digests: list[bytes]) -> int:
        """The most leading blocks of `digests` whose last one has a snapshot (0: none)."""
        return next((n for n in range(len(digests), 0, -1) if digests[n - 1] in self), 0)
