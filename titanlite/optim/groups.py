"""Parameter groups from ordered rules, and the optimizer of a model part built from them.

Each parameter goes to the first rule (``optimizer.param_groups``, else the optimizer's
default rules) whose name patterns and shape class it matches. Names are the model's own
(``layers.3.attention.wq.weight``), the same under every layout; so the groups, and the
optimizer's behaviour, are too.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite import optim
from titanlite.config.job_config import LRScheduler, Optimizer, ParamGroupRule
from titanlite.errors import UserError
from titanlite.models.spec import PARAM_ROLES
from titanlite.optim.muon import spectral_lr
from titanlite.optim.schedule import build_lr_scheduler

logger = logging.getLogger(__name__)


@dataclass
class ParamGroup:
    """A resolved group: its rule's settings and the parameters it took."""

    name: str
    optimizer: str
    lr: float
    weight_decay: float
    params: list[nn.Parameter] = field(default_factory=list)
    names: list[str] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        """What run.json and the log say of the group."""
        numel = sum(p.numel() for p in self.params)  # global shapes, even for DTensors
        return {
            "name": self.name,
            "optimizer": self.optimizer,
            "lr": self.lr,
            "weight_decay": self.weight_decay,
            "tensors": len(self.params),
            "parameters": numel,
        }


def rules_of(settings: Optimizer) -> tuple[ParamGroupRule, ...]:
    """optimizer.param_groups, else the default rules of optimizer.name."""
    return tuple(settings.param_groups) or optim.get(settings.name).default_rules


def patterns_of(rule: ParamGroupRule, roles: Mapping[str, Sequence[str]]) -> list[str]:
    """The rule's name patterns, each ``@role`` replaced by the family's patterns for it
    (``ModelSpec.param_roles``: the embeddings, outputs and routers by their names in that
    family); a UserError for a role the family does not name."""
    patterns = []
    for pattern in (p.strip() for p in rule.params.split(",")):
        if pattern.startswith("@"):
            if pattern[1:] not in roles:
                raise UserError(
                    f"optimizer.param_groups: {pattern} is not a parameter role; the roles "
                    f"are {', '.join('@' + r for r in roles)}"
                )
            patterns += roles[pattern[1:]]
        elif pattern:
            patterns.append(pattern)
    return patterns


def _matches(rule: ParamGroupRule, name: str, param: nn.Parameter, patterns: list[str]) -> bool:
    if rule.dims == "matrix" and param.ndim < 2:
        return False
    if rule.dims == "vector" and param.ndim >= 2:
        return False
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def resolve_groups(
    model: nn.Module,
    settings: Optimizer,
    rules: Sequence[ParamGroupRule] | None = None,
    roles: Mapping[str, Sequence[str]] = PARAM_ROLES,
    *,
    lr_scale: Callable[..., float] | None = None,
    muon_adjustment: str = "match_rms_adamw",
) -> list[ParamGroup]:
    """The groups of ``model``'s trainable parameters, in rule order (empty groups left
    out); a UserError naming a parameter that no rule takes. ``roles`` are the model's
    family's parameter roles (its spec's ``param_roles``), which rules name as ``@role``.
    ``lr_scale`` (μP, titanlite.mup.parametrize.lr_scale): a parameter's learning-rate
    factor in AdamW groups, and in Muon groups (whose steps ``muon_adjustment`` scales);
    a group's parameters of another factor go to a group of their own beside it."""
    rules = tuple(rules) if rules is not None else rules_of(settings)
    patterns = [patterns_of(rule, roles) for rule in rules]
    groups = [
        ParamGroup(
            name=rule.name or f"rule {i}",
            optimizer=(rule.optimizer or settings.name).lower(),
            lr=settings.lr * rule.lr_scale,
            weight_decay=settings.weight_decay if rule.weight_decay is None else rule.weight_decay,
        )
        for i, rule in enumerate(rules)
    ]
    scaled: dict[tuple[int, float], ParamGroup] = {}
    muon_step = partial(spectral_lr, adjustment=muon_adjustment)  # μP's Muon factors (lr_scale)
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        for rule, group, pats in zip(rules, groups, patterns, strict=True):
            if _matches(rule, name, param, pats):
                if param.ndim < 2 and optim.get(group.optimizer).matrices_only:
                    raise UserError(
                        f"optimizer.param_groups: rule {group.name!r} gives {name} (shape "
                        f"{tuple(param.shape)}) to {group.optimizer}, which takes matrices "
                        f'only; add dims = "matrix" to the rule or give it to adamw'
                    )
                factor = 1.0
                if lr_scale and group.optimizer == "adamw":
                    factor = lr_scale(name)
                elif lr_scale and group.optimizer == "muon":
                    factor = lr_scale(name, muon_step)
                if factor != 1.0:
                    group = scaled.setdefault(
                        (id(group), factor),
                        dataclasses.replace(
                            group,
                            name=f"{group.name} (mup x{factor:.4g})",
                            lr=group.lr * factor,
                            params=[],
                            names=[],
                        ),
                    )
                group.params.append(param)
                group.names.append(name)
                break
        else:
            raise UserError(
                f"optimizer.param_groups: no rule takes parameter {name} (shape "
                f'{tuple(param.shape)}); end the rules with one whose params is "*"'
            )
    after = {id(g): [s for (i, _), s in scaled.items() if i == id(g)] for g in groups}
    return [x for g in groups for x in (g, *after[id(g)]) if x.params]


