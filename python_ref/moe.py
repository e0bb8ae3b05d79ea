"""DeepSeek's mixture-of-experts feed-forward (DeepSeekMoE, as in DeepSeek-V2/V3 and Kimi K2), from scratch.

In a mixture-of-experts layer the dense SwiGLU feed-forward is replaced by:

* ``n_routed_experts`` small SwiGLU feed-forwards (``expert_hidden_dim`` wide), of which each token
  uses only ``experts_per_token``, chosen by a *router* (a linear map of the token to one logit per
  expert; HF's ``mlp.gate``);
* ``n_shared_experts`` experts that every token uses, stored (and run) as one SwiGLU
  ``expert_hidden_dim * n_shared_experts`` wide (HF's ``mlp.shared_experts``).

The output is the shared experts' output plus the chosen experts' outputs, each multiplied by its
routing weight. How experts are chosen and weighted (``MoEConfig``):

1. *scores*: the router's logits through a softmax over the experts (DeepSeek-V2) or an elementwise
   sigmoid (DeepSeek-V3, Kimi K2);
2. *which experts*, by ``topk_method``:
   ``greedy``: the ``experts_per_token`` highest scores;
   ``group_limited_greedy`` (DeepSeek-V2): the experts are split into ``n_group`` equal groups (a
   group lived on one device in training), a group is rated by its best score, only the
   ``topk_group`` best-rated groups are eligible, and the highest scores among their experts win;
   ``noaux_tc`` (DeepSeek-V3): as group-limited, but every decision is taken on *biased* scores
   ``score + score_bias`` (HF's ``e_score_correction_bias``, the load-balancing bias learnt without an
   auxiliary loss) and a group is rated by the sum of its two best biased scores;
3. *weights*: the chosen experts' unbiased scores, divided by their sum when ``norm_topk_prob``, times
   ``routed_scaling_factor``.

Routing runs in float32 at least, and the router's weights stay float32 when the model is cast to
half precision, as in transformers (a bfloat16 logit or bias would change which experts win).

Layers ``first_dense_layers`` onwards (HF's ``first_k_dense_replace``), every ``layer_freq``-th,
are mixture-of-experts layers; the first ones keep the dense feed-forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from .llama import FeedForward
from .tensor_parallel import SINGLE_PROCESS

SCORING_FUNCTIONS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class MoEConfig:
    n_routed_experts: int
    experts_per_token: int  # num_experts_per_tok
    expert_hidden_dim: int  # each routed expert's width (moe_intermediate_size)
    n_shared_experts: int = 0
    first_dense_layers: int = 0  # first_k_dense_replace
    layer_freq: int = 1  # moe_layer_freq
    scoring: str = "softmax"  # scoring_func
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        if self.scoring not in SCORING_FUNCTIONS:
            raise ValueError(f"scoring must be one of {SCORING_FUNCTIONS}, got {self.scoring!r}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method must be one of {TOPK_METHODS}, got {self.topk_method!r}")
        if self.n_routed_experts < 1 or self.layer_freq < 1:
            raise ValueError(
                f"n_routed_experts and layer_freq must be >= 1, got {self.n_routed_experts} and {self.layer_freq}"
            )
        if self.n_group < 1 or self.n_routed_experts % self.n_group:
            raise ValueError(
                f"n_group ({self.n_group}) must divide n_routed_experts ({self.n_routed_experts}) into equal groups"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group must be in [1, n_group={self.n_group}], got {self.topk_group}")
        if self.topk_method == "noaux_tc" and self.group_size < 2:
            raise ValueError(f"noaux_tc rates a group by its two best experts: groups of {self.group_size} expert")
        eligible = self.n_routed_experts if self.topk_method == "greedy" else self.topk_group * self.group_size
        if not 1 <= self.experts_per_token <= eligible:
            raise ValueError(
                f"experts_per_token must be in [1, {eligible}] (the experts {self.topk_method} can choose from), "
                f"got {self.experts_per_token}"
            )

    @property
    def group_size(self) -> int:
        return self.n_routed_experts // self.n_group

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_dense_layers and layer % self.layer_freq == 0


def select_experts(
    logits: torch.Tensor, cfg: MoEConfig, score_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts each token uses and their weights: router ``logits`` (N, n_routed_experts) ->
    weights (N, experts_per_token) in ``logits``' dtype and expert indices (N, experts_per_token), in
    no particular order. ``score_bias`` (n_routed_experts,): ``noaux_tc``'s bias (ignored otherwise)."""
    scores = logits.softmax(dim=-1) if cfg.scoring == "softmax" else logits.sigmoid()
    if cfg.topk_method == "noaux_tc":
        if score_bias is None:
            raise ValueError("noaux_tc chooses experts on biased scores: score_bias is required")
        choice = scores + score_bias
    else:
        choice = scores
    if cfg.topk_method != "greedy":
        grouped = choice.unflatten(-1, (cfg.n_group, cfg.group_size))  # (N, n_group, group_size)
        if cfg.topk_method == "noaux_tc":
            group_rating = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_rating = grouped.amax(dim=-1)
        kept_groups = group_rating.topk(cfg.topk_group, dim=-1).indices
        eligible = torch.zeros_like(group_rating, dtype=torch.bool).scatter(-1, kept_groups, True)
        choice = choice.masked_fill(~eligible.repeat_interleave(cfg.group_size, dim=-1), float("-inf"))
    experts = choice.topk(cfg.experts_per_token, dim=-1).indices
    weights = scores.gather(-1, experts)  # unbiased, whatever chose them
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, experts


