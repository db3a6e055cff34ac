"""The same refusals from every entry point, and all of them at once: NaN / Inf and non-float
factors refused from files and from memory alike, for every factor kind; an alpha of 0
loads with a warning that it serves as the base model; a non-expert rank that disagrees
with the config names the file and the module; the fused orientation read from
adapter_config.json's peft_version, the ambiguity refused only when nothing decides it;
several problems in one adapter listed in one error."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging

import adapter_files as af
import peft
import pytest
import torch
import transformers

from moelora import from_hf
from moelora.compare import assert_close
from moelora.errors import AdapterError, AdapterProblems
from moelora.lora import SlotManager, load_adapter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MC = af.model_config("qwen3_moe")  # H = 32, I = 20: fused shapes read one way
MC_2I = af.model_config("qwen3_moe", inter=16)  # H = 2I: a gate_up-only fused file reads both ways
R, RANK = 8, 3
SAFE = "adapter_model.safetensors"
ATTN = "base_model.model.model.layers.{n}.self_attn.q_proj"
ZERO_WARNING = "every LoRA delta it serves is zero"


def _attention(rank: int = RANK, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n in MC.moe_layers:
        out[f"{ATTN.format(n=n)}.lora_A.weight"] = torch.randn(rank, 32, generator=g)
        out[f"{ATTN.format(n=n)}.lora_B.weight"] = torch.randn(32, rank, generator=g)
    return out


def _fused_gate_up(mc, seed: int, orientation: str = "natural", with_down: bool = True):
    """(known factors, fused tensors) with one gate_up LoRA (gate and up share A)."""
    factors = af.known_factors(mc, 2, seed=seed)
    for layer in mc.moe_layers:
        factors[(layer, "up")] = (factors[(layer, "gate")][0], factors[(layer, "up")][1])
    if not with_down:
        factors = {k: v for k, v in factors.items() if k[1] != "down"}
    return factors, af.fused_tensors(mc, factors, orientation, with_down=with_down)


def _delta(adapter, layer: int, part: str) -> torch.Tensor:
    """B_e @ A_e [E, out, in] of one part of a loaded adapter (scale included)."""
    lora = adapter.layers[layer]
    if part == "down":
        return torch.einsum("ehr,eri->ehi", lora.w2_b, lora.w2_a)
    s = {"gate": 0, "up": 1}[part]
    return torch.einsum("eir,erh->eih", lora.w13_b[:, s], lora.w13_a[:, s])


def _assert_deltas(adapter, factors: dict, scale: dict | float) -> None:
    """Every part's delta equals the known factors' (b @ a * scale): the truth they came from."""
    for (layer, part), (a, b) in factors.items():
        sc = scale[part] if isinstance(scale, dict) else scale
        want = torch.einsum("eor,eri->eoi", b, a) * sc
        assert_close(_delta(adapter, layer, part), want, torch.float32, what=f"{layer} {part}")


# ---- NaN / Inf / non-float: the same refusal from a file and from memory --------------------

KEY_B = af.PREFIX.format(n=1) + ".2.down_proj.lora_B.weight"


def _poke(t: torch.Tensor, value: float) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[t.numel() // 3] = value
    return t


# (id, defect applied to one tensor)
DEFECTS = [
    ("nan", lambda t: _poke(t, float("nan"))),
    ("inf", lambda t: _poke(t, float("inf"))),
    ("int8", lambda t: (t * 40).to(torch.int8)),  # quantized factors: never cast silently
    ("fp64", lambda t: t.double()),
]


@pytest.mark.parametrize("defect", [c[1] for c in DEFECTS], ids=[c[0] for c in DEFECTS])
def test_file_and_memory_refuse_alike(tmp_path, seed, defect) -> None:
    factors = af.known_factors(MC, RANK, seed=seed)
    tensors = af.per_expert_tensors(factors)
    good = load_adapter(
        af.write_adapter(tmp_path / "good", tensors, af.lora_config(RANK, 6)), MC, R
    )
    tensors[KEY_B] = defect(tensors[KEY_B])
    bad_dir = af.write_adapter(tmp_path / "bad", tensors, af.lora_config(RANK, 6))
    with pytest.raises(AdapterError) as from_file:
        load_adapter(bad_dir, MC, R)
    layer = good.layers[1]
    bad = dataclasses.replace(
        good, layers={**good.layers, 1: dataclasses.replace(layer, w2_b=defect(layer.w2_b))}
    )
    manager = SlotManager(MC, num_slots=1, max_rank=R, dtype=torch.float32)
    with pytest.raises(AdapterError) as from_memory:
        manager.load(bad, name="x")
    assert manager.loaded == {}
    f, m = from_file.value, from_memory.value
    assert (f.found, f.expected, f.fix) == (m.found, m.expected, m.fix), (str(f), str(m))
    assert (f.file, f.key) == (str(bad_dir / SAFE), KEY_B)
    assert (m.file, m.key) == (good.path, "layers[1].w2_b")


# ---- int8 (non-float) factors: refused for every factor kind ----------------------------------

FUSED_A = af.PREFIX.format(n=0) + ".base_layer.lora_A.weight"  # gate_up
FUSED_B = af.PREFIX.format(n=1) + ".lora_B.weight"  # down


def _per_expert() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {**af.per_expert_tensors(af.known_factors(MC, RANK, seed=3)), **_attention()}
    return tensors, af.lora_config(RANK, 4)


def _shared_outer() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = af.per_expert_tensors(af.known_factors(MC, RANK, seed=4), shared={"gate": "A"})
    return tensors, af.lora_config(RANK, 4)


def _fused() -> tuple[dict[str, torch.Tensor], dict]:
    return {**_fused_gate_up(MC, 5)[1], **_attention(2)}, af.lora_config(2, 4)


# (id, (tensors, config), the key made int8, serves_non_expert)
INT8_KINDS = [
    ("per-expert-A", _per_expert, af.PREFIX.format(n=0) + ".1.up_proj.lora_A.weight", False),
    ("per-expert-B", _per_expert, KEY_B, False),
    ("shared-outer-A", _shared_outer, af.PREFIX.format(n=1) + ".gate_proj.lora_A.weight", False),
    ("fused-gate-up-A", _fused, FUSED_A, False),
    ("fused-down-B", _fused, FUSED_B, False),
    ("attention-A-served", _per_expert, ATTN.format(n=0) + ".lora_A.weight", True),
    ("attention-B-not-served", _fused, ATTN.format(n=1) + ".lora_B.weight", False),
]


@pytest.mark.parametrize(
    "make,key,serves", [c[1:] for c in INT8_KINDS], ids=[c[0] for c in INT8_KINDS]
)
def test_int8_factor_refused_for_every_kind(tmp_path, make, key, serves) -> None:
    tensors, cfg = make()
    load_adapter(af.write_adapter(tmp_path / "ok", tensors, cfg), MC, R, serves_non_expert=serves)
    tensors[key] = (tensors[key] * 40).to(torch.int8)  # loaded above while it was float
    root = af.write_adapter(tmp_path / "int8", tensors, cfg)
    with pytest.raises(AdapterError) as info:
        load_adapter(root, MC, R, serves_non_expert=serves)
    err = info.value
    assert (err.file, err.key, err.found) == (str(root / SAFE), key, "dtype torch.int8"), str(err)


# ---- alpha = 0: loads, and the warning says it serves as the base model --------------------


# (id, lora_alpha, alpha_pattern, the warning's words, scale per part)
ALPHA_ZERO = [
    ("lora-alpha-0", 0, {}, ["lora_alpha = 0", "so it serves as the base model"],
     {"gate": 0.0, "up": 0.0, "down": 0.0}),
    ("pattern-alpha-0", 6, {"down_proj": 0}, ["alpha_pattern['down_proj'] = 0",
                                               "so those modules serve as the base model"],
     {"gate": 2.0, "up": 2.0, "down": 0.0}),
]  # fmt: skip


@pytest.mark.parametrize(
    "alpha,pattern,words,scale", [c[1:] for c in ALPHA_ZERO], ids=[c[0] for c in ALPHA_ZERO]
)
def test_alpha_zero_loads_with_a_warning(tmp_path, caplog, seed, alpha, pattern, words, scale):
    factors = af.known_factors(MC, RANK, seed=seed)
    cfg = af.lora_config(RANK, alpha, alpha_pattern=pattern)
    root = af.write_adapter(tmp_path / "ad", af.per_expert_tensors(factors), cfg)
    with caplog.at_level(logging.WARNING, logger="moelora.lora"):
        adapter = load_adapter(root, MC, R)
    messages = [r.getMessage() for r in caplog.records]
    alpha_warnings = [m for m in messages if "alpha" in m]
    assert len(alpha_warnings) == 1 and all(w in alpha_warnings[0] for w in words), messages
    assert not any(ZERO_WARNING in m for m in messages), messages  # the cause is named once
    _assert_deltas(adapter, factors, scale)


# ---- a non-expert rank against the config: the file in the file field, the module as key ----


@pytest.mark.parametrize("serves", [True, False], ids=["served", "not-served"])
def test_module_rank_mismatch_names_file_and_module(tmp_path, serves) -> None:
    tensors = {**af.per_expert_tensors(af.known_factors(MC, RANK)), **_attention(RANK)}
    cfg = af.lora_config(RANK, 6, rank_pattern={"q_proj": RANK + 1})  # the file's q_proj: rank 3
    root = af.write_adapter(tmp_path / "ad", tensors, cfg)
    manager = SlotManager(MC, num_slots=1, max_rank=R, dtype=torch.float32)
    with pytest.raises(AdapterError) as info:
        manager.load(root, name="x", serves_non_expert=serves)
    problems = info.value.problems  # both layers' q_proj, one problem each
    assert [(p.file, p.key) for p in problems] == [
        (str(root / SAFE), ATTN.format(n=n)) for n in MC.moe_layers
    ]
    assert all(p.found == f"rank {RANK} in lora_A [{RANK}, 32], lora_B [32, {RANK}]"
               and p.expected.startswith(f"rank {RANK + 1} from") for p in problems)  # fmt: skip
    assert manager.loaded == {}


# ---- the fused orientation from peft_version ---------------------------------------------------

# Llama-4 stores its experts [E, in, out] with no is_transposed flag: PEFT reads it the
# other way round from Qwen3-MoE (fused.STORED_IN_OUT).
LLAMA4_2I = from_hf(
    {"model_type": "llama4_text", "hidden_size": 32, "num_local_experts": 4,
     "intermediate_size": 16, "num_experts_per_tok": 1, "num_hidden_layers": 2,
     "torch_dtype": "float32"}, name="tiny-llama4",
)  # fmt: skip
MODELS = {"qwen3_moe": MC_2I, "llama4_text": LLAMA4_2I}  # both H = 2I

# (id, model, peft_version written, orientation the file was saved in, fused_orientation,
# loads)
VERSIONS = [
    ("peft-0.21.2", "qwen3_moe", "0.21.2", "natural", None, True),
    ("peft-0.19.1-first-fixed", "qwen3_moe", "0.19.1", "natural", None, True),
    ("peft-0.20-dev", "qwen3_moe", "0.20.0.dev0@5d602fdbf", "natural", None, True),
    ("peft-0.18.1", "qwen3_moe", "0.18.1", "swapped", None, True),
    ("peft-0.17.1", "qwen3_moe", "0.17.1", "swapped", None, True),
    ("told-overrides-version", "qwen3_moe", "0.21.2", "swapped", "swapped", True),
    ("llama4-peft-0.21.2", "llama4_text", "0.21.2", "swapped", None, True),
    ("llama4-peft-0.18.1", "llama4_text", "0.18.1", "natural", None, True),
    ("peft-0.19.0-undecided", "qwen3_moe", "0.19.0", "natural", None, False),  # see fused.py
    ("peft-0.19.1-dev-undecided", "qwen3_moe", "0.19.1.dev0@abc", "natural", None, False),
    ("peft-0.18.2-dev-undecided", "qwen3_moe", "0.18.2.dev0@5356277", "swapped", None, False),
    ("no-peft-version", "qwen3_moe", None, "natural", None, False),
    ("unreadable-version", "qwen3_moe", "main", "natural", None, False),
]


@pytest.mark.parametrize(
    "model,version,written,told,loads", [c[1:] for c in VERSIONS], ids=[c[0] for c in VERSIONS]
)
def test_peft_version_decides_an_ambiguous_orientation(
    tmp_path, seed, model, version, written, told, loads
) -> None:
    mc = MODELS[model]
    factors, tensors = _fused_gate_up(mc, seed, written, with_down=False)
    extra = {} if version is None else {"peft_version": version}
    root = af.write_adapter(tmp_path / "ad", tensors, af.lora_config(2, 3, **extra))
    if loads:
        _assert_deltas(load_adapter(root, mc, 4, fused_orientation=told), factors, 1.5)
        return
    with pytest.raises(AdapterError) as info:
        load_adapter(root, mc, 4)
    fix = info.value.fix
    assert "fused_orientation='natural'" in fix and "--fused-orientation natural|swapped" in fix
    assert repr(version) in fix, fix


def test_version_decided_orientation_that_does_not_fit_names_it(tmp_path) -> None:
    """A file whose shapes only read swapped, under a config claiming PEFT 0.21.2."""
    _, tensors = _fused_gate_up(MC, 1, "swapped")
    root = af.write_adapter(tmp_path / "ad", tensors, af.lora_config(2, 2, peft_version="0.21.2"))
    with pytest.raises(AdapterError, match=r"natural layout .*\(what PEFT 0.21.2 saves"):
        load_adapter(root, MC, 4)
    load_adapter(root, MC, 4, fused_orientation="swapped")  # the override still reads it


def test_peft_written_gate_up_at_h_eq_2i_loads_and_equals_peft(tmp_path) -> None:
    """PEFT's own file (OLMoE-like H = 2I, gate_up only): read by its peft_version, with no
    argument, and equal to PEFT's own delta weight."""
    torch.manual_seed(4321)
    cfg = transformers.AutoConfig.for_model(
        "qwen3_moe", hidden_size=32, moe_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=64, norm_topk_prob=True,
    )  # fmt: skip
    base = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    lora = peft.LoraConfig(r=2, lora_alpha=5, target_parameters=["mlp.experts.gate_up_proj"])
    pm = peft.get_peft_model(copy.deepcopy(base), lora).eval()
    with torch.no_grad():  # PEFT starts B at zero
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    pm.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["peft_version"]
    adapter = load_adapter(tmp_path, from_hf(base.config.to_dict()), 4)
    want = pm.base_model.model.model.layers[0].mlp.experts.get_delta_weight("default").detach()
    got = torch.cat([_delta(adapter, 0, "gate"), _delta(adapter, 0, "up")], 1)
    assert_close(got, want, torch.float32)


