"""The vLLM peer beside `moelora bench`: which layers it can run, and its JSON rows read
only when they time the same layer as the cases (its tool: .peer/vllm_moe_lora_bench.py,
shared/peer/README.md)."""

from __future__ import annotations

import json
import sys

from ..errors import InputError
from ..presets import resolve_model

# what the vLLM peer's JSON may leave unsaid: its tool (.peer/vllm_moe_lora_bench.py) always
# runs SiLU-gated experts without biases, routing weights on the output
PEER_DEFAULTS = dict(activation="silu", bias=False, weights_on_input=False)


def peer_shape(case) -> dict:
    """The layer a case times, in the peer JSON's "shape" keys (activation, bias and where
    the routing weights apply too: PEER_DEFAULTS when the JSON does not name them)."""
    model = resolve_model(case.model)
    s = model.shape
    dtype = {"torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(str(s.dtype), str(s.dtype))
    return dict(
        E=s.num_experts,
        top_k=s.top_k,
        H=s.hidden_size,
        I=s.intermediate_size,
        dtype=dtype,
        max_loras=case.adapters,
        rank=case.rank,
        activation=s.activation.value,
        bias=s.has_bias,
        weights_on_input=model.routing.method.weights_on_input,
    )


def peer_can_run(case) -> bool:
    """Whether the vLLM peer can run the case's layer at all (PEER_DEFAULTS)."""
    shape = peer_shape(case)
    return all(shape[k] == v for k, v in PEER_DEFAULTS.items())


def peer_rows(path: str | None, cases: list) -> dict[int, dict]:
    """The peer's rows by T, from a JSON of the same layer as every case (else an
    InputError naming both shapes: a peer of another layer is never set beside ours)."""
    if not path:
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
        rows = {int(r["T"]): r for r in data["rows"]}
    except (OSError, KeyError, ValueError) as err:
        print(
            f"moelora bench: warning: peer JSON {path} unreadable ({err}); peer columns left "
            "empty. Fix: pass the vllm_peer.json that .peer/vllm_moe_lora_bench.py wrote",
            file=sys.stderr,
        )
        return {}
    shape = {**PEER_DEFAULTS, **data.get("shape", {})}
    for case in cases:
        want = peer_shape(case)
        got = {k: shape.get(k) for k in want}
        if got != want:
            raise InputError(
                "--peer-json",
                f"{path}, a peer run of the layer {got}",
                f"a peer run of {case.id}'s layer {want}: run .peer/vllm_moe_lora_bench.py "
                f"--experts {want['E']} --topk {want['top_k']} --hidden {want['H']} "
                f"--inter {want['I']} --max-loras {want['max_loras']} --rank {want['rank']} "
                f"--dtype {want['dtype']} (the peer runs only SiLU-gated experts without "
                "biases, routing weights on the output)",
            )
    return rows
