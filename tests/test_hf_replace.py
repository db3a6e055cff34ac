"""Replacing a loaded name through the handle: a refused replacement (a refusal of its
factors, or a slot wait that times out while a call holds every slot) keeps the old version
serving, with free and with full slots; pins are kept, dropped and carried as documented."""

from __future__ import annotations

import json
import shutil
import threading

import pytest
import torch
from hf_models import PAD, alone, build_family
from safetensors.torch import load_file, save_file
from transformers import LogitsProcessor, LogitsProcessorList

from moelora.errors import AdapterError, InputError
from moelora.hf import attach, toy

pytestmark = pytest.mark.filterwarnings("ignore")
NEW = 3
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return build_family("qwen3_moe", tmp_path_factory.mktemp("qwen3"), seed=21)


def _state(handle):
    """What a refused replacement must leave as it was."""
    from peft.tuners.lora import LoraLayer

    lora = {
        n: sorted(m.lora_A) for n, m in handle.model.named_modules() if isinstance(m, LoraLayer)
    }
    banks = {k: v.w13_a.clone() for k, v in handle.registry.manager.snapshot().banks.items()}
    described = [handle.describe(n) for n in handle.adapters]
    return (
        described,
        dict(handle.registry.manager.loaded),
        set(handle.registry.manager.pinned),
        lora,
        banks,
    )


def _assert_same(a, b):
    assert a[:4] == b[:4]
    assert all(torch.equal(a[4][k], b[4][k]) for k in a[4])


def _rank_mismatch(src, dst):
    """q_proj factors of rank 4 while rank_pattern says 2: refused when the factors are read."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    config["rank_pattern"] = {**(config.get("rank_pattern") or {}), "q_proj": 2}
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst


def _int8(src, dst):
    """Attention factors saved as int8: refused as int8 expert factors are, never cast."""
    shutil.copytree(src, dst)
    file = dst / "adapter_model.safetensors"
    tensors = load_file(str(file))
    tensors[Q_A] = torch.randint(-5, 5, tensors[Q_A].shape, dtype=torch.int8)
    save_file(tensors, str(file))
    return dst


class _Hold(LogitsProcessor):
    """Blocks the generate call at its first step until `go` is set (it holds its slots)."""

    def __init__(self, started: threading.Event, go: threading.Event):
        self.started, self.go = started, go

    def __call__(self, input_ids, scores):
        self.started.set()
        assert self.go.wait(timeout=60)
        return scores


def _generate(handle, prompt, names, procs=None):
    ids = prompt[None].expand(len(names), -1)
    return handle.generate(
        ids, adapter_names=names, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
        logits_processor=procs,
    )[:, prompt.shape[0] :]  # fmt: skip


CASES = [
    # (id, slots, old pinned, pin= of the replacement, how it fails, error, words)
    ("rank-free-slots", 4, False, None, "rank", AdapterError, ["rank 4", "q_proj"]),
    ("rank-full-slots", 2, False, None, "rank", AdapterError, ["rank 4", "q_proj"]),
    ("rank-full-pinned", 2, True, None, "rank", AdapterError, ["rank 4", "q_proj"]),
    ("int8-free-slots", 4, False, True, "int8", AdapterError, ["torch.int8", "float"]),
    ("int8-full-slots", 2, True, None, "int8", AdapterError, ["torch.int8", "float"]),
    # a call holds every slot: the pinned replacement must wait for one, and times out (with a
    # slot free nothing waits, so a timeout exists only with full slots)
    ("timeout-full-pin", 2, False, True, "timeout", InputError, ["still leased"]),
    ("timeout-full-carried-pin", 2, True, None, "timeout", InputError, ["still leased"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_refused_replacement_keeps_the_old_version(family, tmp_path, case):
    _, slots, old_pin, new_pin, how, error, words = case
    handle = attach(
        family.fresh(), num_slots=slots, max_rank=8, moe_backend="reference",
        load_timeout_s=0.3,
    )  # fmt: skip
    handle.load_adapter(family.dirs["fused-r4-attn"], name="a", pin=old_pin)
    handle.load_adapter(family.dirs["fused-r2"], name="b")
    assert len(handle.registry.manager.loaded) == 2
    prompt = torch.randint(1, 96, (5,), generator=torch.Generator().manual_seed(5))
    want = alone(family.truth("fused-r4-attn"), prompt, NEW)[0]
    new = tmp_path / "new"
    if how == "rank":
        _rank_mismatch(family.dirs["fused-r4-attn"], new)
    elif how == "int8":
        _int8(family.dirs["fused-r4-attn"], new)
    else:
        toy.write_peft_adapter(
            family.base, new, seed=99, **toy.demo_adapters(family.base)["fused-r4-attn"]
        )
    started, go, outs = threading.Event(), threading.Event(), []
    holder = threading.Thread(
        target=lambda: outs.append(
            _generate(handle, prompt, ["a", "b"], LogitsProcessorList([_Hold(started, go)]))
        )
    )
    if how == "timeout":
        holder.start()
        assert started.wait(timeout=60)
    before = _state(handle)
    try:
        with pytest.raises(error) as info:
            handle.load_adapter(new, name="a", pin=new_pin)
    finally:
        go.set()
        if holder.is_alive():
            holder.join(timeout=60)
    for word in words:
        assert word in str(info.value), str(info.value)
    _assert_same(_state(handle), before)
    assert handle.describe("a")["pinned"] is old_pin
    assert torch.equal(_generate(handle, prompt, ["a", None])[0], want), "the old version serves"
    if how == "timeout":
        assert len(outs) == 1 and torch.equal(outs[0][0], want)


PINS = [
    # (id, pin of the first load, pin= of the replacement, pinned afterwards)
    ("carried", True, None, True),  # None keeps the replaced version's pin (logged)
    ("dropped", True, False, False),
    ("new-pin", False, True, True),
    ("never", False, None, False),
]


@pytest.mark.parametrize("case", PINS, ids=[c[0] for c in PINS])
def test_pins_of_replacements_and_unpin(family, case, caplog):
    _, first, again, pinned = case
    handle = attach(family.fresh(), num_slots=2, max_rank=8, moe_backend="reference")
    handle.load_adapter(family.dirs["fused-r8"], name="a", pin=first)
    with caplog.at_level("INFO", logger="moelora.lora"):
        handle.load_adapter(family.dirs["fused-r2"], name="a", pin=again)
    assert ("keeps the pin" in caplog.text) is (first and again is None)
    internal = handle.version("a").key
    assert handle.describe("a")["pinned"] is pinned
    assert (internal in handle.registry.manager.pinned) is pinned
    handle.unpin("a")
    assert handle.describe("a")["pinned"] is False and not handle.registry.manager.pinned
    with pytest.raises(InputError, match="'nope'"):
        handle.unpin("nope")
