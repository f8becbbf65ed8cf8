"""Qwen3.5-MoE (text) shapes: Qwen35MoeArgs and the flavors (plain Python, no torch).

Qwen3.5's hybrid of Gated DeltaNet and gated full attention (``titanlite.models.qwen3_5``)
with a mixture of experts in every block instead of the dense SwiGLU: a softmax router, each
token's top-k experts with their weights renormalized to sum to one, and one shared expert
whose output a per-token sigmoid gate scales (``titanlite.models.moe``, whose router options
``Qwen35MoeArgs`` inherits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from titanlite.models.decoder_spec import check_score_func
from titanlite.models.moe.options import RouterOptions
from titanlite.models.qwen3_5.args import OVERRIDES as DENSE_OVERRIDES
from titanlite.models.qwen3_5.args import Qwen35Args


@dataclass
class Qwen35MoeArgs(Qwen35Args, RouterOptions):
    # Qwen3.5-35B-A3B's shapes by default (its config.json's text_config).
    dim: int = 2048
    """Hidden size (the width of the residual stream)."""
    n_layers: int = 40
    """Number of blocks (linear and full attention together), each with a mixture of experts."""
    n_heads: int = 16
    """Query heads of the full-attention layers."""
    n_kv_heads: int = 2
    """Key/value heads of the full-attention layers (grouped-query attention)."""
    hidden_dim: int = 0
    """Unused: every block's feed-forward is a mixture of experts (moe_hidden_dim)."""
    linear_v_heads: int = 32
    """Value heads of the Gated DeltaNet layers (a multiple of linear_k_heads)."""
    # The router options (RouterOptions' fields) where Qwen3.5-MoE's defaults differ, and its
    # gated shared expert.
    num_experts: int = 256
    moe_hidden_dim: int = 512
    shared_experts: int = 1
    aux_loss_coef: float = 0.001
    shared_expert_gate: bool = True
    """Scale the shared experts' output per token by sigmoid(x . w) (Qwen3-Next and Qwen3.5)."""

    POSITIVE: ClassVar[tuple[str, ...]] = (
        *(name for name in Qwen35Args.POSITIVE if name != "hidden_dim"),
        "num_experts",
        "top_k",
        "moe_hidden_dim",
    )

    @property
    def ffn_hidden_dim(self) -> int:
        """The width a dense SwiGLU of the same active size would have (for FLOPs)."""
        return self.moe_hidden_dim * (self.top_k + self.shared_experts)

    def check(self) -> None:
        """Raise ValueError naming the field for shapes the architecture cannot take."""
        super().check()
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


# Published shapes: the text_config of Qwen3.5-35B-A3B's and Qwen3.5-397B-A17B's config.json
# on the Hugging Face Hub, plus a small CPU flavor.
FLAVORS: dict[str, Qwen35MoeArgs] = {
    # About 9 M parameters (4 M active) with the shipped 4 K tokenizer: 3 DeltaNet blocks,
    # 1 full-attention block, 8 experts (top-2) and a gated shared expert in each.
    "debugmodel": Qwen35MoeArgs(
        dim=256,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=64,
        linear_k_heads=4,
        linear_v_heads=8,
        linear_k_dim=32,
        linear_v_dim=32,
        num_experts=8,
        top_k=2,
        moe_hidden_dim=256,
        tie_embeddings=True,
        rope_theta=10_000.0,
    ),
    "35B-A3B": Qwen35MoeArgs(max_seq_len=262144),
    "397B-A17B": Qwen35MoeArgs(
        dim=4096,
        n_layers=60,
        n_heads=32,
        n_kv_heads=2,
        linear_v_heads=64,
        num_experts=512,
        top_k=10,
        moe_hidden_dim=1024,
        max_seq_len=262144,
    ),
}

OVERRIDES = (
    *(key for key in DENSE_OVERRIDES if key != "hidden_dim"),
    "num_experts",
    "top_k",
    "moe_hidden_dim",
    "shared_experts",
    "shared_expert_gate",
    "score_func",
    "norm_topk",
    "aux_loss_coef",
    "bias_update_rate",
    "capacity_factor",
    "router_z_loss_coef",
)
