"""[mup]: the maximal-update parametrization. Plain Python (config checks read it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from titanlite.config.catalog import Section


@dataclass
class Mup:
    """[mup]: train with the maximal-update parametrization, so that the learning rate and
    initialization tuned at model.dim = base_dim hold at any width (docs/scaling.md)."""

    enable: bool = False
    """Apply μP: hidden matrices initialized with std x (base_dim / dim)^0.5 and (AdamW)
    learning rate x base_dim / dim, the logits x base_dim / dim (output multiplier); at
    dim = base_dim the model and optimizer are exactly the standard ones."""
    base_dim: int = 256
    """The width the hyperparameters were tuned at (model.dim of the proxy)."""
    base_head_dim: int = 0
    """The attention head size of the proxy: the attention scale becomes
    sqrt(base_head_dim) / head_dim (1/d, equal to 1/sqrt(d) at the base). 0 = the model's own
    head size (the scale unchanged: widths grown by adding heads)."""


def check(cfg: Any, problems: Any) -> None:
    m = cfg.mup
    if not m.enable:
        return
    if m.base_dim < 1:
        problems.add(f"mup.base_dim: must be at least 1, got {m.base_dim!r}")
    if m.base_head_dim < 0:
        problems.add(f"mup.base_head_dim: must be 0 or more, got {m.base_head_dim!r}")


SECTION = Section("mup", Mup, after="muon", check=check)
