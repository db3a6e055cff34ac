"""Log-probabilities of the tokens a request reads or produces, as vLLM returns them.

vLLM's default (`logprobs_mode="raw_logprobs"`): the log-softmax of the logits the model
produced, in fp32, before any sampling processor (temperature, top-k / top-p / min-p,
repetition penalty, min-tokens). A row whose output is constrained (structured output)
gets them after its mask, as vLLM applies the grammar's bitmask to the logits before its
sampler. Each position carries the token's own logprob, its rank (1 + the number of tokens
more likely) and the `n` most likely tokens with theirs, in descending order.
Legend: B rows, S prompt length, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class TokenLogprobs:
    """One position: the token read or chosen, its logprob and rank, and the top-n."""

    token: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: tuple[tuple[int, float], ...]  # (token, logprob), most likely first


def raw_logprobs(logits: Tensor) -> Tensor:
    """logits [B, V] (any float dtype) -> logprobs [B, V] fp32 (a new tensor: the sampling
    processors may then change the logits in place)."""
    return torch.log_softmax(logits.float(), dim=-1)


def token_logprobs(logprobs: Tensor, tokens: list[int], tops: list[int]) -> list[TokenLogprobs]:
    """logprobs [B, V] (raw_logprobs of the rows), tokens[i] the token row i chose, tops[i]
    how many most-likely tokens it returns -> one TokenLogprobs per row."""
    chosen = torch.tensor(tokens, device=logprobs.device)
    return _gather(logprobs, chosen, tops)


def prompt_logprobs(logits: Tensor, prompt: tuple[int, ...], top: int) -> list:
    """logits [S, V] of every prompt position -> [None, then one TokenLogprobs per prompt
    token from the second]: token i is scored by the logits of position i - 1 (the first
    has no context, so None, as vLLM returns it)."""
    if len(prompt) < 2:
        return [None]
    logprobs = raw_logprobs(logits[:-1])
    read = torch.tensor(prompt[1:], device=logits.device)
    return [None, *_gather(logprobs, read, [top] * (len(prompt) - 1))]


def _gather(logprobs: Tensor, tokens: Tensor, tops: list[int]) -> list[TokenLogprobs]:
    """logprobs [B, V], tokens [B] -> their TokenLogprobs (rank: tokens strictly more
    likely, plus one; vLLM counts the same)."""
    own = logprobs.gather(1, tokens[:, None])  # [B, 1]
    ranks = (logprobs > own).sum(dim=-1) + 1
    k = max(tops, default=0)
    values, ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], tokens[:, None][:, :0])
    own_l, ranks_l, values_l, ids_l = (t.tolist() for t in (own[:, 0], ranks, values, ids))
    return [
        TokenLogprobs(int(tok), own_l[i], ranks_l[i], tuple(zip(ids_l[i][:n], values_l[i][:n])))
        for i, (tok, n) in enumerate(zip(tokens.tolist(), tops))
    ]
