"""The decoder-only transformer the families share (Llama, Qwen3, Qwen3-MoE): attention
with grouped-query heads and RoPE, a SwiGLU or mixture-of-experts feed-forward, RMSNorms.

Module names follow Meta's Llama checkpoints (tok_embeddings, layers.N.attention.wq, ...,
feed_forward.w1/w2/w3, norm, output); the families' specs address them through these names.
The modules know nothing about parallelism: attention infers its local head count from the
projection's output, so column-sharded projections just work, and its core (an entry of the
attention registry, ``titanlite.models.attention``) is the one place context parallelism and
document masking hook into.

A family's args object provides dim, n_layers, n_heads, kv_heads, head_dim, ffn_hidden_dim,
vocab_size, norm_eps, rope_theta, max_seq_len, tie_embeddings, and the class constants
qk_norm (per-head RMSNorm on queries and keys), rope_style ("interleaved" pairs as in Meta's
Llama, or "halves" as in Hugging Face's rotate_half) and attention (the registry name of the
attention core), and the attention options of ``decoder_spec.AttentionVariants`` (sliding
window per layer, sinks). A family whose spec names this module as its ``model_module`` needs no
modules of its own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from titanlite.models import attention
from titanlite.models.interfaces import AttentionLayer, Heads
from titanlite.models.layers import ROPE_STYLES, FeedForward, RMSNorm, rope_tables
from titanlite.models.moe import MoE
from titanlite.models.mtp import MTPDepth, tokens_ahead
from titanlite.models.yarn import YaRN, yarn_tables


class Attention(AttentionLayer):
    def __init__(self, args: Any, layer_id: int = 0):
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = args.head_dim
        self.rotate = ROPE_STYLES[args.rope_style]
        bias = getattr(args, "attention_bias", False)  # gpt-oss: biases on all four
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, args.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, args.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.core = attention.for_layer(args, layer_id)

    def heads(self) -> Heads:
        return Heads(self.head_dim, self.wq.weight, self.wk.weight, self.wv.weight, self.wo.weight)

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
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), documents)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class TransformerBlock(nn.Module):
    def __init__(self, args: Any, layer_id: int = 0):
        super().__init__()
        # The attention registry's own projections where a kind has them (latent attention),
        # else the shared q/k/v/o with this layer's core (its window, sinks).
        latent = attention.LAYERS.get(args.attention)
        self.attention = latent(args) if latent else Attention(args, layer_id)
        # A mixture of experts when the family's args have experts (titanlite.models.moe),
        # except in the first ``first_k_dense`` blocks (a SwiGLU of ``dense_hidden_dim``).
        moe = getattr(args, "num_experts", 0) and layer_id >= getattr(args, "first_k_dense", 0)
        self.feed_forward: nn.Module = (
            MoE(args.dim, args)
            if moe
            else FeedForward(args.dim, getattr(args, "dense_hidden_dim", 0) or args.ffn_hidden_dim)
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
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(args, i) for i in range(args.n_layers)}
        )
        for i, block in self.layers.items():
            if isinstance(block.feed_forward, MoE):
                block.feed_forward.layer_id = int(i)
        attention.log_choice([block.attention.core for block in self.layers.values()])
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Multi-token prediction depths (titanlite.models.mtp): blocks n_layers, n_layers + 1, ...
        self.mtp: nn.ModuleDict | None = None
        if getattr(args, "mtp_layers", 0):
            self.mtp = nn.ModuleDict()
            for d in range(args.mtp_layers):
                block = TransformerBlock(args, args.n_layers + d)
                if isinstance(block.feed_forward, MoE):
                    block.feed_forward.layer_id = args.n_layers + d
                self.mtp[str(d)] = MTPDepth(args, block)
        # Not persistent: recomputed by init_buffers, never checkpointed.
        rope = rope_table(args)
        self.register_buffer("rope", rope.to(torch.empty(0).device), persistent=False)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
        *,
        ahead: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids -> logits (in training with ``mtp_layers`` depths [batch, (1 + depths) x
        seq, vocab]: the main logits, then each depth's, ``titanlite.models.mtp``); a pipeline
        stage (some modules set to None) maps its input (ids, or the hidden states of the
        stage before, in training with depths joined with the look-ahead embeddings) to its
        output the same way.

        ``positions`` ([seq], or [batch, seq]) are the tokens' RoPE positions when they are
        not 0, 1, ... (a context-parallel rank holds chunks of a longer sequence; positions
        may restart at each document). ``documents`` [batch, whole seq] (document numbers,
        see ``attention.document_ids``) makes attention block-causal within documents.
        ``ahead`` [depths, batch, seq]: for each multi-token prediction depth d, the id d
        places later in the whole sequence at each token (default: ``tokens_ahead`` of
        ``tokens``; a context-parallel rank's chunks cannot look past their own ends).
        """
        # Training with multi-token prediction: the embeddings of the tokens each depth looks
        # ahead to are taken where the embedding is (a pipeline's first stage) and travel with
        # the hidden state, joined along the last dimension, to the depths (its last stage).
        depths = getattr(self.args, "mtp_layers", 0) if self.training else 0
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)
            later = [
                tokens_ahead(tokens, d) if ahead is None else ahead[d - 1]
                for d in range(1, depths + 1)
            ]
            embedded = [self.tok_embeddings(ids) for ids in later]
        else:
            h, *embedded = tokens.split(self.args.dim, dim=-1) if depths else (tokens,)
        rope = self.rope if positions is None else self.rope[positions]
        for layer in self.layers.values():
            h = layer(h, rope, documents=documents)
        if self.output is None:
            return torch.cat([h, *embedded], dim=-1) if embedded else h
        logits = self.output(self.norm(h)).float()
        if self.mtp is None or not depths:
            return logits
        # Each depth's logits follow the main ones along the sequence.
        predicted = []
        for e, depth in zip(embedded, self.mtp.values(), strict=True):
            h, normed = depth(e, h, rope, documents)
            predicted.append(self.output(normed).float())
        return torch.cat([logits, *predicted], dim=1)

    def init_buffers(self) -> None:
        """Recompute the RoPE tables on the model's device (after to_empty from meta) and
        start the MoE routing biases at zero (a checkpoint load then overwrites them)."""
        self.rope = rope_table(self.args).to(self.rope.device)
        for module in self.modules():
            if isinstance(module, MoE):
                module.expert_bias.zero_()


def rope_table(args: Any) -> torch.Tensor:
    """The RoPE table of ``args``: YaRN-stretched when the family's args give ``yarn`` (its
    keyword arguments, ``titanlite.models.yarn.YaRN``), else plain."""
    yarn = getattr(args, "yarn", None)
    if yarn is not None:
        return yarn_tables(args.head_dim, args.max_seq_len, args.rope_theta, YaRN(**yarn))
    return rope_tables(args.head_dim, args.max_seq_len, args.rope_theta)


def build(args: Any) -> Decoder:
    """The model of ``args`` (call under ``torch.device("meta")`` to allocate nothing)."""
    return Decoder(args)


def init_buffers(model: Decoder) -> None:
    model.init_buffers()
