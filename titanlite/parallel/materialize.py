"""From a meta-device model to real, initialized (possibly sharded) parameters.

Runs after every sharding step, so no rank ever holds a parameter it does not keep: each
allocates its own shards (``to_empty``) and initializes only their elements, from the
spec's per-parameter rules and titanlite's counter-based values
(``titanlite.models.init``), so every layout starts from bit-identical weights.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from titanlite.models.init import Block, canonical_name, init_parameters, whole
from titanlite.models.interfaces import LowRankLinear
from titanlite.models.spec import InitRule, ModelSpec

logger = logging.getLogger(__name__)


def local_block(param: torch.Tensor) -> Block:
    """(this rank's tensor, global shape, offset of its first element) of a parameter."""
    if not isinstance(param, DTensor):
        return whole(param)
    local = param.to_local()
    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    if tuple(shape) != tuple(local.shape):
        # A placement this arithmetic does not describe: initializing it would silently
        # give another layout's weights, so refuse loudly.
        raise RuntimeError(
            f"local shard {tuple(local.shape)} of a {tuple(param.shape)} parameter does not "
            f"match its placements {param.placements} (expected {tuple(shape)})"
        )
    return local, tuple(param.shape), tuple(offset)


def allocate(model: nn.Module, device: torch.device | str) -> None:
    """Give every (sharded) meta parameter and buffer real, uninitialized storage."""
    # Swapping tensors in place keeps shared (tied) parameters shared; the default
    # conversion would give each module its own copy.
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


def adapter_rules(model: nn.Module) -> dict[str, InitRule]:
    """Parameter name -> rule of every low-rank adapter's factors (``LowRankLinear``)."""
    return {
        canonical_name(f"{path}.{name}"): rule
        for path, module in model.named_modules()
        if isinstance(module, LowRankLinear)
        for name, rule in module.adapter_init.items()
    }


def materialize(
    model: nn.Module,
    spec: ModelSpec,
    args: Any,
    device: torch.device | str,
    *,
    seed: int,
    init_weights: bool = True,
    aliases: dict[str, str] | None = None,
) -> dict[str, float]:
    """Allocate, compute the buffers, and (unless a checkpoint is about to overwrite them)
    initialize this rank's elements (``aliases``: see ``init_parameters``). Returns what it
    cost: seconds and elements written."""
    start = time.perf_counter()
    allocate(model, device)
    spec.init_buffers(model)
    allocated = time.perf_counter()
    # Low-rank adapters (LoRA) start by their own rules, and always: the checkpoint that
    # overwrites the weights (the base model) does not hold them.
    adapters = adapter_rules(model)
    written = 0
    if init_weights or adapters:
        written = init_parameters(
            model,
            lambda name: adapters.get(name) or spec.init_rule(args, name),
            seed,
            locate=local_block,
            aliases=aliases,
            only=None if init_weights else adapters.__contains__,
        )
    done = time.perf_counter()
    logger.info(
        "materialized the model on %s: %s (%.2f s allocation, %.2f s initialization)",
        device,
        f"{written:,} local elements initialized"
        if init_weights
        else "weights left to the checkpoint",
        allocated - start,
        done - allocated,
    )
    return {"allocate_s": allocated - start, "init_s": done - allocated, "elements": written}
