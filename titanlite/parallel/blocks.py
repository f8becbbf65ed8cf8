"""Per-block transformations: activation checkpointing and torch.compile.

Both address the model only through the spec's block container (a ModuleDict keyed by
layer index), never through its classes.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titanlite.models.spec import ModelSpec

logger = logging.getLogger(__name__)

# Ops whose outputs selective activation checkpointing keeps (the expensive ones).
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _save_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:  # noqa: ANN001
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: nn.Module, spec: ModelSpec, mode: str, selective_option: str) -> None:
    """Non-reentrant activation checkpointing of blocks: all (full), every Nth (selective N),
    or every block keeping matmul and attention outputs (selective "op")."""
    blocks = getattr(model, spec.blocks)
    every = int(selective_option) if mode == "selective" and selective_option != "op" else 1
    kwargs = {}
    if mode == "selective" and selective_option == "op":
        kwargs["context_fn"] = lambda: create_selective_checkpoint_contexts(_save_matmuls_policy)
    wrapped = 0
    for name, block in list(blocks.named_children()):
        if int(name) % every == 0:
            blocks.register_module(
                name, checkpoint_wrapper(block, preserve_rng_state=False, **kwargs)
            )
            wrapped += 1
    logger.info(
        "applied %s activation checkpointing to %d of %d blocks",
        mode if selective_option != "op" or mode == "full" else "selective (op)",
        wrapped,
        len(blocks),
    )


def apply_compile(model: nn.Module, spec: ModelSpec) -> None:
    """torch.compile each block on its own: small graphs compile fast, and the data-parallel
    hooks stay outside compiled code."""
    blocks = getattr(model, spec.blocks)
    for block in blocks.values():
        block.compile(fullgraph=True)
    logger.info("compiled %d transformer blocks with torch.compile", len(blocks))
