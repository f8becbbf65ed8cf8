"""Qwen3-MoE shapes: Qwen3MoeArgs and the flavors (plain Python, no torch).

Qwen3-MoE is Qwen3's attention (GQA, per-head q/k RMSNorm, rotate-half RoPE) with a
mixture-of-experts feed-forward in every layer: a linear router scores the experts (softmax),
each token goes to its top-k, whose weights are renormalized to sum to one, and each expert is
a SwiGLU of width ``moe_hidden_dim``. The router, expert and balancing options are the MoE
layer's own (``titanlite.models.moe.options``), so later families reuse them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from titanlite.models.decoder_spec import (
    ATTENTION_OVERRIDES,
    AttentionVariants,
    check_decoder_shape,
    check_moe_routing,
    check_score_func,
)
from titanlite.models.moe.options import GroupLimitedRouting


@dataclass
class Qwen3MoeArgs(AttentionVariants, GroupLimitedRouting):
    dim: int = 2048
    """Hidden size (the width of the residual stream)."""
    n_layers: int = 48
    """Number of transformer blocks."""
    n_heads: int = 32
    """Number of query heads."""
    n_kv_heads: int = 4
    """Number of key/value heads (grouped-query attention)."""
    head_dim: int = 128
    """Size of one attention head."""
    vocab_size: int = -1  # set from the tokenizer
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 1_000_000.0
    """RoPE base frequency."""
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    """The output projection shares the token embedding's weight."""
    # The mixture of experts in every layer: GroupLimitedRouting's fields, whose defaults are
    # Qwen3-30B-A3B's (128 experts, top-8 softmax renormalized, no balancing).
    first_k_dense: int = 0
    """The first this many blocks have a dense SwiGLU (of the active experts' width) instead of
    experts."""

    qk_norm: ClassVar[bool] = True
    rope_style: ClassVar[str] = "halves"
    attention: ClassVar[str] = "sdpa"  # the attention registry's causal core

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """The width a dense layer of the same active size would have (for FLOPs)."""
        return self.moe_hidden_dim * (self.top_k + self.shared_experts)

    def check(self) -> None:
        """Raise ValueError naming the field for shapes the architecture cannot take."""
        for name in (
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "num_experts",
            "top_k",
            "moe_hidden_dim",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k {self.top_k} exceeds num_experts {self.num_experts}")
        check_score_func(self)
        for name in (
            "shared_experts",
            "aux_loss_coef",
            "bias_update_rate",
            "capacity_factor",
            "router_z_loss_coef",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        check_moe_routing(self)
        check_decoder_shape(self)


# Published shapes (Qwen3-30B-A3B and Qwen3-235B-A22B config.json), plus a small CPU flavor.
FLAVORS: dict[str, Qwen3MoeArgs] = {
    # About 8.1 M parameters (3.4 M active) with the shipped 4 K tokenizer.
    "debugmodel": Qwen3MoeArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        num_experts=8,
        top_k=2,
        moe_hidden_dim=256,
        tie_embeddings=True,
        aux_loss_coef=0.001,
    ),
    "30B-A3B": Qwen3MoeArgs(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        num_experts=128,
        top_k=8,
        moe_hidden_dim=768,
        aux_loss_coef=0.001,
        max_seq_len=40960,
    ),
    "235B-A22B": Qwen3MoeArgs(
        dim=4096,
        n_layers=94,
        n_heads=64,
        n_kv_heads=4,
        head_dim=128,
        num_experts=128,
        top_k=8,
        moe_hidden_dim=1536,
        aux_loss_coef=0.001,
        max_seq_len=40960,
    ),
}

OVERRIDES = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "rope_theta",
    "norm_eps",
    "tie_embeddings",
    "num_experts",
    "top_k",
    "moe_hidden_dim",
    "score_func",
    "norm_topk",
    "shared_experts",
    "aux_loss_coef",
    "bias_update_rate",
    "capacity_factor",
    "router_z_loss_coef",
    "n_groups",
    "topk_groups",
    "route_scale",
    "first_k_dense",
    *ATTENTION_OVERRIDES,
)
