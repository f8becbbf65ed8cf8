"""The masked core's FlexAttention path: sliding window, documents and sinks through
``torch.nn.attention.flex_attention``, the kernel the masked core runs on CUDA.

The mask is a ``BlockMask`` whose rule (``mask_mod``) is the banded kernel's: a query at
position t sees the keys at t - window < position <= t of its own document. Queries hold
``chunks`` of the sequence ((first position, length), as ``attend`` receives them), so the rule
looks each query's position up in a table instead of reading its index. Key and value heads
may be fewer than the query heads (``enable_gqa``: query head i reads key head i // group, as
the banded kernel groups them).

Sinks are exact through the log-sum-exp flex returns. With a sink logit s of a head and a row's
logits l_j, the softmax over [l, s] gives token j the weight
exp(l_j) / (sum exp(l) + exp(s)) = softmax(l)_j * 1 / (1 + exp(s - lse)),
with lse = log sum exp(l): the row's output without the sink times sigmoid(lse - s). The lse
is differentiable (flex's backward takes its gradient), so the gradient reaches the queries and
keys through it and the sink through s.

On CUDA flex_attention and the block-mask builder run compiled (once per shape and process);
inside a compiled model flex is traced where it stands. Elsewhere, when forced
(``model.attention_kernel = "flex"``), the path runs FlexAttention's own dense reference: its
operator called directly, which materializes every query's logits over all keys (the public
function refuses gradients on a CPU) — for tests and checks, not for speed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch.nn.attention.flex_attention import (
    AuxRequest,
    BlockMask,
    create_block_mask,
    flex_attention,
)

from titanlite.models.layers import outside_graphs

KERNELS = ("auto", "explicit", "flex")
"""``model.attention_kernel``: "auto" runs FlexAttention on CUDA and the blocked explicit
kernel elsewhere; "explicit" and "flex" force one of them."""

_CACHE_SIZE = 16
_masks: dict[tuple, tuple[torch.Tensor | None, BlockMask]] = {}
_compiled: dict[str, Callable] = {}


def uses_flex(kernel: str, device: torch.device) -> bool:
    """Whether the masked core runs FlexAttention for tensors on ``device``."""
    return kernel == "flex" or (kernel == "auto" and device.type == "cuda")


def describe(kernel: str, *, cuda: bool) -> str:
    """Which kernel the masked layers will run and why, for the start-up log."""
    if uses_flex(kernel, torch.device("cuda" if cuda else "cpu")):
        if cuda:
            return "FlexAttention (compiled; a block mask of the window, documents and causality)"
        return (
            'FlexAttention\'s dense reference (model.attention_kernel = "flex"; on a CPU it '
            "computes every query's logits over all keys: for tests, not speed)"
        )
    why = 'model.attention_kernel = "explicit"' if kernel == "explicit" else "no CUDA device"
    return (
        f"the blocked explicit kernel (the band of keys each block of queries reaches; {why}: "
        "FlexAttention runs compiled on CUDA only)"
    )


def _compiled_op(name: str) -> Callable:
    """flex_attention or create_block_mask compiled, once per process."""
    if name not in _compiled:
        op = flex_attention if name == "flex" else create_block_mask
        _compiled[name] = torch.compile(op, dynamic=False)
    return _compiled[name]


@outside_graphs  # a Python cache and data-dependent rules: eager, outside graphs
def block_mask(
    chunks: Sequence[tuple[int, int]],
    *,
    keys: int,
    window: int | None,
    documents: torch.Tensor | None,
    device: torch.device,
) -> BlockMask:
    """The BlockMask of queries holding ``chunks`` over ``keys`` keys in sequence order:
    causal, within ``window`` and the same document (``documents`` [b, keys]). Kept for the
    next layer with the same shape, window and documents."""
    key = (tuple(chunks), keys, window, device, None if documents is None else documents.shape)
    cached = _masks.get(key)
    if cached is not None and (
        documents is None or cached[0] is documents or torch.equal(cached[0], documents)
    ):
        return cached[1]
    positions = torch.cat(
        [torch.arange(first, first + length, device=device) for first, length in chunks]
    )

    def visible(
        b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        at = positions[q]
        ok = kv <= at
        if window is not None:
            ok = ok & (kv > at - window)
        if documents is not None:
            ok = ok & (documents[b, kv] == documents[b, at])
        return ok

    build = _compiled_op("mask") if device.type == "cuda" else create_block_mask
    batch = None if documents is None else documents.shape[0]
    mask = build(visible, batch, None, len(positions), keys, device=device)
    if len(_masks) >= _CACHE_SIZE:
        _masks.clear()
    _masks[key] = (documents, mask)
    return mask


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention's output and natural-log log-sum-exp [b, h, queries] (float32)."""
    gqa = q.shape[1] != k.shape[1]
    if q.device.type == "cuda":  # traced where it stands inside a compiled model
        op = flex_attention if torch.compiler.is_compiling() else _compiled_op("flex")
        out, aux = op(q, k, v, block_mask=mask, enable_gqa=gqa, return_aux=AuxRequest(lse=True))
        return out, aux.lse
    # FlexAttention's own dense reference with its autograd (the public function refuses
    # gradients off CUDA); it groups the query heads itself and returns the log-sum-exp in
    # base 2.
    from torch._higher_order_ops.flex_attention import flex_attention as operator

    options = {"OUTPUT_LOGSUMEXP": True, "OUTPUT_MAX": False}
    out, lse, _ = operator(q, k, v, _score, mask.as_tuple(), 1.0 / math.sqrt(q.shape[-1]), options)
    return out, lse * math.log(2.0)


def _score(score: torch.Tensor, *index: torch.Tensor) -> torch.Tensor:
    """The identity score_mod (called with the batch, head, query and key indices)."""
    return score


def flex_masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunks: Sequence[tuple[int, int]],
    *,
    window: int | None,
    sinks: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """``masked.banded_attention``'s result (same arguments) through FlexAttention."""
    mask = block_mask(chunks, keys=k.shape[2], window=window, documents=documents, device=q.device)
    out, lse = _attend(q, k, v, mask)
    if sinks is None:
        return out
    wide = torch.promote_types(q.dtype, torch.float32)
    keep = torch.sigmoid(lse.to(wide) - sinks.to(wide).view(1, -1, 1))  # 1 - the sink's weight
    return (out.to(wide) * keep.unsqueeze(-1)).to(q.dtype)
