"""Input validation for MoELoRALayer: what the oracle judged (the deployment) must be what
runs. Shape, dtype and device checks read tensor metadata only; value checks (expert ids,
slots) read the tensors and so synchronise with the GPU: the layer skips them while a CUDA
graph is being captured, or when built with check_values=False.

Legend: T tokens, K top-k, E_l local experts, H hidden, I_p = I / tp, R rank, L slots.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .config import AddInputs, MoEShape
from .deployment import Deployment, LoRASharding
from .errors import InputError
from .weights import ExpertWeights, LoRABank


def _want(name: str, t: Tensor | None, shape: tuple[int, ...], dtype: torch.dtype | None = None):
    if t is None:
        raise InputError(name, None, f"a tensor of shape {list(shape)}")
    if tuple(t.shape) != shape:
        raise InputError(name, f"shape {list(t.shape)}", f"shape {list(shape)}")
    if dtype is not None and t.dtype != dtype:
        raise InputError(name, f"dtype {t.dtype}", f"{dtype}")


def check_experts(experts: ExpertWeights, shape: MoEShape, local_experts: int) -> None:
    """w13 [E_l, S*I_p, H], w2 [E_l, H, I_p] in the serving dtype; biases iff has_bias."""
    e, h, i = local_experts, shape.hidden_size, shape.intermediate_size
    _want("experts.w13", experts.w13, (e, shape.w13_rows, h), shape.dtype)
    _want("experts.w2", experts.w2, (e, h, i), shape.dtype)
    for name, bias, rows in (("b13", experts.b13, shape.w13_rows), ("b2", experts.b2, h)):
        if shape.has_bias:
            _want(f"experts.{name}", bias, (e, rows), shape.dtype)
        elif bias is not None:
            raise InputError(f"experts.{name}", "a bias", "None: the model shape has no biases")


def check_batch(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    token_slots: Tensor | None,
    shape: MoEShape,
    device: torch.device,
) -> None:
    """x [T, H] serving dtype; topk_ids [T, K] int; topk_weights [T, K] fp32; slots [T] int32."""
    if x.dim() != 2 or x.shape[1] != shape.hidden_size:
        raise InputError("x", f"shape {list(x.shape)}", f"[T, H = {shape.hidden_size}]")
    if x.dtype != shape.dtype:
        raise InputError("x", f"dtype {x.dtype}", f"{shape.dtype} (the deployment's dtype)")
    tokens, top_k = x.shape[0], shape.top_k
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise InputError("topk_ids", f"dtype {topk_ids.dtype}", "int32")
    _want("topk_ids", topk_ids, (tokens, top_k))
    _want("topk_weights", topk_weights, (tokens, top_k), torch.float32)
    if token_slots is not None:
        _want("token_slots", token_slots, (tokens,), torch.int32)
    for name, t in (
        ("x", x),
        ("topk_ids", topk_ids),
        ("topk_weights", topk_weights),
        ("token_slots", token_slots),
    ):
        if t is not None and t.device != device:
            raise InputError(name, f"on {t.device}", f"on {device}, where the weights are")


def bank_shapes(deployment: Deployment, num_slots: int, rank: int) -> dict[str, tuple[int, ...]]:
    """The shapes of this rank's slot bank under the deployment's LoRA sharding."""
    s = deployment.shape
    tp = deployment.parallel.tp
    fully = deployment.lora_sharding is LoRASharding.FULLY_SHARDED
    e, i = deployment.local_experts, deployment.intermediate_per_partition
    h, width = s.hidden_size, s.activation.width_factor
    return {
        "w13_a": (num_slots, e, width, rank // tp if fully else rank, h),
        "w13_b": (num_slots, e, width, i, rank),
        "w2_a": (num_slots, e, rank, i),
        "w2_b": (num_slots, e, h // tp if fully else h, rank),
    }


def check_bank(lora: LoRABank, deployment: Deployment) -> None:
    """L <= max_loras, R <= max_lora_rank (what the oracle checked), shapes of this rank."""
    num_slots, rank = lora.w13_b.shape[0], lora.w13_b.shape[-1]
    cfg = deployment.lora
    if num_slots > cfg.max_loras:
        raise InputError("lora", f"{num_slots} slots", f"at most max_loras = {cfg.max_loras}")
    if rank > cfg.max_rank:
        raise InputError("lora", f"rank {rank}", f"at most max_lora_rank = {cfg.max_rank}")
    for name, want in bank_shapes(deployment, num_slots, rank).items():
        _want(f"lora.{name}", getattr(lora, name), want)


def check_values(
    topk_ids: Tensor,
    token_slots: Tensor | None,
    local_experts: int,
    num_slots: int,
    foreign_ids: bool,
) -> None:
    """Expert ids in [0, E_l) (or -1 for another rank's expert under EP); slots in [-1, L)."""
    low = -1 if foreign_ids else 0
    if topk_ids.numel() and not bool(((topk_ids >= low) & (topk_ids < local_experts)).all()):
        bad = topk_ids[(topk_ids < low) | (topk_ids >= local_experts)][0].item()
        raise InputError("topk_ids", f"containing {bad}", f"ids in [{low}, {local_experts})")
    if token_slots is not None and token_slots.numel():
        if not bool(((token_slots >= -1) & (token_slots < num_slots)).all()):
            bad = token_slots[(token_slots < -1) | (token_slots >= num_slots)][0].item()
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
