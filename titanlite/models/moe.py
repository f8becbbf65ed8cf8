"""A mixture-of-experts feed-forward layer, reusable by any decoder family.

A linear router scores every expert for every token (softmax over the experts, or a sigmoid
each), the token goes to its ``top_k`` experts, and their outputs are summed with the scores
as weights (renormalized to sum to one with ``norm_topk``). Shared experts, if any, see every
token. The experts' SwiGLUs run as grouped matrix multiplies over the tokens sorted by expert
(``torch.nn.functional.grouped_mm`` where it runs, a padded batched matmul elsewhere), never
as a Python loop over experts.

Balancing, both optional:
- a sequence-wise auxiliary loss (DeepSeek-V3's): per sequence, ``coef * sum_e f_e * P_e`` with
  ``f_e`` the share of the sequence's token slots routed to expert e (times the number of
  experts over top_k, so an even load gives 1 per expert) and ``P_e`` the mean normalized
  score of e. Being per sequence it does not depend on how the batch is split over ranks;
- the auxiliary-loss-free bias update (DeepSeek-V3): a per-expert bias added to the scores
  for choosing experts only (not for weighting them), moved after every step by
  ``rate * sign(mean load - load)`` from the global token counts.

Dropless by default; a capacity factor caps each expert at ``ceil(factor * slots / experts)``
token slots per micro-batch (the later ones in token order are dropped and counted).

The auxiliary loss reaches the router through the layer's own backward: the output passes
through an identity whose backward also gives the loss term its gradient (``aux_weight``),
so no second loss root is needed and a pipeline schedule's backward carries it too. Each
training forward adds its tokens per expert, dropped slots and auxiliary loss to the layer's
running ``totals`` (not when it is recomputed in backward under activation checkpointing);
``MoETracker`` takes them after the step for the bias updates and the metrics. ``last`` keeps
the latest forward's record.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

_FAST: dict[tuple[str, torch.dtype], bool] = {}
"""(device type, dtype) -> whether torch's grouped_mm ran there (tried once)."""


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` [N, in] sorted by group, group g (``counts[g]`` rows) times ``w[g]``
    [in, out]: [N, out]. No host synchronization on the fast path."""
    if x.is_meta:  # a shape probe (the dry run): one matmul keeps what a grouped one keeps
        return x @ w[0]
    key = (x.device.type, x.dtype)
    aligned = all((t.shape[-1] * t.element_size()) % 16 == 0 for t in (x, w))
    if aligned and _FAST.get(key, True) and hasattr(F, "grouped_mm"):
        try:
            out = F.grouped_mm(x, w, offs=torch.cumsum(counts, 0, dtype=torch.int32))
            _FAST[key] = True
            return out
        except (RuntimeError, NotImplementedError):  # not for this device or dtype
            _FAST[key] = False
    return _padded_bmm(x, w, counts)


def _padded_bmm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The same as one batched matmul over groups padded to the largest (one host read)."""
    groups = w.shape[0]
    starts = torch.cumsum(counts, 0) - counts
    group = torch.repeat_interleave(torch.arange(groups, device=x.device), counts)
    row = torch.arange(x.shape[0], device=x.device) - starts[group]
    padded = x.new_zeros(groups, int(counts.max()) if x.shape[0] else 0, x.shape[1])
    padded[group, row] = x
    return torch.bmm(padded, w)[group, row]


class _AllToAll(torch.autograd.Function):
    """Rows to other ranks (``send[r]`` of them to rank r, ``recv[r]`` from it); its backward
    sends the gradients the opposite way. torch.distributed.nn.functional's version of this is
    deprecated as of torch 2.13."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, recv: list[int], send: list[int], group: Any):
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        back = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


def expert_parallel(
    x: torch.Tensor,
    counts: torch.Tensor,
    group: Any,
    degree: int,
    experts: Any,
) -> torch.Tensor:
    """Expert parallelism's dispatch and combine around ``experts(rows, local_counts)``.

    ``x`` holds this rank's token slots sorted by global expert (``counts`` [E] rows each);
    expert e lives on rank ``e // (E / degree)`` of ``group``. The rows travel to their
    experts' ranks (one all-to-all, with the counts exchanged first), are regrouped there from
    (source rank, expert) to (expert, source rank) order, go through the local experts, and
    come back in their original order (a second all-to-all). Both all-to-alls carry gradients.
    The split sizes need one host read of the counts per call.
    """
    local = counts.numel() // degree
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    by_source = received.view(degree, local)  # [source rank, local expert]
    send = counts.view(degree, local).sum(1).tolist()
    recv = by_source.sum(1).tolist()
    rows = _AllToAll.apply(x, recv, send, group)
    # Row j of the expert-major order is row index[j] of the source-major order.
    flat = by_source.reshape(-1)
    source_start = (torch.cumsum(flat, 0) - flat).view(degree, local).t().reshape(-1)
    sizes = by_source.t().reshape(-1)
    target_start = torch.cumsum(sizes, 0) - sizes
    index = torch.repeat_interleave(source_start - target_start, sizes)
    index = index + torch.arange(index.numel(), device=x.device)
    out = experts(rows[index], by_source.sum(0))
    back = out.new_zeros(out.shape).index_copy(0, index, out)
    return _AllToAll.apply(back, send, recv, group)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLUs as three [experts, in, out] weights (w1 gate, w3 up, w2 down)."""

    def __init__(self, num_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.ep: tuple[Any, int] | None = None
        """(group, degree) under expert parallelism (titanlite.parallel.expert): the weights
        are then DTensors split by expert over the group, and rows are dispatched to them."""

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        weights = [
            w.to_local() if hasattr(w, "to_local") else w for w in (self.w1, self.w3, self.w2)
        ]

        def swiglu(rows: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
            w1, w3, w2 = weights
            hidden = F.silu(grouped_mm(rows, w1, sizes)) * grouped_mm(rows, w3, sizes)
            return grouped_mm(hidden, w2, sizes)

        if self.ep is None:
            return swiglu(x, counts)
        return expert_parallel(x, counts, *self.ep, swiglu)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


@dataclass
class Record:
    """What one forward of a layer saw (tensors on the device, detached except ``aux``)."""

    aux: torch.Tensor  # summed over the micro-batch's sequences, with grad
    counts: torch.Tensor  # [experts] token slots routed to each (before any drop)
    dropped: torch.Tensor  # slots over capacity


class MoE(nn.Module):
    """Tokens [batch, seq, dim] -> [batch, seq, dim] through the top-k of ``num_experts``."""

    def __init__(self, dim: int, args: Any):
        super().__init__()
        self.num_experts, self.top_k = args.num_experts, args.top_k
        self.score_func, self.norm_topk = args.score_func, args.norm_topk
        self.aux_loss_coef, self.capacity_factor = args.aux_loss_coef, args.capacity_factor
        self.bias_update_rate = args.bias_update_rate
        self.router = nn.Linear(dim, args.num_experts, bias=False)
        self.experts = GroupedExperts(args.num_experts, dim, args.moe_hidden_dim)
        self.shared = (
            SwiGLU(dim, args.shared_experts * args.moe_hidden_dim) if args.shared_experts else None
        )
        # Routing bias of the auxiliary-loss-free balancing: changed by MoETracker, not by
        # the optimizer; persistent, so a resume continues with it.
        self.register_buffer("expert_bias", torch.zeros(args.num_experts, dtype=torch.float32))
        self.last: Record | None = None
        self.totals: torch.Tensor | None = None
        """[experts + 2]: tokens per expert, dropped slots and auxiliary loss summed over the
        training forwards since ``MoETracker`` last took them."""
        self.aux_weight = 0.0
        """The gradient of the training loss with respect to this layer's auxiliary loss sum
        (set by ``MoETracker``: the loss is a mean over the global batch's sequences)."""
        self.layer_id = 0
        """The block this layer belongs to (set by the model), to name its metrics."""
        self.sequence_shards: tuple[Any, int] | None = None
        """(group, degree) when tensor parallelism hands this layer one shard of each
        sequence (every rank routes its own tokens): the balancing loss then takes its
        per-sequence expert shares over the whole sequence, from all the group's shards."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, dim = x.shape
        flat = x.reshape(-1, dim)
        logits = self.router(flat).float()
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        choose = scores + self.expert_bias if self.bias_update_rate > 0 else scores
        chosen = torch.topk(choose, self.top_k, dim=-1).indices  # [tokens, k]
        weights = scores.gather(-1, chosen)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)

        slots = chosen.reshape(-1)  # token t's j-th choice is slot t * k + j
        counts = (  # on the meta device (a shape probe) no values: zeros of the shape
            slots.new_zeros(self.num_experts)
            if slots.is_meta
            else torch.bincount(slots, minlength=self.num_experts)
        )
        order = torch.argsort(slots, stable=True)  # slots grouped by expert, in token order
        kept, dropped = order, torch.zeros((), dtype=torch.int64, device=x.device)
        routed = counts
        if self.capacity_factor > 0:
            capacity = math.ceil(self.capacity_factor * slots.numel() / self.num_experts)
            starts = torch.cumsum(counts, 0) - counts
            rank = torch.arange(slots.numel(), device=x.device) - starts[slots[order]]
            keep = rank < capacity
            kept, routed = order[keep], counts.clamp(max=capacity)
            dropped = (~keep).sum()
        outputs = self.experts(flat[kept // self.top_k], routed)
        # Each slot's weighted output in its own row, then the k rows of a token summed:
        # deterministic, unlike an atomic index_add.
        combined = torch.zeros(slots.numel(), dim, dtype=outputs.dtype, device=x.device)
        combined[kept] = outputs * weights.reshape(-1)[kept, None].to(outputs.dtype)
        out = combined.view(-1, self.top_k, dim).sum(1)
        if self.shared is not None:
            out = out + self.shared(flat)

        aux = self._aux(scores, chosen, bsz, seq)
        self.last = Record(aux, counts.detach(), dropped)
        if self.training and torch.is_grad_enabled():
            if self.aux_loss_coef > 0 and self.aux_weight:
                out = _AuxGradient.apply(out, aux, self.aux_weight)
            if torch._C._current_graph_task_id() == -1:  # not a recomputation in backward
                row = torch.cat([counts.float(), dropped.float().view(1), aux.detach().view(1)])
                self.totals = row if self.totals is None else self.totals + row
        return out.view(bsz, seq, dim).to(x.dtype)

    def _aux(self, scores: torch.Tensor, chosen: torch.Tensor, bsz: int, seq: int) -> torch.Tensor:
        """The sequence-wise balancing loss summed over this micro-batch's sequences."""
        if self.aux_loss_coef <= 0:
            return scores.new_zeros(())
        e, k = self.num_experts, self.top_k
        hits = torch.zeros(bsz, seq * k, e, device=scores.device)
        hits.scatter_(-1, chosen.view(bsz, seq * k, 1), 1.0)
        hits = hits.sum(1)
        if self.sequence_shards is not None:
            # f needs the whole sequence's counts; P's sum over the shards is the sum of
            # every shard's loss term, so each rank's gradient covers its own tokens.
            group, degree = self.sequence_shards
            dist.all_reduce(hits, group=group)
            seq *= degree
        share = hits * (e / (k * seq))  # f: [batch, experts]
        normalized = scores / scores.sum(-1, keepdim=True)
        mean_score = normalized.view(bsz, -1, e).sum(1) / seq  # P: [batch, experts]
        return self.aux_loss_coef * (share * mean_score).sum()


class _AuxGradient(torch.autograd.Function):
    """The identity on the layer's output, whose backward also hands the auxiliary loss the
    gradient ``weight``: as if ``weight * aux`` were added to the loss."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight = weight
        ctx.aux_like = (aux.shape, aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        shape, dtype, device = ctx.aux_like
        return grad, torch.full(shape, ctx.weight, dtype=dtype, device=device), None


class MoETracker:
    """The trainer's side of the MoE layers of a model: their auxiliary loss per micro-batch,
    the bias updates after each step and the per-step metrics.

    Counts are summed over the step's micro-batches on the device; after the step they are
    all-reduced over ``group`` (the ranks that route different tokens: the batch's split and,
    under tensor parallelism, the sequence's) only when they are needed: every step with the
    bias update on, otherwise at log steps.
    """

    def __init__(
        self,
        layers: list[MoE],
        group: Any,
        global_batch: int,
        grad_weight: float = 1.0,
        stage_group: Any = None,
        n_layers: int = 0,
    ):
        """``grad_weight`` multiplies the auxiliary loss's gradient (the data-parallel
        engines average gradients over that many ranks); under pipeline parallelism
        ``stage_group`` (pp) gathers the other stages' layers (of ``n_layers``) at log steps."""
        self.layers = layers
        self.group = group
        self.global_batch = global_batch
        self.stage_group = stage_group
        self.n_layers = n_layers
        self.balancing = any(m.bias_update_rate > 0 for m in layers)
        for m in layers:  # the auxiliary loss is a mean over the global batch's sequences
            m.aux_weight = grad_weight / global_batch

    @staticmethod
    def find(parts: list[nn.Module]) -> list[MoE]:
        return [m for part in parts for m in part.modules() if isinstance(m, MoE)]

    def discard(self) -> None:
        """Forget what the layers recorded so far (forwards that were not training steps)."""
        self._take()

    def _take(self) -> torch.Tensor | None:
        """[layers, experts + 2] of the step's training forwards; the layers start afresh."""
        rows = [m.totals for m in self.layers]
        for m in self.layers:
            m.totals = None
        if any(row is None for row in rows):
            return None
        return torch.stack(rows)

    def after_step(self, log: bool) -> dict[str, float] | None:
        """Bias updates (every step, when on) and, at a log step, the metrics."""
        step = self._take()
        if step is None or not (self.balancing or log):
            return None
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(step, group=self.group)
        counts = step[:, :-2]
        if self.balancing:
            with torch.no_grad():
                for layer, load in zip(self.layers, counts, strict=True):
                    if layer.bias_update_rate > 0:
                        push = torch.sign(load.mean() - load) * layer.bias_update_rate
                        layer.expert_bias.add_(push)
        if not log:
            return None
        if self.stage_group is not None:  # every stage's layers, in block order
            whole = step.new_zeros(self.n_layers, step.shape[1])
            whole[[m.layer_id for m in self.layers]] = step
            dist.all_reduce(whole, group=self.stage_group)
            step, counts = whole, whole[:, :-2]
        balance = (counts.max(1).values / counts.mean(1).clamp(min=1e-9)).tolist()
        slots = counts.sum(1)
        dropped = (step[:, -2].sum() / slots.sum().clamp(min=1)).item()
        metrics = {f"moe_load_max_mean_{i}": v for i, v in enumerate(balance)}
        metrics.update(
            moe_load_max_mean=max(balance),
            moe_dropped_fraction=dropped,
            moe_aux_loss=(step[:, -1].sum() / self.global_batch).item(),
        )
        return metrics
