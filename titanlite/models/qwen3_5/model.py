"""Qwen3.5's modules: the hybrid decoder of Gated DeltaNet and gated full-attention blocks.

Names follow the shared decoder's (tok_embeddings, layers.N.attention.wq, feed_forward.w1,
norm, output); a linear block holds ``linear_attn`` where a full one holds ``attention``.
Every projection is its own Linear (queries, gates, keys, values, ...), never a fused one,
so tensor parallelism splits each by heads; the Hugging Face adapter fuses and splits them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models import attention
from titanlite.models.interfaces import AttentionLayer, Heads
from titanlite.models.layers import FeedForward, RMSNorm, apply_rope_halves, rope_tables
from titanlite.models.moe import MoE


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a weight tensor parallelism split by channels (else the weight)."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


class OffsetRMSNorm(nn.Module):
    """RMSNorm scaled by (1 + weight): zero-centered, so the weight starts at zero and
    weight decay pulls the scale towards one, not zero."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class GatedAttention(AttentionLayer):
    """Full causal attention with zero-centered q/k norms, RoPE on the first ``rope_dim``
    dimensions of each head, and a sigmoid gate (its own projection, per output channel) on
    the attended values before the output projection."""

    def __init__(self, args: Any):
        super().__init__()
        self.head_dim, self.rope_dim = args.head_dim, args.rope_dim
        width, kv_width = args.n_heads * args.head_dim, args.kv_heads * args.head_dim
        self.wq = nn.Linear(args.dim, width, bias=False)
        self.wg = nn.Linear(args.dim, width, bias=False)
        self.wk = nn.Linear(args.dim, kv_width, bias=False)
        self.wv = nn.Linear(args.dim, kv_width, bias=False)
        self.wo = nn.Linear(width, args.dim, bias=False)
        self.q_norm = OffsetRMSNorm(args.head_dim, args.norm_eps)
        self.k_norm = OffsetRMSNorm(args.head_dim, args.norm_eps)
        self.core = attention.build(args.attention)

    def heads(self) -> Heads:
        return Heads(self.head_dim, self.wq.weight, self.wk.weight, self.wv.weight, self.wo.weight)

    def _rotate(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        turned = apply_rope_halves(x[..., : self.rope_dim], rope)
        return torch.cat([turned, x[..., self.rope_dim :]], dim=-1)

    def forward(
        self, x: torch.Tensor, *, rope: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.q_norm(self.wq(x).view(bsz, seq, -1, self.head_dim))
        k = self.k_norm(self.wk(x).view(bsz, seq, -1, self.head_dim))
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q, k = self._rotate(q, rope), self._rotate(k, rope)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), documents)
        out = out.transpose(1, 2).reshape(bsz, seq, -1)
        return self.wo(out * torch.sigmoid(self.wg(x)))


class ShortConv(nn.Module):
    """Causal depthwise convolutions (one per projection: queries, keys, values) followed by
    SiLU; a tap never reaches across a document start. Weights [channels, kernel], the
    last column applied to the current token."""

    def __init__(self, channels: dict[str, int], kernel: int):
        super().__init__()
        self.kernel = kernel
        for name, width in channels.items():
            self.register_parameter(name, nn.Parameter(torch.empty(width, kernel)))

    def forward(
        self, name: str, x: torch.Tensor, documents: torch.Tensor | None = None, *, lead: int = 0
    ) -> torch.Tensor:
        """x [b, seq, channels] -> the same shape, less the first ``lead`` tokens: those only
        feed the taps of the ones after (the tokens before a context-parallel chunk)."""
        weight = _local(getattr(self, name)).to(x.dtype)
        kernel, seq = weight.shape[1], x.shape[1]
        out = x * weight[:, -1]
        for lag in range(1, kernel):
            earlier = F.pad(x, (0, 0, lag, 0))[:, :seq]
            if documents is not None:
                before = F.pad(documents, (lag, 0), value=-1)[:, :seq]
                earlier = earlier * (before == documents).unsqueeze(-1).to(x.dtype)
            out = out + earlier * weight[:, -1 - lag]
        return F.silu(out[:, lead:])