class Router(nn.Linear):
    """The router (HF's ``mlp.gate``): one logit per expert, and ``noaux_tc``'s ``score_bias``."""

    def __init__(self, emb_dim: int, cfg: MoEConfig):
        super().__init__(emb_dim, cfg.n_routed_experts, bias=False)
        self.cfg = cfg
        if cfg.topk_method == "noaux_tc":
            self.register_buffer("score_bias", torch.zeros(cfg.n_routed_experts))
        else:
            self.score_bias = None

    def _apply(self, fn, recurse=True):
        # the tensors themselves: _apply converts a parameter in place (replaces its .data)
        exact = {
            name: None if t is None else t.data
            for name, t in (("weight", self.weight), ("score_bias", self.score_bias))
        }
        super()._apply(fn, recurse)
        # model.to(torch.bfloat16) moves the router but keeps it float32 (or wider, for float64 checks)
        for name, before in exact.items():
            after = getattr(self, name)
            if after is not None and after.is_floating_point() and after.element_size() < 4:
                after.data = before.to(device=after.device, dtype=torch.float32)
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``x`` (N, emb_dim) -> routing weights (float32 or wider) and expert indices, both
        (N, experts_per_token)."""
        dtype = torch.promote_types(self.weight.dtype, torch.float32)
        logits = F.linear(x.to(dtype), self.weight.to(dtype))
        bias = None if self.score_bias is None else self.score_bias.to(dtype)
        return select_experts(logits, self.cfg, bias)


class _SwiGLUWidths(NamedTuple):
    """What llama.py's FeedForward reads from a config."""

    emb_dim: int
    hidden_dim: int


def swiglu(emb_dim: int, width: int) -> FeedForward:
    return FeedForward(_SwiGLUWidths(emb_dim, width), SINGLE_PROCESS)


class MixtureOfExperts(nn.Module):
    """DeepSeekMoE's feed-forward (module docstring); a drop-in for the dense ``FeedForward``."""

    def __init__(self, emb_dim: int, cfg: MoEConfig):
        super().__init__()
        self.router = Router(emb_dim, cfg)
        self.experts = nn.ModuleList(swiglu(emb_dim, cfg.expert_hidden_dim) for _ in range(cfg.n_routed_experts))
        self.shared = swiglu(emb_dim, cfg.expert_hidden_dim * cfg.n_shared_experts) if cfg.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(tokens)
        out = torch.zeros_like(tokens)
        # Each expert that some token chose runs once, on all the tokens that chose it.
        for expert in chosen.unique().tolist():
            token, slot = (chosen == expert).nonzero(as_tuple=True)
            contribution = self.experts[expert](tokens[token]) * weights[token, slot].unsqueeze(-1)
            out.index_add_(0, token, contribution.to(out.dtype))
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.view(x.shape)
