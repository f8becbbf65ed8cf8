"""Attention kernels on [batch, heads, seq, head_dim] queries, keys and values, and the
document structure of packed windows.

The building block is ``chunk_attention``: a run of consecutive queries over the keys up to
them, the earlier ones fully visible and the run's own causally; on the CPU computed without
any mask. Block-causal attention within documents (``document_attention``) and a context-
parallel rank's share of a sequence are runs of such chunks.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from titanlite.models.interfaces import AttentionCore, Mask
from titanlite.models.layers import outside_graphs

LOGIT_BLOCK = 1 << 24
"""Logits computed at once by ``max_logits`` (64 MiB in float32), whatever the sequence."""
QUERY_BLOCK = 256
"""At most this many queries at a time: causally, a block computes only the keys up to its
last query (about half of the square in all)."""


def chunk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: bool = False
) -> torch.Tensor:
    """Attention of the queries of the sequence's last ``c = q.shape[2]`` positions over the
    ``end = k.shape[2]`` keys up to them: keys before ``end - c`` are all visible, the last
    ``c`` causally (query i sees key end - c + i and those before). On the CPU by the flash
    kernel in two parts; elsewhere, or ``masked``, through a boolean mask."""
    c, end = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if end == c:  # the sequence's first chunk: plain causal attention
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if q.device.type == "cpu" and not masked:
        return _PrefixAttention.apply(q, k, v)
    # A boolean mask: correct on every backend, but the kernels keep a c x end float mask
    # per layer for backward (1 GiB per layer at 32K tokens and cp 2).
    keys_at = torch.arange(end, device=q.device)
    mask = keys_at[None, :] <= (end - c + torch.arange(c, device=q.device))[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _PrefixAttention(torch.autograd.Function):
    """``chunk_attention`` on the CPU without a mask: the flash kernel (which keeps only the
    output and the log-sum-exp of each query) over the visible prefix and, causally, over the
    chunk itself, the two merged by their log-sum-exps. Backward runs the kernel's backward
    on each part with the merged output and log-sum-exp, which gives each part's exact share
    of the gradients."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        split = k.shape[2] - q.shape[2]
        out_prefix, lse_prefix = _flash_cpu(q, k[:, :, :split], v[:, :, :split], 0.0, False)
        out_diag, lse_diag = _flash_cpu(q, k[:, :, split:], v[:, :, split:], 0.0, True)
        lse = torch.logaddexp(lse_prefix, lse_diag)
        wide = torch.promote_types(q.dtype, torch.float32)  # merge bf16 parts in float32
        out = (
            out_prefix.to(wide) * torch.exp(lse_prefix - lse).unsqueeze(-1)
            + out_diag.to(wide) * torch.exp(lse_diag - lse).unsqueeze(-1)
        ).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
        q, k, v, out, lse = ctx.saved_tensors
        split = k.shape[2] - q.shape[2]
        grad = grad.contiguous()
        dq_p, dk_p, dv_p = _flash_cpu_backward(
            grad, q, k[:, :, :split], v[:, :, :split], out, lse, 0.0, False
        )
        dq_d, dk_d, dv_d = _flash_cpu_backward(
            grad, q, k[:, :, split:], v[:, :, split:], out, lse, 0.0, True
        )
        return dq_p + dq_d, torch.cat([dk_p, dk_d], dim=2), torch.cat([dv_p, dv_d], dim=2)


