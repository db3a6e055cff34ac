"""The paged KV cache's blocks (vLLM's block pool): which blocks are free, who holds each,
and the prefix cache over full blocks.

The cache is num_blocks blocks of block_size positions in every layer; a request holds a
list of blocks (its block table) and its position p lives in block table[p // block_size]
at offset p % block_size. Block 0 is the null block: never handed out, written by a graph
bucket's padding rows. A block is free when no request holds it; a free block may still
carry a full block's content, registered under its digest, and a request whose prompt
starts with the same tokens under the same adapter version takes it again (a hit) instead
of computing it. Free blocks are handed out least recently freed first; a free block with
content loses it when handed out.

A full block's digest chains its tokens to the digests before it and to a seed naming the
adapter version (blake2b over bytes: equal digests mean equal prefixes, two adapters' or
two versions' blocks never meet). Policy-free: the engine decides who allocates, when and
whom to preempt. Not thread-safe (the engine's scheduler thread owns it).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

NULL_BLOCK = 0


def digest(parent: bytes, tokens) -> bytes:
    """The digest of one full block of `tokens` after the blocks `parent` digests."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def seed(adapter_key: str | None) -> bytes:
    """The digest a request's first block chains from: its adapter version (None: base)."""
    name = "" if adapter_key is None else adapter_key
    return hashlib.blake2b(b"moelora-prefix\0" + name.encode(), digest_size=16).digest()


@dataclass
class PrefixStats:
    """Counters since the start, in tokens (vLLM's prefix_cache_queries / _hits)."""

    queries: int = 0
    hits: int = 0


class BlockPool:
    """num_blocks blocks (block 0 the null block) of block_size positions."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 2 or block_size < 1:
            raise ValueError(f"BlockPool: num_blocks {num_blocks} (>= 2), block_size {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = prefix_caching
        self._refs = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self._digest_of: dict[int, bytes] = {}  # a block with content -> its digest
        self._block_of: dict[bytes, int] = {}  # digest -> the block holding that content
        self.stats = PrefixStats()

    # ---- facts ------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Blocks a request can ever hold: all but the null block."""
        return self.num_blocks - 1

    @property
    def available(self) -> int:
        """Blocks allocate() can hand out now (free ones, with or without content)."""
        return len(self._free)

    @property
    def used(self) -> int:
        """Blocks some request holds."""
        return self.capacity - len(self._free)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold `tokens` positions."""
        return -(-tokens // self.block_size)

    # ---- holding ----------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int] | None:
        """n blocks, each held once (content they carried is dropped); None when fewer than n
        are free (nothing changes)."""
        if n > len(self._free):
            return None
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            old = self._digest_of.pop(block, None)
            if old is not None:
                del self._block_of[old]
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: list[int]) -> None:
        """Let go of one hold on each block; a block no one holds becomes free. The last
        blocks of a request go first in line to be handed out (its first blocks, the prefix
        others may share, stay cached longest)."""
        for block in reversed(blocks):
            if block == NULL_BLOCK or self._refs[block] <= 0:
                raise ValueError(f"BlockPool.release: block {block} is not held")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None

    # ---- the prefix cache -------------------------------------------------------------------

    def match(self, digests: list[bytes]) -> list[int]:
        """Hold the cached blocks of the longest run of `digests` from the first (each
        digest a full block's); the blocks, in order."""
        found = []
        if self.prefix_caching:
            for d in digests:
                block = self._block_of.get(d)
                if block is None:
                    break
                found.append(block)
        for block in found:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
        return found

    def register(self, block: int, block_digest: bytes) -> None:
        """`block` (held) now holds the full content `block_digest` names; if another block
        already holds it, this one stays anonymous."""
        if not self.prefix_caching or block_digest in self._block_of:
            return
        if self._refs[block] <= 0:
            raise ValueError(f"BlockPool.register: block {block} is not held")
        self._block_of[block_digest] = block
        self._digest_of[block] = block_digest

    def count(self, queried: int, hit: int) -> None:
        self.stats.queries += queried
        self.stats.hits += hit

    def check(self) -> None:
        """Raise AssertionError if the pool's books disagree with each other (tests)."""
        free = set(self._free)
        for block in range(1, self.num_blocks):
            assert (self._refs[block] == 0) == (block in free), block
        assert self._refs[NULL_BLOCK] == 0 and NULL_BLOCK not in free
        assert all(self._digest_of[b] == d for d, b in self._block_of.items())
        assert len(self._digest_of) == len(self._block_of)
