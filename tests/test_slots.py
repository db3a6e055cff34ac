"""SlotManager: free slots, name -> slot map, token_slots, replace, unload, pin, LRU
eviction, zero padding; leases (reading()): a load never writes a slot a forward holds,
banks are written in place and never copied, replace under a lease, waiting and timeout."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from adapter_files import model_config, write_random_adapter

from moelora import moe_lora_reference, random_expert_weights
from moelora.compare import assert_close
from moelora.errors import ConfigError, InputError
from moelora.lora import Adapter, LoadOrigin, Placement, SlotManager, load_adapter

MC = model_config("qwen3_moe")
R = 8
FIELDS = ("w13_a", "w13_b", "w2_a", "w2_b")


@pytest.fixture
def adapters(tmp_path, seed) -> dict[str, Adapter]:
    """Five random non-zero adapters with different ranks (all below R except 'full')."""
    out = {}
    for k, (name, r) in enumerate([("a", 2), ("b", 3), ("c", 4), ("d", 5), ("full", R)]):
        path = write_random_adapter(tmp_path / name, MC, r, 2 * r, seed=seed + k)
        out[name] = load_adapter(path, MC, R)
    return out


def _slot_contents(manager: SlotManager, slot: int) -> dict:
    """Copies of `slot` in every layer's bank, to compare bit for bit later."""
    banks = manager.snapshot().banks
    return {(layer, f): getattr(b, f)[slot].clone() for layer, b in banks.items() for f in FIELDS}


def _unchanged(manager: SlotManager, slot: int, before: dict) -> bool:
    after = _slot_contents(manager, slot)
    return all(torch.equal(after[k], t) for k, t in before.items())


def _forward(snap, slots: torch.Tensor, seed: int) -> dict[int, torch.Tensor]:
    """Every MoE layer's reference forward on the snapshot's banks (random, seeded inputs)."""
    gen = torch.Generator().manual_seed(seed)
    experts = random_expert_weights(MC.shape, generator=gen, dtype=torch.float32)
    t = slots.shape[0]
    x = torch.randn(t, MC.shape.hidden_size, generator=gen)
    ids = torch.stack([torch.randperm(MC.shape.num_experts, generator=gen)[:2] for _ in range(t)])
    w = torch.rand(t, 2, generator=gen)
    return {
        layer: moe_lora_reference(x, ids, w, slots, experts, snap.banks[layer], MC.shape)
        for layer in MC.moe_layers
    }


def _slot_equals(manager: SlotManager, slot: int, adapter: Adapter | None) -> bool:
    """Slot contents == the adapter zero-padded to R (or all zeros for None)."""
    snap = manager.snapshot()
    for layer, bank in snap.banks.items():
        lora = None if adapter is None else adapter.layers.get(layer)
        for f in FIELDS:
            got = getattr(bank, f)[slot]
            want = torch.zeros_like(got)
            if lora is not None:
                src = getattr(lora, f)
                r = adapter.rank
                index = {"w13_a": (..., slice(0, r), slice(None)), "w13_b": (..., slice(0, r)),
                         "w2_a": (slice(None), slice(0, r)), "w2_b": (..., slice(0, r))}[f]  # fmt: skip
                want[index] = src
            if not torch.equal(got, want):
                return False
    return True


def test_load_fills_free_slots_and_maps_names(adapters) -> None:
    m = SlotManager(MC, num_slots=3, max_rank=R, dtype=torch.float32)
    assert [m.load(adapters[n]) for n in ("a", "b", "c")] == [0, 1, 2]
    assert m.loaded == {"a": 0, "b": 1, "c": 2}
    for slot, n in enumerate("abc"):
        assert _slot_equals(m, slot, adapters[n])  # rank < R: zero-padded
    _, slots = m.token_slots(["b", None, "a", "c", None])
    assert slots.dtype == torch.int32 and slots.tolist() == [1, -1, 0, 2, -1]
    with pytest.raises(InputError, match="'zzz'"):
        m.token_slots(["zzz"])


