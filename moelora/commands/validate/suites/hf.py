"""`moelora validate --suite hf`: the transformers integration around moelora's expert op, on
a small random Qwen3-MoE model with two PEFT adapters of the demo (moelora/hf/toy.py).

Cases:
  graph replay: a CUDA graph captured around the expert op with adapters in the batch
    (decode shape: one token per row) replays to the eager result;
  graph follows slots: after new per-row slots are written into the same slot tensor, the
    replay equals the eager op on them (the graph reads the slots, it does not copy them);
  torch.compile: compiling model.forward with a mixed batch leaves one moelora.experts node
    per MoE layer, logits equal to eager within the dtype's tolerance;
  decode graphs: the layer's own small-T graphs (attach's max_graph_tokens) replay to the
    layer run directly, over 6 calls whose rows change adapters, across a replace that
    moves an adapter to another slot.
On a CPU (fp32, the toy's default sizes) only torch.compile runs: the other cases need CUDA
graphs and say so. Needs transformers and peft (`pip install moelora[test]`).
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from ....bench.runner import capture_graph
from ....compare import compare
from ....device import installed_packages
from ....errors import ConfigError
from .suite import CheckSuite, Outcome, Verdict

ADAPTERS = ("fused-r8", "fused-r2")  # experts-only adapters of toy.demo_adapters
ROWS = ["fused-r8", None, "fused-r2", "fused-r8", None, "fused-r2", "fused-r8", None]
# The GPU model: big enough for the triton backend's real tiles, small enough for seconds.
CUDA_SIZES = dict(
    hidden_size=512, moe_intermediate_size=256, num_experts=32, num_experts_per_tok=4,
    num_hidden_layers=2, head_dim=64, num_attention_heads=8, vocab_size=4096,
)  # fmt: skip
GRAPH_CASES = ("graph replay", "graph follows slots", "decode graphs")


def build(device: str, backend: str, folder: Path, seed: int):
    """(model, handle, one bound experts module, the adapters' PEFT settings)."""
    from ....hf import attach, toy

    sizes = CUDA_SIZES if device == "cuda" else {}
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = toy.build_model("qwen3_moe", seed=seed, dtype=dtype, device=device, **sizes)
    handle = attach(model, num_slots=4, max_rank=16, moe_backend=backend)
    specs = toy.demo_adapters(model)
    for i, name in enumerate(ADAPTERS):
        toy.write_peft_adapter(model, folder / name, seed=seed + i + 1, **specs[name])
        handle.load_adapter(folder / name, name=name)
    from ....hf import experts

    module = next(m for m in model.modules() if experts.key_of(m) is not None)
    return model, handle, module, specs


def routed(model, rows: int, g: torch.Generator):
    """x [rows, H] in the model's dtype, ids [rows, K], w [rows, K] of a softmax top-k."""
    dev, dtype = model.device, model.dtype
    x = torch.randn(rows, model.config.hidden_size, generator=g).to(dev, dtype)
    logits = torch.randn(rows, model.config.num_experts, generator=g).to(dev)
    w, ids = torch.topk(logits.softmax(-1), model.config.num_experts_per_tok)
    return x, ids, w


def graph_verdicts(handle, module, x, ids, w) -> Iterator[Verdict]:
    """A graph captured around the op, replayed, then replayed again after new row slots."""
    from ....hf import experts

    key = experts.key_of(module)
    with handle.call(ROWS, len(ROWS)) as current:
        eager = experts.experts_op(x, ids, w, key)
        graph, captured = capture_graph(experts.experts_op, (x, ids, w, key), warmups=1)
        graph.replay()
        torch.cuda.synchronize()
        same = torch.equal(captured, eager)
        # new per-row adapters written into the same slot tensor: the replay follows them
        flipped = [-1 if s >= 0 else 0 for s in current.row_slots.tolist()]
        current.row_slots.copy_(torch.tensor(flipped, dtype=torch.int32, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        err = compare(captured, experts.experts_op(x, ids, w, key), x.dtype)
    yield Verdict.of("graph replay", same, "replay equals eager bit for bit (decode shape, "
                     f"adapters): {same}")  # fmt: skip
    yield Verdict.of("graph follows slots", err.ok, f"replay after new row slots vs eager {err}")


def compile_verdict(model, handle, g: torch.Generator) -> Verdict:
    """model.forward under torch.compile with a recording backend: its graphs are searched
    for the op, its logits compared with eager."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    prompt = torch.randint(1, model.config.vocab_size, (4, 16), generator=g).to(model.device)
    rows = ["fused-r8", None, "fused-r2", "fused-r8"]
    eager_logits = handle(prompt, adapter_names=rows).logits
    forward = model.forward
    torch._dynamo.reset()
    model.forward = torch.compile(forward, backend=backend)
    try:
        compiled = handle(prompt, adapter_names=rows).logits
    finally:
        model.forward = forward
        torch._dynamo.reset()
    nodes = sum(
        1 for gm in graphs for n in gm.graph.nodes
        if n.op == "call_function" and "moelora.experts" in str(n.target)
    )  # fmt: skip
    err = compare(compiled, eager_logits, model.dtype)
    layers = len(handle.model_config.moe_layers)
    return Verdict.of(
        "torch.compile",
        nodes == layers and err.ok,
        f"{nodes} moelora.experts nodes (want {layers}, one per MoE layer); logits vs eager {err}",
    )


def decode_graphs_verdict(model, handle, module, specs, folder: Path, g: torch.Generator):
    """6 calls through the layer's own graphs against the layer run directly; rows change
    adapters between calls and a replace moves fused-r2 to another slot at the 4th."""
    from ....hf import experts, toy

    binding = experts.binding_of(module)
    good, names, errors, repeatable = binding.graphs is not None, list(ROWS), [], True
    for step in range(6):
        if step == 3:  # a new version of fused-r2 lands in another slot
            toy.write_peft_adapter(model, folder / "v2", seed=99, **specs["fused-r2"])
            handle.load_adapter(folder / "v2", name="fused-r2")
        names = [names[-1], *names[:-1]]  # rows change adapters between calls
        x, ids, w = routed(model, len(names), g)
        with handle.call(names, len(names)) as current:
            replayed = experts.experts_op(x, ids, w, experts.key_of(module))
            slots = current.token_slots(len(names), refresh=False)
            bank = current.snapshot.banks[binding.layer_index]
            direct = binding.layer(x, ids.int(), w.float(), slots, bank)
            again = binding.layer(x, ids.int(), w.float(), slots, bank)
        err = compare(replayed, direct, x.dtype)
        good &= err.ok
        repeatable &= torch.equal(direct, again)  # reported, not judged: fp32 atomics
        errors.append(f"{err.rel_err:.1e}")
    entries = len(binding.graphs._entries) if binding.graphs is not None else 0
    return Verdict.of(
        "decode graphs",
        good and entries > 0,
        f"6 calls (adapters moved between calls, a replace) vs the direct layer: rel_err "
        f"{', '.join(errors)}; {entries} graph(s) captured (want > 0); the direct layer "
        f"bit-repeatable: {repeatable}",
    )


def run(args: argparse.Namespace, device: str, backend: str) -> Iterator[Verdict]:
    g = torch.Generator().manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model, handle, module, specs = build(device, backend, Path(tmp), args.seed)
        if device == "cuda":
            yield from graph_verdicts(handle, module, *routed(model, len(ROWS), g))
        yield compile_verdict(model, handle, g)
        if device == "cuda":
            yield decode_graphs_verdict(model, handle, module, specs, Path(tmp), g)
    if device != "cuda":
        for case in GRAPH_CASES:
            yield Verdict(case, Outcome.NOT_RUN, "needs a CUDA device (CUDA graphs)")


def check_packages(args: argparse.Namespace, device: str) -> None:
    """Refuse before anything runs when transformers or peft is missing."""
    missing = sorted({"transformers", "peft"} - installed_packages())
    if missing:
        raise ConfigError("--suite", "hf", f"transformers and peft installed ({', '.join(missing)} "
                          "missing)", "pip install 'moelora[hf]'")  # fmt: skip


SUITE = CheckSuite(
    name="hf",
    summary="the transformers integration: a CUDA graph around the expert op with changing "
    "adapters, torch.compile of a mixed batch, the layers' decode graphs (on a CPU: "
    "torch.compile only)",
    cpu_refusal=None,
    run=run,
    check_args=check_packages,
)
