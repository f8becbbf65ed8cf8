"""μP for any family: which dimensions of each parameter grow with width, and the table.

Width grows, for every family, by scaling ``dim`` and the sizes that go with it (attention and
linear-attention heads, feed-forward and expert hidden sizes, MLA's low ranks) while head
sizes stay. The family's model is built twice on the meta device, at its shape and at twice
those sizes: a dimension that doubled is a *width* dimension. By how many of its dimensions
grow, and whether its input (last) dimension is one of them, each parameter plays one role:

| role | which | init std | AdamW lr |
|---|---|---|---|
| hidden | two or more width dims (projections, expert stacks) | x m^-1/2 | x 1/m |
| output-like | one width dim, the input (routers, MLA's rope key) | x 1/m | x 1/m |
| readout | the output projection (untied; tied: the embeddings') | x m | unchanged |
| input-like, vectors | embeddings, norms, biases, the rest | unchanged | unchanged |

with the width multiplier m = dim / base_dim. The readout's logits are multiplied by 1/m
(the output multiplier) and its init is m times larger: the logits start as large as at the
base width and each update moves them as much (Adam's step is O(1) per entry, summed over
dim entries, divided by m); tied embeddings keep their init (the multiplier alone). With
``base_head_dim`` set the attention scores are sqrt(base_head_dim) / head_dim instead of
1/sqrt(head_dim). At dim = base_dim every factor is 1: the standard model. Shapes are global,
so the factors are the same under every layout.

Muon's matrices (hidden and output-like) follow μP's spectral condition instead: a step's
spectral norm should stay proportional to sqrt(fan_out / fan_in) as the width grows. Muon's
orthogonalized step has the spectral norm of its learning rate times its shape's scale
(``muon.lr_adjustment``), so the factor is what keeps that ratio as at the base shape
(``lr_scale``'s ``step``): x m^-1/2 for a hidden matrix under match_rms_adamw (its step grows
with sqrt(fan)), x 1 under original or none; the groups Muon hands to AdamW follow the table.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.errors import UserError
from titanlite.models.interfaces import AttentionCore

WIDTH_ARGS = (
    "dim",
    "n_heads",
    "n_kv_heads",
    "hidden_dim",
    "moe_hidden_dim",
    "dense_hidden_dim",
    "q_lora_rank",
    "kv_lora_rank",
    "linear_k_heads",
    "linear_v_heads",
)
"""The model args that grow with width (where a family has them and they are set)."""
WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def clean(name: str) -> str:
    """A parameter's name without the wrappers' pieces (compile, checkpointing)."""
    for piece in WRAPPERS:
        name = name.replace(piece, "")
    return name


def wider(args: Any, factor: int = 2) -> Any:
    """``args`` with every width size multiplied by ``factor``."""
    grown = {
        k: getattr(args, k) * factor
        for k in WIDTH_ARGS
        if isinstance(getattr(args, k, None), int) and getattr(args, k)
    }
    return dataclasses.replace(args, **grown)


@dataclass(frozen=True)
class Plan:
    """What μP does to one model: each parameter's role and factors, and the multipliers."""

    width_mult: float
    roles: dict[str, str]
    init_scale: dict[str, float] = field(default_factory=dict)
    lr_scale: dict[str, float] = field(default_factory=dict)
    output_multiplier: float = 1.0
    attention_scale: float = 1.0
    """The factor on the queries: the scores become sqrt(base_head_dim) / head_dim."""
    shapes: dict[str, tuple[tuple[int, ...], tuple[float, ...]]] = field(default_factory=dict)
    """A hidden or output-like parameter's shape, and at the base width (width dims / m)."""


