"""A writer thread loads, replaces, evicts and unloads adapters while reader threads run
forwards under leases (SlotManager.reading): every forward equals, bit for bit, the
reference for the adapters its map names, and the slots it leased are never written while
it holds them, although the banks are shared and written in place."""

from __future__ import annotations

import itertools
import threading
import time
from contextlib import ExitStack

import pytest
import torch
from adapter_files import bank_of, model_config, write_random_adapter

from moelora import moe_lora_reference, random_expert_weights
from moelora.errors import InputError
from moelora.lora import Adapter, SlotManager, load_adapter
from moelora.weights import LoRABank

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MC = model_config("qwen3_moe")
R, SLOTS, T, STEPS, READERS = 8, 3, 12, 40, 2
FIELDS = ("w13_a", "w13_b", "w2_a", "w2_b")


def _expected_bank(behind: dict[str, tuple[int, Adapter]], layer: int) -> LoRABank:
    """The bank implied by name -> (slot, adapter), built from the adapters directly."""
    return bank_of(MC, dict(behind.values()), layer, SLOTS, R)


def _adapter_at(assigned: list[tuple[int, str, Adapter]], name: str, version: int) -> Adapter:
    """The adapter behind `name` in `version`: the last one published for it by then."""
    return [ad for v, n, ad in assigned if n == name and v <= version][-1]


def test_forwards_under_leases_see_whole_slots_while_loading(tmp_path, seed) -> None:
    adapters = {}
    for k, r in enumerate([2, 3, 4, 5, 6, 8]):
        path = write_random_adapter(tmp_path / f"ad{k}", MC, r, r + 1, seed=seed + k)
        adapters[f"ad{k}"] = load_adapter(path, MC, R)
    names = list(adapters)
    manager = SlotManager(MC, num_slots=SLOTS, max_rank=R, dtype=torch.float32)
    # (version that published it, name, adapter): written by the only writer after each
    # load or replace, so a reader can tell which adapter any version's map names. Versions
    # in between (an eviction, an unload) name a subset of the adapters before them.
    assigned: list[tuple[int, str, Adapter]] = []
    stop, errors, seen = threading.Event(), [], []

    def writer() -> None:
        try:
            for step in range(STEPS):
                name = names[step % len(names)]
                if step % 7 == 3 and manager.loaded:
                    manager.unload(next(iter(manager.loaded)))
                elif step % 5 == 4 and name in manager.loaded:
                    source = adapters[names[(step + 1) % len(names)]]
                    manager.replace(name, source)  # moves to a slot no forward holds
                    assigned.append((manager.snapshot().version, name, source))
                else:
                    manager.load(adapters[name])  # evicts an unleased LRU adapter when full
                    assigned.append((manager.snapshot().version, name, adapters[name]))
                time.sleep(0.005)
        except Exception as err:  # surfaced in the main thread
            errors.append(err)
        finally:
            stop.set()

    def reader(k: int) -> None:
        gen = torch.Generator().manual_seed(seed + 100 + k)
        experts = random_expert_weights(MC.shape, generator=gen, dtype=torch.float32)
        try:
            for step in itertools.count():
                if stop.is_set():
                    break
                # A random subset of the loaded adapters (and the base model) per forward, so
                # the leases leave the writer a slot now and then, as a server's batches do.
                loaded = sorted(manager.loaded)
                pick = torch.randperm(len(loaded), generator=gen)[: 1 + step % 2].tolist()
                names_t = [None if not pick or t % 4 == k else loaded[pick[t % len(pick)]]
                           for t in range(T)]  # fmt: skip
                x = torch.randn(T, MC.shape.hidden_size, generator=gen)
                ids = torch.stack(
                    [torch.randperm(MC.shape.num_experts, generator=gen)[:2] for _ in range(T)]
                )
                w = torch.rand(T, 2, generator=gen)
                with ExitStack() as stack:
                    try:
                        snap, slots = stack.enter_context(manager.reading(names_t))
                    except InputError:  # a name unloaded since `loaded` was read: again
                        continue
                    outs = {
                        layer: moe_lora_reference(
                            x, ids, w, slots, experts, snap.banks[layer], MC.shape
                        )
                        for layer in MC.moe_layers
                    }
                    held = sorted(set(slots.tolist()) - {-1})
                    # The leased slots as they are at the end of the forward, still leased.
                    at_end = {(layer, f, s): getattr(b, f)[s].clone()
                              for layer, b in snap.banks.items() for f in FIELDS for s in held}  # fmt: skip
                seen.append((k, snap, x, ids, w, slots, outs, at_end))
        except Exception as err:
            errors.append(err)

    threads = [threading.Thread(target=writer)]
    threads += [threading.Thread(target=reader, args=(k,)) for k in range(READERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[0]
    versions = {snap.version for _, snap, *_ in seen}
    assert {k for k, *_ in seen} == set(range(READERS)), "every reader ran forwards"
    assert len(seen) >= 10 and len(versions) >= 5, (len(seen), versions)
    for k, snap, x, ids, w, slots, outs, at_end in seen:
        gen = torch.Generator().manual_seed(seed + 100 + k)
        experts = random_expert_weights(MC.shape, generator=gen, dtype=torch.float32)
        behind = {n: (s, _adapter_at(assigned, n, snap.version)) for n, s in snap.slot_of.items()}
        for layer, out in outs.items():
            want = _expected_bank(behind, layer)
            ref = moe_lora_reference(x, ids, w, slots, experts, want, MC.shape)
            assert torch.equal(out, ref), f"reader {k} version {snap.version} layer {layer}"
        for (layer, f, s), got in at_end.items():  # nothing was written under the forward
            want = getattr(_expected_bank(behind, layer), f)[s]
            assert torch.equal(got, want), f"version {snap.version} layer {layer} {f} slot {s}"
