"""The epsilon of a transformers RMSNorm module, whichever attribute its version names it by
(transformers 5.17's Llama4TextL2Norm and Qwen3_5MoeRMSNorm keep `eps`, most others and
later versions `variance_epsilon`)."""

from __future__ import annotations

from torch import nn


def norm_eps(module: nn.Module) -> float:
    """module's epsilon: its `variance_epsilon`, else its `eps`."""
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if value is not None:
            return float(value)
    raise AttributeError(
        f"{type(module).__name__} has neither variance_epsilon nor eps: moelora cannot read "
        "this RMSNorm's epsilon (fix: run this model with runner=False, or report its "
        "transformers version)"
    )
