"""Optimizer, learning-rate schedule and gradient clipping."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.config import JobConfig


def build_optimizer(
    model: nn.Module, cfg: JobConfig, device: torch.device
) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (norm weights are not decayed)."""
    o = cfg.optimizer
    # Fused and foreach kernels take DTensors or plain tensors, not both in one call: under
    # tensor parallelism without FSDP a layer that runs on sequence shards (a mixture of
    # experts) keeps plain weights, so those get groups of their own.
    by_kind: dict[tuple[bool, bool], list[nn.Parameter]] = {(True, False): [], (False, False): []}
    for p in model.parameters():
        if p.requires_grad:
            by_kind.setdefault((p.ndim >= 2, isinstance(p, DTensor)), []).append(p)
    groups = [
        {"params": params, "weight_decay": o.weight_decay if decay else 0.0}
        for (decay, _), params in by_kind.items()
        if params
    ]
    impl = o.implementation
    if impl == "auto":
        # Fused: one kernel per step over all parameters; the fastest on CPUs too
        # (BENCHMARKS.md has the measured step times of the three).
        impl = "fused" if device.type in ("cuda", "cpu") else "foreach"
    return torch.optim.AdamW(
        groups,
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        fused=impl == "fused",
        foreach=impl == "foreach",
    )


def lr_factor(step: int, cfg: JobConfig) -> float:
    """Multiplier of optimizer.lr for optimizer step `step` (1-based).

    Linear warmup to 1 over warmup_steps, flat, then a decay over the last decay_ratio of the
    steps (all post-warmup steps when decay_ratio is unset) down to min_lr_factor.
    """
    s, total = cfg.lr_scheduler, cfg.training.steps
    warmup = min(s.warmup_steps, total)
    if step <= warmup:
        return step / (warmup + 1)
    # The first step after warmup runs at the peak; the decay uses the steps after it.
    post_peak = max(total - warmup - 1, 0)
    decay_steps = post_peak if s.decay_ratio is None else round(s.decay_ratio * total)
    decay_steps = min(decay_steps, post_peak)
    decay_start = total - decay_steps
    if step <= decay_start or decay_steps == 0:
        return 1.0
    progress = (step - decay_start) / decay_steps
    if s.decay_type == "linear":
        curve = 1.0 - progress
    elif s.decay_type == "sqrt":
        curve = 1.0 - math.sqrt(progress)
    else:
        curve = 0.5 * (1.0 + math.cos(math.pi * progress))
    return s.min_lr_factor + (1.0 - s.min_lr_factor) * curve


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: JobConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    # LambdaLR counts from 0 at construction; optimizer step s (1-based) runs with factor(s).
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: lr_factor(e + 1, cfg))


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