# ---- several problems: every one listed ----------------------------------------------------


def test_several_problems_are_listed_together(tmp_path) -> None:
    """An orientation nothing decides, a NaN attention factor and an int8 one: one error
    naming all three (each with its own key and fix), and a manager left as it was."""
    _, tensors = _fused_gate_up(MC_2I, 2, with_down=False)
    attention = _attention(2)
    nan_key, int8_key = ATTN.format(n=0) + ".lora_B.weight", ATTN.format(n=1) + ".lora_A.weight"
    attention[nan_key] = _poke(attention[nan_key], float("nan"))
    attention[int8_key] = (attention[int8_key] * 40).to(torch.int8)
    root = af.write_adapter(tmp_path / "ad", {**tensors, **attention}, af.lora_config(2, 2))
    manager = SlotManager(MC_2I, num_slots=1, max_rank=4, dtype=torch.float32)
    with pytest.raises(AdapterProblems) as info:
        manager.load(root, name="x", serves_non_expert=True)
    err = info.value
    by_key = {p.key: p for p in err.problems}
    assert set(by_key) == {nan_key, int8_key, af.PREFIX.format(n=0) + ".lora_A.weight"}, str(err)
    assert "1 NaN/Inf values" in by_key[nan_key].found
    assert by_key[int8_key].found == "dtype torch.int8"
    assert "--fused-orientation" in by_key[af.PREFIX.format(n=0) + ".lora_A.weight"].fix
    assert str(err).startswith("3 problems") and all(k in str(err) for k in by_key), str(err)
    assert manager.loaded == {}


