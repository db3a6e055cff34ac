"""The handle's adapters: refusals that change nothing, and loads / replaces / unloads between
and during generate calls, where every call keeps the adapter versions it started with."""

from __future__ import annotations

import shutil
import threading

import pytest
import torch
from hf_models import PAD, alone, build_family
from safetensors.torch import load_file, save_file
from transformers import LogitsProcessor, LogitsProcessorList

from moelora.errors import (
    AdapterError,
    ConfigError,
    InputError,
    MoeloraError,
    UnsupportedDeploymentError,
)
from moelora.hf import attach, experts, toy

pytestmark = pytest.mark.filterwarnings("ignore")
NEW = 4


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return build_family("qwen3_moe", tmp_path_factory.mktemp("qwen3"), seed=7)


def _state(handle):
    """Everything a refused load must leave as it was: names, slots, expert and module banks."""
    banks = {k: v.w13_a.clone() for k, v in handle.registry.manager.snapshot().banks.items()}
    modules = handle.registry.manager.module_banks
    banks.update({p: t.clone() for p, t in modules.a.items()})
    banks.update({f"{p}.bt": t.clone() for p, t in modules.bt.items()})
    return handle.adapters, dict(handle.registry.manager.loaded), banks


def _same(a, b):
    assert a[:2] == b[:2]
    assert a[2].keys() == b[2].keys()
    assert all(torch.equal(a[2][k], b[2][k]) for k in a[2])


def _with_extra_keys(src, dst, extra: dict[str, torch.Tensor]):
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "adapter_model.safetensors"))
    save_file({**tensors, **extra}, str(dst / "adapter_model.safetensors"))
    return dst


REFUSALS = [
    # (id, how to make the adapter, exception, words the message must hold)
    ("norm-lora", "norm", AdapterError, ["input_layernorm", "does not serve"]),
    ("missing-module", "missing", AdapterError, ["self_attn.w_nope", "does not serve"]),
    ("rank-above-max", "rank", AdapterError, ["rank 8", "max_rank"]),
    ("other-model", "other", AdapterError, ["expected"]),
]


@pytest.mark.parametrize("case", REFUSALS, ids=[c[0] for c in REFUSALS])
def test_refused_adapters_change_nothing(family, tmp_path, case):
    _, how, error, words = case
    handle = attach(family.fresh(), num_slots=4, max_rank=4, moe_backend="reference")
    handle.load_adapter(family.dirs["fused-r4-attn"], name="ok")
    before = _state(handle)
    src = family.dirs["fused-r4-attn"]
    if how == "norm":  # LoRA on a norm (a module with a .weight, not a Linear): not served
        path = _with_extra_keys(src, tmp_path / "bad", {
            "base_model.model.model.layers.0.input_layernorm.lora_A.weight": torch.randn(4, 32),
            "base_model.model.model.layers.0.input_layernorm.lora_B.weight": torch.randn(32, 4),
        })  # fmt: skip
    elif how == "missing":
        path = _with_extra_keys(src, tmp_path / "bad", {
            "base_model.model.model.layers.0.self_attn.w_nope.lora_A.weight": torch.randn(4, 32),
            "base_model.model.model.layers.0.self_attn.w_nope.lora_B.weight": torch.randn(8, 4),
        })  # fmt: skip
    elif how == "rank":
        path = family.dirs["fused-r8"]
    else:  # an adapter saved for a model with another hidden size
        other = toy.build_model("qwen3_moe", seed=3, hidden_size=48)
        path = tmp_path / "other"
        toy.write_peft_adapter(other, path, seed=5, **toy.demo_adapters(other)["fused-r2"])
    with pytest.raises(error) as info:
        handle.load_adapter(path, name="bad")
    for word in words:
        assert word in str(info.value), str(info.value)
    _same(_state(handle), before)


