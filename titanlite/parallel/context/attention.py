"""Context parallelism: each sequence split across the ranks of the cp mesh dimension.

A sequence of S tokens is cut into 2 x cp chunks of c = S / (2 cp); cp rank r holds chunks r
and 2 cp - 1 - r, one early and one late, so every rank has the same causal work (the early
chunk attends to few keys, the late one to many). Everything per token follows the split:
the inputs and labels (``shard``), the RoPE positions (``positions``) and so the loss, which
the trainer sums over the loss mesh (batch x cp) like any other.

Attention needs each query's whole causal prefix. This rank's keys and values are
all-gathered over the cp group (one collective per layer for both; its backward
reduce-scatters their gradients, summing what every rank's queries contributed) and put in
sequence order; the attention core then attends each local chunk to the prefix that ends
with it (``AttentionCore.attend``). For causal attention on the CPU that is the flash kernel
twice, over the fully visible keys and causally over the chunk's own, merged by log-sum-exp,
so no mask is ever built; other devices use a boolean mask on scaled_dot_product_attention
(correct, but the kernels keep it for backward: chunk x prefix bytes per layer). This module
only moves keys and values: the attention math is the core's. Sinks need nothing more: a
sink joins each query's one softmax row, so it counts once per row, not once per chunk.

A sliding window of w keys (``core.mask.window``) needs less: each rank receives only the
keys its windows reach (``titanlite.parallel.context.window``), and the layer gathers only
when its window reaches as far as the gather would.

Gathering, not a ring exchange: with grouped-query attention the keys and values are a small
part of the activations (measured in docs/context_parallel.md), one collective per layer for
both costs a few percent of the step, and it runs the same on gloo and NCCL without the
send/receive pairing and per-hop latency chain of a ring.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from titanlite.models.interfaces import AttentionCore, find
from titanlite.parallel.context.window import WindowExchange, window_reach, windowed_attention

logger = logging.getLogger(__name__)


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


def chunk_positions(local_len: int, cp: int, rank: int) -> torch.Tensor:
    """Positions in the whole sequence (cp x local_len tokens) of cp rank ``rank``'s tokens:
    chunk ``rank`` then chunk ``2 cp - 1 - rank``."""
    if local_len % 2:
        raise ValueError(f"a context-parallel share of {local_len} tokens is not two chunks")
    c = local_len // 2
    first, second = rank, 2 * cp - 1 - rank
    return torch.cat(
        [torch.arange(first * c, (first + 1) * c), torch.arange(second * c, (second + 1) * c)]
    )


class ContextParallel:
    """This rank's part of the cp group: the split of sequences and the attention over it."""

    def __init__(self, group: dist.ProcessGroup, degree: int, rank: int, masked: bool = False):
        self.group, self.degree, self.rank = group, degree, rank
        self.masked = masked  # the boolean-mask kernel on the CPU too (tests compare both)
        self._cache: dict[tuple[str, int, torch.device], torch.Tensor] = {}
        self.windows: set[int] = set()
        """The sliding windows of the cores pointed here (``apply_cp``)."""
        self._exchanges: dict[tuple[int, int, torch.device], WindowExchange | None] = {}

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
        for window in self.windows:
            self.exchange(window, local_len, device)
        return self._cached("positions", local_len, device)

    def exchange(self, window: int, local_len: int, device: torch.device) -> WindowExchange | None:
        """This rank's exchange for a ``window`` over ``local_len`` local tokens (None: the
        layer gathers instead)."""
        key = (window, local_len, device)
        if key not in self._exchanges:
            self._exchanges[key] = WindowExchange.plan(
                local_len=local_len, cp=self.degree, rank=self.rank, window=window, device=device
            )
        return self._exchanges[key]

    def shard(self, batch: torch.Tensor) -> torch.Tensor:
        """[batch, seq] token ids or labels -> this rank's [batch, seq / cp] share."""
        seq = batch.shape[1]
        if seq % (2 * self.degree):
            raise ValueError(
                f"sequence length {seq} does not split into 2 x {self.degree} context chunks"
            )
        return batch[:, self.positions(seq // self.degree, batch.device)]

    def attention(
        self,
        core: AttentionCore,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``core``'s attention of this rank's queries [batch, heads, local, head_dim] over the
        whole sequence's keys and values (gathered from the cp group); block-causal within
        documents when given the whole sequence's ``documents`` [batch, seq]."""
        local = q.shape[2]
        # One collective for keys and values: [2, b, h, s, d] -> seq first -> gather.
        kv = torch.stack([k, v]).permute(3, 0, 1, 2, 4)
        window = core.mask.window
        plan = None if window is None else self.exchange(window, local, kv.device)
        if plan is not None:
            return windowed_attention(
                core, q, kv, plan, group=self.group, documents=documents, masked=self.masked
            )
        kv = _GatherSequence.apply(kv, self.group)
        kv = kv.index_select(0, self._cache["order", local, kv.device])
        keys, values = kv.permute(1, 2, 3, 0, 4)
        c = local // 2
        chunks = [(i * c, c) for i in (self.rank, 2 * self.degree - 1 - self.rank)]
        return core.attend(q, keys, values, chunks, documents=documents, masked=self.masked)


def apply_cp(model: nn.Module, context: ContextParallel, seq_len: int | None = None) -> int:
    """Point every (non-recurrent) attention core of ``model`` at ``context``; returns how
    many cores the model has. Given ``seq_len``, logs what each windowed layer receives."""
    cores = find(model, AttentionCore)
    if not cores:
        raise ValueError("context parallelism found no attention core in the model")
    windows: dict[int, int] = {}
    for core in cores:
        if core.recurrent:
            continue  # linear attention passes a state instead: linear_context.apply_linear_cp
        if not core.mask.causal:
            raise ValueError(f"context parallelism takes causal attention only, not {core.mask}")
        core.sequence_split = context
        if core.mask.window is not None:
            windows[core.mask.window] = windows.get(core.mask.window, 0) + 1
    context.windows.update(windows)
    for window, count in windows.items() if seq_len else ():
        local, cp = seq_len // context.degree, context.degree
        tokens = max(len(r) for r in window_reach(local, cp, window))
        logger.info(
            "context parallelism: %d layer(s) with a window of %d %s",
            count,
            window,
            f"receive only the keys and values their windows reach: at most {tokens} tokens "
            f"per rank and layer instead of {(cp - 1) * local}"
            if tokens < (cp - 1) * local
            else "gather every key and value (their windows reach as far)",
        )
    return len(cores)
