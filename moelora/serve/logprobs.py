"""The logprobs objects of the responses, as vLLM writes them from the engine's
TokenLogprobs (moelora/engine/logprobs.py: raw logprobs, vLLM's default mode).

Each position lists, as vLLM's sampler does, the token itself first, then the most likely
tokens (without repeating it). From that list:
- completions (`logprobs: N`): `tokens`, `token_logprobs`, `top_logprobs` (the first N + 1
  entries as {token text: logprob}: the top N and the token, OpenAI's rule) and
  `text_offset` (each token's start, counted over the tokens' own texts); a prompt's first
  token has no logprob (null, and null top_logprobs);
- chat (`logprobs: true`, `top_logprobs: N`): `{"content": [{"token", "logprob", "bytes",
  "top_logprobs": the first N entries}]}`;
- vLLM's `prompt_logprobs`: per prompt token null (the first) or {token id: {"logprob",
  "rank", "decoded_token"}}.
A token's text is the tokenizer's decode of it alone (vLLM's), and -inf is written as
-9999.0 (OpenAI's JSON-safe floor, as vLLM).
"""

from __future__ import annotations

from ..engine import TokenLogprobs

FLOOR = -9999.0  # what OpenAI and vLLM write for -inf


def _floor(value: float) -> float:
    return max(value, FLOOR)


class Texts:
    """Token id -> its text decoded alone, cached per response."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._cache.get(token)
        if text is None:
            text = self._cache[token] = self.tokenizer.decode([token]) or ""
        return text


def _entries(position: TokenLogprobs) -> list[tuple[int, float]]:
    """The token first, then the top tokens without it (vLLM's order)."""
    own = (position.token, position.logprob)
    return [own, *((t, lp) for t, lp in position.top if t != position.token)]


def completion_logprobs(
    tokens: list[int], positions: list[TokenLogprobs | None], top: int, texts: Texts,
    offset: int = 0,
) -> dict:  # fmt: skip
    """vLLM's completions logprobs object of `tokens` (positions[i] scores tokens[i]; None:
    a prompt's first token). offset: the text_offset of the first token."""
    out: dict[str, list] = {"text_offset": [], "token_logprobs": [], "tokens": [],
                            "top_logprobs": []}  # fmt: skip
    for token, position in zip(tokens, positions):
        text = texts(token)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if position is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_floor(position.logprob))
        out["top_logprobs"].append(
            {texts(t): _floor(lp) for t, lp in _entries(position)[: top + 1]}
        )
    return out


def chat_logprobs(positions: list[TokenLogprobs], top: int, texts: Texts) -> list[dict]:
    """The `content` list of OpenAI's chat logprobs object."""

    def entry(token: int, logprob: float) -> dict:
        text = texts(token)
        return {"token": text, "logprob": _floor(logprob),
                "bytes": list(text.encode("utf-8", errors="replace"))}  # fmt: skip

    out = []
    for p in positions:
        top_entries = [entry(t, lp) for t, lp in _entries(p)[:top]]
        out.append(entry(p.token, p.logprob) | {"top_logprobs": top_entries})
    return out


def prompt_logprobs(positions: list[TokenLogprobs | None], texts: Texts) -> list[dict | None]:
    """vLLM's prompt_logprobs field: null, then {token id: {logprob, rank, decoded_token}}
    with the prompt token first, then its top ones."""
    out: list[dict | None] = []
    for p in positions:
        if p is None:
            out.append(None)
            continue
        ranks = {t: i + 1 for i, (t, _) in enumerate(p.top)} | {p.token: p.rank}
        out.append({
            str(t): {"logprob": _floor(lp), "rank": ranks[t], "decoded_token": texts(t)}
            for t, lp in _entries(p)
        })  # fmt: skip
    return out
