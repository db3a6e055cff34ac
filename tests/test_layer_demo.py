"""The layer (oracle verdict at construction, then the selected backend), the PEFT export
round trip, and the demo command end to end."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moelora import (
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
        _deployment(lora=LoRAConfig(enabled=True, max_rank=4, max_loras=2), backend="reference"),
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


def test_demo_refusals_and_bad_counts_exit_2(capsys):
    assert main(["demo", "--moe-backend", "grouped_mm", "--tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert "grouped_mm" in err and "would accept" in err
    with pytest.raises(SystemExit) as exit_info:  # argparse refuses before anything runs
        main(["demo", "--tokens", "0"])
    assert exit_info.value.code == 2


def test_plan_json_reports_config_errors_on_stdout(capsys):
    assert main(["plan", "--model", "/no/such/config.json", "--json"]) == 2
    out = capsys.readouterr().out
    assert '"verdict": "ERROR"' in out and "config.json" in out
