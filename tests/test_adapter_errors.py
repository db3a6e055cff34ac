"""A table of corrupted adapter directories: each raises its documented AdapterError (naming
the file and key) and leaves every slot of a full slot manager exactly as it was."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from adapter_files import fused_tensors, known_factors, model_config, write_random_adapter
from safetensors.torch import load_file, save_file

from moelora.errors import AdapterError, MoeloraError
from moelora.lora import SlotManager, load_adapter

MC = model_config("qwen3_moe")
R, RANK = 8, 3
EXPERTS = "base_model.model.model.layers.{n}.mlp.experts"
KEY_B = EXPERTS.format(n=0) + ".1.up_proj.lora_B.weight"
KEY_A = EXPERTS.format(n=1) + ".2.down_proj.lora_A.weight"
SAFE, CONFIG = "adapter_model.safetensors", "adapter_config.json"


def _edit_tensors(root: Path, fn: Callable[[dict], None]) -> None:
    tensors = load_file(str(root / SAFE))
    fn(tensors)
    save_file(tensors, str(root / SAFE))


def _edit_config(root: Path, **changes) -> None:
    cfg = json.loads((root / CONFIG).read_text())
    cfg.update(changes)
    (root / CONFIG).write_text(json.dumps(cfg))


def _set(key: str, value: Callable[[torch.Tensor], torch.Tensor]):
    return lambda root: _edit_tensors(root, lambda t: t.__setitem__(key, value(t.get(key))))


def _drop(*keys: str):
    return lambda root: _edit_tensors(root, lambda t: [t.pop(k) for k in keys])


def _truncate(root: Path) -> None:
    data = (root / SAFE).read_bytes()
    (root / SAFE).write_bytes(data[: len(data) // 2])


def _garbage_header(root: Path) -> None:
    data = bytearray((root / SAFE).read_bytes())
    data[:16] = b"\xff" * 16
    (root / SAFE).write_bytes(bytes(data))


def _symlink_outside(root: Path) -> None:
    outside = root.parent / "elsewhere.safetensors"
    (root / SAFE).rename(outside)
    os.symlink(outside, root / SAFE)


class Payload:
    """Not a tensor: torch.load(weights_only=True) refuses to rebuild it (no code runs)."""


def _pickled_code(root: Path) -> None:
    (root / SAFE).unlink()
    torch.save({"x": Payload()}, root / "adapter_model.bin")


def _shared_and_per_expert(root: Path) -> None:
    key = EXPERTS.format(n=0) + ".gate_proj.lora_A.weight"
    _edit_tensors(root, lambda t: t.__setitem__(key, torch.randn(RANK, 32)))


def _fused_good() -> dict[str, torch.Tensor]:
    """A valid fused (target_parameters) file's tensors."""
    factors = known_factors(MC, RANK)
    for layer in MC.moe_layers:
        factors[(layer, "up")] = (factors[(layer, "gate")][0], factors[(layer, "up")][1])
    return fused_tensors(MC, factors)


def _fused(mutate: Callable[[dict], None] | None = None) -> Callable[[Path], None]:
    """Replace the per-expert file with a fused one, then apply `mutate` to its tensors."""

    def run(root: Path) -> None:
        tensors = _fused_good()
        if mutate:
            mutate(tensors)
        save_file(tensors, str(root / SAFE))

    return run


FUSED_A = EXPERTS.format(n=0) + ".lora_A.weight"
FUSED_B = EXPERTS.format(n=0) + ".lora_B.weight"