def test_full_rank_adapter_fills_the_slot(adapters) -> None:
    m = SlotManager(MC, num_slots=1, max_rank=R, dtype=torch.float32)
    m.load(adapters["full"])
    assert _slot_equals(m, 0, adapters["full"])
    assert m.snapshot().banks[0].w2_b[0, :, :, R - 1].abs().sum() > 0


def test_replace_writes_another_slot_and_keeps_the_leased_one(adapters, seed) -> None:
    """replace under a lease: the new weights go to the free slot, the name moves there;
    the forward holding the old slot still computes with the old adapter, bit for bit."""
    m = SlotManager(MC, num_slots=3, max_rank=R, dtype=torch.float32)
    m.load(adapters["full"], name="x")
    m.load(adapters["b"], name="y")
    with m.reading(["x", None, "y", "x"]) as (snap, slots):
        ref = _forward(snap, slots, seed)
        held = _slot_contents(m, 0)
        assert m.replace("x", adapters["d"]) == 2  # the free slot, never the leased slot 0
        assert m.loaded == {"x": 2, "y": 1} and dict(snap.slot_of) == {"x": 0, "y": 1}
        assert _slot_equals(m, 2, adapters["d"]) and _slot_equals(m, 1, adapters["b"])
        assert _unchanged(m, 0, held)
        out = _forward(snap, slots, seed)
        assert all(torch.equal(out[layer], ref[layer]) for layer in ref)
        with m.reading(["x"]) as (new, new_slots):  # a later forward sees the new adapter
            assert new.version > snap.version and new_slots.tolist() == [2]
        # Slot 0 is in no map now but still leased: a load evicts x (the only unleased
        # adapter) rather than reuse it.
        assert m.load(adapters["c"], name="z") == 2
        assert m.loaded == {"z": 2, "y": 1} and _unchanged(m, 0, held)
        out = _forward(snap, slots, seed)
        assert all(torch.equal(out[layer], ref[layer]) for layer in ref)
    # The retired slot 0 is free once the lease ends; reusing it overwrites it in full
    # (rank 2 < the old occupant's R: the rank padding is zero again).
    assert m.load(adapters["a"], name="w") == 0
    assert _slot_equals(m, 0, adapters["a"])
    with pytest.raises(InputError):
        m.replace("nope", adapters["a"])


def test_replace_with_one_slot_rewrites_it_when_no_forward_holds_it(adapters) -> None:
    """One slot: no other slot can take the successor, so the replaced adapter's own slot is
    rewritten once no lease holds it (the name is unmapped meanwhile); while a forward holds
    it, the replace waits, then times out with everything unchanged."""
    m = SlotManager(MC, num_slots=1, max_rank=R, dtype=torch.float32, load_timeout_s=0.2)
    m.load(adapters["a"], name="x")
    before = _slot_contents(m, 0)
    with m.reading(["x"]):
        with pytest.raises(InputError, match="still leased"):
            m.replace("x", adapters["b"])
        assert m.loaded == {"x": 0} and _unchanged(m, 0, before)
    assert m.replace("x", adapters["b"]) == 0
    assert m.loaded == {"x": 0} and _slot_equals(m, 0, adapters["b"])
    m.pin("x")  # a pinned adapter can still be replaced explicitly
    assert m.replace("x", adapters["c"]) == 0 and _slot_equals(m, 0, adapters["c"])
    with pytest.raises(ConfigError, match=r"unpin or unload.*raise num_slots"):  # no eviction
        m.load(adapters["d"], name="y")


@pytest.mark.parametrize(
    "sizes, named",
    [
        (dict(num_slots=0, max_rank=R), "'num_slots' = 0"),  # no slot for an adapter
        (dict(num_slots=2, max_rank=0), "'max_rank' = 0"),  # no rank for a factor
    ],
    ids=["no-slot", "no-rank"],
)
def test_bad_sizes_are_refused_naming_the_keyword_passed(sizes, named) -> None:
    with pytest.raises(ConfigError, match=named):
        SlotManager(MC, dtype=torch.float32, **sizes)


def test_unload_zeroes_and_frees_the_slot(adapters) -> None:
    m = SlotManager(MC, num_slots=2, max_rank=R, dtype=torch.float32)
    m.load(adapters["a"])
    m.load(adapters["b"])
    m.unload("a")
    assert m.loaded == {"b": 1} and _slot_equals(m, 0, None)
    assert m.load(adapters["c"]) == 0
    with pytest.raises(InputError):
        m.unload("a")


