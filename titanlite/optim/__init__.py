"""The optimizer registry, parameter-group rules, learning-rate schedules and clipping.

``optimizer.name`` picks a registry entry (case-insensitive). Which parameters an optimizer
takes, with which learning-rate scale and weight decay, comes from ordered rules
(``optimizer.param_groups``, or the entry's ``default_rules``): a parameter goes to the first
rule its name and shape match. The resolved groups are logged and written to run.json.

This module is plain Python (config validation and the launcher's preflight read the
registry without importing torch); the builders live in the modules the entries name.

Adding an optimizer: a module with ``build(groups, settings, device) ->
torch.optim.Optimizer`` (``groups`` are torch param-group dicts with "params", "lr" and
"weight_decay"; ``settings`` the [optimizer] section) and one entry below.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from titanlite.optim.rules import ParamGroupRule


@dataclass(frozen=True)
class OptimizerEntry:
    """One optimizer of the registry."""

    module: str
    """Provides ``build(groups, settings, device)``."""
    default_rules: tuple[ParamGroupRule, ...]
    """The parameter groups when optimizer.param_groups is empty."""

    def implementation(self) -> ModuleType:
        return importlib.import_module(self.module)


REGISTRY: dict[str, OptimizerEntry] = {
    "adamw": OptimizerEntry(
        module="titanlite.optim.adamw",
        # Weight decay on matrices (projections, embeddings); none on norms and biases.
        default_rules=(
            ParamGroupRule(dims="matrix", name="decay"),
            ParamGroupRule(weight_decay=0.0, name="no_decay"),
        ),
    ),
}


_TORCH_SIDE = {  # name -> the module it lives in (imported on first use: it needs torch)
    "build_optimizer": "groups",
    "build_optimizers": "groups",
    "log_groups": "groups",
    "resolve_groups": "groups",
    "build_lr_scheduler": "schedule",
    "lr_factor": "schedule",
    "clip_grad_norm_": "clip",
}


def __getattr__(name: str) -> Any:
    if name in _TORCH_SIDE:
        return getattr(importlib.import_module(f"titanlite.optim.{_TORCH_SIDE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get(name: str) -> OptimizerEntry:
    """The entry of ``name`` (case-insensitive); KeyError if unknown (config validation names
    the valid ones first)."""
    return REGISTRY[name.lower()]