def plan(spec: Any, args: Any, base_dim: int, base_head_dim: int = 0) -> Plan:
    """The μP plan of the family ``spec`` at ``args``, tuned at width ``base_dim``."""
    with torch.device("meta"):
        here = dict(spec.build(args).named_parameters())
        try:
            there = dict(spec.build(wider(args)).named_parameters())
        except (ValueError, AssertionError) as e:
            raise UserError(f"mup: cannot grow this {spec.name} model's width ({e})") from None
    m = args.dim / base_dim
    patterns = {role: spec.param_roles.get(role, ()) for role in ("embeddings", "outputs")}

    def has_role(name: str, role: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in patterns[role])

    roles, init, lr, base = {}, {}, {}, {}
    for name, p in here.items():
        q = there.get(name)
        grows = [a != b for a, b in zip(p.shape, q.shape, strict=True)] if q is not None else []
        if has_role(name, "outputs"):
            role = "readout"
        elif has_role(name, "embeddings") or p.ndim < 2:
            role = "input-like"
        elif sum(grows) >= 2:
            role = "hidden"
        elif sum(grows) == 1 and grows[-1]:
            role = "output-like"
        else:
            role = "input-like"
        roles[name] = role
        if role in ("hidden", "output-like"):
            at_base = tuple(n / m if g else n for n, g in zip(p.shape, grows, strict=True))
            base[name] = (tuple(p.shape), at_base)
        if role == "hidden":
            init[name], lr[name] = m**-0.5, 1 / m
        elif role == "output-like":
            init[name], lr[name] = 1 / m, 1 / m
        elif role == "readout" and not getattr(args, "tie_embeddings", False):
            init[name] = m  # with the multiplier: the logits at init as at the base
    head_dim = _head_dim(args)
    attention = math.sqrt(base_head_dim / head_dim) if base_head_dim and head_dim else 1.0
    return Plan(m, roles, init, lr, output_multiplier=1 / m, attention_scale=attention, shapes=base)


def _head_dim(args: Any) -> int:
    for key in ("head_dim", "qk_nope_head_dim"):
        value = getattr(args, key, None)
        if isinstance(value, int) and value:
            return value + (getattr(args, "qk_rope_head_dim", 0) if key != "head_dim" else 0)
    return args.dim // args.n_heads


def install(model: nn.Module, p: Plan) -> None:
    """The forward's factors, as hooks on a model part as it runs (parallelized; a pipeline
    stage without the readout gets none there): the readout's input times the output
    multiplier (with the fused loss, the hidden states it projects), every attention core's
    queries times the attention factor."""
    if p.output_multiplier != 1.0 and getattr(model, "output", None) is not None:
        factor = p.output_multiplier
        model.output.register_forward_pre_hook(lambda _, args: (args[0] * factor, *args[1:]))
    if p.attention_scale != 1.0:
        scale = p.attention_scale
        for module in model.modules():
            if isinstance(module, AttentionCore):
                module.register_forward_pre_hook(lambda _, args: (args[0] * scale, *args[1:]))


@torch.no_grad()
def scale_init(parts: Sequence[nn.Module], p: Plan) -> None:
    """Multiply each freshly initialized parameter by its init factor (local shards: a scalar
    factor is the same on every layout)."""
    for part in parts:
        for name, param in part.named_parameters():
            factor = p.init_scale.get(clean(name))
            if factor is not None:
                (param._local_tensor if isinstance(param, DTensor) else param).mul_(factor)


def lr_scale(p: Plan | None) -> LRScale | None:
    """A parameter's (any wrapper's name for it) learning-rate factor, for the optimizer's
    groups: ``factor(name)`` AdamW's (the table); ``factor(name, step)`` that of an
    optimizer whose lr at a shape gives the spectral norm μP asks for in proportion to
    ``step(shape)`` (Muon: ``titanlite.optim.muon.spectral_lr``): step's ratio between the
    parameter's shape and its base-width shape (1 for the roles that do not grow)."""
    if p is None:
        return None

    def factor(name: str, step: Callable[[tuple[float, ...]], float] | None = None) -> float:
        key = clean(name)
        if step is None:
            return p.lr_scale.get(key, 1.0)
        shapes = p.shapes.get(key)
        return 1.0 if shapes is None else step(shapes[0]) / step(shapes[1])

    return factor


LRScale = Callable[..., float]
"""``lr_scale``'s result: (name[, step]) -> the parameter's learning-rate factor."""
