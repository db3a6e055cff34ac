"""Routing methods: router logits [T, E] -> (topk_ids [T, K] int32, topk_weights [T, K] fp32).

All routing math runs in fp32, whatever the dtype of the logits.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from .errors import ConfigError


class RoutingMethod(str, enum.Enum):
    """How router logits become expert ids and weights (see SPEC.md, routing methods)."""

    SOFTMAX_TOPK = "softmax_topk"  # Qwen3-MoE, Mixtral, OLMoE: softmax over E, then top-k
    TOPK_SOFTMAX = "topk_softmax"  # gpt-oss: top-k on the logits, softmax over the k chosen
    DEEPSEEK_V3 = "deepseek_v3"  # sigmoid + correction bias + grouped top-k (also NemotronH)
    DEEPSEEK_V2 = "deepseek_v2"  # softmax + group-limited greedy (groups scored by their max)
    LLAMA4 = "llama4"  # top-1, sigmoid weight applied to the expert's input

    @property
    def weights_on_input(self) -> bool:
        """True when the routing weight scales the expert input instead of its output."""
        return self is RoutingMethod.LLAMA4


@dataclass(frozen=True)
class RoutingConfig:
    """Routing parameters (top_k lives in MoEShape). n_group/topk_group/routed_scaling_factor
    only matter for the DeepSeek methods; renormalize for softmax_topk and the DeepSeek ones."""

    method: RoutingMethod
    renormalize: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.n_group < 1 or not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(
                "topk_group",
                self.topk_group,
                f"1 <= topk_group <= n_group (n_group = {self.n_group})",
                "set topk_group to at most n_group",
            )


def route(
    logits: torch.Tensor,
    cfg: RoutingConfig,
    top_k: int,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose experts. logits [T, E] -> (topk_ids [T, K] int32, topk_weights [T, K] fp32).

    correction_bias [E] is used by DEEPSEEK_V3 only (it picks experts, never weighs them).
    """
    num_experts = logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ConfigError("top_k", top_k, f"1 <= top_k <= num_experts = {num_experts}")
    if cfg.method is RoutingMethod.LLAMA4 and top_k != 1:
        raise ConfigError("top_k", top_k, "1 for llama4 routing")
    scores = logits.float()
    method = cfg.method
    if method is RoutingMethod.SOFTMAX_TOPK:
        probs = torch.softmax(scores, dim=-1)
        weights, ids = torch.topk(probs, top_k, dim=-1)
    elif method is RoutingMethod.TOPK_SOFTMAX:
        top, ids = torch.topk(scores, top_k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    elif method is RoutingMethod.DEEPSEEK_V3:
        weights, ids = _deepseek_v3(scores, cfg, top_k, correction_bias)
    elif method is RoutingMethod.DEEPSEEK_V2:
        weights, ids = _deepseek_v2(scores, cfg, top_k)
    elif method is RoutingMethod.LLAMA4:
        top, ids = torch.topk(scores, 1, dim=-1)
        weights = torch.sigmoid(top)
    else:  # pragma: no cover - the enum is closed
        raise ValueError(f"unknown routing method {method!r}")
    if cfg.renormalize and method is RoutingMethod.SOFTMAX_TOPK:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), weights.float()


def _group_mask(group_scores: torch.Tensor, cfg: RoutingConfig, num_experts: int) -> torch.Tensor:
    """Boolean mask [T, E] of experts whose group is among the best topk_group groups."""
    best = torch.topk(group_scores, cfg.topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    per_group = num_experts // cfg.n_group
    return keep.repeat_interleave(per_group, dim=1)


def _grouped(scores: torch.Tensor, cfg: RoutingConfig) -> torch.Tensor:
    tokens, num_experts = scores.shape
    if num_experts % cfg.n_group:
        raise ValueError(f"n_group = {cfg.n_group} does not divide the {num_experts} experts")
    return scores.view(tokens, cfg.n_group, num_experts // cfg.n_group)


def _deepseek_v3(
    scores: torch.Tensor, cfg: RoutingConfig, top_k: int, correction_bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.sigmoid(scores)
    choice = probs if correction_bias is None else probs + correction_bias.float()
    if cfg.n_group > 1:  # one group is always kept: skip the top-2 scoring (E may be 1)
        group_scores = _grouped(choice, cfg).topk(2, dim=-1).values.sum(dim=-1)
        mask = _group_mask(group_scores, cfg, scores.shape[-1])
        choice = choice.masked_fill(~mask, float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1, sorted=False).indices
    return _scale(probs.gather(1, ids), cfg), ids


def _deepseek_v2(
    scores: torch.Tensor, cfg: RoutingConfig, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(scores, dim=-1)
    if cfg.n_group > 1:
        group_scores = _grouped(probs, cfg).amax(dim=-1)
        probs = probs.masked_fill(~_group_mask(group_scores, cfg, scores.shape[-1]), 0.0)
    weights, ids = torch.topk(probs, top_k, dim=-1, sorted=False)
    return _scale(weights, cfg), ids


def _scale(weights: torch.Tensor, cfg: RoutingConfig) -> torch.Tensor:
    """DeepSeek post-processing: optional renormalisation, then routed_scaling_factor."""
    if cfg.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor
