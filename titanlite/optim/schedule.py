"""The learning-rate schedule: warmup, a flat peak, and a decay (WSD and its variants)."""

from __future__ import annotations

import math

import torch

from titanlite.config.job_config import LRScheduler


def lr_factor(step: int, s: LRScheduler, total: int) -> float:
    """Multiplier of each group's learning rate for optimizer step `step` (1-based) of
    ``total``.

    Linear warmup to 1 over warmup_steps, flat, then a decay over the last decay_ratio of the
    steps (all post-warmup steps when decay_ratio is unset) down to min_lr_factor.
    """
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
    optimizer: torch.optim.Optimizer, schedule: LRScheduler, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    # LambdaLR counts from 0 at construction; optimizer step s (1-based) runs with factor(s).
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda e: lr_factor(e + 1, schedule, total_steps)
    )
