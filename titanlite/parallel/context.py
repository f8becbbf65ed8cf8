"""Context parallelism: each sequence split across the ranks of the cp mesh dimension.

A sequence of S tokens is cut into 2 x cp chunks of c = S / (2 cp); cp rank r holds chunks r
and 2 cp - 1 - r, one early and one late, so every rank has the same causal work (the early
chunk attends to few keys, the late one to many). Everything per token follows the split:
the inputs and labels (``shard``), the RoPE positions (``positions``) and so the loss, which
the trainer sums over the loss mesh (batch x cp) like any other.

Attention needs each query's whole causal prefix. This rank's keys and values are
all-gathered over the cp group (one collective per layer for both; its backward
reduce-scatters their gradients, summing what every rank's queries contributed) and put in
sequence order; each local chunk then attends to the prefix that ends with it
(``chunk_attention``). On the CPU that is the flash kernel twice, over the fully visible keys
and causally over the chunk's own, merged by log-sum-exp, so no mask is ever built; other
devices use a boolean mask on scaled_dot_product_attention (correct, but the kernels keep it
for backward: chunk x prefix bytes per layer).

Gathering, not a ring exchange: with grouped-query attention the keys and values are a small
part of the activations (measured in docs/context_parallel.md), one collective per layer for
both costs a few percent of the step, and it runs the same on gloo and NCCL without the
send/receive pairing and per-hop latency chain of a ring.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from titanlite.models.layers import CausalAttention


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 of every rank's equal-sized tensor (rank order); backward
    reduce-scatters the gradient, so each rank gets the sum over ranks for its own part."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        ctx.group = group
        world = dist.get_world_size(group)
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        world = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // world, *grad.shape[1:]))
        dist.reduce_scatter_single(out, grad.contiguous(), group=ctx.group)
        return out, None


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


def chunk_positions(local_len: int, cp: int, rank: int) -> torch.Tensor:
    """Positions in the whole sequence (cp x local_len tokens) of cp rank ``rank``'s tokens:
    chunk ``rank`` then chunk ``2 cp - 1 - rank``."""
    if local_len % 2:
        raise ValueError(f"a context-parallel share of {local_len} tokens is not two chunks")
    c = local_len // 2
    first, second = rank, 2 * cp - 1 - rank
    return torch.cat([torch.arange(first * c, (first + 1) * c),
                      torch.arange(second * c, (second + 1) * c)])  # fmt: skip


class ContextParallel:
    """This rank's part of the cp group: the split of sequences and the attention over it."""

    def __init__(self, group: dist.ProcessGroup, degree: int, rank: int, masked: bool = False):
        self.group, self.degree, self.rank = group, degree, rank
        self.masked = masked  # the boolean-mask kernel on the CPU too (tests compare both)
        self._cache: dict[tuple[str, int, torch.device], torch.Tensor] = {}

    def _cached(self, kind: str, n: int, device: torch.device) -> torch.Tensor:
        key = (kind, n, device)
        if key not in self._cache:
            if kind == "positions":  # this rank's tokens in a sequence of n local tokens
                value = chunk_positions(n, self.degree, self.rank)
            else:  # "order": the gathered (rank-ordered) tokens put back in sequence order
                gathered = torch.cat(
                    [chunk_positions(n, self.degree, r) for r in range(self.degree)]
                )
                value = torch.argsort(gathered)
            self._cache[key] = value.to(device)
        return self._cache[key]

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """This rank's positions for ``local_len`` local tokens; called before the forward, it
        also prepares what attention looks up (a compiled or recomputed block must not fill
        a cache)."""
        self._cached("order", local_len, device)
        return self._cached("positions", local_len, device)

    def shard(self, batch: torch.Tensor) -> torch.Tensor:
        """[batch, seq] token ids or labels -> this rank's [batch, seq / cp] share."""
        seq = batch.shape[1]
        if seq % (2 * self.degree):
            raise ValueError(
                f"sequence length {seq} does not split into 2 x {self.degree} context chunks"
            )
        return batch[:, self.positions(seq // self.degree, batch.device)]

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this rank's queries [batch, heads, local, head_dim] over the
        whole sequence's keys and values (gathered from the cp group)."""
        local = q.shape[2]
        # One collective for keys and values: [2, b, h, s, d] -> seq first -> gather.
        kv = torch.stack([k, v]).permute(3, 0, 1, 2, 4)
        kv = _GatherSequence.apply(kv, self.group)
        kv = kv.index_select(0, self._cache["order", local, kv.device])
        keys, values = kv.permute(1, 2, 3, 0, 4)
        c = local // 2
        outs = []
        for i, chunk in enumerate((self.rank, 2 * self.degree - 1 - self.rank)):
            end = (chunk + 1) * c  # this chunk and every key before it
            outs.append(
                chunk_attention(
                    q[:, :, i * c : (i + 1) * c], keys[:, :, :end], values[:, :, :end], self.masked
                )
            )
        return torch.cat(outs, dim=2)


def apply_cp(model: nn.Module, context: ContextParallel) -> int:
    """Point every attention kernel of ``model`` at ``context``; returns how many."""
    kernels = [m for m in model.modules() if isinstance(m, CausalAttention)]
    for kernel in kernels:
        kernel.context = context
    if not kernels:
        raise ValueError("context parallelism found no attention kernel in the model")
    return len(kernels)