def _host(kinds: Sequence[str], main: str) -> str:
    """The registry entry whose optimizer steps every group: the only kind named, or one
    that hosts all the others (Muon hosts AdamW), preferring optimizer.name."""
    if len(kinds) <= 1:
        return kinds[0] if kinds else main
    for kind in sorted(kinds, key=lambda k: k != main):
        if set(kinds) - {kind} <= set(optim.get(kind).hosts):
            return kind
    hosting = [f"{k} (with {', '.join(e.hosts)})" for k, e in optim.REGISTRY.items() if e.hosts]
    raise UserError(
        f"optimizer.param_groups: the rules name {', '.join(kinds)}, which no optimizer "
        f"steps together; a part may mix only {'; '.join(hosting) or 'nothing'}"
    )


def build_optimizer(
    model: nn.Module,
    settings: Optimizer,
    device: torch.device,
    *,
    sections: Mapping[str, Any] | None = None,
    roles: Mapping[str, Sequence[str]] = PARAM_ROLES,
    replica_group: Any = None,
    dims: Any = None,
    n_layers: int = 0,
    lr_scale: Callable[..., float] | None = None,
) -> tuple[torch.optim.Optimizer, list[ParamGroup]]:
    """The optimizer of one model part (a whole model, or a pipeline stage) and its groups.

    ``sections`` are the run's component sections by name (``cfg.components``); the
    building entry takes its own (``OptimizerEntry.section``; absent: its defaults).
    ``roles`` the family's parameter roles (``ModelSpec.param_roles``); ``replica_group``
    the group over which plain parameters are replicated (titanlite's DDP), for optimizers
    that split their work over it (Muon); ``dims`` the run's ParallelDims and ``n_layers``
    the model's blocks (QK-clip); ``lr_scale`` μP's factors (resolve_groups).
    """
    muon = (sections or {}).get("muon")
    adjustment = getattr(muon, "lr_adjustment", "match_rms_adamw")
    groups = resolve_groups(
        model, settings, roles=roles, lr_scale=lr_scale, muon_adjustment=adjustment
    )
    kinds = sorted({g.optimizer for g in groups})
    host = _host(kinds, settings.name.lower())
    torch_groups = []
    for group in groups:
        # Fused and foreach kernels take DTensors or plain tensors, not both in one call:
        # under tensor parallelism without FSDP a layer that runs on sequence shards (a
        # mixture of experts) keeps plain weights, so those get a group of their own.
        plain = [p for p in group.params if not isinstance(p, DTensor)]
        distributed = [p for p in group.params if isinstance(p, DTensor)]
        for params in (plain, distributed):
            if params:
                torch_groups.append(
                    {
                        "params": params,
                        "lr": group.lr,
                        "weight_decay": group.weight_decay,
                        "optimizer": group.optimizer,
                    }
                )
    entry = optim.get(host)
    own = None
    if entry.section is not None:
        own = (sections or {}).get(entry.section.name) or entry.section.settings()
    context = optim.BuildContext(
        device, own, replica_group, model=model, dims=dims, n_layers=n_layers
    )
    return entry.implementation().build(torch_groups, settings, context), groups


def build_optimizers(
    parts: Sequence[nn.Module],
    settings: Optimizer,
    schedule: LRScheduler,
    *,
    total_steps: int,
    device: torch.device,
    sections: Mapping[str, Any] | None = None,
    roles: Mapping[str, Sequence[str]] = PARAM_ROLES,
    replica_group: Any = None,
    dims: Any = None,
    n_layers: int = 0,
    lr_scale: Callable[..., float] | None = None,
) -> tuple[list[torch.optim.Optimizer], list[torch.optim.lr_scheduler.LambdaLR], list[ParamGroup]]:
    """One optimizer and learning-rate schedule per model part (the whole model, or each
    pipeline stage of this rank), and the groups of all of them (logged); ``sections``,
    ``roles``, ``replica_group``, ``dims``, ``n_layers`` and ``lr_scale`` as for
    build_optimizer."""
    optimizers, groups = [], []
    for part in parts:
        optimizer, part_groups = build_optimizer(
            part,
            settings,
            device,
            sections=sections,
            roles=roles,
            replica_group=replica_group,
            dims=dims,
            n_layers=n_layers,
            lr_scale=lr_scale,
        )
        optimizers.append(optimizer)
        groups += part_groups
    log_groups(groups)
    schedulers = [build_lr_scheduler(o, schedule, total_steps) for o in optimizers]
    return optimizers, schedulers, groups


def log_groups(groups: Sequence[ParamGroup]) -> None:
    for group in groups:
        d = group.describe()
        logger.info(
            "optimizer group %s: %s, lr %.3g, weight decay %g, %d tensors (%s parameters)",
            d["name"],
            d["optimizer"],
            d["lr"],
            d["weight_decay"],
            d["tensors"],
            f"{d['parameters']:,}",
        )
