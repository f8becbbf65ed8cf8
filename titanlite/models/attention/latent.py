"""Multi-head latent attention (MLA, DeepSeek-V2/V3, Kimi K2): the "mla" kind.

Keys and values come from one small latent per token: ``wkv_a`` compresses the hidden state
to ``kv_lora_rank`` values, RMSNorm'd (``kv_norm``), and ``wkv_b`` expands them to every
head's key part without position (``qk_nope_head_dim``) and its value (``v_head_dim``). The
positional part of the key (``qk_rope_head_dim``) comes straight from the hidden state
(``wk_rope``) and is one head shared by all. Queries are full-rank (``wq``) or low-rank
(``wq_a`` to ``q_lora_rank``, ``q_norm``, ``wq_b``), split the same way. RoPE turns only the
positional parts, in interleaved pairs (DeepSeek's checkpoints; Hugging Face's
``rope_interleave``), with YaRN when the family's args ask for it.

The core is causal attention (``CausalAttention``: document masking and context parallelism
as for every kind) with two adaptations at its door: the softmax scale (YaRN's mscale
correction) goes into the queries, and the values are zero-padded to the query/key head size
(and the output cut back), so every kernel and the context-parallel gather of keys and values
see one head size.

(Hugging Face keeps ``wkv_a`` and ``wk_rope`` as one matrix, ``kv_a_proj_with_mqa``; here they
are two, so tensor parallelism can treat the positional key, used by local heads, apart from
the latent, which passes through the replicated norm into a head-split projection.)
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.attention.causal import CausalAttention
from titanlite.models.interfaces import AttentionLayer, Heads, Mask
from titanlite.models.layers import ROPE_STYLES, RMSNorm
from titanlite.models.yarn import YaRN


class LatentCore(CausalAttention):
    """Causal attention over query/key heads of one size and value heads of a smaller one,
    with a given softmax scale."""

    mask = Mask(causal=True)

    def __init__(self) -> None:
        super().__init__()
        self.softmax_scale: float | None = None
        """Set by the layer (None: 1 / sqrt(query head size))."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        d, dv = q.shape[-1], v.shape[-1]
        if self.softmax_scale is not None:
            q = q * (self.softmax_scale * math.sqrt(d))  # the kernels divide by sqrt(d)
        padded = F.pad(v, (0, d - dv)) if dv < d else v
        return super().forward(q, k, padded, documents)[..., :dv]


class LatentAttention(AttentionLayer):
    def __init__(self, args: Any):
        super().__init__()
        self.nope, self.rope_dim, self.v_dim = (
            args.qk_nope_head_dim,
            args.qk_rope_head_dim,
            args.v_head_dim,
        )
        qk = self.nope + self.rope_dim
        self.rotate = ROPE_STYLES[args.rope_style]
        if args.q_lora_rank:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps)
            self.wq_b = nn.Linear(args.q_lora_rank, args.n_heads * qk, bias=False)
        else:
            self.wq = nn.Linear(args.dim, args.n_heads * qk, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank, bias=False)
        self.wk_rope = nn.Linear(args.dim, self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, args.norm_eps)
        self.wkv_b = nn.Linear(
            args.kv_lora_rank, args.n_heads * (self.nope + self.v_dim), bias=False
        )
        self.wo = nn.Linear(args.n_heads * self.v_dim, args.dim, bias=False)
        self.core = LatentCore()
        yarn = getattr(args, "yarn", None)  # YaRN's keyword arguments, or None
        if yarn is not None:
            self.core.softmax_scale = qk**-0.5 * YaRN(**yarn).softmax_scale()

    def heads(self) -> Heads:
        raise NotImplementedError(
            "latent attention has no per-head q/k/v matrices (Muon's per-head blocks and "
            "QK-clip take grouped-query attention only)"
        )

    def forward(
        self, x: torch.Tensor, *, rope: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of heads.
        q = self.wq_b(self.q_norm(self.wq_a(x))) if hasattr(self, "wq_b") else self.wq(x)
        q_nope, q_rope = q.view(bsz, seq, -1, self.nope + self.rope_dim).split(
            [self.nope, self.rope_dim], dim=-1
        )
        kv = self.wkv_b(self.kv_norm(self.wkv_a(x))).view(bsz, seq, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rope = self.rotate(self.wk_rope(x).view(bsz, seq, 1, self.rope_dim), rope)
        q = torch.cat([q_nope, self.rotate(q_rope, rope)], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), documents)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))