def test_bad_calls_are_refused_before_running(family):
    handle = attach(family.fresh(), num_slots=2, max_rank=8, moe_backend="reference")
    handle.load_adapter(family.dirs["fused-r2"], name="a")
    ids = torch.randint(1, 96, (2, 5))
    with pytest.raises(InputError, match=r"'nope'.*loaded adapter"):
        handle.generate(ids, adapter_names=["a", "nope"], max_new_tokens=2)
    with pytest.raises(InputError, match=r"3 names.*2 rows"):
        handle.generate(ids, adapter_names=["a", None, "a"], max_new_tokens=2)
    with pytest.raises(InputError, match="adapter_names"):
        handle(ids, adapter_names="a")
    # nothing leaked: no lease held, no current call
    from moelora.lora import rows as batch

    assert batch.current() is None
    assert not handle.registry.manager.leased()


def test_explicit_backend_refused_before_anything_is_allocated(family):
    model = family.fresh()
    with pytest.raises(UnsupportedDeploymentError) as info:
        attach(model, num_slots=2, max_rank=8, moe_backend="grouped_mm")
    assert "grouped_mm" in str(info.value) and "device" in str(info.value)
    assert not any(experts.key_of(m) is not None for m in model.modules())
    assert model.config._experts_implementation != "moelora"


@pytest.mark.parametrize(
    "sizes, named",
    [
        (dict(num_slots=0, max_rank=8), "'num_slots' = 0"),  # no slot for an adapter
        (dict(num_slots=2, max_rank=0), "'max_rank' = 0"),  # no rank for a factor
    ],
    ids=["no-slot", "no-rank"],
)
def test_bad_bank_sizes_are_refused_naming_the_keyword_passed(family, sizes, named):
    model = family.fresh()
    with pytest.raises(ConfigError, match=named):
        attach(model, moe_backend="reference", **sizes)
    assert not any(experts.key_of(m) is not None for m in model.modules())
    assert model.config._experts_implementation != "moelora"


class _MidCall(LogitsProcessor):
    """Runs `action` once, at the second decoding step of a generate call."""

    def __init__(self, action):
        self.action, self.steps = action, 0

    def __call__(self, input_ids, scores):
        self.steps += 1
        if self.steps == 2:
            self.action()
        return scores


def _generate(handle, prompt, names, action=None):
    procs = LogitsProcessorList([_MidCall(action)]) if action else None
    ids = prompt[None].expand(len(names), -1)
    return handle.generate(
        ids, adapter_names=names, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
        logits_processor=procs,
    )[:, prompt.shape[0] :]  # fmt: skip


@pytest.mark.parametrize("slots", [4, 2], ids=["free-slots", "full-slots"])
def test_swaps_during_a_call_keep_its_versions(family, tmp_path, slots):
    """A replace ("a": v1 -> v2, both with attention LoRA) and an unload ("b") run from
    another thread while a call generates with them: that call's rows equal v1 / b alone;
    the next call sees v2 and refuses "b"."""
    v1, v2 = family.dirs["fused-r4-attn"], tmp_path / "v2"
    base = family.base
    v2_model = toy.write_peft_adapter(
        base, v2, seed=4242, **toy.demo_adapters(base)["fused-r4-attn"]
    )
    handle = attach(family.fresh(), num_slots=slots, max_rank=8, moe_backend="reference")
    handle.load_adapter(v1, name="a")
    handle.load_adapter(family.dirs["fused-r2"], name="b")
    prompt = torch.randint(1, 96, (6,), generator=torch.Generator().manual_seed(11))
    want = {
        "a1": alone(family.truth("fused-r4-attn"), prompt, NEW)[0],
        "a2": alone(v2_model, prompt, NEW)[0],
        "b": alone(family.truth("fused-r2"), prompt, NEW)[0],
        None: alone(base, prompt, NEW)[0],
    }
    assert not torch.equal(want["a1"], want["a2"]), "the two versions must differ"
    errors = []

    def swap():
        try:
            handle.load_adapter(v2, name="a")
            handle.unload_adapter("b")
        except MoeloraError as err:  # surfaced below
            errors.append(err)

    worker = threading.Thread(target=swap)

    # the swap completes during the call, with free and with full slots (full: the new
    # version is registered and copied into a slot when a call first names it)
    def action():
        worker.start()
        worker.join(timeout=30)
        assert not worker.is_alive(), "the swap must not wait for the call"

    out = _generate(handle, prompt, ["a", "b", None], action)
    worker.join(timeout=60)
    assert not worker.is_alive() and not errors, errors
    assert torch.equal(out[0], want["a1"]), "the call must keep the version it started with"
    assert torch.equal(out[1], want["b"])
    assert torch.equal(out[2], want[None])
    after = _generate(handle, prompt, ["a", None])
    assert torch.equal(after[0], want["a2"]) and torch.equal(after[1], want[None])
    assert handle.adapters == ["a"]
    with pytest.raises(InputError, match="'b'"):
        _generate(handle, prompt, ["b"])
    assert list(handle.registry.manager.registered) == [handle.version("a").key], (
        "retired versions must leave the slot manager"
    )


