"""The float8 converter's torch side: linears -> torchao's float8 training linears.

Each chosen ``nn.Linear`` becomes a torchao ``Float8Linear``: the same module path and the
same high-precision ``weight`` parameter (so checkpoints, initialization, exports and the
optimizer see no difference), whose forward and backward cast their operands to float8 with
scales computed from the whole tensor or row and multiply with ``torch._scaled_mm``. What
stays in high precision, and why, is logged once.

The routed experts (``float8.experts``) go through torchao's float8 grouped matmul, which
only CUDA GPUs of compute capability 9.0 and later run; elsewhere that is refused.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from titanlite.errors import UserError

logger = logging.getLogger(__name__)

INSTALL = "pip install 'titanlite[float8]' (or pip install torchao)"
ROWWISE_RECIPES = ("rowwise", "rowwise_with_gw_hp")


def torchao_missing() -> bool:
    return importlib.util.find_spec("torchao") is None


def _import(module: str) -> Any:
    """A torchao module; its optional CUDA extensions that fail to load on other machines are
    reported by torchao as log warnings, which are of no use to a titanlite user."""
    if torchao_missing():
        raise UserError(
            f"model.converters: float8 needs torchao, which is not installed: {INSTALL}"
        )
    quiet = logging.getLogger("torchao")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return importlib.import_module(module)
    finally:
        quiet.setLevel(level)


def too_small(recipe: str, out_features: int, in_features: int) -> bool:
    """Whether a linear of these sizes runs slower in float8 than in bf16 on an H100, by the
    thresholds torchao measured for each recipe (its README's performance tables): the casts
    cost more than the faster matmul saves."""
    n, k = out_features, in_features
    if recipe == "tensorwise":
        return k <= 4096 and n <= 1024
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


def high_precision_reason(fqn: str, module: nn.Linear, settings: Any) -> str | None:
    """Why the linear at ``fqn`` stays in high precision, or None to convert it."""
    if any(pattern in fqn for pattern in settings.filter_fqns):
        return "float8.filter_fqns"
    n, k = module.weight.shape
    if n % 16 or k % 16:
        return "sizes not multiples of 16"
    if settings.auto_filter_small and too_small(settings.recipe, n, k):
        return "too small to gain (float8.auto_filter_small)"
    return None


def linear_config(settings: Any) -> Any:
    """torchao's Float8LinearConfig for ``settings`` ([float8])."""
    config_module = _import("torchao.float8")
    config = config_module.Float8LinearConfig.from_recipe_name(settings.recipe)
    changes = {}
    if settings.enable_fsdp_float8_all_gather:
        changes["enable_fsdp_float8_all_gather"] = True
    if settings.emulate:
        changes["emulate"] = True
    return dataclasses.replace(config, **changes) if changes else config


def convert(model: nn.Module, spec: Any, settings: Any) -> int:
    """Swap the chosen linears of ``model`` (on the meta device) for float8 linears, and the
    routed experts' grouped matmuls when ``settings.experts``; returns how many modules."""
    float8 = _import("torchao.float8")
    linear_class = _import("torchao.float8.float8_linear").Float8Linear
    kept: dict[str, str] = {}

    def take(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return True  # a container: torchao looks inside it
        reason = high_precision_reason(fqn, module, settings)
        if reason is not None:
            kept[fqn] = reason
        return reason is None

    names = [n for n, _ in model.named_modules()]
    defaults = type(settings)().filter_fqns  # (routers: only MoE models have them)
    unused = [
        p for p in settings.filter_fqns if p not in defaults and not any(p in n for n in names)
    ]
    if unused:
        logger.warning(
            "float8.filter_fqns: %s match%s no module of the model",
            ", ".join(map(repr, unused)),
            "es" if len(unused) == 1 else "",
        )
    float8.convert_to_float8_training(model, module_filter_fn=take, config=linear_config(settings))
    converted = sum(isinstance(m, linear_class) for m in model.modules())
    reasons = Counter(kept.values())
    logger.info(
        "float8 (%s): %d linears in float8, %d kept in high precision%s",
        settings.recipe,
        converted,
        len(kept),
        "".join(f"; {n} by {why}" for why, n in reasons.items()),
    )
    if kept:
        logger.debug("float8: kept in high precision: %s", ", ".join(kept))
    if converted == 0:
        logger.warning(
            "float8: no linear converted (model too small for float8.auto_filter_small, or all "
            "filtered): the run trains in high precision"
        )
    if settings.experts:
        converted += convert_experts(model, spec)
    return converted


def convert_experts(model: nn.Module, spec: Any) -> int:
    """The routed experts' weights as torchao's float8 grouped-matmul training tensors."""
    if not spec.experts:
        raise UserError(f"float8.experts: {spec.name} has no routed experts")
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)):
        raise UserError(
            "float8.experts: float8 grouped matmuls need a CUDA GPU of compute capability 9.0 "
            "or later (H100, H200, B200); set float8.experts = false on this machine"
        )
    moe = _import("torchao.prototype.moe_training.config")
    quantize = _import("torchao.quantization")
    names = set()

    def experts_only(module: nn.Module, fqn: str) -> bool:
        if fqn.endswith("experts") and hasattr(module, "w1"):
            names.add(fqn)
            return True
        return False

    config = moe.Float8TrainingOpConfig.from_recipe(moe.Float8TrainingRecipe.FP8_ROWWISE)
    quantize.quantize_(model, config=config, filter_fn=experts_only)
    logger.info("float8: %d routed-expert modules use float8 grouped matmuls", len(names))
    return len(names)


def after_optimizer_step(parts: Sequence[nn.Module], settings: Any) -> None:
    """With precomputed FSDP scales: every float8 weight's scale for the next all-gather, in
    one all-reduce per part."""
    if settings.enable_fsdp_float8_all_gather and settings.precompute_float8_dynamic_scale_for_fsdp:
        precompute = _import("torchao.float8").precompute_float8_dynamic_scale_for_fsdp
        for part in parts:
            precompute(part)
