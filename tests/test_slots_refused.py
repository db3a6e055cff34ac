"""An in-memory Adapter whose factors disagree with its rank or with the banks (shape, dtype,
NaN / Inf) is refused by SlotManager before anything is written: loaded or replaced under
a name already served, with slots free or full, and while other threads run forwards, the
name keeps serving its previous version bit for bit, and the error names the tensor."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from adapter_files import bank_of, model_config, write_random_adapter

from moelora import moe_lora_reference, random_expert_weights
from moelora.errors import AdapterError, AdapterProblems
from moelora.lora import Adapter, LayerLoRA, SlotManager, load_adapter
from moelora.weights import LoRABank

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MC = model_config("qwen3_moe")
R, RANK, T = 8, 3, 12
E, H, INTER = MC.shape.num_experts, MC.shape.hidden_size, MC.shape.intermediate_size
ALL_FACTORS = [
    f"layers[{n}].{f}" for n in MC.moe_layers for f in ("w13_a", "w13_b", "w2_a", "w2_b")
]


def _adapter(root, seed: int, name: str) -> Adapter:
    path = write_random_adapter(root / name, MC, RANK, 5, seed=seed)
    return load_adapter(path, MC, R, name=name)


def _with(adapter: Adapter, layer: int, **factors) -> Adapter:
    """`adapter` with some factors of one layer replaced (the others shared)."""
    layers = dict(adapter.layers)
    layers[layer] = dataclasses.replace(layers[layer], **factors)
    return dataclasses.replace(adapter, layers=layers)


def _poke(t: torch.Tensor, value: float) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[t.numel() // 2] = value
    return t


# (id, bad version built from a good one, the keys the error names, what it found)
BAD = [
    ("rank-declared-above-tensors", lambda a: dataclasses.replace(a, rank=RANK + 1),
     ALL_FACTORS, f"shape ({E}, 2, {RANK}, {H})"),  # every factor is rank 3, not 4: all listed
    ("one-factor-lower-rank", lambda a: _with(a, 1, w2_b=a.layers[1].w2_b[..., :2]),
     ["layers[1].w2_b"], f"shape ({E}, {H}, 2)"),
    ("factor-for-another-hidden", lambda a: _with(a, 0, w13_a=torch.randn(E, 2, RANK, H + 1)),
     ["layers[0].w13_a"], f"shape ({E}, 2, {RANK}, {H + 1})"),  # declared shape is right
    ("nan", lambda a: _with(a, 1, w13_b=_poke(a.layers[1].w13_b, float("nan"))),
     ["layers[1].w13_b"], "1 NaN/Inf values"),
    ("inf", lambda a: _with(a, 0, w2_a=_poke(a.layers[0].w2_a, float("-inf"))),
     ["layers[0].w2_a"], "1 NaN/Inf values"),
    ("int8", lambda a: _with(a, 1, w2_a=(a.layers[1].w2_a * 50).to(torch.int8)),
     ["layers[1].w2_a"], "dtype torch.int8"),
    ("not-a-tensor", lambda a: _with(a, 0, w2_b=a.layers[0].w2_b.tolist()), ["layers[0].w2_b"],
     "a list"),
    ("two-bad-factors", lambda a: _with(a, 0, w13_b=a.layers[0].w13_b[..., :1],
                                        w2_a=_poke(a.layers[0].w2_a, float("nan"))),
     ["layers[0].w13_b", "layers[0].w2_a"], f"shape ({E}, 2, {INTER}, 1)"),  # both listed
]  # fmt: skip


def _bank(behind: dict[str, tuple[int, Adapter]], layer: int, num_slots: int) -> LoRABank:
    """The bank name -> (slot, adapter) implies, built from the adapters, not the manager."""
    return bank_of(MC, dict(behind.values()), layer, num_slots, R)


def _serves(manager: SlotManager, good: dict[str, Adapter], gen: torch.Generator) -> None:
    """A forward of every served name and the base model, under a lease, equals bit for bit
    the reference on a bank built from the adapters themselves (every row)."""
    names = [[None, *sorted(good)][t % (len(good) + 1)] for t in range(T)]
    experts = random_expert_weights(MC.shape, generator=gen, dtype=torch.float32)
    x = torch.randn(T, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(T)])
    w = torch.rand(T, 2, generator=gen)
    with manager.reading(names) as (snap, slots):
        behind = {n: (s, good[n]) for n, s in snap.slot_of.items()}
        assert set(behind) == set(good), snap.slot_of
        for layer in MC.moe_layers:
            out = moe_lora_reference(x, ids, w, slots, experts, snap.banks[layer], MC.shape)
            want = _bank(behind, layer, manager.num_slots)
            ref = moe_lora_reference(x, ids, w, slots, experts, want, MC.shape)
            assert torch.equal(out, ref), f"layer {layer}: rows differ from the served adapters"


def _check_refusal(err: AdapterError, bad: Adapter, keys: list[str], found: str) -> None:
    problems = err.problems if isinstance(err, AdapterProblems) else (err,)
    assert [p.key for p in problems] == keys, str(err)
    assert found in str(problems[0].found) and problems[0].expected and problems[0].fix
    assert all(p.file == bad.path for p in problems)
    if len(keys) > 1:
        assert all(k in str(err) for k in keys), str(err)


@pytest.mark.parametrize("make,keys,found", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
@pytest.mark.parametrize("how", ["load", "replace"])
@pytest.mark.parametrize("slots", [3, 2], ids=["slots-free", "slots-full"])
def test_bad_version_is_refused_and_the_old_one_still_served(
    tmp_path, seed, make, keys, found, how, slots
) -> None:
    v1, other = _adapter(tmp_path, seed, "v1"), _adapter(tmp_path, seed + 1, "other")
    bad = make(_adapter(tmp_path, seed + 2, "v2"))
    manager = SlotManager(MC, num_slots=slots, max_rank=R, dtype=torch.float32)
    manager.load(v1, name="v")
    manager.load(other)
    version = manager.snapshot().version
    with pytest.raises(AdapterError) as info:
        manager.load(bad, name="v") if how == "load" else manager.replace("v", bad)
    _check_refusal(info.value, bad, keys, found)
    assert manager.snapshot().version == version and manager.loaded == {"v": 0, "other": 1}
    _serves(manager, {"v": v1, "other": other}, torch.Generator().manual_seed(seed))
    with pytest.raises(AdapterError):  # registering it is refused the same way
        manager.register("v3", bad)
    assert "v3" not in manager.registered


def test_refusals_under_concurrent_forwards(tmp_path, seed) -> None:
    """Slots full; readers run forwards of both names while a writer tries every bad version
    under the served name, by load and by replace: each refused, every row of every forward
    the previous version's."""
    v1, other = _adapter(tmp_path, seed, "v1"), _adapter(tmp_path, seed + 1, "other")
    bads = [make(_adapter(tmp_path, seed + 2 + k, f"bad{k}")) for k, (_, make, *_) in
            enumerate(BAD)]  # fmt: skip
    manager = SlotManager(MC, num_slots=2, max_rank=R, dtype=torch.float32)
    manager.load(v1, name="v")
    manager.load(other)
    good = {"v": v1, "other": other}
    stop, errors, forwards, refused = threading.Event(), [], [0, 0], [0]

    def reader(k: int) -> None:
        gen = torch.Generator().manual_seed(seed + 10 + k)
        try:
            while not stop.is_set():
                _serves(manager, good, gen)
                forwards[k] += 1
        except Exception as err:  # surfaced in the main thread
            errors.append(err)

    def writer() -> None:
        try:
            while min(forwards) < 3 or refused[0] < 4 * len(bads):  # overlap both readers
                for bad in bads:
                    for attempt in (lambda b: manager.load(b, name="v"),
                                    lambda b: manager.replace("v", b)):  # fmt: skip
                        try:
                            attempt(bad)
                        except AdapterError:
                            refused[0] += 1
                        else:
                            errors.append(AssertionError(f"{bad.name} was accepted"))
                            return
                if errors:
                    return
        finally:
            stop.set()

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(2)]
    threads.append(threading.Thread(target=writer))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[0]
    assert min(forwards) >= 3 and refused[0] >= 4 * len(bads), (forwards, refused)
    assert manager.loaded == {"v": 0, "other": 1}
    _serves(manager, good, torch.Generator().manual_seed(seed))


def test_lower_rank_layers_padded_by_zeros_load(tmp_path, seed) -> None:
    """The check is the declared rank, not a refusal of padding: an Adapter whose layers
    were built with LayerLoRA.zeros at its rank and filled to a lower one loads and serves."""
    v1 = _adapter(tmp_path, seed, "v1")
    padded = {
        layer: LayerLoRA.zeros(MC.shape, RANK + 2) for layer in v1.layers
    }  # rank 5 banks, rank-3 contents
    for layer, lora in v1.layers.items():
        padded[layer].w13_a[:, :, :RANK] = lora.w13_a
        padded[layer].w13_b[..., :RANK] = lora.w13_b
        padded[layer].w2_a[:, :RANK] = lora.w2_a
        padded[layer].w2_b[..., :RANK] = lora.w2_b
    wide = dataclasses.replace(v1, rank=RANK + 2, layers=padded)
    manager = SlotManager(MC, num_slots=2, max_rank=R, dtype=torch.float32)
    manager.load(wide, name="v")
    _serves(manager, {"v": wide}, torch.Generator().manual_seed(seed))