# (id, corruption, regex the error message must match)
CORRUPTIONS = [
    ("missing-config", lambda r: (r / CONFIG).unlink(), "adapter_config.json.*no such file"),
    ("config-not-json", lambda r: (r / CONFIG).write_text("{r: 3"), "invalid JSON"),
    ("missing-weights", lambda r: (r / SAFE).unlink(), "no such file"),
    ("truncated-safetensors", _truncate, "truncated or corrupt"),
    ("corrupt-header", _garbage_header, "truncated or corrupt"),
    ("missing-expert-key", _drop(KEY_B), r"no such key.*missing \[1\]"),
    ("missing-A-factor", _drop(*[EXPERTS.format(n=1) + f".{e}.down_proj.lora_A.weight"
                                 for e in range(4)]), "lora_A.*no such key"),
    ("extra-expert-bias", _set(KEY_B.replace("weight", "bias"), lambda _: torch.zeros(20)),
     "cannot serve"),
    ("wrong-shape", _set(KEY_A, lambda t: torch.randn(RANK, 21)), r"shape \(3, 21\).*\(r, 20\)"),
    ("B-rank-differs-from-A", _set(KEY_B, lambda t: torch.randn(20, RANK + 1)), r"shape \(20, 4\)"),
    ("rank-above-R", lambda r: write_random_adapter(r, MC, 10, 10), "rank 10.*at most.*8"),
    ("config-rank-mismatch", lambda r: _edit_config(r, r=4), "rank 3 in the tensor.*rank 4"),
    ("layer-out-of-range", _set(KEY_B.replace("layers.0", "layers.5"), lambda _: torch.randn(20, 3)),
     "layer 5.*MoE layers"),
    ("expert-out-of-range", _set(KEY_B.replace(".1.up", ".7.up"), lambda _: torch.randn(20, 3)),
     "expert 7.*E = 4"),
    ("int-dtype", _set(KEY_B, lambda t: t.to(torch.int32)), "dtype torch.int32"),
    ("fp64-dtype", _set(KEY_A, lambda t: t.double()), "dtype torch.float64"),
    ("nan", _set(KEY_B, lambda t: t.index_fill(0, torch.tensor([3]), float("nan"))), "NaN/Inf"),
    ("inf", _set(KEY_A, lambda t: t.index_fill(1, torch.tensor([2]), float("inf"))), "NaN/Inf"),
    ("dora", lambda r: _edit_config(r, use_dora=True), "use_dora"),
    ("not-lora", lambda r: _edit_config(r, peft_type="IA3"), "peft_type"),
    ("symlink-escape", _symlink_outside, "outside the adapter directory"),
    ("pickled-code-bin", _pickled_code, "weights_only=True"),
    ("shared-and-per-expert", _shared_and_per_expert, "shared factor and per-expert"),
    ("fused-not-divisible-by-E", _fused(lambda t: t.update({FUSED_A: torch.randn(13, 20),
                                                            FUSED_B: torch.randn(32, 13)})),
     "divisible by E = 4"),
    ("fused-wrong-model", _fused(lambda t: t.__setitem__(FUSED_B, torch.randn(33, 12))),
     "natural layout"),
    ("fused-next-to-per-expert", lambda r: _edit_tensors(r, lambda t: t.update(_fused_good())),
     "one layout"),
    ("empty-file", lambda r: save_file({}, str(r / SAFE)), "empty file"),
    ("bad-regex-pattern", lambda r: _edit_config(r, rank_pattern={"gate_proj(": 3}), "valid regex"),
    ("rank-pattern-string", lambda r: _edit_config(r, rank_pattern={"gate_proj": "3"}), "a number"),
    ("rank-pattern-float", lambda r: _edit_config(r, rank_pattern={"gate_proj": 2.5}),
     "positive integer rank"),
    ("alpha-pattern-null", lambda r: _edit_config(r, alpha_pattern={"gate_proj": None}), "a number"),
    ("two-names-one-part", _set(KEY_B.replace("up_proj", "w3"), lambda _: torch.randn(20, 3)),
     "second lora_B for up"),  # Mixtral's w3 and up_proj both mean "up"
]  # fmt: skip


def _good(root: Path, seed: int = 0) -> Path:
    return write_random_adapter(root, MC, RANK, 6, seed=seed)


@pytest.fixture(scope="module")
def full_manager(tmp_path_factory) -> SlotManager:
    """Two slots, both holding unpinned adapters: a bad load that evicted first would show."""
    root = tmp_path_factory.mktemp("good")
    manager = SlotManager(MC, num_slots=2, max_rank=R, dtype=torch.float32)
    manager.load(_good(root / "one", 1), name="one")
    manager.load(_good(root / "two", 2), name="two")
    return manager


def _contents(manager: SlotManager) -> dict:
    snap = manager.snapshot()
    tensors = {
        (layer, f): getattr(bank, f).clone()
        for layer, bank in snap.banks.items()
        for f in ("w13_a", "w13_b", "w2_a", "w2_b")
    }
    return {"version": snap.version, "slots": dict(snap.slot_of), "tensors": tensors}


def test_table_has_enough_cases() -> None:
    assert len(CORRUPTIONS) >= 15


@pytest.mark.parametrize(
    "corrupt,pattern", [c[1:] for c in CORRUPTIONS], ids=[c[0] for c in CORRUPTIONS]
)
@pytest.mark.parametrize("as_name", ["new", "one"], ids=["load-new", "replace-loaded"])
def test_corruption_raises_and_leaves_slots(
    tmp_path, full_manager, corrupt, pattern, as_name
) -> None:
    root = _good(tmp_path / "bad")
    load_adapter(root, MC, R)  # the uncorrupted file loads
    corrupt(root)
    before = _contents(full_manager)
    with pytest.raises(AdapterError, match=pattern) as info:
        full_manager.load(root, name=as_name)
    err = info.value
    assert err.file.startswith(str(tmp_path)), err.file  # names the file ...
    assert err.key and err.expected  # ... the key, and what was expected
    after = _contents(full_manager)
    assert after["version"] == before["version"] and after["slots"] == before["slots"]
    for k, t in before["tensors"].items():
        assert torch.equal(after["tensors"][k], t), f"slot contents changed at {k}"


def test_all_pinned_full_manager_refuses_and_keeps_slots(tmp_path) -> None:
    manager = SlotManager(MC, num_slots=1, max_rank=R, dtype=torch.float32)
    manager.load(_good(tmp_path / "a", 1), name="a", pin=True)
    before = _contents(manager)
    with pytest.raises(MoeloraError, match="unpin or unload"):
        manager.load(_good(tmp_path / "b", 2), name="b")
    after = _contents(manager)
    assert after["slots"] == before["slots"] == {"a": 0}
    assert all(torch.equal(after["tensors"][k], t) for k, t in before["tensors"].items())


def test_adapter_for_another_model_is_refused(tmp_path) -> None:
    other = model_config("qwen3_moe", hidden=48)
    adapter = load_adapter(
        write_random_adapter(tmp_path / "o", other, 2, 2),
        other,
        R,
    )
    manager = SlotManager(MC, num_slots=1, max_rank=R, dtype=torch.float32)
    with pytest.raises(AdapterError, match="an adapter loaded for"):
        manager.load(adapter)
    assert manager.loaded == {}
