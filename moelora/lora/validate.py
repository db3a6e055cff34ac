"""Checks on an adapter's config and tensors. Every failure raises AdapterError naming the
file, the key, what was found and what was expected."""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from ..errors import AdapterError

ALLOWED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_lora_config(file: str, config: dict[str, Any]) -> None:
    """Refuse configs whose math moelora does not implement (DoRA, fan_in_fan_out, ...)."""
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise AdapterError(file, "peft_type", repr(peft_type), "'LORA'", "use a LoRA adapter")
    r = config.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise AdapterError(file, "r", repr(r), "a positive integer", "set the LoRA rank 'r'")
    alpha = config.get("lora_alpha", r)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise AdapterError(file, "lora_alpha", repr(alpha), "a finite number")
    for flag in ("use_dora", "fan_in_fan_out"):
        if config.get(flag):
            raise AdapterError(
                file, flag, "true", "false", f"moelora serves plain LoRA; re-train without {flag}"
            )
    for key in ("rank_pattern", "alpha_pattern"):
        value = config.get(key) or {}
        if not isinstance(value, dict):
            raise AdapterError(file, key, type(value).__name__, "a dict of pattern -> number")
        for pattern, number in value.items():
            _check_pattern(file, key, pattern, number)


def _check_pattern(file: str, key: str, pattern: Any, number: Any) -> None:
    """One rank_pattern / alpha_pattern entry: a valid regex mapped to an int rank or a
    finite alpha (PEFT would fail on anything else at a worse moment)."""
    where = f"{key}[{pattern!r}]"
    try:
        re.compile(str(pattern))
    except re.error as err:
        raise AdapterError(file, where, f"pattern {pattern!r} ({err})", "a valid regex") from None
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        raise AdapterError(file, where, repr(number), "a number")
    if key == "rank_pattern" and (not isinstance(number, int) or number < 1):
        raise AdapterError(file, where, repr(number), "a positive integer rank")
    if not math.isfinite(number):
        raise AdapterError(file, where, repr(number), "a finite number")


def peft_name(path: str) -> str:
    """The module name PEFT matches rank_pattern / alpha_pattern against."""
    return path.removeprefix("base_model.model.")


def pattern_value(patterns: dict[str, Any], name: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: the first key k with
    re.match(rf"(.*\\.)?({k})$", name) wins (peft.utils.other.get_pattern_key)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def lora_scale(file: str, config: dict[str, Any], target: str, rank: int, key: str) -> float:
    """alpha / r (or alpha / sqrt(r) for rsLoRA) for the PEFT target `target`.

    The rank the config gives that target must equal the rank found in the tensor.
    """
    r = pattern_value(config.get("rank_pattern") or {}, target, config["r"])
    alpha = pattern_value(config.get("alpha_pattern") or {}, target, config.get("lora_alpha", r))
    if r != rank:
        raise AdapterError(
            file,
            key,
            f"rank {rank} in the tensor",
            f"rank {r} from adapter_config.json (r / rank_pattern for '{target}')",
            "the config and the weights come from different adapters: save them together",
        )
    return float(alpha) / (math.sqrt(r) if config.get("use_rslora") else r)


def module_factors(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Non-expert tensors grouped by module: path -> {'A': [r, in], 'B': [out, r]}; entries
    that are not LoRA factors (biases, embeddings, modules_to_save) are left out."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        module, sep, factor = key.rpartition(".lora_")
        if sep and factor in ("A.weight", "B.weight") and t.dim() == 2:
            out.setdefault(module, {})[factor[0]] = t
    return out


def check_module_rank(
    file: str, config: dict[str, Any], module: str, factors: dict[str, torch.Tensor]
) -> None:
    """A non-expert module's factors (A [r, in], B [out, r], e.g. attention) must have the
    rank adapter_config.json gives that module (r / rank_pattern): PEFT builds its layer
    from the config and would fail on the copy, after the adapter was half applied. The
    key field names the module."""
    name = peft_name(module)
    r = pattern_value(config.get("rank_pattern") or {}, name, config["r"])
    ranks = {k: t.shape[0] if k == "A" else t.shape[1] for k, t in sorted(factors.items())}
    if any(rank != r for rank in ranks.values()):
        shapes = ", ".join(f"lora_{k} {list(factors[k].shape)}" for k in ranks)
        raise AdapterError(
            file,
            module,
            f"rank {'/'.join(str(v) for v in dict.fromkeys(ranks.values()))} in {shapes}",
            f"rank {r} from adapter_config.json (r / rank_pattern for '{name}')",
            "the config and the weights come from different adapters: save them together",
        )


def zero_alphas(config: dict[str, Any]) -> list[str]:
    """The config fields whose alpha is 0 ('lora_alpha', "alpha_pattern['q_proj']"): the
    modules they scale serve as the base model."""
    out = ["lora_alpha"] if config.get("lora_alpha", config["r"]) == 0 else []
    patterns = config.get("alpha_pattern") or {}
    return out + [f"alpha_pattern[{k!r}]" for k, v in patterns.items() if v == 0]


def check_tensor(file: str, key: str, t: torch.Tensor) -> None:
    """dtype one of fp32/fp16/bf16 and every value finite."""
    if t.dtype not in ALLOWED_DTYPES:
        raise AdapterError(
            file,
            key,
            f"dtype {t.dtype}",
            "float32, float16 or bfloat16",
            "save LoRA factors as floats",
        )
    # The sum is finite when every value is (a NaN or Inf makes it NaN or Inf): a scalar
    # instead of temporaries the size of t; only an overflowing sum needs the full look.
    if not torch.isfinite(t.sum()) and not torch.isfinite(t).all():
        bad = int((~torch.isfinite(t)).sum())
        raise AdapterError(
            file, key, f"{bad} NaN/Inf values", "finite values", "the adapter diverged in training"
        )


def check_shape(file: str, key: str, t: torch.Tensor, expected: tuple[int | str, ...]) -> None:
    """Compare t.shape with `expected`, where a str entry (a rank like 'r') matches any size."""
    ok = t.dim() == len(expected) and all(
        isinstance(e, str) or s == e for s, e in zip(t.shape, expected, strict=True)
    )
    if not ok:
        raise AdapterError(
            file,
            key,
            f"shape {tuple(t.shape)}",
            f"shape ({', '.join(str(e) for e in expected)})",
            "the adapter was trained for a different model: check hidden and intermediate sizes",
        )


def check_rank(file: str, key: str, rank: int, max_rank: int) -> None:
    if rank > max_rank:
        raise AdapterError(
            file,
            key,
            f"rank {rank}",
            f"rank at most max_rank R = {max_rank}",
            "raise max_rank or use a lower-rank adapter",
        )
