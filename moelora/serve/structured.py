"""Structured output: OpenAI's response_format (`json_object`, `json_schema`) as a
per-request TokenConstraint (moelora/engine/sampling.py) built on xgrammar, the library
vLLM uses by default.

The grammar is compiled once per body (its vocabulary once per tokenizer); each choice gets
its own matcher, whose mask the engine applies to that row's logits only. With the grammar
matched whole the row stops (finish reason "stop"), whether or not the model has an end
token (xgrammar's terminate_without_stop_token). xgrammar is the optional `structured`
extra: without it, a body with a response_format other than text is refused with a 400
naming the package. A schema xgrammar cannot compile, and a vocabulary in which no token
can start the output, are refused with a 400 too, before anything runs.
"""

from __future__ import annotations

import importlib
import json
import threading
from collections.abc import Callable

import torch
from torch import Tensor

from .protocol import ResponseFormat

PACKAGE = "xgrammar"
EXTRA = "structured"


class FormatRefused(ValueError):
    """A response_format this server cannot serve (the message says why and the fix);
    context.py answers it as a 400 naming response_format."""


_compilers: dict[int, tuple[object, object]] = {}  # id(tokenizer) -> (tokenizer, compiler)
_lock = threading.Lock()


class GrammarConstraint:
    """One choice's matcher: the tokens its grammar allows next, advanced per token."""

    def __init__(self, xgr, grammar, vocab_size: int) -> None:
        self._matcher = xgr.GrammarMatcher(grammar, terminate_without_stop_token=True)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._vocab = vocab_size

    def allowed(self) -> Tensor:
        """allowed [V] bool, from xgrammar's bitmask (bit j of word i: token 32 i + j)."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        shifts = torch.arange(32, dtype=torch.int32)
        bits = (self._bitmask[0][:, None] >> shifts) & 1
        return bits.bool().flatten()[: self._vocab]

    def accept(self, token: int) -> None:
        if not self._matcher.accept_token(token):  # the mask allowed it: a bug if refused
            raise RuntimeError(f"the grammar refused token {token} its own mask allowed")

    @property
    def finished(self) -> bool:
        return self._matcher.is_terminated()


JSON_OBJECT = '{"type": "object"}'  # the schema response_format json_object compiles


def maker(
    fmt: ResponseFormat, tokenizer, vocab_size: int, stop_ids: tuple[int, ...] = ()
) -> Callable[[], GrammarConstraint]:
    """A maker of one GrammarConstraint per choice for `fmt` (json_object or json_schema);
    refusals raise FormatRefused."""
    xgr = _xgrammar(fmt)
    compiler = _compiler(xgr, tokenizer, vocab_size, stop_ids)
    try:
        if fmt.type == "json_object":  # a JSON object, as the name says (not any JSON value)
            grammar = compiler.compile_json_schema(JSON_OBJECT)
        else:
            grammar = compiler.compile_json_schema(json.dumps(fmt.json_schema.schema_))
    except Exception as err:  # xgrammar's own words: an unsupported or invalid schema
        raise FormatRefused(f"response_format.json_schema.schema could not be compiled by "
                            f"{PACKAGE}: {err}") from None  # fmt: skip
    if not bool(GrammarConstraint(xgr, grammar, vocab_size).allowed().any()):
        raise FormatRefused(f"response_format {fmt.type!r}: no token of this model's "
                            "vocabulary can start such an output")  # fmt: skip
    return lambda: GrammarConstraint(xgr, grammar, vocab_size)


def _xgrammar(fmt: ResponseFormat):
    try:
        return importlib.import_module(PACKAGE)
    except ImportError:
        raise FormatRefused(
            f"response_format {fmt.type!r} needs the package {PACKAGE!r}, which this server "
            f"does not have: install it (pip install 'moelora[{EXTRA}]') and restart the "
            "server, or leave response_format out"
        ) from None


def _compiler(xgr, tokenizer, vocab_size: int, stop_ids: tuple[int, ...]):
    """The tokenizer's GrammarCompiler, built once (its vocabulary is read then)."""
    with _lock:
        entry = _compilers.get(id(tokenizer))
        if entry is None or entry[0] is not tokenizer:
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_ids) or None
            )
            entry = _compilers[id(tokenizer)] = (tokenizer, xgr.GrammarCompiler(info))
        return entry[1]
