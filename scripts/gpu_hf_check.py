"""GPU checks of the transformers integration (run on a CUDA machine; prints PASS/FAIL lines):
1. a CUDA graph captured around moelora's expert op with adapters in the batch (decode
   shape: one token per row) replays to the eager result, after the slot banks and the
   per-row adapters changed between replays (the graph reads them, it does not copy them);
2. torch.compile(model.forward) with a mixed batch: one moelora.experts node per MoE layer,
   logits equal to eager (bf16 tolerance).
    python scripts/gpu_hf_check.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch


def main() -> int:
    from moelora.compare import compare
    from moelora.hf import attach, batch, experts, toy

    model = toy.build_model(
        "qwen3_moe", seed=0, dtype=torch.bfloat16, device="cuda", hidden_size=512,
        moe_intermediate_size=256, num_experts=32, num_experts_per_tok=4, num_hidden_layers=2,
        head_dim=64, num_attention_heads=8, vocab_size=4096,
    )  # fmt: skip
    tmp = Path(tempfile.mkdtemp())
    handle = attach(model, num_slots=4, max_rank=16)
    specs = toy.demo_adapters(model)
    for i, name in enumerate(["fused-r8", "fused-r2"]):
        toy.write_peft_adapter(model, tmp / name, seed=i + 1, **specs[name])
        handle.load_adapter(tmp / name, name=name)
    ok = True
    module = next(m for m in model.modules() if hasattr(m, "_moelora_key"))
    rows, hidden = 8, model.config.hidden_size
    names = ["fused-r8", None, "fused-r2", "fused-r8", None, "fused-r2", "fused-r8", None]
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(rows, model.config.num_experts, device="cuda")
    w, ids = torch.topk(logits.softmax(-1), model.config.num_experts_per_tok)
    with handle._call(names, len(names)) as current:
        eager = experts.experts_op(x, ids, w, module._moelora_key)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm the kernels outside the capture
            experts.experts_op(x, ids, w, module._moelora_key)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = experts.experts_op(x, ids, w, module._moelora_key)
        graph.replay()
        torch.cuda.synchronize()
        same = torch.equal(captured, eager)
        # new per-row adapters written into the same slot tensor: the replay follows them
        flipped = torch.tensor([-1 if s >= 0 else 0 for s in current.row_slots.tolist()],
                               dtype=torch.int32, device="cuda")  # fmt: skip
        current.row_slots.copy_(flipped)
        graph.replay()
        torch.cuda.synchronize()
        eager_flipped = experts.experts_op(x, ids, w, module._moelora_key)
        follows = compare(captured, eager_flipped, torch.bfloat16).ok
    ok &= same and follows
    print(f"{'PASS' if same else 'FAIL'} cuda graph replay equals eager (decode shape, adapters)")
    print(f"{'PASS' if follows else 'FAIL'} replay follows the row slots written between replays")

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    prompt = torch.randint(1, 4000, (4, 16), device="cuda")
    rows4 = ["fused-r8", None, "fused-r2", "fused-r8"]
    eager_logits = handle(prompt, adapter_names=rows4).logits
    forward = model.forward
    model.forward = torch.compile(forward, backend=backend)
    try:
        compiled = handle(prompt, adapter_names=rows4).logits
    finally:
        model.forward = forward
    nodes = sum(
        1 for g in graphs for n in g.graph.nodes
        if n.op == "call_function" and "moelora.experts" in str(n.target)
    )  # fmt: skip
    err = compare(compiled, eager_logits, torch.bfloat16)
    good = nodes == len(handle.model_config.moe_layers) and err.ok
    ok &= good
    print(f"{'PASS' if good else 'FAIL'} torch.compile: {nodes} moelora.experts nodes, {err}")

    # 3. the decode graphs (attach's max_graph_tokens): replays equal the layer run directly,
    # across calls whose rows use other adapters, and after a replace moved an adapter.
    from moelora.hf.experts import _bindings

    binding = _bindings[module._moelora_key]
    good = binding.graphs is not None
    for step in range(6):
        if step == 3:  # a new version of fused-r2 lands in another slot
            toy.write_peft_adapter(model, tmp / "v2", seed=99, **specs["fused-r2"])
            handle.load_adapter(tmp / "v2", name="fused-r2")
        names = [names[-1], *names[:-1]]  # rows change adapters between calls
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        with handle._call(names, len(names)) as current:
            replayed = experts.experts_op(x, ids, w, module._moelora_key)
            slots = current.token_slots(rows, refresh=False)
            direct = binding.layer(x, ids.int(), w.float(), slots, current.snapshot.banks[0])
            again = binding.layer(x, ids.int(), w.float(), slots, current.snapshot.banks[0])
        err = compare(replayed, direct, torch.bfloat16)
        print(
            f"  step {step}: replay vs direct {err}; direct repeatable: {torch.equal(direct, again)}"
        )
        good &= err.ok
    entries = len(binding.graphs._entries) if binding.graphs is not None else 0
    ok &= good and entries > 0
    print(f"{'PASS' if good and entries else 'FAIL'} decode graphs: 6 calls equal the direct "
          f"layer (adapters moved between calls, a replace), {entries} graph(s) captured")  # fmt: skip
    del batch
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
