"""handle.generate on the decode engine: what model.generate returns (the left-padded input,
then the new tokens, pad after a row's stop), decoded by an Engine the calling thread keeps.

Used for the models the engine supports (engine_support) and the generate settings it
implements: greedy or sampling (temperature, top-k, top-p), max_new_tokens / max_length,
min_new_tokens, eos and pad ids, left-padded attention masks. Anything else (beams, several
sequences per row, logits processors, streamers, scores) runs model.generate, with one log
line per reason. Each thread keeps its engine (its own KV cache and decode graphs), grown
when a call needs more rows or positions.
"""

from __future__ import annotations

import copy
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..errors import InputError
from .engine import Engine, Request, build_runner
from .sampling import Sampling
from .served import ServedModel
from .step_graphs import buckets_for
from .support import engine_support

log = logging.getLogger("moelora.engine")

# Generation settings the engine implements; others at a non-default value fall back.
ENGINE_FIELDS = frozenset(
    {"max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p",
     "min_new_tokens", "pad_token_id", "eos_token_id", "bos_token_id", "use_cache",
     "decoder_start_token_id", "_from_model_config", "transformers_version"}
)  # fmt: skip
CALL_KWARGS = frozenset({"attention_mask", "generation_config"})
# HF's defaults for fields a generation config leaves unset (GenerationConfig, 5.17 / 5.24).
_HF_DEFAULTS = {"max_length": 20, "temperature": 1.0, "top_k": 50, "top_p": 1.0}

_engines: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # handle -> threading.local
_logged: set[str] = set()


@dataclass(frozen=True)
class _Settings:
    sampling: Sampling
    pad: int


def generate(
    handle: ServedModel, input_ids: Tensor | None, names: list[str | None], kwargs: dict[str, Any]
):
    """The generated ids [B, S + n] as model.generate returns them, or None when this call
    must run model.generate (the reason logged once)."""
    reason = _fallback_reason(handle, input_ids, kwargs)
    settings = None if reason else _settings(handle.model, input_ids, kwargs)
    prompts = None if settings is None else _prompts(input_ids, kwargs, settings.pad)
    if reason or prompts is None:
        reason = reason or "attention_mask is not left padding"
        if reason not in _logged:
            _logged.add(reason)
            log.info("generate runs model.generate: %s", reason)
        return None
    longest = max(len(p) for p in prompts) + settings.sampling.max_new_tokens
    engine = _engine(handle, len(prompts), longest)
    requests = [
        Request(f"row{i}", p, n, settings.sampling) for i, (p, n) in enumerate(zip(prompts, names))
    ]
    _refuse_too_many_adapters(handle, names)
    tokens = _run(engine, requests)
    return _assemble(input_ids, tokens, settings.pad)


def warmup(handle: ServedModel, max_batch: int, max_length: int):
    """The calling thread's engine for `max_batch` rows of `max_length` tokens, its graphs
    captured (Engine.warmup: a CaptureReport, None without graphs)."""
    for field, value in (("max_batch", max_batch), ("max_length", max_length)):
        if type(value) is not int or value < 1:
            raise InputError(field, repr(value), "a positive integer")
    limit = int(handle.model.config.max_position_embeddings)
    if max_length > limit:
        raise InputError("max_length", str(max_length),
                         f"at most the model's max_position_embeddings = {limit}")  # fmt: skip
    return _engine(handle, max_batch, max_length).warmup()


def thread_engine(handle: ServedModel) -> Engine | None:
    """The engine handle.generate uses on the calling thread (None before its first
    generate or warmup there)."""
    local = _engines.get(handle)
    return None if local is None else getattr(local, "engine", None)


def _fallback_reason(handle, input_ids, kwargs) -> str | None:
    model = handle.model
    if input_ids is None:
        return "inputs_embeds (the engine takes token ids)"
    reasons = engine_support(model)
    if reasons and next(model.parameters()).is_cuda and not engine_support(model, runner=True):
        if not build_runner(handle)[1]:  # on a GPU the engine runs it on the runner
            reasons = []
    if reasons:
        return "; ".join(reasons)
    extra = sorted(set(kwargs) - CALL_KWARGS - ENGINE_FIELDS - _generation_fields())
    if extra:
        return f"generate arguments {extra}"
    config = _config(model, kwargs)
    defaults = getattr(type(config), "_get_default_generation_params", dict)()
    for key, value in config.to_diff_dict().items():
        if key not in ENGINE_FIELDS and value not in (None, False, defaults.get(key)):
            return f"generation setting {key} = {value!r}"
    return None


def _generation_fields() -> set[str]:
    from transformers import GenerationConfig

    return set(GenerationConfig().to_dict())


