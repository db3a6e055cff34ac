"""The load benchmark's adapter writer (benchmarks/serve_load_model.py) writes PEFT's own file
layout: the same keys and shapes as PEFT's save_pretrained on a tiny Qwen3-MoE of the same
config, and the handle loads it. Its row summary (benchmarks/serve_load_report.py) against a
sorted-list truth."""

from __future__ import annotations

import json
import random

import pytest
from safetensors import safe_open

from benchmarks import serve_load_model, serve_load_report
from moelora.hf import attach, toy

pytestmark = pytest.mark.filterwarnings("ignore")

CASES = [
    # (id, rank, layers): the edge each covers
    ("rank-4-two-layers", 4, 2),
    ("rank-1-one-layer", 1, 1),  # r = 1: A and B are one row / column per expert
]


def _shapes(path) -> dict:
    with safe_open(str(path / "adapter_model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_written_adapter_matches_peft_layout_and_loads(case, tmp_path, seed):
    _, rank, layers = case
    config = serve_load_model.model_config(layers, tiny=True)
    base = toy.build_model("qwen3_moe", seed=seed % 1000, **{k: config[k] for k in
                           ("hidden_size", "moe_intermediate_size", "num_experts",
                            "num_experts_per_tok", "num_hidden_layers")})  # fmt: skip
    toy.write_peft_adapter(base, tmp_path / "peft", seed=1, r=rank, lora_alpha=2 * rank,
                           target_parameters=toy.expert_parameters(base))  # fmt: skip
    serve_load_model.write_expert_adapter(tmp_path / "ours", config, rank, seed=seed)
    assert _shapes(tmp_path / "ours") == _shapes(tmp_path / "peft")
    ours = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    peft = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert {k: ours[k] for k in ("r", "lora_alpha", "peft_type")} == {
        k: peft[k] for k in ("r", "lora_alpha", "peft_type")
    }
    assert sorted(ours["target_parameters"]) == sorted(peft["target_parameters"])
    handle = attach(base, num_slots=1, max_rank=rank, moe_backend="reference")
    handle.load_adapter(tmp_path / "ours", name="ours")
    assert handle.describe("ours")["rank"] == rank and handle.describe("ours")["experts"]


def test_summary_percentiles_and_throughput(seed):
    rng = random.Random(seed)
    results = [{"ok": True, "error": None, "ttft": rng.random(), "tokens": 6,
                "itl": [rng.random() for _ in range(5)]} for _ in range(40)]  # fmt: skip
    results.append({"ok": False, "error": "APITimeoutError: x", "ttft": 0.0, "tokens": 2,
                    "itl": [0.0]})  # fmt: skip  # a failure: counted, not in the latencies
    out = serve_load_report.level_row(results, 4.0, before={}, after={})
    ttft = sorted(r["ttft"] for r in results[:40])
    assert out["ttft_p50_ms"] == ttft[20] * 1e3 and out["ttft_p99_ms"] == ttft[39] * 1e3
    itl = sorted(g for r in results[:40] for g in r["itl"])
    assert out["itl_p99_ms"] == itl[198] * 1e3
    assert out["output_tok_s"] == 242 / 4.0
    assert (out["requests"], out["completed"], out["failed"]) == (41, 40, 1)
    assert out["errors"] == {"APITimeoutError: x": 1}
