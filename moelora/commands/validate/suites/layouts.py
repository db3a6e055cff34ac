"""One parallel layout against the single-process reference: what `moelora validate --suite
parallel` runs in each process (tests/parallel_worker.py runs its cases through
`parallel_vs_reference` too). Call inside an initialised torch.distributed group.

Legend: T tokens, E experts, K top-k, H hidden, I intermediate, R max rank, L slots.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from ....activations import Activation
from ....compare import Comparison, compare
from ....config import AddInputs, LoRAConfig, MoEShape, ParallelConfig
from ....deployment import Deployment
from ....device import probe
from ....layer import to_device
from ....parallel import ParallelMoELoRALayer
from ....reference import moe_lora_reference
from ....routing import RoutingConfig, route
from ....weights import ExpertWeights, LoRABank, random_expert_weights, random_lora_bank


@dataclass(frozen=True)
class Sizes:
    tokens: int  # T
    experts: int  # E
    top_k: int  # K
    hidden: int  # H
    inter: int  # I
    rank: int  # R
    slots: int  # L


@dataclass(frozen=True)
class Layout:
    """One case: its id, the parallel layout, the experts' activation and biases, the
    routing, the backend and the dtype it runs in."""

    id: str
    parallel: ParallelConfig
    activation: Activation
    bias: bool
    routing: RoutingConfig
    backend: str
    dtype: torch.dtype

    @property
    def label(self) -> str:
        return f"{self.backend} {self.id} {str(self.dtype)[6:]}"


def parallel_vs_reference(
    deployment: Deployment,
    experts: ExpertWeights,
    bank: LoRABank | None,
    x: Tensor,
    ids: Tensor,
    w: Tensor,
    slots: Tensor | None,
    *,
    out: Tensor | None = None,
    add_inputs: AddInputs | None = None,
) -> tuple[Tensor, Tensor]:
    """(y, ref): the parallel layer of `deployment` on this process's share of the full
    `experts` and `bank` (sharded here), and the reference on the full ones (y [T, H] of
    the layer: `out` when given, by add_inputs; ref never adds)."""
    layer = ParallelMoELoRALayer(deployment, experts)
    shard = None if bank is None else layer.shard_bank(bank)
    y = layer(x, ids, w, slots, shard, out=out, add_inputs=add_inputs)
    woi = deployment.routing.method.weights_on_input
    ref = moe_lora_reference(
        x, ids, w, slots, experts, bank, deployment.shape, weights_on_input=woi
    )
    return y, ref


def layout_run(layout: Layout, sizes: Sizes, device: str, seed: int) -> Comparison:
    """The layout on random weights and inputs (the same on every process: one seed), LoRA
    on with slot ranks R, R/2, R, 4 and slot -1 among the tokens."""
    s = sizes
    shape = MoEShape(s.experts, s.top_k, s.hidden, s.inter, layout.activation,
                     has_bias=layout.bias, dtype=layout.dtype)  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    experts = random_expert_weights(shape, generator=gen, dtype=torch.float32)
    ranks = [s.rank, s.rank // 2, s.rank, 4][: s.slots]
    bank = random_lora_bank(shape, s.slots, s.rank, ranks=ranks, generator=gen, dtype=torch.float32)
    x = torch.randn(s.tokens, s.hidden, generator=gen)
    ids, w = route(torch.randn(s.tokens, s.experts, generator=gen), layout.routing, s.top_k)
    slots = torch.randint(-1, s.slots, (s.tokens,), generator=gen, dtype=torch.int32)
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else "cpu"
    experts = to_device(experts, dev, layout.dtype)
    factors = ("w13_a", "w13_b", "w2_a", "w2_b")
    bank = dataclasses.replace(bank, **{f: getattr(bank, f).to(dev, layout.dtype) for f in factors})
    x, ids, w, slots = x.to(dev, layout.dtype), ids.to(dev), w.to(dev), slots.to(dev)
    deployment = Deployment(
        shape=shape,
        routing=layout.routing,
        device=probe() if device == "cuda" else probe("cpu"),
        parallel=layout.parallel,
        lora=LoRAConfig(enabled=True, max_rank=s.rank, num_slots=s.slots),
        backend=layout.backend,
        name=layout.id,
    )
    y, ref = parallel_vs_reference(deployment, experts, bank, x, ids, w, slots)
    return compare(y, ref, layout.dtype)
