"""SlotManager: free slots, name -> slot map, token_slots, replace, unload, pin, LRU
eviction, zero padding, copy-on-write snapshots."""

from __future__ import annotations

import pytest
import torch
from adapter_files import (
    known_factors,
    lora_config,
    model_config,
    per_expert_tensors,
    write_adapter,
)

from moelora.compare import assert_close
from moelora.errors import InputError
from moelora.lora import Adapter, SlotManager, load_adapter

MC = model_config("qwen3_moe")
R = 8
FIELDS = ("w13_a", "w13_b", "w2_a", "w2_b")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Adapter]:
    """Five adapters with different ranks (all below R except 'full') and seeds."""
    root = tmp_path_factory.mktemp("ad")
    out = {}
    for seed, (name, r) in enumerate([("a", 2), ("b", 3), ("c", 4), ("d", 5), ("full", R)]):
        path = write_adapter(
            root / name, per_expert_tensors(known_factors(MC, r, seed=seed)), lora_config(r, 2 * r)
        )
        out[name] = load_adapter(path, MC, R)
    return out


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


def test_replace_keeps_slot_and_old_snapshot(adapters) -> None:
    m = SlotManager(MC, num_slots=2, max_rank=R, dtype=torch.float32)
    m.load(adapters["a"], name="x")
    m.load(adapters["b"], name="y")
    old = m.snapshot()
    old_copy = {layer: b.w13_a.clone() for layer, b in old.banks.items()}
    assert m.replace("x", adapters["d"]) == 0
    assert _slot_equals(m, 0, adapters["d"]) and _slot_equals(m, 1, adapters["b"])
    assert m.snapshot().version == old.version + 1
    for layer, bank in old.banks.items():  # a forward holding `old` still sees adapter a
        assert torch.equal(bank.w13_a, old_copy[layer])
    with pytest.raises(InputError):
        m.replace("nope", adapters["a"])


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
    factors = {k: v for k, v in known_factors(MC, 2, seed=9).items() if k[0] == 0}
    path = write_adapter(tmp_path / "l0", per_expert_tensors(factors), lora_config(2, 2))
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
