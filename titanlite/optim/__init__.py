"""The optimizer registry, parameter-group rules, learning-rate schedules and clipping.

``optimizer.name`` picks a registry entry (case-insensitive). Which parameters an optimizer
takes, with which learning-rate scale and weight decay, comes from ordered rules
(``optimizer.param_groups``, or the entry's ``default_rules``): a parameter goes to the first
rule its name and shape match. A ``@role`` in a rule's patterns stands for the family's own
names of the parameters playing that role (``ModelSpec.param_roles``: embeddings, outputs,
routers). The resolved groups are logged and written to run.json.

This module is plain Python (config validation and the launcher's preflight read the
registry without importing torch); the builders live in the modules the entries name.

Adding an optimizer: a module with ``build(groups, settings, context) ->
torch.optim.Optimizer`` (``groups`` are torch param-group dicts with "params", "lr",
"weight_decay" and "optimizer", the registry name of the group's rule; ``settings`` the
[optimizer] section; ``context`` a BuildContext, whose ``settings`` are the entry's own
section) and one entry below; its own settings, if any, as a ``Section`` in a torch-free
module beside it (``muon_settings``), and its rules against the rest of a run as
``refuses``. A part's groups may name several optimizers only when one entry ``hosts`` the
others (Muon hosts AdamW): its builder gets every group and returns one optimizer, so
checkpoints and schedules see one per part.

May import: ``config``, ``models`` (specs' parameter roles, attention interfaces),
``errors``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from titanlite.config.catalog import Section
from titanlite.config.job_config import ParamGroupRule
from titanlite.config.planned import Rule
from titanlite.optim import muon_settings


@dataclass(frozen=True)
class BuildContext:
    """What a builder may need beyond its groups and the [optimizer] section."""

    device: Any
    """The torch.device of the parameters."""
    settings: Any = None
    """The building entry's own section (``OptimizerEntry.section``: [muon] for Muon), or
    None."""
    replica_group: Any = None
    """The process group over which plain (not DTensor) parameters and their gradients are
    the same on every rank (titanlite's DDP replicas), or None."""
    model: Any = None
    """The model part the groups come from (its attention layers: Muon's per-head blocks,
    QK-clip), or None."""
    dims: Any = None
    """The run's ParallelDims (QK-clip's reductions over ranks), or None for one process."""
    n_layers: int = 0
    """The whole model's blocks (a pipeline stage holds some)."""


@dataclass(frozen=True)
class OptimizerEntry:
    """One optimizer of the registry."""

    module: str
    """Provides ``build(groups, settings, context)``."""
    default_rules: tuple[ParamGroupRule, ...]
    """The parameter groups when optimizer.param_groups is empty."""
    hosts: tuple[str, ...] = ()
    """Other entries whose groups this optimizer also steps (in one torch optimizer)."""
    matrices_only: bool = False
    """Takes only parameters of 2 or more dimensions (a rule giving it a vector is an error)."""
    section: Section | None = None
    """Its own settings ([muon]), if any: its builder gets them as ``context.settings``."""
    refuses: Rule | None = None
    """What it cannot take of the planned run (its model, the other settings), checked
    before launch when optimizer.name or a parameter-group rule names it."""

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
    "muon": OptimizerEntry(
        module="titanlite.optim.muon",
        # Muon orthogonalizes the hidden matrices (attention, MLPs, each expert); what is not
        # a linear map between hidden states (embeddings, the output projection, routers)
        # and every vector go to AdamW at the same lr (match_rms_adamw makes one lr fit both).
        default_rules=(
            ParamGroupRule(
                params="@embeddings, @outputs, @routers", optimizer="adamw", name="adamw"
            ),
            ParamGroupRule(
                dims="vector", optimizer="adamw", weight_decay=0.0, name="adamw_no_decay"
            ),
            ParamGroupRule(dims="matrix", name="muon"),
        ),
        hosts=("adamw",),
        matrices_only=True,
        section=muon_settings.SECTION,
        refuses=muon_settings.refuses,
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
    "step_metrics": "qk_clip",
}


def __getattr__(name: str) -> Any:
    if name in _TORCH_SIDE:
        return getattr(importlib.import_module(f"titanlite.optim.{_TORCH_SIDE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get(name: str) -> OptimizerEntry:
    """The entry of ``name`` (case-insensitive); KeyError if unknown (config validation names
    the valid ones first)."""
    return REGISTRY[name.lower()]
