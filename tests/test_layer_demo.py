"""The layer (oracle verdict at construction, then the selected backend), the PEFT export
round trip, and the demo command end to end."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moelora import (
    AddInputs,
    InputError,
    LoRAConfig,
    load_preset,
    moe_lora_reference,
    random_expert_weights,
    random_lora_bank,
    route,
)
from moelora.cli import main
from moelora.compare import assert_close
from moelora.deployment import Deployment
from moelora.device import target
from moelora.errors import UnsupportedDeploymentError
from moelora.layer import MoELoRALayer
from moelora.lora import LayerLoRA, load_adapter
from moelora.lora.export import save_adapter

MODEL = load_preset("tiny")


def _deployment(**kw) -> Deployment:
    return Deployment(shape=MODEL.shape, routing=MODEL.routing, device=target("cpu"), **kw)


def _batch(gen: torch.Generator, tokens: int = 10):
    shape = MODEL.shape
    x = torch.randn(tokens, shape.hidden_size, generator=gen)
    ids, wts = route(torch.randn(tokens, shape.num_experts, generator=gen), MODEL.routing, 2)
    return x, ids, wts


def test_layer_runs_the_selected_backend_and_matches_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    experts = random_expert_weights(MODEL.shape, generator=gen)
    bank = random_lora_bank(MODEL.shape, 2, 4, generator=gen)
    layer = MoELoRALayer(
        _deployment(lora=LoRAConfig(enabled=True, max_rank=4, num_slots=2), backend="reference"),
        experts,
    )
    assert layer.backend_name == "reference" and layer.selection.how == "explicit"
    x, ids, wts = _batch(gen)
    slots = torch.tensor([-1, 0, 1, 0, -1, 1, 1, 0, -1, 0], dtype=torch.int32)
    out = layer(x, ids, wts, slots, bank)
    ref = moe_lora_reference(x, ids, wts, slots, experts, bank, MODEL.shape)
    assert_close(out, ref, torch.float32)


def test_layer_refuses_lora_the_deployment_did_not_declare(seed):
    gen = torch.Generator().manual_seed(seed)
    experts = random_expert_weights(MODEL.shape, generator=gen)
    bank = random_lora_bank(MODEL.shape, 1, 4, generator=gen)
    attention_only = LoRAConfig(enabled=True, targets=("q_proj", "v_proj"))
    layer = MoELoRALayer(_deployment(lora=attention_only), experts)
    x, ids, wts = _batch(gen)
    with pytest.raises(InputError, match="declared no LoRA"):
        layer(x, ids, wts, torch.zeros(10, dtype=torch.int32), bank)
    with pytest.raises(InputError, match="dtype"):
        layer(x.double(), ids, wts)


def test_layer_refusal_happens_at_construction():
    experts = random_expert_weights(MODEL.shape)
    with pytest.raises(UnsupportedDeploymentError, match="grouped_mm"):
        MoELoRALayer(_deployment(backend="grouped_mm"), experts)


def test_export_round_trip_through_load_adapter(tmp_path, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = dataclasses.replace(MODEL.shape, dtype=torch.float32)
    layers = {}
    for n in MODEL.moe_layers:
        b = random_lora_bank(shape, 1, 3, generator=gen)
        layers[n] = LayerLoRA(b.w13_a[0], b.w13_b[0], b.w2_a[0], b.w2_b[0])
    save_adapter(tmp_path / "a", MODEL, layers, 3, alpha=12.0)
    loaded = load_adapter(tmp_path / "a", MODEL, max_rank=8)
    assert loaded.rank == 3 and set(loaded.layers) == set(MODEL.moe_layers)
    for n, want in layers.items():
        got = loaded.layers[n]
        for field in ("w13_a", "w13_b", "w2_a", "w2_b"):
            assert_close(getattr(got, field), getattr(want, field), torch.float32, what=field)


@pytest.mark.parametrize("model", ["tiny", "tiny-relu2"])
def test_demo_command_end_to_end(model, capsys):
    assert main(["demo", "--model", model, "--tokens", "12", "--adapters", "3"]) == 0
    printed = capsys.readouterr().out
    assert "verdict: PASS" in printed and "adapter-2" in printed


def test_demo_refusal_exits_3_and_bad_counts_exit_2(capsys):
    # issue 18.6: an oracle refusal is exit 3 in every command (it was 2 here, 3 in plan)
    assert main(["demo", "--moe-backend", "grouped_mm", "--tokens", "4"]) == 3
    err = capsys.readouterr().err
    assert "grouped_mm" in err and "would accept" in err
    with pytest.raises(SystemExit) as exit_info:  # argparse refuses before anything runs
        main(["demo", "--tokens", "0"])
    assert exit_info.value.code == 2


def test_plan_json_reports_config_errors_on_stdout(capsys):
    assert main(["plan", "--model", "/no/such/config.json", "--json"]) == 2
    out = capsys.readouterr().out
    assert '"verdict": "ERROR"' in out and "config.json" in out


def _layer_and_batch(seed: int, **lora_kw):
    gen = torch.Generator().manual_seed(seed)
    experts = random_expert_weights(MODEL.shape, generator=gen)
    lora_cfg = LoRAConfig(enabled=True, max_rank=4, num_slots=2, **lora_kw)
    layer = MoELoRALayer(_deployment(lora=lora_cfg, backend="reference"), experts)
    bank = random_lora_bank(MODEL.shape, 2, 4, generator=gen)
    x, ids, wts = _batch(gen)
    slots = torch.randint(-1, 2, (10,), generator=gen, dtype=torch.int32)
    return layer, bank, x, ids, wts, slots


def _bad_ids(ids):
    ids = ids.clone()
    ids[3, 1] = 8  # E = 8: out of range, would be silently dropped
    return ids


def _bad_slots(slots):
    slots = slots.clone()
    slots[2] = 2  # L = 2
    return slots


# (id, how the call is spoiled, regex the InputError must match)
BAD_CALLS = [
    ("rank-above-R", lambda a: a.update(bank=random_lora_bank(MODEL.shape, 2, 8)), "rank 8"),
    ("slots-above-L", lambda a: a.update(bank=random_lora_bank(MODEL.shape, 3, 4)), "3 slots"),
    ("id-out-of-range", lambda a: a.update(ids=_bad_ids(a["ids"])), "containing 8"),
    ("slot-out-of-range", lambda a: a.update(slots=_bad_slots(a["slots"])), "containing 2"),
    ("slot-below-minus-one", lambda a: a.update(slots=a["slots"] - 3), "slots in"),
    ("ids-rows-differ", lambda a: a.update(ids=a["ids"][:7]), "topk_ids"),
    ("weights-fp16", lambda a: a.update(wts=a["wts"].half()), "topk_weights"),
    ("wrong-hidden", lambda a: a.update(x=torch.randn(10, 12)), r"\[T, H = 64\]"),
    ("slots-int64", lambda a: a.update(slots=a["slots"].long()), "token_slots"),
    ("add-inputs-differs", lambda a: a.update(add_inputs=AddInputs.OVERWRITE), "add_inputs"),
]


@pytest.mark.parametrize("case", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_forward_refuses_what_the_oracle_did_not_judge(case, seed):
    layer, bank, x, ids, wts, slots = _layer_and_batch(seed)  # deployment: add_inputs ADD
    call = dict(bank=bank, x=x, ids=ids, wts=wts, slots=slots, add_inputs=None)
    layer(x, ids, wts, slots, bank)  # the unspoiled call runs
    case[1](call)
    out = torch.zeros(call["x"].shape[0], 64)
    with pytest.raises(InputError, match=case[2]):
        layer(
            call["x"],
            call["ids"],
            call["wts"],
            call["slots"],
            call["bank"],
            out=out,
            add_inputs=call["add_inputs"],
        )


def test_construction_checks_the_weights(seed):
    experts = random_expert_weights(MODEL.shape, generator=torch.Generator().manual_seed(seed))
    with pytest.raises(InputError, match=r"experts\.w2"):
        MoELoRALayer(_deployment(), dataclasses.replace(experts, w2=experts.w2[:, :, :16]))
    with pytest.raises(InputError, match="no biases"):
        MoELoRALayer(_deployment(), dataclasses.replace(experts, b2=torch.zeros(8, 64)))


def test_empty_batch_returns_empty(seed):
    layer, bank, x, ids, wts, slots = _layer_and_batch(seed)
    y = layer(x[:0], ids[:0], wts[:0], slots[:0], bank)
    assert y.shape == (0, 64)
