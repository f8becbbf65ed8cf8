"""The "sdpa" attention core: causal scaled dot-product attention, block-causal within
documents when given document ids, grouped-query when keys have fewer heads."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from titanlite.models.attention.kernels import (
    chunk_attention,
    document_attention,
    record_max_logits,
)
from titanlite.models.interfaces import AttentionCore, Mask


class CausalAttention(AttentionCore):
    mask = Mask(causal=True)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        chunks: Sequence[tuple[int, int]],
        *,
        documents: torch.Tensor | None = None,
        masked: bool = False,
    ) -> torch.Tensor:
        if self.record_max_logits:  # QK-clip (titanlite.optim.qk_clip)
            record_max_logits(self, q, k, chunks, documents=documents)
        if documents is not None:
            return document_attention(q, k, v, documents, chunks=chunks, masked=masked)
        outs, local = [], 0
        for first, length in chunks:
            end = first + length  # the chunk sees every key up to its own last position
            rows = q[:, :, local : local + length]
            outs.append(chunk_attention(rows, k[:, :, :end], v[:, :, :end], masked))
            local += length
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
