"""The `triton` backend: fused MoE + multi-LoRA Triton kernels (moelora/kernels).

The backend decides, once per forward: the tile config (the H200 table or the heuristic,
tiling/pick.py), fitted to this GPU (tiling/fit.py), and what the forward derives from it
(tiling/plan.py); the kernels run that plan and decide nothing.

Kernels are imported on first use, so the registry imports this module (and the oracle can
reason about it) on hosts without the triton package.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..activations import Activation
from ..call import MoECall
from ..comm import LoRAComm
from ..config import AddInputs, MoEShape
from ..deployment import LoRASharding, ParallelMode
from ..device import gpu_limits, triton_interpreted
from ..errors import InputError
from ..quant.fp8_experts import FP8ExpertWeights
from ..quantization import Quantization
from ..tiling.config import TileConfig
from ..tiling.fit import fit_to_device
from ..tiling.pick import pick_config
from ..tiling.plan import ForwardPlan, plan_forward
from ..tiling.quantized import fit_to_fp8
from ..weights import ExpertWeights, LoRABank
from .capabilities import (
    ALL_ACTIVATIONS,
    ALL_DTYPES,
    ALL_GATING,
    ALL_ROUTING,
    Capabilities,
    Validation,
)

# Where this record has run (docs/history/benchmarks.md): one GPU so far; `moelora plan` warns elsewhere.
_H200, _SM90, _BENCH = "NVIDIA H200", (9, 0), "docs/history/benchmarks.md, 2026-11-30"
VALIDATED_ON = (
    Validation(_H200, "cuda", _SM90, frozenset({torch.bfloat16}), "2026-11-30",
               "moelora validate --ref-tokens 1024 at 4acd27b: 110/110 pass (qwen3-30b-a3b, "
               "mixtral-8x7b, deepseek-v3, nemotron-h, gpt-oss-20b; T 1..16384, CUDA graphs, "
               "ranks 8-128)", f"{_BENCH} (seventh session); h200_4acd27b_validate.log in benchmarks/results/h200_validate.txt"),
    Validation(_H200, "cuda", _SM90, frozenset({torch.bfloat16}), "2026-12-01",
               "scripts/gpu_ranks_check.py at 310c49a: 50/50 pass (qwen3-30b-a3b; mixed ranks "
               "8-128, rank 256, 64 and 128 slots, garbage past each slot's rank; T 1..4096, "
               "eager and graphs); validate --lora-sweep at f01537b: 16/16, at 5a2d445: 16/16, "
               "--tokens 2048,4096,8192 at ad73e7f (expand_one_dot rows): 18/18",
               "docs/history/benchmarks.md, 2026-12-01 (LoRA configurations), 2026-12-02"),
    Validation(_H200, "cuda", _SM90, frozenset({torch.float16}), "2026-11-30",
               "moelora validate --quick --tokens 1,7,64,1024 --dtype fp16 at 4aa3e56: 20/20 "
               "pass (the five models)", f"{_BENCH} (sixth session)"),
    Validation(_H200, "cuda", _SM90, frozenset({torch.float32}), "2026-11-30",
               "moelora validate --quick --dtype fp32 at 4aa3e56: 5/5 pass (qwen3-30b-a3b, "
               "T 1..4096); --rank 128 --tokens 4096 at c2185c0: 2/2 (qwen3-30b-a3b, "
               "gpt-oss-20b)", f"{_BENCH} (sixth session)"),
    Validation(_H200, "cuda", _SM90, frozenset({torch.bfloat16}), "2026-12-01",
               "moelora validate --quantization fp8 --ref-tokens 1024 at 1d0ea3b: 44/44 pass "
               "(qwen3-30b-a3b, deepseek-v3; T 1..16384, CUDA graphs, ranks 8-128, the "
               "LoRA-free path), the decode path at 5a2d445 (T 1, 2, 7): 6/6; "
               "--quantization fp8_channel --quick at 0026125: 9/9 (qwen3-30b-a3b)",
               "docs/history/benchmarks.md, 2026-12-02 (FP8 experts); "
               "h200_1d0ea3b_s14call2_call2.log in benchmarks/results/h200_bench.txt",
               frozenset({Quantization.FP8_BLOCK, Quantization.FP8_CHANNEL})),
    Validation("cpu", "cpu", None, frozenset({torch.float16, torch.float32}), "every commit",
               "the test suite under TRITON_INTERPRET=1 against the reference (FP8 "
               "experts, block and per-channel: against the reference on their "
               "dequantization)",
               "tests/test_kernels.py, tests/test_parallel.py, tests/test_quant_triton.py",
               frozenset(Quantization)),
)  # fmt: skip


CAPABILITIES = Capabilities(
    devices=frozenset({"cuda", "cpu"}),
    # bf16 tl.dot needs Ampere; validated on an H200 (sm90) by `moelora validate`.
    min_compute_capability=(8, 0),
    max_compute_capability=None,
    cpu_needs_interpreter=True,  # CPU = TRITON_INTERPRET=1 (tests; slow)
    packages=frozenset({"torch", "triton"}),
    dtypes=ALL_DTYPES,  # fp32 uses exact (non-tf32) dots: correct, not fast
    activations=ALL_ACTIVATIONS,
    gating=ALL_GATING,
    # Routing happens before the backend; weights_on_input (Llama-4) is fused in the up GEMM.
    routing_methods=ALL_ROUTING,
    expert_bias=True,
    # e4m3 experts, W8A8: each base GEMM input is quantized per token and group before the
    # kernel that reads it (kernels/quant_rows.py); each K step of the GEMMs runs an FP8 dot
    # (sm89+; e4m3 MMA from BLOCK_M 64) scaled by both sides' scales, the decode GEMVs compute
    # the same products in fp32. Block scales: a GEMM step is one activation group (the
    # block's K side). Per-channel scales: each row's activation scale spans all of K. The
    # LoRA seams are the bf16 ones (unquantized x and z).
    quantizations={
        Quantization.NONE: None,
        Quantization.FP8_BLOCK: (8, 9),
        Quantization.FP8_CHANNEL: (8, 9),
    },
    # The kernels run whatever shard they are given: TP = I_p-sized w13/w2 shards and a
    # partial y (the caller all-reduces); EP = local experts, ids outside [0, E_l) dropped.
    parallel_modes=frozenset(ParallelMode),
    lora=True,
    runs_without_lora=True,
    # Each slot's real rank is data (LoRABank.ranks): the shrink splits the rank into chunks
    # over its grid, the in-GEMM expand packs the slots' rank lanes into its dots, and the
    # decode kernels hold one slot's rank lanes in registers (at most 256 of them).
    max_rank=256,
    max_slots=None,  # slots only enter the sort key and a per-block loop: no limit
    # Fully sharded LoRA: the pipeline runs shrink and expand as separate launches with the
    # fp32 rank intermediates in memory between them, so the caller's LoRAComm all-gathers
    # the gate/up one and all-reduces the down one there (once each per forward), and the
    # down expand writes only this process's H/tp columns. Checked against the single-process
    # reference over gloo, interpreted (tests/test_parallel.py); the collectives are the
    # caller's (NCCL on GPUs), outside the kernels. add_inputs acts on the final y.
    lora_add_inputs={
        LoRASharding.UNSHARDED: frozenset(AddInputs),
        LoRASharding.TP: frozenset(AddInputs),
        LoRASharding.FULLY_SHARDED: frozenset(AddInputs),
    },
    intermediate_align=1,  # every tile load is masked
    hidden_align=1,
    max_experts=None,  # the grid is bounded by pairs, not experts
    max_groups=None,
    # No host sync (alignment is a Triton kernel), static shapes per T; workspaces come
    # from the capturing graph's pool. Checked by `moelora validate --graphs`.
    cuda_graph_safe=True,
    validated_on=VALIDATED_ON,
)


Experts = ExpertWeights | FP8ExpertWeights


def _check_inputs(call: MoECall, experts: Experts) -> None:
    """What the kernels need beyond the record's own checks: x's and out's H that of the
    weights (the bench, validate and the tune call backends without a layer), FP8 experts
    in the format the kernels run, and on the CPU the Triton interpreter. Metadata only."""
    hidden = experts.w13.shape[2]
    for name, t in (("x", call.x), ("out", call.out)):
        if t is not None and t.shape[1] != hidden:
            raise InputError(name, f"shape {list(t.shape)}", f"[T, H = {hidden}]")
    if (
        isinstance(experts, FP8ExpertWeights)
        and experts.quant.method not in CAPABILITIES.quantizations
    ):
        names = ", ".join(q.value for q in CAPABILITIES.quantizations)
        raise InputError("experts", f"{experts.quant.method.value} FP8 experts", f"one of {names}")
    x = call.x
    if x.device.type == "cpu" and not triton_interpreted():
        raise InputError(
            "x", "on cpu", "a cuda tensor, or TRITON_INTERPRET=1 for the Triton interpreter on cpu"
        )


def _check_sharded_bank(lora: LoRABank | None, shape: MoEShape, comm: LoRAComm) -> None:
    """Fully sharded: down B holds H/tp rows placed at comm.hidden_offset inside H."""
    if lora is None:
        return
    rows = lora.w2_b.shape[2]
    if not 0 <= comm.hidden_offset <= shape.hidden_size - rows:
        raise InputError(
            "lora.w2_b",
            f"{rows} rows at lora_comm.hidden_offset {comm.hidden_offset}",
            f"an H slice inside H = {shape.hidden_size} (fully sharded LoRA)",
        )


class TritonBackend:
    name = "triton"
    capabilities = CAPABILITIES

    def forward(self, call: MoECall, experts: Experts, shape: MoEShape) -> Tensor:
        """y [T, H] in x's dtype; see Backend.forward for out / add_inputs / lora_comm."""
        _check_inputs(call, experts)
        if call.lora_comm is not None and call.lora is not None:
            _check_sharded_bank(call.lora, shape, call.lora_comm)
        return fused_moe_lora(call, experts, shape)


