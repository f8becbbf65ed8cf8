"""The router and balancing options of the mixture-of-experts layer, declared once (plain
Python, no torch).

Each MoE family's args dataclass inherits them, so they are ``model.*`` config keys with one
docstring each (``--help`` and docs/config.md read it), and ``titanlite.models.moe.layer.MoE``
reads them from the args. A family overrides a default it differs in by declaring the field
again (it keeps its place and takes the new default) and lists the keys it lets a config
override in its ``OVERRIDES``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class RouterOptions:
    """The experts and their router: softmax top-k renormalized, no shared experts and no
    balancing by default (the expert shape defaults are Qwen3-30B-A3B's)."""

    num_experts: int = 128
    """Experts in each mixture-of-experts layer."""
    top_k: int = 8
    """Experts each token goes to."""
    moe_hidden_dim: int = 768
    """Width of each expert's SwiGLU."""
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    """How the router scores experts: softmax over all of them, or an independent sigmoid each."""
    norm_topk: bool = True
    """Renormalize the chosen experts' weights to sum to one."""
    shared_experts: int = 0
    """Experts every token goes through besides its top-k (one SwiGLU of width shared_experts x
    moe_hidden_dim)."""
    aux_loss_coef: float = 0.0
    """Weight of the sequence-wise load-balancing loss (0 = none)."""
    bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing: after every step each expert's routing bias moves by this much
    towards an even load (0 = off)."""
    capacity_factor: float = 0.0
    """Tokens an expert takes at most, as a multiple of an even share (0 = dropless); tokens over it
    are dropped and counted."""
    router_z_loss_coef: float = 0.0
    """Weight of the router z-loss (ST-MoE): the mean over tokens of logsumexp(router logits)^2,
    summed over the layers (0 = none; 1e-3 is usual). Logged as moe_router_z_loss."""


@dataclass
class GroupLimitedRouting(RouterOptions):
    """``RouterOptions`` and DeepSeek-V3's group-limited routing and route scale (plain top-k
    with weights unscaled by default)."""

    n_groups: int = 1
    """Group-limited routing: the experts form this many groups, each token chooses among those of
    its topk_groups best groups (a group rated by its two best scores); 1 = plain top-k."""
    topk_groups: int = 1
    """Groups each token's experts may come from (with n_groups > 1)."""
    route_scale: float = 1.0
    """The chosen experts' weights are multiplied by this (after any renormalization)."""
