"""The output projection fused with the loss (``training.fused_loss``): per-token scores of
hidden states against the vocabulary without ever holding [tokens, vocab] logits.

For hidden states h [tokens, dim] and the output weight W [vocab, dim], the loss needs only
two numbers per token: the log-partition ``lse = logsumexp(h W^T)`` and the target's logit
``h . W[label]``. The cross-entropy is ``lse - target`` and the z-loss ``lse^2``, so every
term the training loss has (``titanlite.training.loss``) is an ordinary function of these,
and its objective is ``sum(ce_weight * (lse - target)) + sum(z_weight * lse^2)`` with a
weight per token (0 for an ignored position; an MTP depth's share; the z-loss's weight).

Two ways to get there, both exact to float32 rounding:

- ``head_objective`` (the default): the gradients are computed in the forward. The tokens
  are walked in blocks of ``tokens`` rows; each block's [block, vocab] logits give its
  log-sum-exp, its softmax and, with the tokens' weights, the logits' gradient
  ``(ce_weight + 2 z_weight lse) softmax - ce_weight onehot(label)``, whose products with W
  and h are the block's rows of dh and its share of dW. Backward only scales the kept dh and
  dW by the objective's incoming gradient (a number). The same three [tokens, dim] x [dim,
  vocab] products as the unfused loss; kept for backward: dh and dW, never the logits; one
  block of them exists at a time (its size does not grow with the batch).
- ``head_scores`` (``training.fused_loss_recompute``): the vocabulary is walked in chunks of
  ``chunk`` rows with an online log-sum-exp (each chunk's log-sum-exp joined to the running
  one by ``logaddexp``) and backward recomputes each chunk's logits from h and W: with the
  upstream gradients g_lse and g_target per token, the logits' gradient is ``g_lse *
  softmax + g_target * onehot(label)``. Nothing of vocabulary size outlives the forward, at
  the price of one more product (4 instead of 3); each chunk holds [tokens, chunk] blocks.

Vocabulary-sharded weights (tensor parallelism: W a DTensor split along the vocabulary)
are reduced where they lie: each rank scores its own shard, then one all-reduce of the
shards' maxima and one of the sums of exponentials relative to it and of the target logits
give every rank the same per-token scores (per block of tokens in ``head_objective``). Each
rank's dh is then a partial sum over its shard (the replicated hidden states take it as
such: ``Partial``, summed by the reduce-scatter back to sequence shards).

The logits are computed in the dtype the unfused projection would use: autocast's when it
is on, else the weight's (bf16 under FSDP's mixed precision); the log-sum-exp, the softmax
and every reduction in float32, as are dh and dW until they are handed to backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

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
    [...] (IGNORE_INDEX positions get a target logit of 0; their lse is computed, unused).
    Differentiable in both; backward recomputes the logits, ``chunk`` vocabulary rows at a
    time."""
    flat, weight, walk = _local(hidden, weight, chunk)
    lse, target = _ChunkedHead.apply(flat, weight, labels.reshape(-1), walk)
    return lse.view(labels.shape), target.view(labels.shape)


