"""The "masked" attention core: causal attention with a sliding window, learned sinks, or
both, through an explicit kernel that computes only the keys each block of queries can see.

With a window of w keys, a block of n queries starting at position p attends the keys from
p - w + 1 to its own last one: n x (n + w - 1) logits, so the work and the memory grow with
the window, not the sequence. A sink is one more logit per query head in every softmax row,
a learned scalar whose column is dropped after the softmax (it attends to nothing, so a row
may give most of its weight to no token).

Why an explicit kernel: PyTorch's fused SDPA kernels take neither a band mask without
materializing it nor an extra softmax column, and FlexAttention on a CPU build runs as a
reference implementation over the whole square. Blocking the queries keeps the explicit
kernel at the band's cost, on every device, and its autograd is exact in any dtype (logits
and softmax in float32 at least). On CUDA the core runs FlexAttention instead
(``titanlite.models.attention.flex``), unless ``model.attention_kernel`` says otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from titanlite.models.attention.flex import flex_masked_attention, uses_flex
from titanlite.models.attention.kernels import QUERY_BLOCK, record_max_logits
from titanlite.models.interfaces import AttentionCore, Mask


def banded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunks: Sequence[tuple[int, int]],
    *,
    window: int | None,
    sinks: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of queries ``q`` [b, h, local, d] holding the sequence's ``chunks``
    ((first position, length), in local order) over keys and values [b, h_kv, seq, d] in
    sequence order: a query at position t sees the keys at t - window < position <= t
    (all up to t when ``window`` is None) of its own document (``documents`` [b, seq]);
    ``sinks`` [h] join every softmax row. A block of at most QUERY_BLOCK queries at a time,
    over the keys the block reaches."""
    b, h, _, d = q.shape
    kv = k.shape[1]
    wide = torch.promote_types(q.dtype, torch.float32)
    scale = 1.0 / math.sqrt(d)
    outs, local = [], 0
    for first, length in chunks:
        for lo in range(0, length, QUERY_BLOCK):
            n = min(QUERY_BLOCK, length - lo)
            start, end = first + lo, first + lo + n  # query positions [start, end)
            begin = 0 if window is None else max(0, start - window + 1)  # first key reached
            rows = q[:, :, local + lo : local + lo + n].unflatten(1, (kv, h // kv))
            keys, values = k[:, :, begin:end].to(wide), v[:, :, begin:end].to(wide)
            logits = torch.einsum("bkgqd,bksd->bkgqs", rows.to(wide), keys) * scale
            at = torch.arange(start, end, device=q.device)[:, None]
            key_at = torch.arange(begin, end, device=q.device)[None, :]
            visible = key_at <= at
            if window is not None:
                visible = visible & (key_at > at - window)
            if documents is not None:
                same = documents[:, None, begin:end] == documents[:, start:end, None]
                visible = (visible & same)[:, None, None]  # [b, 1, 1, n, keys]
            logits = logits.masked_fill(~visible, -math.inf)
            if sinks is not None:
                column = sinks.to(wide).view(1, kv, -1, 1, 1).expand(b, -1, -1, n, 1)
                probs = torch.cat([logits, column], dim=-1).softmax(-1)[..., :-1]
            else:
                probs = logits.softmax(-1)
            out = torch.einsum("bkgqs,bksd->bkgqd", probs, values)
            outs.append(out.flatten(1, 2).to(q.dtype))
        local += length
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


class MaskedAttention(AttentionCore):
    """Causal attention with a sliding ``window`` (None = none) and, given ``sink_heads``,
    a learned sink per query head (``sinks``: split with the heads under tensor
    parallelism); ``kernel`` as ``model.attention_kernel`` (``flex.KERNELS``)."""

    def __init__(
        self, *, window: int | None = None, sink_heads: int = 0, kernel: str = "auto"
    ) -> None:
        super().__init__()
        self.mask = Mask(causal=True, window=window, sink=sink_heads > 0)
        self.sinks = nn.Parameter(torch.empty(sink_heads)) if sink_heads else None
        self.kernel = kernel

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
        sinks = self.sinks
        if sinks is not None and hasattr(sinks, "to_local"):  # split with the heads (TP)
            sinks = sinks.to_local()
        attention = banded_attention
        if uses_flex(self.kernel, q.device):
            attention = flex_masked_attention
        return attention(q, k, v, chunks, window=self.mask.window, sinks=sinks, documents=documents)
