"""AdamW (torch's), with the kernel titanlite measured fastest on each device."""

from __future__ import annotations

from typing import Any

import torch

from titanlite.config.job_config import Optimizer
from titanlite.optim import BuildContext


def build(
    groups: list[dict[str, Any]], settings: Optimizer, context: BuildContext
) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, **adamw_defaults(settings, context.device))


def adamw_defaults(settings: Optimizer, device: torch.device) -> dict[str, Any]:
    """torch.optim.AdamW's keyword arguments from the [optimizer] section."""
    impl = settings.implementation
    if impl == "auto":
        # Fused: one kernel per step over all parameters; the fastest on CPUs too
        # (BENCHMARKS.md has the measured step times of the three).
        impl = "fused" if device.type in ("cuda", "cpu") else "foreach"
    return dict(
        lr=settings.lr,
        betas=(settings.beta1, settings.beta2),
        eps=settings.eps,
        fused=impl == "fused",
        foreach=impl == "foreach",
    )
