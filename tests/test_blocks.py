"""The paged KV cache's block pool (moelora/engine/blocks.py) under random use: requests of
random adapters and token streams take blocks, share cached prefixes, register full blocks,
release them, in any order. The books always agree, no block is held by two requests unless
both asked for the same content (same adapter version, same tokens), a cached block is
handed out again only once no one holds it, and every block comes back."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moelora.engine.blocks import NULL_BLOCK, BlockPool, digest, seed

SIZE = 4


def _digests(adapter: str | None, tokens: list[int]) -> list[bytes]:
    out, parent = [], seed(adapter)
    for i in range(len(tokens) // SIZE):
        parent = digest(parent, tokens[i * SIZE : (i + 1) * SIZE])
        out.append(parent)
    return out


# a request: (adapter, tokens from a small alphabet so that prefixes repeat)
REQUEST = st.tuples(
    st.sampled_from([None, "a", "b"]),
    st.lists(st.integers(0, 2), min_size=1, max_size=14),
)


@settings(max_examples=150, deadline=None)
@given(
    num_blocks=st.integers(2, 12),
    script=st.lists(st.tuples(REQUEST, st.booleans()), min_size=1, max_size=25),
    caching=st.booleans(),
)
def test_random_requests_keep_the_books_and_return_every_block(num_blocks, script, caching):
    pool = BlockPool(num_blocks, SIZE, prefix_caching=caching)
    held: list[tuple[list[int], list[bytes]]] = []  # each live request: blocks, digests
    content: dict[int, bytes] = {}  # a held block's registered content
    for (adapter, tokens), finish_one in script:
        digests = _digests(adapter, tokens)
        hit = pool.match(digests[: (len(tokens) - 1) // SIZE])
        for block, d in zip(hit, digests):
            assert content.get(block, d) == d  # a hit is that content, never another's
            assert pool.refs(block) >= 1
        rest = pool.blocks_for(len(tokens)) - len(hit)
        fresh = pool.allocate(rest)
        if fresh is None:  # too few free: nothing more was taken, the hits are let go
            assert pool.available < rest
            pool.release(hit)
        else:
            assert NULL_BLOCK not in fresh
            assert all(pool.refs(b) == 1 for b in fresh)
            blocks = hit + fresh
            for i, d in enumerate(digests):  # the request fills its full blocks
                pool.register(blocks[i], d)
                content.setdefault(blocks[i], d)
            held.append((blocks, digests))
        # no block is in two live requests unless they hold the same content there
        owners: dict[int, bytes | None] = {}
        for blocks, ds in held:
            for i, b in enumerate(blocks):
                mine = ds[i] if i < len(ds) else None
                if b in owners:
                    assert mine is not None and owners[b] == mine, (b, owners[b], mine)
                owners[b] = mine
        assert pool.used == len(owners)
        if finish_one and held:
            blocks, _ = held.pop(0)
            pool.release(blocks)
            for b in blocks:
                if pool.refs(b) == 0:
                    content.pop(b, None)
        pool.check()
    for blocks, _ in held:
        pool.release(blocks)
    pool.check()
    assert pool.available == pool.capacity == num_blocks - 1 and pool.used == 0


def test_a_prefix_is_found_again_after_its_request_ends_until_its_block_is_taken():
    pool = BlockPool(4, SIZE)  # 3 blocks to hand out
    tokens = list(range(9))
    ds = _digests("a", tokens)
    first = pool.allocate(3)
    for b, d in zip(first, ds):
        pool.register(b, d)
    pool.release(first)
    assert pool.match(ds) == first[:2]  # free, still cached: found
    pool.release(first[:2])
    assert pool.match(_digests("b", tokens)) == []  # another adapter: never
    assert pool.match(_digests(None, tokens)) == []
    taken = pool.allocate(3)  # every free block handed out: the content is gone
    assert sorted(taken) == sorted(first)
    pool.release(taken)
    assert pool.match(ds) == []
    pool.check()


def test_the_last_blocks_of_a_request_are_handed_out_first():
    pool = BlockPool(5, SIZE)
    blocks = pool.allocate(4)
    pool.release(blocks)
    assert pool.allocate(1) == [blocks[-1]]


def test_misuse_is_refused():
    pool = BlockPool(3, SIZE)
    with pytest.raises(ValueError, match="not held"):
        pool.release([1])
    with pytest.raises(ValueError, match="not held"):
        pool.release([NULL_BLOCK])
    assert pool.allocate(3) is None and pool.available == 2
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1, SIZE)
