"""Model shapes: ModelArgs, the flavors, and FLOPs per token.

Plain Python, no torch: the launcher's preflight checks a config against these shapes in a
fraction of a second, before any process imports torch (about 3-4 s of CPU each).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = -1  # set from the tokenizer
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False

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
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.kv_heads}"
            )
        if self.vocab_size <= 0:
            raise ValueError("vocab_size must be set (it comes from the tokenizer)")


# Shapes of published models (Llama 3 / 3.1 / 3.2), plus small CPU flavors.
FLAVORS: dict[str, ModelArgs] = {
    # About 5 M parameters with the shipped 4 K tokenizer: trains visibly in a minute on a CPU.
    "debugmodel": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, multiple_of=64),
    # Tens of millions of parameters: the CPU benchmark flavor.
    "bench": ModelArgs(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, multiple_of=128),
    "1B": ModelArgs(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5,
        multiple_of=256, tie_embeddings=True,
    ),
    "3B": ModelArgs(
        dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0,
        multiple_of=256, tie_embeddings=True,
    ),
    "8B": ModelArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024
    ),
    "70B": ModelArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096
    ),
    "405B": ModelArgs(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2,
        multiple_of=4096,
    ),
}  # fmt: skip


def model_args(flavor: str, vocab_size: int, max_seq_len: int, **overrides: object) -> ModelArgs:
    """The flavor's shape with the non-None overrides applied."""
    if flavor not in FLAVORS:
        raise KeyError(flavor)
    changes = {k: v for k, v in overrides.items() if v is not None}
    args = dataclasses.replace(
        FLAVORS[flavor], vocab_size=vocab_size, max_seq_len=max_seq_len, **changes
    )
    args.check()
    return args


def flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Training FLOPs per token: 6 x matmul params + 6 x layers x dim x seq (causal attention).

    Matmul params exclude the embedding lookup but include the output projection (once,
    even when tied). The attention term counts QK^T and AV over the causal half of the
    sequence, forward and backward.
    """
    per_layer = (
        args.dim * args.head_dim * (args.n_heads * 2 + args.kv_heads * 2)  # wq, wo, wk, wv
        + 3 * args.dim * args.ffn_hidden_dim  # w1, w2, w3
    )
    matmul_params = args.n_layers * per_layer + args.vocab_size * args.dim
    return 6 * matmul_params + 6 * args.n_layers * args.dim * seq_len
