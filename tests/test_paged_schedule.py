"""The engine's paged scheduling under hypothesis: random pools, block sizes, token budgets,
arrivals, prompts sharing prefixes, adapters, output lengths, prompt-logprob rows and
cancellations, with the model replaced by a token model that reads what the engine arranged
(so hundreds of schedules run in seconds). Each forward writes every token's id into its
slot of the paged cache (through the block table) and picks a row's next token from a
digest of its adapter slot and every token it reads back through the table, positions 0 ..
its own. A block read from the wrong row, a stale block, another adapter's cached prefix, a
preempted row resumed without its tokens, a chunk written past its blocks: each changes what
a row reads, and its tokens stop equalling the same request run alone. The books agree after
every step; every block comes back."""

from __future__ import annotations

import copy
import hashlib

import pytest
import torch
from engine_helpers import run_paged
from hypothesis import HealthCheck, given, settings
from hypothesis import event as tally
from hypothesis import strategies as st

from moelora.engine import Engine, Request, Sampling
from moelora.hf import attach, toy

pytestmark = pytest.mark.filterwarnings("ignore")
MAX_LEN = 24


def _next(slot: int, read: list[int], vocab: int) -> int:
    """The pick of a row of adapter `slot` that read `read` (token * 8 + slot + 1 each)."""
    data = repr((slot, read)).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") % vocab


class TokenRunner:
    """Stands in for engine/runner.DecodeRunner: each token's id and its row's adapter slot
    (what a layer's k / v depend on) in layer 0's keys [NB, Hk, BS, D] at [block, 0, offset,
    0]; logits one-hot (10 at the pick, 0 elsewhere)."""

    linear = frozenset()  # no linear-attention layer (DecodeRunner.linear)

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def _write(self, cache, table, rows, positions, ids, slots) -> None:
        size = cache.block_size
        blocks = table[rows, positions // size].long()
        assert (blocks > 0).all(), "a token written to the null block"
        value = ids * 8 + slots.long() + 1  # slot -1 .. 6
        cache.layers[0].keys[blocks, 0, positions % size, 0] = value.float()

    def _pick(self, cache, table, row: int, position: int, slot: int) -> torch.Tensor:
        size = cache.block_size
        where = torch.arange(position + 1)
        blocks = table[row, where // size].long()
        read = cache.layers[0].keys[blocks, 0, where % size, 0].long().tolist()
        logits = torch.zeros(self.vocab)
        logits[_next(slot, read, self.vocab)] = 10.0
        return logits

    def prefill(self, ids, positions, write_rows, lengths, cache_rows, rows, cache, table,
                every=False, pos0=None):  # fmt: skip
        self._write(cache, table, write_rows, positions, ids, rows.row_slots[: ids.shape[0]])
        slots = rows.row_slots.tolist()
        out, at = [], 0
        for n, row in zip(lengths, cache_rows):
            assert n >= 1, lengths  # the kernels' contract
            wanted = range(at, at + n) if every else [at + n - 1]
            out += [self._pick(cache, table, row, int(positions[t]), slots[t]) for t in wanted]
            at += n
        return torch.stack(out)

    def decode(self, ids, positions, write_rows, rows, cache, kv_len, table):
        live = write_rows[:, 0] < table.shape[0] - 1  # padding writes the null row
        self._write(cache, table, write_rows[live, 0], positions[live, 0], ids[live, 0],
                    rows.row_slots[: ids.shape[0]][live])  # fmt: skip
        slots = rows.row_slots.tolist()
        return torch.stack([self._pick(cache, table, b, int(positions[b, 0]), slots[b])
                            for b in range(ids.shape[0])])  # fmt: skip


def _slot(handle, name: str) -> int:
    (hold,) = handle.hold([name])
    hold.release()
    return hold.slot


def _alone(slot: int, prompt: tuple[int, ...], new: int, vocab: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(new):
        tokens.append(_next(slot, [t * 8 + slot + 1 for t in tokens], vocab))
    return tokens[len(prompt) :]


@pytest.fixture(scope="module")
def handle(tmp_path_factory):
    root = tmp_path_factory.mktemp("schedule")
    base = toy.build_model("qwen3_moe", seed=35)
    handle = attach(copy.deepcopy(base), num_slots=2, max_rank=4, moe_backend="reference")
    for i, name in enumerate(("a", "b")):
        toy.write_peft_adapter(base, root / name, seed=60 + i, r=2, lora_alpha=4,
                               target_modules=["q_proj"])  # fmt: skip
        handle.load_adapter(root / name, name=name)
    return handle


REQUEST = st.fixed_dictionaries({
    "at": st.integers(0, 6),
    "prefix": st.integers(0, 9),  # leading tokens of a shared stream: cached prefixes
    "own": st.lists(st.integers(1, 4), min_size=1, max_size=8),
    "adapter": st.sampled_from([None, "a", "a", "b"]),
    "new": st.integers(1, 14),
    "cancel": st.one_of(st.none(), st.integers(0, 20)),
    "prompt_logprobs": st.booleans(),
})  # fmt: skip


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    block_size=st.sampled_from([1, 2, 3, 4, 8]),
    spare_blocks=st.integers(0, 3),
    max_rows=st.integers(1, 4),
    budget=st.integers(1, 12),
    caching=st.booleans(),
    script=st.lists(REQUEST, min_size=2, max_size=10),
)
def test_any_schedule_gives_each_row_its_own_tokens_and_returns_every_block(
    handle, block_size, spare_blocks, max_rows, budget, caching, script
):
    per_row = -(-MAX_LEN // block_size)
    engine = Engine(handle, max_rows=max_rows, max_len=MAX_LEN, enforce_eager=True, runner=True,
                    block_size=block_size, num_blocks=per_row + 1 + spare_blocks,
                    max_num_batched_tokens=budget, enable_prefix_caching=caching)  # fmt: skip
    vocab = engine.vocab_size
    engine.runner = TokenRunner(vocab)
    stream = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    requests = []
    for i, r in enumerate(script):
        prompt = tuple(stream[: r["prefix"]] + r["own"])[: MAX_LEN - r["new"]]
        sampling = Sampling(
            max_new_tokens=r["new"], prompt_logprobs=0 if r["prompt_logprobs"] else None
        )
        requests.append((r, Request(f"q{i}", prompt, r["adapter"], sampling)))
    slot = {None: -1, **{n: _slot(handle, n) for n in ("a", "b")}}
    try:
        arrivals = [(r["at"], q) for r, q in requests]
        cancels = {q.request_id: r["cancel"] for r, q in requests if r["cancel"] is not None}
        tokens, reasons = run_paged(engine, arrivals, cancels, limit=300)
        for r, q in requests:
            got = tokens.get(q.request_id, [])
            want = _alone(slot[q.adapter], q.prompt_ids, len(got), vocab)
            assert got == want, (q.request_id, got, want)
            if reasons[q.request_id] != "cancelled":
                assert reasons[q.request_id] == "length" and len(got) == r["new"], q.request_id
        assert engine.pool.used == 0 and engine.pool.available == engine.pool.capacity
        tally(f"preempted: {engine.preemptions > 0}")  # --hypothesis-show-statistics
        tally(f"prefix hits: {engine.pool.stats.hits > 0}")
    finally:
        engine.close()
