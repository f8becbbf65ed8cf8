"""Expert parallelism: each mixture-of-experts layer's experts split over the ep ranks.

Runs before FSDP. Every expert weight ([experts, in, out]) becomes a DTensor sharded by expert
(Shard(0)) over the ``ep`` mesh dimension, and the layer's ``dispatch`` hook
(``titanlite.models.interfaces.RoutedExperts``) is set to ``expert_parallel`` over the ep
group: token rows travel to the ranks holding their experts and back. FSDP then shards the
experts further over the rest of dp_shard (``apply_fsdp``'s expert units), so checkpoints hold
expert weights at their global shape and resume under any expert-parallel degree.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from titanlite.models.interfaces import RoutedExperts, find
from titanlite.parallel.ddp.collectives import local_tensor

logger = logging.getLogger(__name__)


class AllToAll(torch.autograd.Function):
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
    experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    group: Any,
    degree: int,
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
    rows = AllToAll.apply(x, recv, send, group)
    # Row j of the expert-major order is row index[j] of the source-major order.
    flat = by_source.reshape(-1)
    source_start = (torch.cumsum(flat, 0) - flat).view(degree, local).t().reshape(-1)
    sizes = by_source.t().reshape(-1)
    target_start = torch.cumsum(sizes, 0) - sizes
    index = torch.repeat_interleave(source_start - target_start, sizes)
    index = index + torch.arange(index.numel(), device=x.device)
    out = experts(rows[index], by_source.sum(0))
    back = out.new_zeros(out.shape).index_copy(0, index, out)
    return AllToAll.apply(back, send, recv, group)


@dataclass(frozen=True)
class ExpertGrads:
    """What expert parallelism leaves to do after each step's backward. FSDP reduces the
    expert weights' gradients over the ranks that shard each ep rank's experts and divides by
    that mesh's size, but those gradients already sum the tokens of the whole ep group (the
    all-to-all's backward brings them), so they come out ep times too large: ``finish``
    multiplies them by ``scale`` (1 / ep; gloo has no pre-multiplied reduce-scatter for a
    custom divide factor). ``units`` are the expert modules, one per MoE layer (FSDP also makes
    each a unit of its own); their parameters are read when finishing, since FSDP replaces a
    module's parameters after ``apply_ep`` returned."""

    units: tuple[nn.Module, ...]
    scale: float

    @staticmethod
    def join(pieces: Sequence[ExpertGrads]) -> ExpertGrads | None:
        """One fix-up for the experts of every pipeline stage of this rank (None: no pieces)."""
        if not pieces:
            return None
        return ExpertGrads(tuple(u for piece in pieces for u in piece.units), pieces[0].scale)

    def finish(self) -> None:
        grads = [p.grad for m in self.units for p in m.parameters() if p.grad is not None]
        if grads and self.scale != 1.0:
            torch._foreach_mul_([local_tensor(g) for g in grads], self.scale)


def apply_ep(model: nn.Module, mesh: DeviceMesh) -> ExpertGrads:
    """Split the experts of every MoE layer of ``model`` over ``mesh`` (the ep dimension);
    returns those expert modules with the scale their gradients need (``ExpertGrads``)."""
    degree = mesh.size()
    layers = find(model, RoutedExperts)
    for experts in layers:
        if experts.num_experts % degree:
            raise ValueError(
                f"parallelism.expert_parallel_degree {degree} does not divide the "
                f"{experts.num_experts} experts"
            )
        for name, param in list(experts.named_parameters(recurse=False)):
            shard = distribute_tensor(param.data, mesh, [Shard(0)])
            experts.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))
        experts.dispatch = functools.partial(expert_parallel, group=mesh.get_group(), degree=degree)
    logger.info(
        "expert parallelism: the experts of %d layers split over ep=%d ranks (all-to-all "
        "dispatch and combine)",
        len(layers),
        degree,
    )
    return ExpertGrads(tuple(layers), 1.0 / degree)
