"""Qwen3 (dense) shapes: Qwen3Args and the flavors (plain Python, no torch).

Unlike Llama, Qwen3 states its head size and MLP width instead of deriving them, and
normalizes each query and key head (RMSNorm over head_dim) before RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from titanlite.models.decoder_spec import (
    ATTENTION_OVERRIDES,
    AttentionVariants,
    check_decoder_shape,
)

QWEN3_VOCAB = 151936
"""The vocabulary of Qwen3's own tokenizer (the published parameter counts assume it)."""


@dataclass
class Qwen3Args(AttentionVariants):
    dim: int = 4096
    """Hidden size (the width of the residual stream)."""
    n_layers: int = 36
    """Number of transformer blocks."""
    n_heads: int = 32
    """Number of query heads."""
    n_kv_heads: int = 8
    """Number of key/value heads (grouped-query attention)."""
    head_dim: int = 128
    """Size of one attention head (Qwen3 states it; it need not be dim / n_heads)."""
    hidden_dim: int = 12288
    """Feed-forward (SwiGLU) width."""
    vocab_size: int = -1  # set from the tokenizer
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 1_000_000.0
    """RoPE base frequency."""
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    """The output projection shares the token embedding's weight."""

    qk_norm: ClassVar[bool] = True
    rope_style: ClassVar[str] = "halves"  # rotate_half, as Qwen3's checkpoints expect
    attention: ClassVar[str] = "sdpa"  # the attention registry's causal core

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    @property
    def ffn_hidden_dim(self) -> int:
        return self.hidden_dim

    def check(self) -> None:
        """Raise ValueError naming the field for shapes the architecture cannot take."""
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        check_decoder_shape(self)


# Published shapes (Qwen3 model cards and config.json files), plus a small CPU flavor.
FLAVORS: dict[str, Qwen3Args] = {
    # About 4 M parameters with the shipped 4 K tokenizer.
    "debugmodel": Qwen3Args(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        hidden_dim=768,
        tie_embeddings=True,
    ),
    "0.6B": Qwen3Args(
        dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=3072, tie_embeddings=True
    ),
    "1.7B": Qwen3Args(
        dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=6144, tie_embeddings=True
    ),
    "4B": Qwen3Args(
        dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=9728, tie_embeddings=True
    ),
    "8B": Qwen3Args(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=12288),
    "14B": Qwen3Args(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, hidden_dim=17408),
    "32B": Qwen3Args(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, hidden_dim=25600),
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
    *ATTENTION_OVERRIDES,
)
