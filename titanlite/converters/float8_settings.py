"""[float8]: the settings of the float8 converter (``titanlite.converters.float8``) and the
section its registry entry declares. Plain Python."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Literal

from titanlite.config.catalog import Section
from titanlite.config.planned import PlannedRun


@dataclass
class Float8Settings:
    """[float8]: settings of the float8 converter (model.converters = ["float8"]; needs torchao:
    pip install 'titanlite[float8]'). docs/performance.md says when it pays."""

    recipe: Literal["rowwise", "tensorwise", "rowwise_with_gw_hp"] = "rowwise"
    """Scaling recipe: rowwise (one scale per row of each operand), tensorwise (one per tensor; the
    fastest, allows the float8 FSDP all-gather), rowwise_with_gw_hp (rowwise, weight gradients in
    high precision)."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output", "router"])
    """Linears kept in high precision: those whose module path contains any of these strings
    (default: the output projection and MoE routers)."""
    auto_filter_small: bool = True
    """Also keep in high precision the linears too small to gain on H100-class GPUs (torchao's
    measured thresholds for the recipe); linears whose sizes are not multiples of 16 always stay."""
    enable_fsdp_float8_all_gather: bool = False
    """tensorwise only: FSDP all-gathers the weights in float8 (half of bf16's bytes), with scales
    from the sharded weights."""
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """With enable_fsdp_float8_all_gather: compute every weight's scale in one all-reduce after each
    optimizer step instead of one per weight."""
    emulate: bool = False
    """Run the float8 matmuls in high precision on the float8-rounded values (GPUs without float8
    units; results as float8's, speed not)."""
    experts: bool = False
    """Also the routed experts' grouped matmuls (rowwise; CUDA GPUs of compute capability 9.0 and
    later, through torchao)."""


def refuses(run: PlannedRun) -> list[str]:
    """What the float8 converter cannot take (torch-free: torchao is only looked for)."""
    f = run.cfg.float8
    lines = []
    if importlib.util.find_spec("torchao") is None:
        lines.append("needs torchao, which is not installed: pip install 'titanlite[float8]'")
    if f.enable_fsdp_float8_all_gather and f.recipe != "tensorwise":
        lines.append(
            f'float8.enable_fsdp_float8_all_gather needs float8.recipe = "tensorwise" (the '
            f"{f.recipe} recipe scales each row, which a weight's shard does not hold)"
        )
    if f.precompute_float8_dynamic_scale_for_fsdp and not f.enable_fsdp_float8_all_gather:
        lines.append(
            "float8.precompute_float8_dynamic_scale_for_fsdp needs "
            "float8.enable_fsdp_float8_all_gather = true"
        )
    if f.experts and f.recipe != "rowwise":
        lines.append("float8.experts: the grouped matmuls have the rowwise recipe only")
    return lines


SECTION = Section("float8", Float8Settings, after="compile")
