"""The transformers integration on the triton backend (Triton interpreter, fp32) for a gated
and a non-gated family, and under torch.compile: the expert layer stays one custom-op node
per MoE layer and the compiled model equals the eager one."""

from __future__ import annotations

import pytest
import torch
from hf_models import alone, assert_equals_alone, build_family, mixed_batch

from moelora.compare import assert_close
from moelora.hf import attach

pytestmark = pytest.mark.filterwarnings("ignore")
ROWS = ["fused-r8", None, "fused-r4-attn", "modules-r4", "fused-r2"]


@pytest.fixture(scope="module", params=["qwen3_moe", "nemotron_h"])
def family(request, tmp_path_factory):
    return build_family(request.param, tmp_path_factory.mktemp(request.param), seed=99)


def test_triton_backend_mixed_batch_equals_peft(family, seed):
    model = family.fresh()
    handle = attach(model, num_slots=4, max_rank=8, moe_backend="triton")
    assert handle.backend_name == "triton"
    for name, path in family.dirs.items():
        handle.load_adapter(path, name=name, **family.load_kwargs)
    batch = mixed_batch(handle, ROWS, 3, torch.Generator().manual_seed(seed))
    for row, name in enumerate(ROWS):
        assert_equals_alone(family.truth(name), batch[row], 3, f"row {row} ({name})")


def test_torch_compile_keeps_one_node_per_layer(tmp_path, seed):
    """torch.compile(model): one moelora.experts node per MoE layer in the captured graph,
    logits equal to eager with adapters in the batch."""
    family = build_family("qwen3_moe", tmp_path, seed=seed % 1000)
    model = family.fresh()
    handle = attach(model, num_slots=4, max_rank=8, moe_backend="reference")
    names = ["fused-r8", "fused-r2"]  # experts-only adapters
    for name in names:
        handle.load_adapter(family.dirs[name], name=name)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    eager_forward = model.forward
    model.forward = torch.compile(model.forward, backend=backend, dynamic=False)
    try:
        ids = torch.randint(
            1, model.config.vocab_size, (3, 7), generator=torch.Generator().manual_seed(seed)
        )
        rows = [names[0], None, names[1]]
        compiled = handle(ids, adapter_names=rows).logits
    finally:
        model.forward = eager_forward
        torch._dynamo.reset()
    eager = handle(ids, adapter_names=rows).logits
    nodes = [
        n for g in graphs for n in g.graph.nodes
        if n.op == "call_function" and "moelora.experts" in str(n.target)
    ]  # fmt: skip
    assert len(nodes) == len(handle.model_config.moe_layers)
    assert_close(compiled, eager, torch.float32, what="compiled vs eager")
    _, want = alone(family.truth(names[1]), ids[2], 0)
    assert_close(compiled[2], want, torch.float32, what="compiled row vs PEFT")
