"""Building blocks of the decoder-only families: RMSNorm, RoPE, attention, SwiGLU, the decoder.

Module names follow Meta's Llama checkpoints (tok_embeddings, layers.N.attention.wq, ...,
feed_forward.w1/w2/w3, norm, output); the families' specs address them through these names.
The modules know nothing about parallelism: attention infers its local head count from the
projection's output, so column-sharded projections just work, and its kernel
(``CausalAttention``, models/attention.py) is the one place context parallelism and document
masking hook into.

A family's args object provides dim, n_layers, n_heads, kv_heads, head_dim, ffn_hidden_dim,
vocab_size, norm_eps, rope_theta, max_seq_len, tie_embeddings, and the class constants
qk_norm (per-head RMSNorm on queries and keys) and rope_style ("interleaved" pairs as in
Meta's Llama, or "halves" as in Hugging Face's rotate_half).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.attention import CausalAttention
from titanlite.models.moe import MoE


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
    # compiler stack (seconds) just to build a model whose buffers are filled in later anyway.
    cpu = torch.device("cpu")
    freqs = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=cpu) / head_dim)
    )
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64, device=cpu), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1).float()


def _table_for(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The rows of a RoPE table that x [batch, seq, heads, head_dim] needs, with a heads axis:
    [seq, 1, head_dim/2, 2] from the whole table (positions 0, 1, ...), or [batch, seq, 1,
    head_dim/2, 2] from a table already indexed by per-sequence positions."""
    if table.dim() == 3:
        table = table[: x.shape[1]]
    return table.float().unsqueeze(-3)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x0, x1) of x [batch, seq, heads, head_dim], as Meta's Llama."""
    table = _table_for(x, table)
    if torch.compiler.is_compiling():
        # Written out in real numbers, inductor fuses the rotation into one kernel; it has no
        # complex kernels and would call back into eager code for a complex product.
        pairs = x.float().unflatten(-1, (-1, 2))
        cos, sin = table[..., 0], table[..., 1]
        x0, x1 = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
        return rotated.flatten(-2).type_as(x)
    # Eager: as complex numbers (x0 + i x1) * (cos + i sin), one kernel each way; faster on a
    # CPU than the four products above (and bitwise equal to them; docs/performance.md).
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    rotation = torch.view_as_complex(table.contiguous())
    return torch.view_as_real(pairs * rotation).flatten(-2).type_as(x)


def apply_rope_halves(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate (x_i, x_{i + head_dim/2}) pairs of x [batch, seq, heads, head_dim], as Hugging
    Face's rotate_half (Qwen3 checkpoints are trained this way)."""
    table = _table_for(x, table)
    cos, sin = table[..., 0], table[..., 1]
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    return rotated.type_as(x)


_ROPE = {"interleaved": apply_rope, "halves": apply_rope_halves}


class Attention(nn.Module):
    def __init__(self, args: Any):
        super().__init__()
        self.head_dim = args.head_dim
        self.rotate = _ROPE[args.rope_style]
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, args.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, args.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.kernel = CausalAttention()

    def forward(
        self, x: torch.Tensor, *, rope: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        # rope and documents are keyword-only: tensor-parallel input styles redistribute
        # positional inputs.
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of heads.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotate(q, rope), self.rotate(k, rope)
        out = self.kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), documents)
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
    def __init__(self, args: Any):
        super().__init__()
        self.attention = Attention(args)
        # A mixture of experts when the family's args have experts (titanlite.models.moe).
        self.feed_forward: nn.Module = (
            MoE(args.dim, args)
            if getattr(args, "num_experts", 0)
            else FeedForward(args.dim, args.ffn_hidden_dim)
        )
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope=rope, documents=documents)
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(nn.Module):
    """Token ids [batch, seq] -> logits [batch, seq, vocab] (float32 for a stable loss)."""

    def __init__(self, args: Any):
        super().__init__()
        args.check()
        self.args = args
        # Given its weight, Embedding skips its own normal_ init: on the meta device that op
        # imports torch's Python decompositions (seconds at start-up); the initializer sets it.
        self.tok_embeddings = nn.Embedding(
            args.vocab_size, args.dim, _weight=torch.empty(args.vocab_size, args.dim)
        )
        # A dict keyed by layer index keeps names stable when layers are wrapped or pruned.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        for i, block in self.layers.items():
            if isinstance(block.feed_forward, MoE):
                block.feed_forward.layer_id = int(i)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Not persistent: recomputed by init_buffers, never checkpointed.
        rope = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope", rope.to(torch.empty(0).device), persistent=False)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids -> logits; a pipeline stage (some modules set to None) maps its input
        (ids, or the hidden states of the stage before) to its output the same way.

        ``positions`` ([seq], or [batch, seq]) are the tokens' RoPE positions when they are
        not 0, 1, ... (a context-parallel rank holds chunks of a longer sequence; positions
        may restart at each document). ``documents`` [batch, whole seq] (document numbers,
        see ``attention.document_ids``) makes attention block-causal within documents.
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        rope = self.rope if positions is None else self.rope[positions]
        for layer in self.layers.values():
            h = layer(h, rope, documents=documents)
        if self.output is None:
            return h
        return self.output(self.norm(h)).float()

    def init_buffers(self) -> None:
        """Recompute the RoPE tables on the model's device (after to_empty from meta) and
        start the MoE routing biases at zero (a checkpoint load then overwrites them)."""
        a = self.args
        self.rope = rope_tables(a.head_dim, a.max_seq_len, a.rope_theta).to(self.rope.device)
        for module in self.modules():
            if isinstance(module, MoE):
                module.expert_bias.zero_()


def count_params(model: nn.Module) -> int:
    """Unique parameters (tied weights once), by their global shapes."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
