"""Context-parallel scenarios for tests/test_context.py, run on every rank of a tests/pool.py
pool (the cp group is the whole pool)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from titanlite.models.attention import CausalAttention
from titanlite.parallel.context import ContextParallel


def attention_matches_full(
    rank: int, world: int, kv_heads: int, seq: int, masked: bool, documents: bool = False
) -> dict[str, float]:
    """This rank's queries against the whole sequence give the outputs and the gradients of
    queries, keys and values that full causal attention gives at this rank's positions;
    returns the largest absolute differences. ``masked``: the boolean-mask kernel other
    devices use instead of the CPU's two-part flash kernel. ``documents``: block-causal within
    documents whose boundaries fall inside and across the ranks' chunks."""
    torch.manual_seed(0)  # the same full tensors on every rank
    batch, heads, head_dim = 2, 4, 8
    q = torch.randn(batch, heads, seq, head_dim, dtype=torch.float64, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq, head_dim, dtype=torch.float64, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq, head_dim, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(batch, heads, seq, head_dim, dtype=torch.float64)
    mask, ids = None, None
    if documents:  # boundaries differ per sequence; some inside chunks, some on their edges
        starts = torch.zeros(batch, seq, dtype=torch.long)
        starts[0, [3, seq // 2, seq - 2]] = 1
        starts[1, [seq // 4]] = 1
        ids = starts.cumsum(1)
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        mask = (causal & (ids[:, :, None] == ids[:, None, :]))[:, None]
    full = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=kv_heads != heads
    )
    full.backward(upstream)

    context = ContextParallel(dist.group.WORLD, world, rank, masked=masked)
    mine = context.positions(seq // world, q.device)
    local = [t.detach()[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    out = context.attention(CausalAttention(), *local, documents=ids)
    out.backward(upstream[:, :, mine])
    diffs = {"out": (out - full.detach()[:, :, mine]).abs().max().item()}
    for name, tensor, piece in zip("qkv", (q, k, v), local, strict=True):
        diffs[f"grad_{name}"] = (piece.grad - tensor.grad[:, :, mine]).abs().max().item()
    # Together the ranks hold every position exactly once.
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    assert sorted(torch.cat(everyone).tolist()) == list(range(seq))
    return diffs
