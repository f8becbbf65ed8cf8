"""DeepSeek-V3 shapes: DeepseekV3Args and the flavors (plain Python, no torch).

The DeepSeek-V3 architecture (DeepSeek-V2-Lite, DeepSeek-V3, Kimi K2): multi-head latent
attention (``titanlite.models.attention.latent``) with RoPE on a small per-head part, YaRN
for long contexts, dense SwiGLU blocks first and then mixtures of fine-grained experts with
shared experts, sigmoid scores, group-limited routing and the auxiliary-loss-free bias
(``titanlite.models.moe``, whose router options ``DeepseekV3Args`` inherits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from titanlite.models.decoder_spec import check_moe_routing, check_score_func
from titanlite.models.moe.options import GroupLimitedRouting


@dataclass
class DeepseekV3Args(GroupLimitedRouting):
    dim: int = 7168
    """Hidden size (the width of the residual stream)."""
    n_layers: int = 61
    """Number of transformer blocks."""
    n_heads: int = 128
    """Number of attention heads."""
    vocab_size: int = -1  # set from the tokenizer
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 10_000.0
    """RoPE base frequency."""
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    """The output projection shares the token embedding's weight."""
    # Multi-head latent attention.
    q_lora_rank: int = 1536
    """Rank of the low-rank query projection (0 = a full-rank query projection)."""
    kv_lora_rank: int = 512
    """Size of the compressed key/value latent of each token."""
    qk_nope_head_dim: int = 128
    """Per-head query/key size without position (from the latent)."""
    qk_rope_head_dim: int = 64
    """Per-head query/key size RoPE turns (the key part is shared by all heads)."""
    v_head_dim: int = 128
    """Per-head value size."""
    rope_factor: float = 1.0
    """YaRN context extension: the factor by which the pretraining context is stretched
    (1 = plain RoPE)."""
    rope_original_seq_len: int = 4096
    """YaRN: the sequence length RoPE was pretrained at."""
    rope_beta_fast: float = 32.0
    """YaRN: rotary dimensions turning more often than this over the original context are kept."""
    rope_beta_slow: float = 1.0
    """YaRN: those turning less often than this are fully interpolated."""
    rope_mscale: float = 1.0
    """YaRN attention sharpening of the RoPE tables (numerator of their scale)."""
    rope_mscale_all_dim: float = 1.0
    """YaRN attention sharpening of the softmax scale (and the tables' denominator)."""
    # Feed-forward: dense first blocks, then a mixture of experts.
    dense_hidden_dim: int = 18432
    """SwiGLU width of the dense blocks (the first first_k_dense)."""
    first_k_dense: int = 3
    """Blocks with a dense SwiGLU before the mixture-of-experts blocks."""
    # The router options (GroupLimitedRouting's fields) where DeepSeek-V3's defaults differ:
    # shared experts, sigmoid scores, group-limited routing, a route scale, and balancing by
    # the bias update with a small auxiliary loss.
    num_experts: int = 256
    moe_hidden_dim: int = 2048
    shared_experts: int = 1
    score_func: Literal["softmax", "sigmoid"] = "sigmoid"
    n_groups: int = 8
    topk_groups: int = 4
    route_scale: float = 2.5
    aux_loss_coef: float = 0.0001
    bias_update_rate: float = 0.001
    # Multi-token prediction (titanlite.models.mtp).
    mtp_layers: int = 0
    """Multi-token prediction depths: depth d adds a block that predicts the token d + 1 after the
    next from depth d - 1's hidden state and the next token's embedding, trained only (0 = off;
    DeepSeek-V3 has 1)."""
    mtp_loss_weight: float = 0.3
    """Weight of the multi-token prediction loss (the mean over depths of their cross-entropies) in
    the training objective; logged apart as mtp_loss (DeepSeek-V3: 0.3, later 0.1)."""

    qk_norm: ClassVar[bool] = False
    rope_style: ClassVar[str] = "interleaved"  # DeepSeek's checkpoints (HF rope_interleave)
    attention: ClassVar[str] = "mla"  # the attention registry's latent attention

    @property
    def kv_heads(self) -> int:
        return self.n_heads

    @property
    def head_dim(self) -> int:
        """The size RoPE turns (the decoder builds its tables for it)."""
        return self.qk_rope_head_dim

    @property
    def ffn_hidden_dim(self) -> int:
        """The active experts' width (shared included)."""
        return self.moe_hidden_dim * (self.top_k + self.shared_experts)

    @property
    def yarn(self) -> dict[str, Any] | None:
        """YaRN's keyword arguments (``titanlite.models.yarn.YaRN``), None for plain RoPE."""
        if self.rope_factor <= 1:
            return None
        return {
            "factor": self.rope_factor,
            "original_seq_len": self.rope_original_seq_len,
            "beta_fast": self.rope_beta_fast,
            "beta_slow": self.rope_beta_slow,
            "mscale": self.rope_mscale,
            "mscale_all_dim": self.rope_mscale_all_dim,
        }

    def check(self) -> None:
        """Raise ValueError naming the field for shapes the architecture cannot take."""
        for name in (
            "dim",
            "n_layers",
            "n_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "dense_hidden_dim",
            "num_experts",
            "top_k",
            "moe_hidden_dim",
            "rope_original_seq_len",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even for RoPE")
        if self.v_head_dim > self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise ValueError(f"v_head_dim {self.v_head_dim} exceeds the query/key head size")
        check_score_func(self)
        for name in (
            "q_lora_rank",
            "shared_experts",
            "aux_loss_coef",
            "bias_update_rate",
            "capacity_factor",
            "router_z_loss_coef",
            "mtp_layers",
            "mtp_loss_weight",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.mtp_layers >= self.max_seq_len:  # also keeps an absurd count from being built
            raise ValueError(
                f"mtp_layers {self.mtp_layers} must be below the sequence length "
                f"{self.max_seq_len} (depth k predicts the token k + 1 places ahead)"
            )
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k {self.top_k} exceeds num_experts {self.num_experts}")
        check_moe_routing(self)
        if self.vocab_size <= 0:
            raise ValueError("vocab_size must be set (it comes from the tokenizer)")


_MLA = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
_YARN_40 = dict(rope_factor=40.0, rope_original_seq_len=4096)

# Published shapes (the config.json of each model on the Hugging Face Hub), plus a CPU flavor.
FLAVORS: dict[str, DeepseekV3Args] = {
    # About 5 M parameters (3 M active) with the shipped 4 K tokenizer.
    "debugmodel": DeepseekV3Args(
        dim=256,
        n_layers=4,
        n_heads=8,
        q_lora_rank=0,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        dense_hidden_dim=768,
        first_k_dense=1,
        num_experts=8,
        top_k=2,
        moe_hidden_dim=192,
        shared_experts=1,
        n_groups=4,
        topk_groups=2,
        route_scale=1.0,
        tie_embeddings=True,
    ),
    # DeepSeek-V2-Lite (TorchTitan calls it 16B): softmax scores, no groups, full-rank query.
    "16B": DeepseekV3Args(
        dim=2048,
        n_layers=27,
        n_heads=16,
        q_lora_rank=0,
        **_MLA,
        dense_hidden_dim=10944,
        first_k_dense=1,
        num_experts=64,
        top_k=6,
        moe_hidden_dim=1408,
        shared_experts=2,
        score_func="softmax",
        norm_topk=False,
        n_groups=1,
        topk_groups=1,
        route_scale=1.0,
        aux_loss_coef=0.001,
        bias_update_rate=0.0,
        **_YARN_40,
        rope_mscale=0.707,
        rope_mscale_all_dim=0.707,
    ),
    "671B": DeepseekV3Args(
        dim=7168,
        n_layers=61,
        n_heads=128,
        q_lora_rank=1536,
        **_MLA,
        dense_hidden_dim=18432,
        first_k_dense=3,
        num_experts=256,
        top_k=8,
        moe_hidden_dim=2048,
        shared_experts=1,
        n_groups=8,
        topk_groups=4,
        route_scale=2.5,
        **_YARN_40,
    ),
    # Kimi K2 (Moonshot AI): DeepSeek-V3's architecture, 384 experts, 64 heads, one dense block;
    # its YaRN keeps no dimension unstretched (beta_fast = beta_slow = 1 in its config.json).
    "kimi_k2": DeepseekV3Args(
        dim=7168,
        n_layers=61,
        n_heads=64,
        q_lora_rank=1536,
        **_MLA,
        dense_hidden_dim=18432,
        first_k_dense=1,
        num_experts=384,
        top_k=8,
        moe_hidden_dim=2048,
        shared_experts=1,
        n_groups=1,
        topk_groups=1,
        route_scale=2.827,
        rope_theta=50_000.0,
        rope_factor=32.0,
        rope_original_seq_len=4096,
        rope_beta_fast=1.0,
        rope_beta_slow=1.0,
    ),
}

OVERRIDES = (
    "dim",
    "n_layers",
    "n_heads",
    "rope_theta",
    "norm_eps",
    "tie_embeddings",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "rope_factor",
    "rope_original_seq_len",
    "rope_beta_fast",
    "rope_beta_slow",
    "rope_mscale",
    "rope_mscale_all_dim",
    "dense_hidden_dim",
    "first_k_dense",
    "num_experts",
    "top_k",
    "moe_hidden_dim",
    "shared_experts",
    "score_func",
    "norm_topk",
    "n_groups",
    "topk_groups",
    "route_scale",
    "aux_loss_coef",
    "bias_update_rate",
    "capacity_factor",
    "router_z_loss_coef",
    "mtp_layers",
    "mtp_loss_weight",
)
