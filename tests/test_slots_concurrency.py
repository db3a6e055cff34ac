"""A writer thread loads, replaces and evicts adapters while a reader thread runs forwards:
every forward equals the reference for the slots its snapshot names, and the snapshot's
banks are never written while (or after) the forward reads them."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from adapter_files import (
    known_factors,
    lora_config,
    model_config,
    one_torch_thread,
    per_expert_tensors,
    write_adapter,
)

from moelora import moe_lora_reference, random_expert_weights
from moelora.lora import Adapter, SlotManager, load_adapter
from moelora.weights import LoRABank

MC = model_config("qwen3_moe")
R, SLOTS, T, STEPS = 8, 3, 12, 30


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_torch_thread()


def _expected_bank(behind: dict[str, tuple[int, Adapter]], layer: int) -> LoRABank:
    """The bank implied by name -> (slot, adapter), built from the adapters directly."""
    bank = LoRABank.empty(MC.shape, SLOTS, R, dtype=torch.float32)
    for slot, ad in behind.values():
        lora, r = ad.layers[layer], ad.rank
        bank.w13_a[slot, :, :, :r], bank.w13_b[slot, :, :, :, :r] = lora.w13_a, lora.w13_b
        bank.w2_a[slot, :, :r], bank.w2_b[slot, :, :, :r] = lora.w2_a, lora.w2_b
    return bank


def test_forwards_see_whole_snapshots_while_loading(tmp_path, seed) -> None:
    adapters = {}
    for seed, r in enumerate([2, 3, 4, 5, 6, 8]):
        path = write_adapter(
            tmp_path / f"ad{seed}",
            per_expert_tensors(known_factors(MC, r, seed=seed)),
            lora_config(r, r + 1),
        )
        adapters[f"ad{seed}"] = load_adapter(path, MC, R)
    names = list(adapters)
    manager = SlotManager(MC, num_slots=SLOTS, max_rank=R, dtype=torch.float32)
    # version -> {name: adapter behind it}, recorded by the writer (the only writer) after
    # each operation, so the reader can check any snapshot it took.
    history: dict[int, dict[str, Adapter]] = {0: {}}
    sources: dict[str, Adapter] = {}
    stop, errors, seen = threading.Event(), [], []

    def writer() -> None:
        try:
            for step in range(STEPS):
                name = names[step % len(names)]
                if step % 7 == 3 and manager.loaded:
                    manager.unload(next(iter(manager.loaded)))
                elif step % 5 == 4 and name in manager.loaded:
                    source = adapters[names[(step + 1) % len(names)]]
                    manager.replace(name, source)
                    sources[name] = source
                else:
                    manager.load(adapters[name])  # evicts the LRU adapter when full
                    sources[name] = adapters[name]
                snap = manager.snapshot()
                history[snap.version] = {n: sources[n] for n in snap.slot_of}
                time.sleep(0.01)
        except Exception as err:  # surfaced in the main thread
            errors.append(err)
        finally:
            stop.set()

    def reader() -> None:
        gen = torch.Generator().manual_seed(seed)
        experts = random_expert_weights(MC.shape, generator=gen, dtype=torch.float32)
        try:
            while not stop.is_set():
                snap = manager.snapshot()
                loaded = sorted(snap.slot_of)
                names_t = [None if not loaded or t % 4 == 0 else loaded[t % len(loaded)]
                           for t in range(T)]  # fmt: skip
                slots = snap.token_slots(names_t)
                x = torch.randn(T, MC.shape.hidden_size, generator=gen)
                ids = torch.stack(
                    [torch.randperm(MC.shape.num_experts, generator=gen)[:2] for _ in range(T)]
                )
                w = torch.rand(T, 2, generator=gen)
                outs = {
                    layer: moe_lora_reference(
                        x, ids, w, slots, experts, snap.banks[layer], MC.shape
                    )
                    for layer in MC.moe_layers
                }
                seen.append((snap, x, ids, w, slots, outs))
        except Exception as err:
            errors.append(err)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[0]
    versions = {snap.version for snap, *_ in seen}
    assert len(seen) >= 5 and len(versions) >= 3, (len(seen), versions)
    experts = random_expert_weights(
        MC.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32
    )
    for snap, x, ids, w, slots, outs in seen:
        behind = {n: (snap.slot_of[n], ad) for n, ad in history[snap.version].items()}
        assert set(behind) == set(snap.slot_of)
        for layer, out in outs.items():
            want = _expected_bank(behind, layer)
            ref = moe_lora_reference(x, ids, w, slots, experts, want, MC.shape)
            assert torch.equal(out, ref), f"version {snap.version} layer {layer}"
            for f in ("w13_a", "w13_b", "w2_a", "w2_b"):  # nothing was written under the forward
                assert torch.equal(getattr(snap.banks[layer], f), getattr(want, f)), f
