"""Clipping to the true global gradient norm under every layout."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(
    params: list[nn.Parameter],
    max_norm: float,
    stage_group: dist.ProcessGroup | None = None,
    skip: set[int] | None = None,
) -> torch.Tensor:
    """Clip to the true global norm and return it (a plain tensor, the same on every rank).

    Parameters may be DTensors sharded over different meshes (FSDP, TP, both). Gradients are
    grouped by (mesh, placements); each group's norm is one DTensor reduction over its mesh,
    so the result is the norm of the whole unsharded gradient with one collective per group.
    Under pipeline parallelism ``stage_group`` (pp) adds up the squares of every stage;
    ``skip`` (parameter ids) are clipped but not counted (a tied weight's second copy).
    """
    grads = [p.grad for p in params if p.grad is not None]
    counted = [p.grad for p in params if p.grad is not None and id(p) not in (skip or ())]
    if not grads and stage_group is None:
        return torch.tensor(0.0)
    groups: dict[object, list[torch.Tensor]] = {}
    for g in counted:
        key = (id(g.device_mesh), g.placements) if isinstance(g, DTensor) else g.device
        groups.setdefault(key, []).append(g)
    squares = []
    for members in groups.values():
        # Accumulate in float64: float32 sums over millions of elements drift by ~1e-4.
        norms = torch._foreach_norm(members, 2.0, dtype=torch.float64)
        group_norm = torch.linalg.vector_norm(torch.stack(norms))
        if isinstance(group_norm, DTensor):
            group_norm = group_norm.full_tensor()
        squares.append(group_norm.pow(2))
    total_sq = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64)
    if stage_group is not None:
        dist.all_reduce(total_sq, dist.ReduceOp.SUM, group=stage_group)
    total = total_sq.sqrt().float()
    if max_norm > 0:
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        if local:
            torch._foreach_mul_(local, scale.to(local[0].device))
    return total
