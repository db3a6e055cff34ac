"""`attach(model, ...)`: moelora serves the routed experts of a transformers model while every
row of a batch uses its own adapter; the returned handle (handle.py) owns the slot banks.

The model keeps its own routing, attention and everything else. Per MoE layer the handle
binds a MoELoRALayer whose weights are views of the module's own expert tensors (no copy),
all sharing one oracle verdict (asked once per layer type, logged once). Every nn.Linear
and router an adapter may target gets a per-token LoRA hook (module_lora.py) and a bank in
the slot manager. Legend: L slots (num_slots), R max rank (max_rank).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

import torch
from torch import nn

from ..config import LoRAConfig, ModelConfig, from_hf
from ..deployment import Deployment
from ..device import probe_device
from ..errors import ConfigError
from ..layer import MoELoRALayer
from ..lora import SlotManager
from ..lora.registry import AdapterRegistry
from ..oracle import select
from . import experts
from .bound import Bound
from .fp8_linears import FP8Linears
from .graphs import MAX_GRAPH_TOKENS, LayerGraphs
from .handle import MoELoRAModel
from .llama4 import swap_llama4_blocks
from .module_lora import ModuleHooks, module_shapes, served_modules
from .router_lora import find_routers
from .weights import expert_weights_from_hf

log = logging.getLogger("moelora.hf")

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def attach(
    model: nn.Module,
    *,
    num_slots: int,
    max_rank: int,
    moe_backend: str = "auto",
    fully_sharded_loras: bool = False,
    enforce_eager: bool | None = None,
    max_cpu_loras: int | None = None,
    max_graph_tokens: int = MAX_GRAPH_TOKENS,
    load_timeout_s: float = 30.0,
    lora_target_modules: Sequence[str] | None = None,
) -> MoELoRAModel:
    """Serve `model`'s routed experts with moelora; returns the handle (MoELoRAModel).

    num_slots (L) adapters fit in the slots at once, each of rank <= max_rank (R) (vLLM's
    --max-loras and --max-lora-rank).
    moe_backend: "auto" or a backend name; an explicit one is honoured or refused here,
    before anything is allocated. enforce_eager: True allows eager-only backends on a GPU;
    default: CUDA-graph safe backends on a GPU (vLLM's default), anything on a CPU.
    fully_sharded_loras: accepted for vLLM compatibility; a no-op in one process (tp = 1).
    More adapters than num_slots may be loaded: the slots hold the most recently used, the
    others wait in host memory (max_cpu_loras bounds the pinned copies kept ready, vLLM's
    --max-cpu-loras) and are copied in when a call names them.
    max_graph_tokens: on a GPU (unless enforce_eager), each MoE layer replays a CUDA graph of
    itself for calls of at most this many tokens (decode), captured at a shape's second call: an eager
    decode step is otherwise bound by Triton's Python launch cost. 0 turns it off.
    lora_target_modules: the nn.Linear modules and routers adapters may carry LoRA on (PEFT's
    target_modules matching: "q_proj" names every q_proj), each given a bank of
    L x R x (in + out) values and a per-token LoRA hook; None: every nn.Linear and router.
    An adapter with LoRA on another module is refused at load, naming it.
    The model is put in eval mode: moelora serves inference (no autograd through experts).
    """
    model_config = _model_config(model)
    modules = _experts_modules(model, model_config)
    served = served_modules(model, lora_target_modules, find_routers(model, model_config))
    first = next(iter(modules.values()))
    param = first.down_proj
    quantized = model_config.quantization.method.is_fp8
    device = param.device
    # FP8 experts (e4m3 on sm89+ GPUs): the serving dtype is the model's, not the experts'
    dtype = model.dtype if quantized else param.dtype
    if fully_sharded_loras:
        log.info("fully_sharded_loras: a no-op in one process (tp = 1), as in vLLM")
    deployment = Deployment.for_model(
        model_config,
        dtype=dtype,
        device=probe_device(device),
        lora=LoRAConfig(enabled=True, max_rank=max_rank, num_slots=num_slots, targets=("experts",)),
        cuda_graphs=device.type == "cuda" and not enforce_eager,
        backend=moe_backend,
    )
    selection = select(deployment)  # one verdict for the model's one MoE layer type
    layers = {
        index: MoELoRALayer(
            deployment,
            _layer_experts(module, model_config, index, model),
            selection=selection,
            check_values=False,  # the model's router gives the ids: no host sync per layer
        )
        for index, module in modules.items()
    }
    manager = SlotManager(
        model_config,
        num_slots,
        max_rank,
        device=device,
        dtype=dtype,
        load_timeout_s=load_timeout_s,
        max_cpu_loras=max_cpu_loras,
        module_shapes=module_shapes(served, dtype),
    )
    experts.register()
    for index, module in modules.items():
        first = index == min(modules)
        graphs = (
            LayerGraphs(max_graph_tokens) if deployment.cuda_graphs and max_graph_tokens else None
        )
        experts.bind(module, experts.ExpertsBinding(layers[index], index, first, graphs))
    previous = getattr(model.config, "_experts_implementation", None)
    swapped = swap_llama4_blocks(model, model_config)
    if not swapped:
        model.set_experts_implementation(experts.NAME)
    model.eval()
    hooks = ModuleHooks(served, manager.module_banks)
    bound = Bound(list(modules.values()), swapped, previous, hooks, FP8Linears(model))
    return MoELoRAModel(model, model_config, selection, AdapterRegistry(manager), served,
                        layers, bound, device, enforce_eager)  # fmt: skip


def _layer_experts(module: nn.Module, model_config: ModelConfig, index: int, model: nn.Module):
    """Layer `index`'s experts as moelora serves them: views of the module's tensors, or
    for an FP8 config its e4m3 experts and scales (the module's where transformers kept
    them in FP8, else the checkpoint's: quant/module_fp8.py)."""
    if not model_config.quantization.method.is_fp8:
        return expert_weights_from_hf(module, model_config, in_place=True)
    from ..quant.module_fp8 import fp8_experts_for_layer

    model_dir = getattr(model.config, "_name_or_path", None)
    return fp8_experts_for_layer(module, model_config, index, model_dir)


def _model_config(model: nn.Module) -> ModelConfig:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise ConfigError(
            "model",
            type(model).__name__,
            "a transformers PreTrainedModel (with .config)",
            "pass the model AutoModelForCausalLM returned",
        )
    return from_hf(config.to_dict(), name=getattr(config, "model_type", None))


def _experts_modules(model: nn.Module, model_config: ModelConfig) -> dict[int, nn.Module]:
    """MoE layer index -> the routed-experts module (fused 3-D weights), checked against the
    config's MoE layers."""
    found: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        down = getattr(module, "down_proj", None)
        if not name.endswith("experts") or not isinstance(down, torch.Tensor) or down.dim() != 3:
            continue
        match = _LAYER_INDEX.search(name + ".")
        if match is None:
            continue
        if getattr(module, "_is_expert_parallel", False) or getattr(
            module, "has_post_expert_norm", False
        ):
            raise ConfigError(
                f"{name}",
                "expert parallel or a post-expert norm",
                "plain routed experts in one process",
                "load the model without transformers' expert parallel plan",
            )
        found[int(match.group(1))] = module
    want = tuple(model_config.moe_layers)
    if tuple(sorted(found)) != want:
        raise ConfigError(
            "model",
            f"routed-experts modules in layers {sorted(found)}",
            f"the MoE layers {list(want)} that its config describes",
            "pass a model built from its own config (fused 3-D expert weights, transformers 5)",
        )
    params = {(m.down_proj.device, m.down_proj.dtype) for m in found.values()}
    if len(params) != 1:
        raise ConfigError(
            "model",
            f"experts on {sorted(map(str, params))}",
            "every MoE layer on one device in one dtype",
            "move the model with model.to(device, dtype) first",
        )
    return found
