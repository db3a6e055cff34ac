"""Which transformers models the decode engine runs: reasons it cannot (empty = it can).

The engine keeps keys and values per row at each row's own position and builds the
attention masks itself (kv_cache.py, kv_mask.py). So every layer must be attention whose
only state is k / v (no Mamba or linear-attention state), attention must take an additive
4-D mask (sdpa / eager), and nothing may read one sequence length for the whole batch
(Llama 4's attention temperature on its NoPE layers reads the cache's length in
transformers' forward; moelora's runner reads each token's position and lifts that).
A predicate: it never raises.
"""

from __future__ import annotations

from torch import nn

from .kv_mask import ATTENTION_TYPES, STATELESS_TYPES

MASKED_ATTENTION = ("sdpa", "eager")


def engine_support(model: nn.Module, runner: bool = False) -> list[str]:
    """Reasons the engine cannot decode `model` (an AutoModelForCausalLM); [] = supported.
    runner: on moelora's runner (runner.py), which reads each token's own position and
    keeps linear-attention layers' states (the layer types it runs: runner_support)."""
    config = model.config
    reasons = []
    impl = getattr(config, "_attn_implementation", None)
    if impl not in MASKED_ATTENTION:
        reasons.append(
            f"attention implementation {impl!r} (the engine's 4-D masks need one of "
            f"{list(MASKED_ATTENTION)})"
        )
    known = set(ATTENTION_TYPES) | set(STATELESS_TYPES)
    other = sorted(set(getattr(config, "layer_types", None) or ()) - known)
    if other and not runner:  # (the runner checks the layer types it runs: runner_support)
        reasons.append(f"layer types {other}: state other than keys and values")
    no_rope = getattr(config, "no_rope_layers", None) or ()
    if not runner and getattr(config, "attn_temperature_tuning", False) and 0 in no_rope:
        reasons.append("NoPE layers with attention temperature tuning read one length per batch")
    if getattr(model, "forward", None) is None or not hasattr(model, "get_input_embeddings"):
        reasons.append(f"{type(model).__name__} is not a causal LM")
    return reasons
