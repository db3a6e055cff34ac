"""`moelora bench --peer-json`: the vLLM peer's times are set beside ours only when the peer
ran the same layer (experts, top-k, sizes, dtype, adapters, rank) as every timed case."""

from __future__ import annotations

import json
import random

import pytest

from moelora.bench.cases import CASES
from moelora.bench.peer import peer_rows, peer_shape
from moelora.errors import InputError


def _write(tmp_path, shape: dict, tokens: list[int]):
    ms = {t: random.uniform(0.01, 5.0) for t in tokens}  # fresh values: nothing hard-coded
    rows = [dict(T=t, base_pre_ms=ms[t], lora_pre_ms=2 * ms[t]) for t in tokens]
    path = tmp_path / "vllm_peer.json"
    path.write_text(json.dumps(dict(shape=shape, rows=rows)))
    return str(path), ms


def test_peer_of_the_same_layer_is_read(tmp_path) -> None:
    cases = CASES["mixtral"]
    tokens = [c.tokens for c in cases]
    path, ms = _write(tmp_path, {**peer_shape(cases[0]), "w_std": 0.02}, tokens)
    rows = peer_rows(path, cases)
    assert sorted(rows) == sorted(tokens)
    assert all(rows[t]["base_pre_ms"] == ms[t] for t in tokens)


@pytest.mark.parametrize("field", ["E", "top_k", "H", "I", "dtype", "max_loras", "rank", "bias"])
def test_peer_of_another_layer_is_refused(tmp_path, field: str) -> None:
    cases = CASES["qwen3"]
    shape = peer_shape(cases[0])
    shape[field] = {"dtype": "fp16", "bias": True}.get(field, shape.get(field, 0) * 2)
    path, _ = _write(tmp_path, shape, [c.tokens for c in cases])
    with pytest.raises(InputError, match=f"'{field}': {shape[field]!r}"):
        peer_rows(path, cases)


@pytest.mark.parametrize("suite", ["gpt-oss", "nemotron"])
def test_peer_beside_another_activation_is_refused(tmp_path, suite: str) -> None:
    """The peer runs SiLU-gated experts only: its JSON beside a swigluoai (with biases) or
    relu2 layer of the same sizes is refused, not compared."""
    from moelora.bench.cases import BenchCase

    case = BenchCase({"gpt-oss": "gpt-oss-20b", "nemotron": "nemotron-h"}[suite], 64)
    shape = {k: v for k, v in peer_shape(case).items() if k not in ("activation", "bias")}
    path, _ = _write(tmp_path, shape, [64])
    with pytest.raises(InputError, match="activation"):
        peer_rows(path, [case])


def test_peer_beside_weights_on_input_is_refused(tmp_path) -> None:
    """Llama 4 scales the expert input by the routing weight; the peer scales the output.
    A peer JSON of the same sizes (written before the key existed: no weights_on_input) is
    refused beside it, and still read beside a layer that weights the output."""
    from moelora.bench.cases import BenchCase

    case = BenchCase("llama4-scout", 64)
    shape = {k: v for k, v in peer_shape(case).items() if k != "weights_on_input"}
    path, _ = _write(tmp_path, shape, [64])
    with pytest.raises(InputError, match="weights_on_input"):
        peer_rows(path, [case])
    qwen = CASES["qwen3"]
    old = {k: v for k, v in peer_shape(qwen[0]).items() if k != "weights_on_input"}
    path, _ = _write(tmp_path, old, [c.tokens for c in qwen])
    assert set(peer_rows(path, qwen)) == {c.tokens for c in qwen}


def test_no_peer_file_means_no_peer_columns(tmp_path) -> None:
    assert peer_rows(None, CASES["qwen3"]) == {}
    assert peer_rows(str(tmp_path / "missing.json"), CASES["qwen3"]) == {}


def test_every_suite_is_one_known_layer():
    """scripts/gpu_model.sh tunes a suite's first case's model for all its T: a suite mixing
    models would tune one and bench another. The peer runs only on PEER_DEFAULTS layers."""
    from moelora.bench.peer import peer_can_run

    peer_layers = set()
    for name, cases in CASES.items():
        assert cases, name
        assert {c.model for c in cases} == {cases[0].model}, name
        if peer_can_run(cases[0]):
            peer_layers.add(name)
    assert {"qwen3", "mixtral", "deepseek-v3", "olmoe-1b-7b", "deepseek-v2-lite"} <= peer_layers
    assert not {"gpt-oss-20b", "nemotron-h", "llama4-scout"} & peer_layers
