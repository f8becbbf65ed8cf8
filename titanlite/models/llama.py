"""A Llama 3-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Module names follow Meta's Llama checkpoints (tok_embeddings, layers.N.attention.wq, ...,
feed_forward.w1/w2/w3, norm, output) so tensor-parallel plans and checkpoint converters can
address them. The model knows nothing about parallelism: attention infers its local head
count from the projection's output, so column-sharded projections just work.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

# The shapes live in a torch-free module (the launcher checks them without importing torch).
from titanlite.models.args import FLAVORS, ModelArgs, flops_per_token, model_args  # noqa: F401


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
    # Always computed on the CPU (then moved): arange on the meta device would import torch's
    # compiler stack (~2 s) just to build a model that init_weights fills in later anyway.
    cpu = torch.device("cpu")
    freqs = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=cpu) / head_dim)
    )
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64, device=cpu), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1).float()


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x0, x1) of x [batch, seq, heads, head_dim], as Meta's Llama."""
    seq = x.shape[1]
    table = table[:seq].float()
    if torch.compiler.is_compiling():
        # Written out in real numbers, inductor fuses the rotation into one kernel; it has no
        # complex kernels and would call back into eager code for a complex product.
        pairs = x.float().unflatten(-1, (-1, 2))
        cos, sin = table[:, None, :, 0], table[:, None, :, 1]
        x0, x1 = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
        return rotated.flatten(-2).type_as(x)
    # Eager: as complex numbers (x0 + i x1) * (cos + i sin), one kernel each way, about 4x
    # faster on a CPU than the four products above (and bitwise equal to them).
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    rotation = torch.view_as_complex(table.contiguous()).unsqueeze(1)
    return torch.view_as_real(pairs * rotation).flatten(-2).type_as(x)


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
        # Given its weight, Embedding skips its own normal_ init: on the meta device that op
        # imports torch's Python decompositions (~2 s at start-up); init_weights sets it anyway.
        self.tok_embeddings = nn.Embedding(
            args.vocab_size, args.dim, _weight=torch.empty(args.vocab_size, args.dim)
        )
        # A dict keyed by layer index keeps names stable when layers are wrapped or pruned.
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Not persistent: recomputed by init_weights, never checkpointed.
        rope = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope", rope.to(torch.empty(0).device), persistent=False)

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