def head_objective(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    *,
    tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(objective, lse, target logit): ``sum(ce_weight * (lse - target)) + sum(z_weight *
    lse^2)``, a float32 number differentiable in ``hidden`` and ``weight`` (shaped and
    sharded as for ``head_scores``), with the per-position scores it was made of, float32,
    shaped like ``labels``, detached. ``weights`` is [2, *labels.shape] float32: ce_weight,
    then z_weight (0 at ignored positions). The gradients are computed here, ``tokens`` rows
    at a time (0: ``auto_tokens``), when autograd will want them."""
    flat, local_weight, walk = _local(hidden, weight, tokens)
    if walk.chunk <= 0:
        walk = replace(walk, chunk=auto_tokens(local_weight.shape[0]))
    wanted = torch.is_grad_enabled() and (flat.requires_grad or local_weight.requires_grad)
    targets = _Targets(labels.reshape(-1), weights.reshape(2, -1))
    if wanted:
        objective, lse, target = _InForwardHead.apply(flat, local_weight, targets, walk)
    else:  # evaluation: the scores alone
        scores = _in_forward(flat, local_weight, targets, walk=walk, grads=(False, False))
        objective, lse, target = scores[:3]
    return objective, lse.view(labels.shape), target.view(labels.shape)


class _Targets(NamedTuple):
    """Labels [N] and their weights in the objective, [2, N]: cross-entropy, z-loss."""

    labels: torch.Tensor
    weights: torch.Tensor


# A block of float32 logits of about 256 MiB: big enough that each block's products run at
# full speed, small enough next to the activations of any batch that holds that many tokens.
BLOCK_ELEMENTS = 1 << 26


def auto_tokens(vocab: int) -> int:
    """Tokens per block of ``head_objective`` for a vocabulary (shard) of ``vocab`` rows."""
    return max(1, BLOCK_ELEMENTS // vocab)


def _local(
    hidden: torch.Tensor, weight: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, torch.Tensor, _Walk]:
    """Hidden states as [N, dim] and the weight as this rank holds them (its vocabulary
    shard under tensor parallelism, from ``offset``), and the walk over them."""
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
    return hidden.reshape(-1, hidden.shape[-1]), weight, walk


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


def _in_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: _Targets,
    *,
    walk: _Walk,
    grads: tuple[bool, bool],
) -> tuple[torch.Tensor, ...]:
    """(objective, lse [N], target [N], dh [N, dim] float32, dW [V, dim] float32) from
    hidden [N, dim], this rank's weight rows [V, dim] and the targets, ``walk.chunk`` tokens
    at a time (dh, dW: None where ``grads``, for hidden and weight, says not wanted)."""
    tokens, group, dtype = walk.chunk, walk.group, walk.dtype
    labels, (ce_weight, z_weight) = targets.labels, targets.weights
    n, rows = hidden.shape[0], weight.shape[0]
    local = torch.where(labels == IGNORE_INDEX, -1, labels - walk.offset)
    lse = hidden.new_empty(n, dtype=torch.float32)
    target = hidden.new_empty(n, dtype=torch.float32)
    grad_hidden = grad_weight = None
    if grads[0]:
        grad_hidden = hidden.new_empty(hidden.shape, dtype=torch.float32)
    if grads[1]:
        grad_weight = weight.new_zeros(weight.shape, dtype=torch.float32)
    with torch.autocast(hidden.device.type, enabled=False):
        w = weight.to(dtype)
        for start in range(0, n, tokens):
            end = min(start + tokens, n)
            h = hidden[start:end].to(dtype)
            block = (h @ w.t()).float()  # [tokens, V]: logits, then exponentials, then grad
            inside, column = _chunk_targets(local[start:end], 0, rows)
            picked = torch.where(inside, block.gather(1, column).squeeze(1), 0.0)
            top = block.amax(dim=1)
            if group is not None:
                dist.all_reduce(top, dist.ReduceOp.MAX, group=group)
            block.sub_(top.unsqueeze(1)).exp_()
            sums = torch.stack([block.sum(dim=1), picked])
            if group is not None:
                dist.all_reduce(sums, dist.ReduceOp.SUM, group=group)
            total, picked = sums[0], sums[1]
            lse[start:end] = torch.log(total) + top
            target[start:end] = picked
            if not any(grads):
                continue
            # d objective / d logits: the softmax times (ce + 2 z lse), less ce at the target.
            ce = ce_weight[start:end]
            scale = (ce + 2 * z_weight[start:end] * lse[start:end]) / total
            block.mul_(scale.unsqueeze(1))
            block.scatter_add_(1, column, (-ce * inside).unsqueeze(1))
            grad = block.to(dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = (grad @ w).float()
            if grad_weight is None:
                pass
            elif dtype == torch.float32:
                grad_weight.addmm_(grad.t(), h)
            else:
                grad_weight += (grad.t() @ h).float()
    objective = (ce_weight * (lse - target)).sum() + (z_weight * lse.square()).sum()
    return objective, lse, target, grad_hidden, grad_weight


class _InForwardHead(torch.autograd.Function):
    """(hidden [N, dim], weight [V, dim], targets) -> (objective, lse [N], target logit
    [N]); the gradients computed in the forward, scaled in backward."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: _Targets,
        walk: _Walk,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        wanted = (ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        objective, lse, target, grad_hidden, grad_weight = _in_forward(
            hidden, weight, targets, walk=walk, grads=wanted
        )
        ctx.grads = (
            None if grad_hidden is None else grad_hidden.to(hidden.dtype),
            None if grad_weight is None else grad_weight.to(weight.dtype),
        )
        del grad_hidden, grad_weight
        ctx.mark_non_differentiable(lse, target)
        return objective, lse, target

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_objective: torch.Tensor, *_: object
    ) -> tuple[torch.Tensor | None, ...]:
        # Not consumed: a zero-bubble pipeline schedule runs backward twice (the input's
        # gradient, then the weight's).
        scale = grad_objective.to(torch.float32)
        scaled = [None if g is None else g * scale for g in ctx.grads]
        return *scaled, None, None