def forward_plan(
    x: Tensor,
    topk_ids: Tensor,
    experts: Experts,
    lora: LoRABank | None,
    shape: MoEShape,
    *,
    config: TileConfig | None = None,
    sharded: bool = False,
) -> ForwardPlan:
    """The plan of one forward (lora: the bank, None without LoRA or token slots). Without
    `config`, the config picked for the bank's LoRA class (its tile rank and slots),
    fitted to the GPU x is on (its shared memory, TMA; the rank is B's, under fully sharded
    LoRA the expand still runs at the full R); a config passed explicitly (the tune,
    tests) is launched as given."""
    limits = gpu_limits(x.device)
    use_lora = lora is not None
    cfg = config
    if cfg is None:
        num_tokens, hidden = x.shape
        num_experts, inter_size = experts.w13.shape[0], experts.w2.shape[2]
        # the bank's LoRA class picks the table row (tiling/lora_class.py) and its rank
        # fits it to the shared memory
        rank = lora.tile_rank if use_lora and lora.num_slots else 0
        slots = lora.num_slots if use_lora else 0
        picked = pick_config(
            num_tokens,
            num_experts,
            topk_ids.shape[1],
            hidden,
            inter_size,
            use_lora,
            rank=rank,
            slots=slots,
        )
        cfg = fit_to_device(
            picked, shape.activation.width_factor, x.dtype, limits, rank=rank, num_slots=slots
        )
    if isinstance(experts, FP8ExpertWeights):  # a correctness fit: explicit configs too
        cfg = fit_to_fp8(
            cfg,
            experts.quant,
            parts=shape.activation.width_factor,
            shared_memory=limits.shared_memory if limits is not None else None,
            inter=experts.w2.shape[2],
            interleaved=shape.activation is Activation.SWIGLUOAI,
        )
    return plan_forward(
        cfg,
        lora=use_lora,
        sharded=sharded,
        pdl_supported=limits is not None and limits.pdl,
        interpreted=triton_interpreted(),
    )


def fused_moe_lora(
    call: MoECall, experts: Experts, shape: MoEShape, *, config: TileConfig | None = None
) -> Tensor:
    """y [T, H] in x's dtype (into call.out if given, by call.add_inputs): the plan of this
    call (forward_plan), run by the kernels (kernels/moe_lora.py; shapes and layouts
    there). LoRA runs with a bank and token slots; config: launched as given."""
    from ..kernels import moe_lora

    bank = call.lora if call.has_lora else None
    sharded = call.lora is not None and call.lora_comm is not None
    plan = forward_plan(call.x, call.topk_ids, experts, bank, shape, config=config, sharded=sharded)
    return moe_lora.forward(plan, call, experts, shape)


BACKEND = TritonBackend()