def test_generate_threads_with_a_swapper(family, tmp_path):
    """Two generating threads and one thread that keeps replacing "a" between two versions:
    every row of every call equals one version entirely (never a mix of the two)."""
    v2 = tmp_path / "v2"
    base = family.base
    v2_model = toy.write_peft_adapter(base, v2, seed=77, **toy.demo_adapters(base)["fused-r4-attn"])
    handle = attach(family.fresh(), num_slots=3, max_rank=8, moe_backend="reference")
    handle.load_adapter(family.dirs["fused-r4-attn"], name="a")
    prompt = torch.randint(1, 96, (5,), generator=torch.Generator().manual_seed(3))
    allowed = [
        alone(family.truth("fused-r4-attn"), prompt, NEW)[0],
        alone(v2_model, prompt, NEW)[0],
    ]
    stop, failures, calls = threading.Event(), [], []

    def swapper():
        paths = [v2, family.dirs["fused-r4-attn"]]
        i = 0
        while not stop.is_set():
            handle.load_adapter(paths[i % 2], name="a")
            i += 1

    def generator():
        for _ in range(6):
            out = _generate(handle, prompt, ["a", None])
            calls.append(out)
            if not any(torch.equal(out[0], w) for w in allowed):
                failures.append(out[0])

    threads = [threading.Thread(target=generator) for _ in range(2)]
    swap_thread = threading.Thread(target=swapper)
    swap_thread.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    stop.set()
    swap_thread.join(timeout=60)
    assert len(calls) == 12 and not failures, failures


def test_more_adapters_than_slots(family, seed):
    """Four adapters, two slots: each call names at most two, the others wait in host
    memory and are copied in when named; every row equals HF + PEFT alone. A call naming
    more distinct adapters than slots is refused and leaves nothing held."""
    handle = attach(family.fresh(), num_slots=2, max_rank=8, moe_backend="reference")
    for name, path in family.dirs.items():
        handle.load_adapter(path, name=name)
    assert handle.adapters == sorted(family.dirs)
    prompt = torch.randint(1, 96, (6,), generator=torch.Generator().manual_seed(seed))
    pairs = [("fused-r8", "fused-r2"), ("modules-r4", "fused-r4-attn"), ("fused-r2", "modules-r4")]
    for names in pairs:
        out = _generate(handle, prompt, [*names, None])
        for row, name in enumerate([*names, None]):
            assert torch.equal(out[row], alone(family.truth(name), prompt, NEW)[0]), (names, row)
    assert handle.registry.manager.stats().misses >= 2  # adapters were copied in on demand
    with pytest.raises(InputError, match="num_slots = 2"):
        _generate(handle, prompt, ["fused-r8", "fused-r2", "modules-r4"])
    from moelora.lora import rows as batch

    assert batch.current() is None and not handle.registry.manager.leased()