def test_lru_eviction_skips_pinned_and_recently_used(adapters) -> None:
    m = SlotManager(MC, num_slots=3, max_rank=R, dtype=torch.float32)
    m.load(adapters["a"], pin=True)  # oldest, but pinned
    m.load(adapters["b"])
    m.load(adapters["c"])
    m.token_slots(["b"])  # b used after c: c is now least recently used
    assert m.load(adapters["d"]) == 2  # evicts c
    assert m.loaded == {"a": 0, "b": 1, "d": 2}
    assert _slot_equals(m, 2, adapters["d"])
    m.unpin("a")
    assert m.load(adapters["c"]) == 0  # a is now the least recently used
    assert m.loaded == {"b": 1, "d": 2, "c": 0}
    m.pin("b")
    m.pin("d")
    assert m.load(adapters["a"]) == 0  # only c is unpinned
    with pytest.raises(InputError):
        m.pin("c")  # evicted


def test_layers_an_adapter_lacks_are_zero(tmp_path, adapters) -> None:
    """A slot reused by an adapter of layer 0 only: layer 1 rows of the old occupant vanish."""
    path = write_random_adapter(tmp_path / "l0", MC, 2, 2, seed=9, layers={0})
    m = SlotManager(MC, num_slots=1, max_rank=R, dtype=torch.float32)
    m.load(adapters["full"])
    m.load(path, name="layer0")
    assert m.loaded == {"layer0": 0}
    snap = m.snapshot()
    assert all(getattr(snap.banks[1], f)[0].abs().sum() == 0 for f in FIELDS)
    assert snap.banks[0].w13_a[0].abs().sum() > 0


def test_bank_dtype_follows_the_manager(adapters) -> None:
    m = SlotManager(MC, num_slots=1, max_rank=R, dtype=torch.bfloat16)
    m.load(adapters["b"])
    bank = m.snapshot().banks[0]
    assert bank.w13_a.dtype == torch.bfloat16
    assert_close(bank.w13_b[0, :, :, :, :3], adapters["b"].layers[0].w13_b, torch.bfloat16)


def test_replace_of_an_unloaded_name_is_refused_and_changes_nothing(adapters) -> None:
    """replace() checks the name under the manager's lock: after an unload it must not turn
    into a fresh load (which could evict another adapter)."""
    m = SlotManager(MC, num_slots=2, max_rank=R, dtype=torch.float32)
    m.load(adapters["a"])
    m.load(adapters["b"])
    m.unload("a")
    before = m.snapshot()
    with pytest.raises(InputError, match="loaded adapter"):
        m.replace("a", adapters["c"])
    assert m.snapshot() is before and m.loaded == {"b": 1}


def test_load_never_writes_a_leased_slot(adapters, seed) -> None:
    """The LRU adapter is leased: the load evicts the next one instead, and the leased
    slots (and the forward reading them) stay bit-identical."""
    m = SlotManager(MC, num_slots=3, max_rank=R, dtype=torch.float32)
    for n in ("a", "b", "c"):
        m.load(adapters[n])
    with m.reading(["a", "b", None, "a"]) as (snap, slots):
        m.token_slots(["c"])  # c used after the lease began: a is now the LRU adapter
        held = {s: _slot_contents(m, s) for s in (0, 1)}
        ref = _forward(snap, slots, seed)
        assert m.load(adapters["d"]) == 2  # evicts c, not the leased LRU a
        assert m.loaded == {"a": 0, "b": 1, "d": 2} and _slot_equals(m, 2, adapters["d"])
        assert all(_unchanged(m, s, contents) for s, contents in held.items())
        out = _forward(snap, slots, seed)
        assert all(torch.equal(out[layer], ref[layer]) for layer in ref)
    m.token_slots(["b", "d"])
    assert m.load(adapters["c"]) == 0  # lease released: a, now the LRU adapter, is evicted