class Decay(nn.Module):
    """Per value head: the log-decay g = -exp(A_log) softplus(a + dt_bias) of the state."""

    def __init__(self, heads: int):
        super().__init__()
        self.A_log = nn.Parameter(torch.empty(heads))
        self.dt_bias = nn.Parameter(torch.empty(heads))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        a_log, dt_bias = _local(self.A_log), _local(self.dt_bias)
        return -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet: projections to queries, keys, values, an output gate z, step sizes
    (b) and decay inputs (a); the short convolution on queries, keys and values; the
    gated delta rule (the attention registry's ``gated_delta`` core); per value head an
    RMSNorm of the output times silu(z); the output projection."""

    def __init__(self, args: Any):
        super().__init__()
        self.k_dim, self.v_dim = args.linear_k_dim, args.linear_v_dim
        keys, values = args.linear_k_heads * self.k_dim, args.linear_v_heads * self.v_dim
        self.wq = nn.Linear(args.dim, keys, bias=False)
        self.wk = nn.Linear(args.dim, keys, bias=False)
        self.wv = nn.Linear(args.dim, values, bias=False)
        self.wz = nn.Linear(args.dim, values, bias=False)
        self.wb = nn.Linear(args.dim, args.linear_v_heads, bias=False)
        self.wa = nn.Linear(args.dim, args.linear_v_heads, bias=False)
        self.conv = ShortConv({"q": keys, "k": keys, "v": values}, args.conv_kernel)
        self.decay = Decay(args.linear_v_heads)
        self.norm = RMSNorm(self.v_dim, args.norm_eps)
        self.wo = nn.Linear(values, args.dim, bias=False)
        self.core = attention.build(args.linear_attention)
        self.core.chunk_size = args.chunk_size
        self.core.kernel = args.linear_attention_kernel

    def forward(
        self, x: torch.Tensor, *, rope: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        del rope  # positions reach a recurrent layer only through the order of its tokens
        split = self.core.sequence_split  # context parallelism: a RecurrentSplit, or None
        if split is not None:  # each of this rank's sequence chunks becomes a row
            x = split.rows(x)  # type: ignore[union-attr]
        bsz, seq, _ = x.shape
        inputs, conv_documents, lead = [self.wq(x), self.wk(x), self.wv(x)], documents, 0
        if split is not None:  # each row led by the conv inputs of the tokens before its chunk
            lead = self.conv.kernel - 1
            inputs, conv_documents = split.lead_in(inputs, lead, documents)  # type: ignore[union-attr]
        q, k, v = (
            self.conv(name, t, conv_documents, lead=lead).view(bsz, seq, -1, width)
            for name, t, width in zip(
                "qkv", inputs, (self.k_dim, self.k_dim, self.v_dim), strict=True
            )
        )
        beta = torch.sigmoid(self.wb(x).float())
        g = self.decay(self.wa(x))
        out = self.core(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2).float(),
            documents,
            g=g.transpose(1, 2),
            beta=beta.transpose(1, 2),
        ).transpose(1, 2)
        z = self.wz(x).view(bsz, seq, -1, self.v_dim)
        out = (self.norm(out) * F.silu(z.float())).to(x.dtype).reshape(bsz, seq, -1)
        if split is not None:  # back before wo: sequence-parallel TP splits its output by token
            out = split.unrows(out)  # type: ignore[union-attr]
        return self.wo(out)


class HybridBlock(nn.Module):
    def __init__(self, args: Any, layer: int):
        super().__init__()
        if args.is_full_attention(layer):
            self.attention = GatedAttention(args)
            self.attention.layer_id = layer
        else:
            self.linear_attn = GatedDeltaNet(args)
        # The MoE flavors (titanlite.models.qwen3_5_moe): a mixture of experts in every block.
        self.feed_forward: nn.Module
        if getattr(args, "num_experts", 0):
            self.feed_forward = MoE(args.dim, args)
            self.feed_forward.layer_id = layer
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.attention_norm = OffsetRMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = OffsetRMSNorm(args.dim, args.norm_eps)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        mixer = self.attention if hasattr(self, "attention") else self.linear_attn
        h = x + mixer(self.attention_norm(x), rope=rope, documents=documents)
        return h + self.feed_forward(self.ffn_norm(h))


class HybridDecoder(nn.Module):
    """Token ids [batch, seq] -> logits [batch, seq, vocab] (float32), with the shared
    decoder's forward contract (pipeline stages set modules to None; ``positions`` and
    ``documents`` as in ``titanlite.models.decoder.Decoder.forward``)."""

    def __init__(self, args: Any):
        super().__init__()
        args.check()
        self.args = args
        self.tok_embeddings = nn.Embedding(
            args.vocab_size, args.dim, _weight=torch.empty(args.vocab_size, args.dim)
        )
        self.layers = nn.ModuleDict({str(i): HybridBlock(args, i) for i in range(args.n_layers)})
        attention.log_choice(
            [
                (block.attention if hasattr(block, "attention") else block.linear_attn).core
                for block in self.layers.values()
            ]
        )
        self.norm = OffsetRMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        rope = rope_tables(args.rope_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope", rope.to(torch.empty(0).device), persistent=False)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        rope = self.rope if positions is None else self.rope[positions]
        for layer in self.layers.values():
            h = layer(h, rope, documents=documents)
        if self.output is None:
            return h
        return self.output(self.norm(h)).float()

    def init_buffers(self) -> None:
        """The RoPE tables on the model's device (after to_empty from meta) and any MoE
        routing biases at zero (a checkpoint load then overwrites them)."""
        a = self.args
        self.rope = rope_tables(a.rope_dim, a.max_seq_len, a.rope_theta).to(self.rope.device)
        for module in self.modules():
            if isinstance(module, MoE):
                module.expert_bias.zero_()


def build(args: Any) -> HybridDecoder:
    """The model of ``args`` (call under ``torch.device("meta")`` to allocate nothing)."""
    return HybridDecoder(args)


def init_buffers(model: HybridDecoder) -> None:
    model.init_buffers()
