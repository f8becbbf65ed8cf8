"""AdamW (torch's), with the kernel titanlite measured fastest on each device."""

from __future__ import annotations

from typing import Any

import torch

from titanlite.config.job_config import Optimizer


def build(
    groups: list[dict[str, Any]], settings: Optimizer, device: torch.device
) -> torch.optim.Optimizer:
    impl = settings.implementation
    if impl == "auto":
        # Fused: one kernel per step over all parameters; the fastest on CPUs too
        # (BENCHMARKS.md has the measured step times of the three).
        impl = "fused" if device.type in ("cuda", "cpu") else "foreach"
    return torch.optim.AdamW(
        groups,
        lr=settings.lr,
        betas=(settings.beta1, settings.beta2),
        eps=settings.eps,
        fused=impl == "fused",
        foreach=impl == "foreach",
    )