def test_unload_under_a_lease_defers_zeroing_to_the_next_write(adapters) -> None:
    """An unloaded slot a forward holds keeps its weights and is not reused until the lease
    ends; the load that reuses it overwrites it in full."""
    m = SlotManager(MC, num_slots=2, max_rank=R, dtype=torch.float32)
    m.load(adapters["full"])
    m.load(adapters["b"])
    with m.reading(["full"]):
        held = _slot_contents(m, 0)
        m.unload("full")
        assert m.loaded == {"b": 1} and _unchanged(m, 0, held)
        assert m.load(adapters["c"]) == 1  # slot 0 is free but leased: evicts b instead
        assert _unchanged(m, 0, held)
    assert m.loaded == {"c": 1} and _slot_equals(m, 0, adapters["full"])  # deferred
    assert m.load(adapters["a"]) == 0
    assert _slot_equals(m, 0, adapters["a"]) and _slot_equals(m, 1, adapters["c"])


def test_load_times_out_naming_the_leased_slots(adapters) -> None:
    """Every slot leased: the load waits load_timeout_s, raises InputError naming the
    leased slots, and leaves the map, the version and every slot as they were."""
    m = SlotManager(MC, num_slots=2, max_rank=R, dtype=torch.float32, load_timeout_s=0.3)
    m.load(adapters["a"])
    m.load(adapters["b"])
    with m.reading(["a", "b"]), m.reading(["b"]):
        before = {s: _slot_contents(m, s) for s in (0, 1)}
        version, start = m.snapshot().version, time.monotonic()
        with pytest.raises(InputError, match=r"leased.*\{0: 1, 1: 2\}.*load_timeout_s"):
            m.load(adapters["c"])
        assert time.monotonic() - start >= 0.3
        assert m.snapshot().version == version and m.loaded == {"a": 0, "b": 1}
        assert all(_unchanged(m, s, contents) for s, contents in before.items())
    assert m.load(adapters["c"]) == 0  # leases released: a (LRU) is evicted at once


def test_waiting_load_proceeds_when_the_lease_ends(adapters) -> None:
    m = SlotManager(MC, num_slots=1, max_rank=R, dtype=torch.float32, load_timeout_s=30)
    m.load(adapters["a"])
    result: list = []
    lease = m.reading(["a"])
    lease.__enter__()
    loader = threading.Thread(target=lambda: result.append(m.load(adapters["b"])))
    loader.start()
    time.sleep(0.2)
    assert loader.is_alive() and m.loaded == {"a": 0}  # waiting, nothing written
    assert _slot_equals(m, 0, adapters["a"])
    lease.__exit__(None, None, None)
    loader.join(timeout=10)
    assert result == [0] and m.loaded == {"b": 0} and _slot_equals(m, 0, adapters["b"])


def test_banks_are_written_in_place_never_copied(adapters, tmp_path) -> None:
    """The same bank tensors (objects and storage) across loads, evictions, replaces and
    unloads, and a load allocates less than one slot: no copy-on-write of the banks."""
    from torch.profiler import ProfilerActivity, profile

    m = SlotManager(MC, num_slots=3, max_rank=R, dtype=torch.float32)
    banks = dict(m.snapshot().banks)
    ptrs = {(layer, f): getattr(b, f).data_ptr() for layer, b in banks.items() for f in FIELDS}
    slot_bytes = sum(getattr(banks[0], f)[0].nbytes for f in FIELDS)
    m.load(adapters["a"])
    m.load(adapters["b"])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with m.reading(["a"]):
            assert m.replace("a", adapters["full"]) == 2  # the free slot
            assert m.load(adapters["c"]) == 1  # evicts b: slot 0 is leased
        m.unload("a")
        assert m.load(adapters["d"]) == 0
    assert m.loaded == {"c": 1, "d": 0} and _slot_equals(m, 2, None)
    allocated = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)
    assert allocated < slot_bytes, (allocated, slot_bytes)
    snap = m.snapshot()
    assert all(snap.banks[layer] is bank for layer, bank in banks.items())
    for (layer, f), ptr in ptrs.items():
        assert getattr(snap.banks[layer], f).data_ptr() == ptr, (layer, f)