def _config(model, kwargs):
    config = copy.deepcopy(kwargs.get("generation_config") or model.generation_config)
    config.update(**{k: v for k, v in kwargs.items() if k not in CALL_KWARGS})
    return config


def _settings(model, input_ids: Tensor, kwargs) -> _Settings:
    config = _config(model, kwargs)

    def get(key: str):
        value = getattr(config, key, None)
        return _HF_DEFAULTS.get(key) if value is None else value

    new = get("max_new_tokens") or max(get("max_length") - input_ids.shape[1], 1)
    eos = get("eos_token_id")
    eos = () if eos is None else tuple([eos] if isinstance(eos, int) else eos)
    pad = get("pad_token_id")
    pad = pad if pad is not None else (eos[0] if eos else 0)
    sample = bool(get("do_sample"))
    sampling = Sampling(
        max_new_tokens=int(new), temperature=float(get("temperature")) if sample else 0.0,
        top_k=int(get("top_k") or 0), top_p=float(get("top_p")), stop_token_ids=eos,
        min_new_tokens=int(get("min_new_tokens") or 0), ignore_eos=True,  # eos: given above
    )  # fmt: skip
    return _Settings(sampling, int(pad))


def _prompts(input_ids: Tensor, kwargs, pad: int) -> list[tuple[int, ...]] | None:
    """Each row's prompt (its left padding cut); None when a mask is not left padding.
    Without a mask, pad tokens are padding, as generate infers it."""
    mask = kwargs.get("attention_mask")
    if mask is None:
        mask = input_ids.ne(pad) if bool((input_ids == pad).any()) else torch.ones_like(input_ids)
    mask = mask.to(torch.bool).cpu()
    lengths = mask.sum(dim=1)
    width = input_ids.shape[1]
    if not all(bool(row[width - n :].all()) for row, n in zip(mask, lengths.tolist())):
        return None
    ids = input_ids.cpu()
    return [tuple(ids[i, width - n :].tolist()) for i, n in enumerate(lengths.tolist())]


def _engine(handle: ServedModel, rows: int, length: int) -> Engine:
    """The calling thread's engine, rebuilt (larger) when it has too few rows or positions."""
    local = _engines.setdefault(handle, threading.local())
    engine = getattr(local, "engine", None)
    if engine is not None and engine.max_rows >= rows and engine.max_len >= length:
        return engine
    if engine is not None:
        engine.close()
    limit = int(handle.model.config.max_position_embeddings)
    max_len = min(limit, max(length, 64, 1 << (length - 1).bit_length()))
    max_rows = next((b for b in buckets_for(64) if b >= rows), rows)
    engine = Engine(handle, max_rows=max_rows, max_len=max_len, enforce_eager=handle.enforce_eager)
    local.engine = engine
    return engine


def _refuse_too_many_adapters(handle: ServedModel, names: list[str | None]) -> None:
    keys = {v.key for v in map(handle.version, names) if v is not None}
    if len(keys) > handle.num_slots:
        raise InputError(
            "adapter_names", f"{len(keys)} distinct adapters in one batch",
            f"at most num_slots = {handle.num_slots} (one slot each): split the batch",
        )  # fmt: skip


def _run(engine: Engine, requests: list[Request]) -> list[list[int]]:
    for request in requests:
        engine.check(request)  # before anything is held
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    # every row's adapter held at once, as a model.generate call holds them: rows held one
    # by one could each keep a slot another thread's call waits for, while waiting too
    holds = engine.handle.hold([r.adapter for r in requests])
    added = 0
    try:
        for request, hold in zip(requests, holds):
            engine.add(request, hold=hold)
            added += 1
        while engine.has_work:
            for event in engine.step():
                if event.error is not None:  # a row that failed in the step: the call fails
                    raise event.error
                if event.token_id >= 0:
                    tokens[event.request_id].append(event.token_id)
    except BaseException:
        engine.clear()  # a failed call leaves no request holding an adapter
        for hold in holds[added:]:
            hold.release()
        raise
    return [tokens[r.request_id] for r in requests]


def _assemble(input_ids: Tensor, tokens: list[list[int]], pad: int) -> Tensor:
    """[B, S + n]: the input, then each row's tokens, pad after a row's last."""
    new = max(len(t) for t in tokens)
    out = torch.full((input_ids.shape[0], input_ids.shape[1] + new), pad, dtype=input_ids.dtype)
    out[:, : input_ids.shape[1]] = input_ids.cpu()
    for row, row_tokens in enumerate(tokens):
        out[row, input_ids.shape[1] : input_ids.shape[1] + len(row_tokens)] = torch.tensor(
            row_tokens
        )
    return out.to(input_ids.device)
