"""Qwen3.5 (text) shapes: Qwen35Args and the flavors (plain Python, no torch).

Qwen3.5 is a hybrid: of every ``full_attention_interval`` layers, the last is gated full
attention (Qwen3's attention with a sigmoid output gate, RoPE on a quarter of each head,
zero-centered q/k norms) and the others are Gated DeltaNet linear attention, whose state
has a fixed size whatever the sequence (``titanlite.models.qwen3_5.model``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from titanlite.models.decoder_spec import check_decoder_shape

QWEN35_VOCAB = 248320
"""The vocabulary of Qwen3.5's own tokenizer (the published parameter counts assume it)."""


@dataclass
class Qwen35Args:
    dim: int = 5120
    """Hidden size (the width of the residual stream)."""
    n_layers: int = 64
    """Number of blocks (linear and full attention together)."""
    n_heads: int = 24
    """Query heads of the full-attention layers."""
    n_kv_heads: int = 4
    """Key/value heads of the full-attention layers (grouped-query attention)."""
    head_dim: int = 256
    """Head size of the full-attention layers."""
    hidden_dim: int = 17408
    """Feed-forward (SwiGLU) width."""
    vocab_size: int = -1  # set from the tokenizer
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 10_000_000.0
    """RoPE base frequency."""
    partial_rotary: float = 0.25
    """Share of each full-attention head that RoPE rotates (the first dimensions)."""
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    """The output projection shares the token embedding's weight."""
    full_attention_interval: int = 4
    """Every this-many-th layer is full attention, the others Gated DeltaNet (4: 3 : 1)."""
    layer_types: list[str] = field(default_factory=list)
    """Each layer's kind, as Hugging Face's config.json lists them: "full_attention" or
    "linear_attention", one per layer (empty = every full_attention_interval-th layer full).
    gpt_oss's are "full_attention" or "sliding_attention" (empty = window_pattern)."""
    linear_k_heads: int = 16
    """Query/key heads of the Gated DeltaNet layers."""
    linear_v_heads: int = 48
    """Value heads of the Gated DeltaNet layers (a multiple of linear_k_heads)."""
    linear_k_dim: int = 128
    """Query/key head size of the Gated DeltaNet layers."""
    linear_v_dim: int = 128
    """Value head size of the Gated DeltaNet layers."""
    conv_kernel: int = 4
    """Width of the short causal depthwise convolution on the DeltaNet queries, keys, values."""
    chunk_size: int = 64
    """Tokens the chunked delta rule processes at once (a speed setting: results are equal)."""
    linear_attention_kernel: Literal["auto", "torch"] = "auto"
    """The delta rule's kernel: "auto" runs flash-linear-attention's on CUDA when that package is
    installed (else the chunked PyTorch one), "torch" always the chunked PyTorch one."""

    POSITIVE: ClassVar[tuple[str, ...]] = (
        "dim",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "head_dim",
        "hidden_dim",
        "full_attention_interval",
        "linear_k_heads",
        "linear_v_heads",
        "linear_k_dim",
        "linear_v_dim",
        "conv_kernel",
        "chunk_size",
    )
    """The fields ``check`` wants at least 1."""
    qk_norm: ClassVar[bool] = True  # zero-centered RMSNorm of each query and key head
    rope_style: ClassVar[str] = "halves"  # rotate_half on the rotated part, as Hugging Face
    attention: ClassVar[str] = "sdpa"  # the full-attention layers' core
    linear_attention: ClassVar[str] = "gated_delta"  # the linear layers' core

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    @property
    def ffn_hidden_dim(self) -> int:
        return self.hidden_dim

    @property
    def rope_dim(self) -> int:
        """Dimensions of each head RoPE rotates."""
        return int(self.head_dim * self.partial_rotary)

    def is_full_attention(self, layer: int) -> bool:
        if self.layer_types:
            return self.layer_types[layer] == "full_attention"
        return (layer + 1) % self.full_attention_interval == 0

    def check(self) -> None:
        """Raise ValueError naming the field for shapes the architecture cannot take."""
        for name in self.POSITIVE:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        kinds = {"full_attention", "linear_attention"}
        if self.layer_types and (
            len(self.layer_types) != self.n_layers or set(self.layer_types) - kinds
        ):
            raise ValueError(
                f"layer_types must list {self.n_layers} (n_layers) kinds, each full_attention "
                f"or linear_attention, got {self.layer_types!r}"
            )
        if self.linear_v_heads % self.linear_k_heads:
            raise ValueError(
                f"linear_v_heads {self.linear_v_heads} is not divisible by "
                f"linear_k_heads {self.linear_k_heads}"
            )
        if not 0 < self.partial_rotary <= 1 or self.rope_dim % 2:
            raise ValueError(
                f"partial_rotary {self.partial_rotary} must leave an even number "
                f"of rotated dimensions in (0, head_dim]"
            )
        check_decoder_shape(self)


# Published shapes: Qwen3.5-27B's config.json (text_config), plus a small CPU flavor.
FLAVORS: dict[str, Qwen35Args] = {
    # About 5 M parameters with the shipped 4 K tokenizer: 3 DeltaNet layers, 1 full.
    "debugmodel": Qwen35Args(
        dim=256,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=64,
        hidden_dim=768,
        linear_k_heads=4,
        linear_v_heads=8,
        linear_k_dim=32,
        linear_v_dim=32,
        tie_embeddings=True,
        rope_theta=10_000.0,
    ),
    "27B": Qwen35Args(max_seq_len=262144),
}

OVERRIDES = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "hidden_dim",
    "rope_theta",
    "norm_eps",
    "tie_embeddings",
    "partial_rotary",
    "full_attention_interval",
    "layer_types",
    "linear_k_heads",
    "linear_v_heads",
    "linear_k_dim",
    "linear_v_dim",
    "conv_kernel",
    "chunk_size",
    "linear_attention_kernel",
)
