"""Parameter-group rules: which parameters an optimizer group takes, and its settings (the
[[optimizer.param_groups]] tables). Plain Python: the config schema uses it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class ParamGroupRule:
    """One [[optimizer.param_groups]] table: which parameters a group takes and how it is
    optimized. A parameter goes to the first rule it matches."""

    params: str = "*"
    """Shell-style patterns on parameter names, comma-separated (e.g. "*norm.weight,*.bias"); names are the model's own (layers.3.attention.wq.weight)."""
    dims: Literal["any", "vector", "matrix"] = "any"
    """Shapes the rule takes: vector (ndim < 2: norms, biases), matrix (ndim >= 2: projections, embeddings, expert stacks) or any."""
    optimizer: str = ""
    """The group's optimizer ("" = optimizer.name)."""
    lr_scale: float = 1.0
    """The group's learning rate is optimizer.lr times this (the schedule applies on top)."""
    weight_decay: float | None = None
    """The group's decoupled weight decay (unset = optimizer.weight_decay)."""
    name: str = ""
    """The group's name in logs and run.json (default: rule N)."""
