"""vLLM's tokenizer routes: POST /tokenize, POST /detokenize and GET /tokenizer_info, in
vLLM's request and response shapes (lm-evaluation-harness's `local-completions` reads
/tokenizer_info, then tokenizes and detokenizes through the other two).

The answers are plain dicts; refusals raise ServeError (context.py). The tokenizer is the
model's, shared by every adapter: a `model` field only has to name a served model.
"""

from __future__ import annotations

from typing import Any

from .context import ServeContext
from .protocol import DetokenizeRequest, TokenizeRequest

# init_kwargs entries that are paths on the server's disk, not configuration (vLLM drops
# the same two)
_PATH_KEYS = ("vocab_file", "merges_file")
_SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")


def tokenize(ctx: ServeContext, body: TokenizeRequest) -> dict:
    """{"count", "max_model_len", "tokens", "token_strs"} (token_strs: null unless asked)."""
    if body.model is not None:
        ctx.adapter_of(body.model)  # 404 for a name the server does not serve
    if body.messages is not None:
        text = ctx.chat_text(body.messages, body.add_generation_prompt, body.chat_template_kwargs)
        special = bool(body.add_special_tokens)  # default False: the template wrote them
    else:
        text = body.prompt
        special = body.add_special_tokens is not False  # default True
    ids = ctx.tokenize(text, special)
    strs = ctx.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids,
            "token_strs": strs}  # fmt: skip


def detokenize(ctx: ServeContext, body: DetokenizeRequest) -> dict:
    """{"prompt": the text of `tokens`} (special tokens kept, as vLLM decodes)."""
    if body.model is not None:
        ctx.adapter_of(body.model)
    ids = ctx.checked_ids(body.tokens, "tokens")
    return {"prompt": ctx.tokenizer.decode(ids)}


def tokenizer_info(ctx: ServeContext) -> dict:
    """vLLM's /tokenizer_info: the tokenizer's init kwargs made JSON-safe (paths dropped),
    its special tokens (null when it has none: clients look for the keys), its class, and
    the chat template requests are rendered with."""
    tok = ctx.tokenizer
    config = {k: _json_safe(v) for k, v in (getattr(tok, "init_kwargs", None) or {}).items()
              if k not in _PATH_KEYS}  # fmt: skip
    for name in _SPECIAL:
        value = getattr(tok, name, None)
        config[name] = None if value is None else str(value)
    config["tokenizer_class"] = type(tok).__name__
    template = getattr(tok, "chat_template", None)
    if template:
        config["chat_template"] = template
    return config


def _json_safe(value: Any) -> Any:
    """A JSON value for an init kwarg (AddedToken and other objects as their text)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    return str(value)
