"""moelora inside Hugging Face transformers: one model, many PEFT adapters, one mixed batch.

    handle = moelora.hf.attach(model, num_slots=8, max_rank=16)
    handle.load_adapter("path/to/peft-adapter", name="a")
    out = handle.generate(input_ids, adapter_names=["a", None], max_new_tokens=32)

`attach` registers the "moelora" experts implementation in transformers' ExpertsInterface
and binds every MoE layer of the model to moelora; see attach.py and handle.py.
"""

from .attach import attach
from .experts import NAME, register
from .handle import MoELoRAModel
from .weights import expert_weights_from_hf, router_from_hf, router_logits

__all__ = [
    "NAME",
    "MoELoRAModel",
    "attach",
    "expert_weights_from_hf",
    "register",
    "router_from_hf",
    "router_logits",
]
