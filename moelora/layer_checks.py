"""Input validation for MoELoRALayer: what the oracle judged (the deployment) must be what
runs. Shape, dtype and device checks read tensor metadata only; value checks (expert ids,
slots) read the tensors and so synchronise with the GPU: the layer skips them while a CUDA
graph is being captured, or when built with check_values=False.

Legend: T tokens, K top-k, E_l local experts, H hidden, I_p = I / tp, R max rank, L slots.
"""

from __future__ import annotations

import torch

from .call import MoECall, check_tensor
from .config import AddInputs, MoEShape
from .deployment import Deployment, LoRASharding
from .errors import InputError
from .quant.fp8_experts import FP8ExpertWeights
from .quantization import QuantConfig
from .weights import ExpertWeights, LoRABank

NO_QUANT = QuantConfig()


def check_experts(
    experts: ExpertWeights | FP8ExpertWeights,
    shape: MoEShape,
    local_experts: int,
    quant: QuantConfig = NO_QUANT,
) -> None:
    """w13 [E_l, S*I_p, H], w2 [E_l, H, I_p] in the serving dtype, or FP8ExpertWeights in
    the deployment's FP8 format (their scales checked on construction); biases iff has_bias."""
    fp8 = isinstance(experts, FP8ExpertWeights)
    if fp8 != quant.method.is_fp8 or (fp8 and experts.quant != quant):
        found = experts.quant if fp8 else "serving-dtype ExpertWeights"
        want = f"FP8ExpertWeights in {quant}" if quant.method.is_fp8 else "ExpertWeights"
        raise InputError("experts", found, f"{want} (the deployment's quantization)")
    e, h, i = local_experts, shape.hidden_size, shape.intermediate_size
    weight_dtype = torch.float8_e4m3fn if fp8 else shape.dtype
    check_tensor("experts.w13", experts.w13, (e, shape.w13_rows, h), weight_dtype)
    check_tensor("experts.w2", experts.w2, (e, h, i), weight_dtype)
    for name, bias, rows in (("b13", experts.b13, shape.w13_rows), ("b2", experts.b2, h)):
        if shape.has_bias:
            check_tensor(f"experts.{name}", bias, (e, rows), shape.dtype)
        elif bias is not None:
            raise InputError(f"experts.{name}", "a bias", "None: the model shape has no biases")


def check_batch(call: MoECall, shape: MoEShape, device: torch.device) -> None:
    """What the deployment fixes of a call (the record checked the rest): x [T, H] in the
    serving dtype on the weights' device (and out [T, H]), K = the model's top-k."""
    x = call.x
    if x.shape[1] != shape.hidden_size:
        raise InputError("x", f"shape {list(x.shape)}", f"[T, H = {shape.hidden_size}]")
    if call.out is not None and call.out.shape != x.shape:
        raise InputError("out", f"shape {list(call.out.shape)}", f"{list(x.shape)} (like x)")
    if x.dtype != shape.dtype:
        raise InputError("x", f"dtype {x.dtype}", f"{shape.dtype} (the deployment's dtype)")
    if call.top_k != shape.top_k:
        want = (call.num_tokens, shape.top_k)
        check_tensor("topk_ids", call.topk_ids, want)
    if x.device != device:
        raise InputError("x", f"on {x.device}", f"on {device}, where the weights are")


def bank_shapes(
    deployment: Deployment, num_slots: int, max_rank: int
) -> dict[str, tuple[int, ...]]:
    """The shapes of this process's slot bank under the deployment's LoRA sharding."""
    s = deployment.shape
    tp = deployment.parallel.tp
    fully = deployment.lora_sharding is LoRASharding.FULLY_SHARDED
    e, i = deployment.local_experts, deployment.intermediate_per_partition
    h, width = s.hidden_size, s.activation.width_factor
    return {
        "w13_a": (num_slots, e, width, max_rank // tp if fully else max_rank, h),
        "w13_b": (num_slots, e, width, i, max_rank),
        "w2_a": (num_slots, e, max_rank, i),
        "w2_b": (num_slots, e, h // tp if fully else h, max_rank),
    }


def check_bank(lora: LoRABank, deployment: Deployment) -> None:
    """L <= num_slots, R <= max_rank (what the oracle checked), shapes of this process's
    shard."""
    num_slots, max_rank = lora.num_slots, lora.max_rank
    cfg = deployment.lora
    if num_slots > cfg.num_slots:
        raise InputError("lora", f"{num_slots} slots", f"at most num_slots = {cfg.num_slots}")
    if max_rank > cfg.max_rank:
        raise InputError("lora", f"rank {max_rank}", f"at most max_rank = {cfg.max_rank}")
    for name, want in bank_shapes(deployment, num_slots, max_rank).items():
        check_tensor(f"lora.{name}", getattr(lora, name), want)


def check_values(call: MoECall, local_experts: int, foreign_ids: bool) -> None:
    """Expert ids in [0, E_l) (or -1 for another rank's expert under EP); with LoRA, slots
    in [-1, L). Reads the tensors: a GPU sync."""
    topk_ids, low = call.topk_ids, -1 if foreign_ids else 0
    if topk_ids.numel() and not bool(((topk_ids >= low) & (topk_ids < local_experts)).all()):
        bad = topk_ids[(topk_ids < low) | (topk_ids >= local_experts)][0].item()
        raise InputError("topk_ids", f"containing {bad}", f"ids in [{low}, {local_experts})")
    slots = call.token_slots
    if call.has_lora and slots.numel():
        num_slots = call.lora.num_slots
        if not bool(((slots >= -1) & (slots < num_slots)).all()):
            bad = slots[(slots < -1) | (slots >= num_slots)][0].item()
            raise InputError(
                "token_slots", f"containing {bad}", f"slots in [-1, {num_slots}) (-1 = base model)"
            )


def resolve_add_inputs(deployment: Deployment, add_inputs: AddInputs | None) -> AddInputs:
    """The output mode: default the deployment's; with LoRA on the experts, only that one
    (it is the mode the oracle checked the backend for)."""
    declared = deployment.lora.add_inputs
    mode = add_inputs or declared
    if deployment.lora.on_experts and mode is not declared:
        raise InputError("add_inputs", mode.value, f"{declared.value}, the deployment's mode")
    return mode
