"""Llama 3 shapes: LlamaArgs and the flavors (plain Python, no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from titanlite.models.decoder_spec import (
    ATTENTION_OVERRIDES,
    AttentionVariants,
    check_decoder_shape,
)


@dataclass
class LlamaArgs(AttentionVariants):
    dim: int = 4096
    """Hidden size (the width of the residual stream)."""
    n_layers: int = 32
    """Number of transformer blocks."""
    n_heads: int = 32
    """Number of query heads."""
    n_kv_heads: int | None = None
    """Number of key/value heads (grouped-query attention; unset = n_heads)."""
    vocab_size: int = -1  # set from the tokenizer
    multiple_of: int = 256
    """The feed-forward width is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    """Multiplier of the feed-forward width (2/3 of 4 x dim before rounding)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 500000.0
    """RoPE base frequency."""
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    """The output projection shares the token embedding's weight."""

    # Architecture constants of the family (not fields: never saved or overridden).
    qk_norm: ClassVar[bool] = False
    rope_style: ClassVar[str] = "interleaved"  # Meta's pairs (x0, x1), (x2, x3), ...
    attention: ClassVar[str] = "sdpa"  # the attention registry's causal core

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU width: 2/3 of 4*dim, scaled, rounded up to multiple_of (as in Llama)."""
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def check(self) -> None:
        """Raise ValueError naming the field for shapes the architecture cannot take."""
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        check_decoder_shape(self)


# Shapes of published models (Llama 3 / 3.1 / 3.2), plus small CPU flavors.
FLAVORS: dict[str, LlamaArgs] = {
    # About 5 M parameters with the shipped 4 K tokenizer: trains visibly in a minute on a CPU.
    "debugmodel": LlamaArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, multiple_of=64),
    # Tens of millions of parameters: the CPU benchmark flavor.
    "bench": LlamaArgs(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, multiple_of=128),
    "1B": LlamaArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        tie_embeddings=True,
    ),
    "3B": LlamaArgs(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        ffn_dim_multiplier=1.0,
        multiple_of=256,
        tie_embeddings=True,
    ),
    "8B": LlamaArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024
    ),
    "70B": LlamaArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096
    ),
    "405B": LlamaArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
    ),
}

OVERRIDES = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_dim_multiplier",
    "multiple_of",
    "rope_theta",
    "norm_eps",
    "tie_embeddings",
    *ATTENTION_OVERRIDES,
)
