"""moelora's decode engine: continuous batching of requests, each with its own adapter, over a
served model (`ServedModel`: moelora.hf's handle), with its KV cache, masks, sampling and
whole decode steps replayed as CUDA graphs. Below moelora.hf and moelora.serve: it imports
neither (tests/test_module_layers.py)."""

from .engine import Engine, Request, TokenEvent
from .logprobs import TokenLogprobs
from .sampling import Sampling, TokenConstraint
from .served import ServedModel

__all__ = [
    "Engine", "Request", "Sampling", "ServedModel", "TokenConstraint", "TokenEvent",
    "TokenLogprobs",
]  # fmt: skip
