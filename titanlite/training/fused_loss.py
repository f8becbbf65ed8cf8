"""The output projection fused with the loss (``training.fused_loss``): per-token scores of
hidden states against the vocabulary without ever holding [tokens, vocab] logits.

For hidden states h [tokens, dim] and the output weight W [vocab, dim], the loss needs only
two numbers per token: the log-partition ``lse = logsumexp(h W^T)`` and the target's logit
``h . W[label]``. The cross-entropy is ``lse - target`` and the z-loss ``lse^2``, so every
term the training loss has (``titanlite.training.loss``) is an ordinary function of these.
``head_scores`` computes both, walking the vocabulary in chunks of ``chunk`` rows of W with
an online log-sum-exp (each chunk's log-sum-exp joined to the running one by ``logaddexp``);
only one [tokens, chunk] block of logits exists at a time.

Backward recomputes each chunk's logits from h and W (h and W are kept, no logits): with
the upstream gradients g_lse and g_target per token, the logits' gradient is
``g_lse * softmax + g_target * onehot(label)``, and each chunk adds its share to dh and
writes its rows of dW. That costs one more [tokens, dim] x [dim, vocab] product than the
unfused loss (3 instead of 2 in backward) and saves the logits, their softmax and their
gradient: 3 x tokens x vocab x 4 bytes at the unfused loss's peak (11.7 GiB at 8,192 tokens
and a 128,256 vocabulary).

Vocabulary-sharded weights (tensor parallelism: W a DTensor split along the vocabulary)
are reduced where they lie: each rank runs its own shard's chunks, then one all-reduce of
the shards' log-sum-exps (their maximum) and one of the sums of exponentials relative to it
and of the target logits give every rank the same per-token scores. Each rank's dh is then
a partial sum over its shard (the replicated hidden states take it as such: ``Partial``,
summed by the reduce-scatter back to sequence shards).

The logits are computed in the dtype the unfused projection would use: autocast's when it
is on, else the weight's (bf16 under FSDP's mixed precision); the log-sum-exp and every
reduction in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial

from titanlite.data.batches import IGNORE_INDEX


def head_scores(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse, target logit) per position, float32, shaped like ``labels``: hidden states
    [..., dim] (a replicated DTensor under tensor parallelism) against the output weight
    [vocab, dim] (a DTensor split along the vocabulary under tensor parallelism) and labels
    [...] (IGNORE_INDEX positions get a target logit of 0; their lse is computed, unused)."""
    group, offset = None, 0
    if isinstance(weight, DTensor):  # vocabulary shards: this rank's rows, from `offset`
        mesh = weight.device_mesh
        size = weight.shape[0]
        offset = min(mesh.get_local_rank() * math.ceil(size / mesh.size()), size)
        group = mesh.get_group()
        weight = weight.to_local()
    if isinstance(hidden, DTensor):  # each rank's dh covers its vocabulary shard only
        hidden = hidden.to_local(grad_placements=[Partial()])
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = weight.dtype
    walk = _Walk(chunk=chunk, offset=offset, group=group, dtype=dtype)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    lse, target = _ChunkedHead.apply(hidden, weight, labels.reshape(-1), walk)
    return lse.view(labels.shape), target.view(labels.shape)


def _chunk_targets(
    local: torch.Tensor, start: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which rows' labels (``local``: relative to this rank's shard) fall in the chunk of
    ``width`` rows from ``start``, and each row's column there (clamped into the chunk for
    the others): masks and gathers, no host synchronization on a GPU."""
    column = local - start
    inside = (column >= 0) & (column < width)
    return inside, column.clamp(0, width - 1).unsqueeze(1)


@dataclass(frozen=True)
class _Walk:
    """How ``_ChunkedHead`` walks the vocabulary: rows per chunk, this shard's first row in
    the whole vocabulary, the group of the shards (None: the whole vocabulary is here), and
    the dtype of the logits."""

    chunk: int
    offset: int
    group: dist.ProcessGroup | None
    dtype: torch.dtype


class _ChunkedHead(torch.autograd.Function):
    """(hidden [N, dim], weight [V, dim], labels [N]) -> (lse [N], target logit [N])."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        walk: _Walk,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        chunk, group, dtype = walk.chunk, walk.group, walk.dtype
        n = hidden.shape[0]
        local = torch.where(labels == IGNORE_INDEX, -1, labels - walk.offset)
        lse = hidden.new_full((n,), -math.inf, dtype=torch.float32)
        target = hidden.new_zeros(n, dtype=torch.float32)
        with torch.autocast(hidden.device.type, enabled=False):
            h = hidden.to(dtype)
            for start in range(0, weight.shape[0], chunk):
                block = weight[start : start + chunk]
                logits = (h @ block.to(dtype).t()).float()  # [N, chunk]
                inside, column = _chunk_targets(local, start, block.shape[0])
                target = torch.where(inside, logits.gather(1, column).squeeze(1), target)
                lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=1))
            if group is not None:
                top = lse.clone()
                dist.all_reduce(top, dist.ReduceOp.MAX, group=group)
                sums = torch.stack([torch.exp(lse - top), target])
                dist.all_reduce(sums, dist.ReduceOp.SUM, group=group)
                lse, target = torch.log(sums[0]) + top, sums[1]
        ctx.save_for_backward(hidden, weight, local, lse)
        ctx.walk = walk
        return lse, target

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_lse: torch.Tensor, grad_target: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, local, lse = ctx.saved_tensors
        chunk, dtype = ctx.walk.chunk, ctx.walk.dtype
        grad_lse, grad_target = grad_lse.float(), grad_target.float()
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_weight = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
        with torch.autocast(hidden.device.type, enabled=False):
            h = hidden.to(dtype)
            for start in range(0, weight.shape[0], chunk):
                block = weight[start : start + chunk].to(dtype)
                logits = (h @ block.t()).float()
                # d/dlogits: softmax times the lse's gradient, plus the target's at the target.
                grad = logits.sub_(lse.unsqueeze(1)).exp_().mul_(grad_lse.unsqueeze(1))
                inside, column = _chunk_targets(local, start, block.shape[0])
                grad.scatter_add_(1, column, (grad_target * inside).unsqueeze(1))
                grad = grad.to(dtype)
                if dtype == torch.float32:
                    grad_hidden.addmm_(grad, block)
                else:
                    grad_hidden += (grad @ block).float()
                torch.mm(grad.t(), h, out=grad_weight[start : start + chunk])
        return grad_hidden.to(hidden.dtype), grad_weight, None, None