def test_the_handle_names_every_refusal(tmp_path) -> None:
    """The issue's case through the transformers handle: a gate_up file nothing decides at
    H = 2I AND a LoRA on a module nothing serves (a norm): both named in one error, nothing
    loaded."""
    from moelora.hf import attach

    cfg = transformers.AutoConfig.for_model(
        "qwen3_moe", hidden_size=32, moe_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=64,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    norm = "base_model.model.model.layers.1.post_attention_layernorm"
    _, tensors = _fused_gate_up(MC_2I, 6, with_down=False)
    tensors[f"{norm}.lora_A.weight"] = torch.randn(2, 32)
    tensors[f"{norm}.lora_B.weight"] = torch.randn(32, 2)
    root = af.write_adapter(tmp_path / "ad", tensors, af.lora_config(2, 2))
    handle = attach(model, num_slots=2, max_rank=4)
    with pytest.raises(AdapterProblems) as info:
        handle.load_adapter(root, name="x")
    keys = [p.key for p in info.value.problems]
    assert keys[0] == af.PREFIX.format(n=0) + ".lora_A.weight" and len(keys) == 2, keys
    assert "post_attention_layernorm" in keys[1], keys
    assert "--fused-orientation" in info.value.problems[0].fix
    assert handle.adapters == []


# ---- one fault met by two checks: listed once -------------------------------------------

HEADER = ("a.safetensors", "<header>", "an unreadable file", "a complete safetensors file",
          "the file is truncated or corrupt: copy or save it again")  # fmt: skip


def _error(**changes) -> AdapterError:
    file, key, found, expected, fix = HEADER
    return AdapterError(**{**dict(file=file, key=key, found=found, expected=expected, fix=fix),
                           **changes})  # fmt: skip


# (id, the error each check raises, how many problems the refusal lists)
REPEATS = [
    ("identical-twice", [_error(), _error()], 1),
    # one field apart: two problems, both listed
    ("other-key", [_error(), _error(key="w")], 2),
    ("other-found", [_error(), _error(found="3 NaN/Inf values")], 2),
    ("other-fix", [_error(), _error(fix="save it again")], 2),
    ("other-file", [_error(), _error(file="b.safetensors")], 2),
    # a check that raises several at once: flattened, and its repeat of an earlier one dropped
    ("inside-a-list", [_error(), AdapterProblems([_error(), _error(key="w")])], 2),
]  # fmt: skip


@pytest.mark.parametrize("case", REPEATS, ids=[c[0] for c in REPEATS])
def test_an_error_identical_to_one_kept_is_listed_once(case) -> None:
    from moelora.lora.refusals import Refusals

    _, raised, count = case
    refusals = Refusals()
    for err in raised:
        with refusals.check():
            raise err
    with pytest.raises(AdapterError) as info:
        refusals.raise_any()
    problems = getattr(info.value, "problems", (info.value,))
    assert len(problems) == count, str(info.value)
    assert isinstance(info.value, AdapterProblems) == (count > 1), str(info.value)


def test_a_truncated_file_is_one_problem(tmp_path, capsys) -> None:
    """The issue's case: a truncated adapter_model.safetensors fails the handle's experts read
    and its modules read alike; the error names it once (it said "2 problems" with two
    identical lines), through the handle and through `moelora generate`."""
    from moelora.cli import main
    from moelora.hf import attach, toy

    base = toy.build_model("qwen3_moe", seed=1)
    adapter = tmp_path / "a"
    toy.write_peft_adapter(base, adapter, seed=2, **toy.demo_adapters(base)["fused-r4-attn"])
    data = (adapter / SAFE).read_bytes()
    (adapter / SAFE).write_bytes(data[: len(data) // 2])
    handle = attach(copy.deepcopy(base), num_slots=2, max_rank=8, moe_backend="reference")
    with pytest.raises(AdapterError) as info:
        handle.load_adapter(adapter, name="x")
    assert not isinstance(info.value, AdapterProblems), str(info.value)
    assert info.value.key == "<header>" and "truncated or corrupt" in info.value.fix
    assert handle.adapters == []
    base.save_pretrained(tmp_path / "model")
    argv = ["generate", "--model", str(tmp_path / "model"), "--adapter", f"x={adapter}",
            "--max-new-tokens", "1", "--moe-backend", "reference"]  # fmt: skip
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("truncated or corrupt") == 1 and "problems" not in err, err