# (id, slots loaded, pinned, name replaced, names a forward holds, slot, placement, evicted)
REPLACES = [
    # the case: every slot full, nothing pinned or leased -> its own slot, no eviction
    ("full-unleased", "abc", None, "c", [], 2, Placement.IN_PLACE, None),
    ("lru-itself-unleased", "abc", None, "a", [], 0, Placement.IN_PLACE, None),
    ("free-slot-unleased", "ab", None, "b", [], 1, Placement.IN_PLACE, None),  # not slot 2
    ("leased-free-slot", "ab", None, "b", ["b"], 2, Placement.FREE, None),  # costs nothing
    ("leased-full-evicts-lru", "abc", None, "c", ["c"], 0, Placement.EVICTED, "a"),
    ("leased-full-lru-pinned", "abc", "a", "c", ["c"], 1, Placement.EVICTED, "b"),
    ("leased-full-lru-leased", "abc", None, "c", ["a", "c"], 1, Placement.EVICTED, "b"),
]


@pytest.mark.parametrize(
    "names,pin,target,held,slot,placement,evicted",
    [c[1:] for c in REPLACES],
    ids=[c[0] for c in REPLACES],
)
def test_replace_costs_another_adapter_only_under_a_lease(
    adapters, seed, names, pin, target, held, slot, placement, evicted
) -> None:
    """replace rewrites the name's own slot when no forward holds it; only when one does
    does it take another slot, evicting the LRU unpinned unleased adapter if none is free,
    and the SlotWrite says so. Untouched slots stay bit-identical; a holding forward keeps
    computing with the old weights."""
    m = SlotManager(MC, num_slots=3, max_rank=R, dtype=torch.float32)
    for n in names:
        m.load(adapters[n], pin=n == pin)
    before = {s: _slot_contents(m, s) for s in range(3)}
    with m.reading(held or [None]) as (snap, slots):
        ref = _forward(snap, slots, seed) if held else None
        result = m.replace(target, adapters["full"])
        assert (result, result.placement, result.evicted) == (slot, placement, evicted)
        assert result.origin is LoadOrigin.MEMORY and result.seconds > 0
        if held:
            out = _forward(snap, slots, seed)
            assert all(torch.equal(out[layer], ref[layer]) for layer in ref)
    expected = {n: s for s, n in enumerate(names) if n != evicted} | {target: slot}
    assert m.loaded == expected
    assert _slot_equals(m, slot, adapters["full"])
    old_slot = names.index(target)
    for s in range(3):  # every other slot: bit for bit as before, or freed/zeroed
        if s not in (slot, old_slot):
            assert _unchanged(m, s, before[s])
    stats = m.stats()
    assert stats.in_place == (placement is Placement.IN_PLACE)
    assert stats.evictions == (placement is Placement.EVICTED)


def test_readers_of_a_name_wait_for_its_in_place_rewrite(adapters, monkeypatch) -> None:
    """While its own slot is rewritten the name is in no map; a reading() of it waits for
    the write and gets the new weights (before issue 17 it was refused)."""
    from moelora.lora.slot_banks import SlotBanks

    m = SlotManager(MC, num_slots=2, max_rank=R, dtype=torch.float32)
    m.load(adapters["a"], name="x")
    m.load(adapters["b"], name="y")
    writing, go = threading.Event(), threading.Event()
    write = SlotBanks.write

    def slow_write(self, slot, adapter):
        if adapter is adapters["full"]:
            writing.set()
            assert go.wait(10)
        write(self, slot, adapter)

    monkeypatch.setattr(SlotBanks, "write", slow_write)
    replacer = threading.Thread(target=lambda: m.replace("x", adapters["full"]))
    replacer.start()
    assert writing.wait(10) and m.loaded == {"y": 1}  # x unmapped while slot 0 is written
    got: list = []

    def reader() -> None:
        with m.reading(["x", "y"]) as (_, slots):
            got.append(slots.tolist())

    thread = threading.Thread(target=reader)
    thread.start()
    time.sleep(0.2)
    assert thread.is_alive() and not got  # waiting, not refused
    go.set()
    replacer.join(10)
    thread.join(10)
    assert got == [[0, 1]] and _slot_equals(m, 0, adapters["full"])