@outside_graphs  # the split depends on the data: eager, outside compiled graphs
def document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    documents: torch.Tensor,
    *,
    chunks: Sequence[tuple[int, int]],
    masked: bool = False,
) -> torch.Tensor:
    """Block-causal attention: each query sees the keys of its own document at or before its
    position. ``q`` [b, h, local, d] holds the queries of ``chunks`` ((first position, length)
    in the sequence, in local order); ``k``, ``v`` [b, h_kv, seq, d] the keys in sequence
    order; ``documents`` [b, seq] the document numbers. Each run of queries within one document
    is one ``chunk_attention`` over the keys from the document's start."""
    # One device-to-host copy per call: where each sequence's documents start.
    changes = torch.nonzero(documents[:, 1:] != documents[:, :-1]).tolist()
    starts: list[list[int]] = [[0] for _ in range(q.shape[0])]
    for b, position in changes:
        starts[b].append(position + 1)
    outs = []
    for b in range(q.shape[0]):
        pieces, local = [], 0
        for first, length in chunks:
            end = first + length
            inside = starts[b][
                bisect.bisect_right(starts[b], first) : bisect.bisect_left(starts[b], end)
            ]
            cuts = [first, *inside, end]
            for lo, hi in itertools.pairwise(cuts):
                doc_start = starts[b][bisect.bisect_right(starts[b], lo) - 1]
                rows = slice(local + lo - first, local + hi - first)
                pieces.append(
                    chunk_attention(
                        q[b : b + 1, :, rows],
                        k[b : b + 1, :, doc_start:hi],
                        v[b : b + 1, :, doc_start:hi],
                        masked,
                    )
                )
            local += length
        outs.append(torch.cat(pieces, dim=2))
    return torch.cat(outs, dim=0)


def max_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    chunks: Sequence[tuple[int, int]],
    *,
    mask: Mask,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """The largest pre-softmax logit q.k / sqrt(head_dim) of each query head [heads] over the
    batch, the queries ``q`` [b, h, local, d] (holding ``chunks`` of the sequence, as in
    ``attend``) and the keys ``k`` [b, h_kv, seq, d] each query may see under ``mask`` and
    ``documents`` [b, seq]. In float32 (float64 for float64 inputs), a block of queries at a
    time (at most LOGIT_BLOCK logits), without gradients."""
    b, h, _, d = q.shape
    kv, seq = k.shape[1], k.shape[2]
    wide = torch.promote_types(q.dtype, torch.float32)
    # Query heads grouped by the key head they share: [b, kv, group, queries, d].
    grouped = q.detach().to(wide).unflatten(1, (kv, h // kv)) / math.sqrt(d)
    keys = k.detach().to(wide)
    best = torch.full((h,), -math.inf, dtype=wide, device=q.device)
    local, step = 0, max(1, min(QUERY_BLOCK, LOGIT_BLOCK // (b * h * seq)))  # queries at a time
    for first, length in chunks:
        for lo in range(0, length, step):
            n = min(step, length - lo)
            at = torch.arange(first + lo, first + lo + n, device=q.device)  # query positions
            end = first + lo + n if mask.causal else seq
            logits = torch.einsum(
                "bkgqd,bksd->bkgqs", grouped[:, :, :, local + lo : local + lo + n], keys[:, :, :end]
            )
            key_at = torch.arange(end, device=q.device)
            visible = torch.ones(n, end, dtype=torch.bool, device=q.device)
            if mask.causal:
                visible &= key_at[None, :] <= at[:, None]
            if mask.window is not None:
                visible &= key_at[None, :] > at[:, None] - mask.window
            visible = visible.expand(b, n, end)
            if documents is not None and mask.documents:
                visible = visible & (documents[:, None, :end] == documents[:, at, None])
            logits.masked_fill_(~visible[:, None, None], -math.inf)
            best = torch.maximum(best, logits.amax(dim=(0, 3, 4)).flatten())
        local += length
    return best


@outside_graphs  # a side effect on the module: eager, outside compiled graphs
def record_max_logits(
    core: AttentionCore,
    q: torch.Tensor,
    k: torch.Tensor,
    chunks: Sequence[tuple[int, int]],
    *,
    documents: torch.Tensor | None = None,
) -> None:
    """Fold ``max_logits`` of this forward into ``core.max_logits``: in training forwards
    only (not validation, which runs without gradients, nor activation checkpointing's
    recomputation in backward, which would see the same logits again)."""
    if not (core.training and torch.is_grad_enabled()):
        return
    if torch._C._current_graph_task_id() != -1:  # a recomputation in backward
        return
    step = max_logits(q, k, chunks, mask=core.mask, documents=documents)
    core.max_logits = step if core.max_logits is None else torch.maximum(core.max_logits, step)
