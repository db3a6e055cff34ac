"""The `reference` backend: moelora.reference behind the Backend interface.

Slow (a Python loop over experts, fp32) and exact: the ground truth, on any device.
"""

from __future__ import annotations

from torch import Tensor

from ..call import MoECall
from ..config import MoEShape
from ..quant.fp8_experts import FP8ExpertWeights
from ..quantization import Quantization
from ..reference import reference_forward
from ..weights import ExpertWeights
from .base import write_output
from .capabilities import (
    ALL_ACTIVATIONS,
    ALL_DEVICES,
    ALL_DTYPES,
    ALL_GATING,
    ALL_PARALLEL,
    ALL_ROUTING,
    EVERY_LORA_SHARDING,
    Capabilities,
    Validation,
)

# The ground truth is checked against an independent float64 loop and transformers' MoE
# blocks (CPU, every commit), and it is the comparison side of every GPU validate run.
VALIDATED_ON = (
    Validation("cpu", "cpu", None, ALL_DTYPES, "every commit",
               "the test suite: against a float64 loop and transformers' MoE blocks (FP8: "
               "against a float64 loop on the dequantized experts)",
               "tests/test_foundation_reference.py, tests/test_foundation_hf.py, "
               "tests/test_quant_reference.py", frozenset(Quantization)),
    Validation("NVIDIA H200", "cuda", (9, 0), ALL_DTYPES, "2026-11-30",
               "the comparison side of every moelora validate run there (bf16, fp16 and fp32 "
               "inputs), and its own fp32 layouts over NCCL (the check of "
               "`moelora validate --suite parallel`)",
               "docs/history/benchmarks.md, 2026-11-30"),
)  # fmt: skip

CAPABILITIES = Capabilities(
    devices=ALL_DEVICES,
    min_compute_capability=None,
    max_compute_capability=None,
    cpu_needs_interpreter=False,
    packages=frozenset({"torch"}),
    dtypes=ALL_DTYPES,
    activations=ALL_ACTIVATIONS,
    gating=ALL_GATING,
    routing_methods=ALL_ROUTING,
    expert_bias=True,
    # FP8 experts are dequantized (FP8ExpertWeights.dequantize); W8A8 input quantization
    # is modelled per token in the base GEMMs, the LoRA branch reads unquantized inputs.
    quantizations=dict.fromkeys(Quantization),
    parallel_modes=ALL_PARALLEL,
    lora=True,
    runs_without_lora=True,
    max_rank=None,
    max_slots=None,
    lora_add_inputs=EVERY_LORA_SHARDING,
    intermediate_align=1,
    hidden_align=1,
    max_experts=None,
    max_groups=None,
    # The only thing it lacks: it finds each expert's tokens with torch.nonzero and reads
    # the active slots with .tolist(), host syncs that CUDA-graph capture forbids.
    cuda_graph_safe=False,
    validated_on=VALIDATED_ON,
)


class ReferenceBackend:
    name = "reference"
    capabilities = CAPABILITIES

    def forward(
        self, call: MoECall, experts: ExpertWeights | FP8ExpertWeights, shape: MoEShape
    ) -> Tensor:
        """y [T, H] = the reference's; see Backend.forward for out / add_inputs. FP8
        experts are dequantized to fp32 first (the one reference takes dequantized weights)."""
        if isinstance(experts, FP8ExpertWeights):
            experts = experts.dequantize()
        return write_output(reference_forward(call, experts, shape), call.out, call.add_inputs)


BACKEND = ReferenceBackend()
