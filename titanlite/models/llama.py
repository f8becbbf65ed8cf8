"""A Llama 3-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Module names follow Meta's Llama checkpoints (tok_embeddings, layers.N.attention.wq, ...,
feed_forward.w1/w2/w3, norm, output) so tensor-parallel plans and checkpoint converters can
address them. The model knows nothing about parallelism: attention infers its local head
count from the projection's output, so column-sharded projections just work.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 whatever the activation dtype, as Llama does.
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """cos and sin of every (position, frequency) pair: shape [max_seq_len, head_dim/2, 2]."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1).float()


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x0, x1) of x [batch, seq, heads, head_dim], as Meta's Llama."""
    seq = x.shape[1]
    pairs = x.float().unflatten(-1, (-1, 2))
    cos = table[:seq, None, :, 0]
    sin = table[:seq, None, :, 1]
    x0, x1 = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of heads.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            enable_gqa=q.shape[2] != k.shape[2],
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        args.check()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A dict keyed by layer index keeps names stable when layers are wrapped or pruned.
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Not persistent: recomputed by init_weights, never checkpointed.
        self.register_buffer(
            "rope", rope_tables(args.head_dim, args.max_seq_len, args.rope_theta), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids [batch, seq] -> logits [batch, seq, vocab] (float32 for a stable loss)."""
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope)
        return self.output(self.norm(h)).float()

    def param_init_std(self, name: str) -> float | None:
        """Initial std of a weight by its name; None for norm weights (set to one)."""
        args = self.args
        if name.endswith("norm.weight"):
            return None
        if name == "tok_embeddings.weight":
            # Tied embeddings also act as the output projection, so keep them small.
            return args.dim**-0.5 if args.tie_embeddings else 1.0
        if name == "output.weight":
            return args.dim**-0.5
        if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            # Residual-branch outputs shrink with depth so the residual stream stays O(1).
            return 0.02 / math.sqrt(2 * args.n_layers)
        return 0.02

    def materialize(self, device: torch.device | str, seed: int = 0) -> None:
        """Allocate a meta-device (possibly sharded) model on `device` and initialize it."""
        # Swapping tensors in place keeps shared (tied) parameters shared; the default
        # conversion would give each module its own copy.
        swap = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            self.to_empty(device=device)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(swap)
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Initialize every parameter from its own seeded generator (keyed by name).

        Each weight depends only on (seed, name, shape), never on the order, device or
        sharding of the others, so every parallel layout starts from exactly the same model.
        One full parameter exists at a time, never the whole model.
        """
        self.rope = rope_tables(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta).to(
            self.rope.device
        )
        for name, param in self.named_parameters():
            # Wrappers (activation checkpointing) must not change what a weight starts as.
            name = name.replace("_checkpoint_wrapped_module.", "")
            full = initial_value(self, name, param.shape, seed).to(param.device, param.dtype)
            if isinstance(param, DTensor):
                # A sharded parameter keeps only its own slice of the same full value.
                full = distribute_tensor(
                    full, param.device_mesh, param.placements, src_data_rank=None
                ).to_local()
                param.to_local().copy_(full)
            else:
                param.copy_(full)


def initial_value(model: Transformer, name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """The full initial value of one parameter, generated on the CPU in float32."""
    std = model.param_init_std(name)
    if std is None:
        return torch.ones(shape)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    value = torch.empty(shape)
    nn.init.trunc_normal_(value, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=generator)
    return value


def count_params(model: nn.Module) -> int:
    """Unique parameters (tied weights once), by their global shapes."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


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
