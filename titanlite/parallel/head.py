"""The output projection deferred to the loss (training.fused_loss).

``defer_head`` replaces the spec's ``head`` (the projection to the vocabulary) by a
``DeferredHead``: the same parameter under the same name (checkpoints, initialization,
tied embeddings, optimizers and exports see no difference), whose forward passes the final
hidden states on unprojected. The model's output is then the hidden states, and the loss
(``LossSum`` given ``head=``) projects them itself, chunk by chunk, never holding the logits
(``titanlite.training.fused_loss``). Under tensor parallelism the weight is split along the
vocabulary as the unfused projection's is and the hidden states arrive replicated
(``deferred_head_style``).
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel

from titanlite.models.spec import ModelSpec

logger = logging.getLogger(__name__)


class DeferredHead(nn.Linear):
    """An output projection whose forward is the identity: the loss applies the weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def defer_head(model: nn.Module, spec: ModelSpec) -> None:
    """Replace ``model``'s projection to the vocabulary (on the meta device, before any
    parallelism) by a ``DeferredHead`` holding the same weight parameter. A head some
    converter turned into another kind of linear (float8) is deferred all the same: the
    fused loss projects in high precision."""
    path, _, name = spec.head.rpartition(".")
    parent = model.get_submodule(path) if path else model
    old = getattr(parent, name)
    if old.bias is not None:
        raise ValueError(f"{spec.name}: the fused loss needs a bias-free {spec.head}")
    with torch.device("meta"):
        head = DeferredHead(old.in_features, old.out_features, bias=False)
    head.weight = old.weight  # the same Parameter: a tie to the embedding survives
    setattr(parent, name, head)
    logger.info("fused loss: %s's projection deferred to the loss", spec.head)


def deferred_head_style() -> ColwiseParallel:
    """The tensor-parallel style of a ``DeferredHead``: its weight split along the
    vocabulary like the projection's, its input gathered from sequence shards and handed on
    replicated (a DTensor: the loss turns its gradient into a partial sum)."""
    return ColwiseParallel(
        input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=False
    )


def head_weight(part: nn.Module, path: str) -> torch.Tensor:
    """The weight of ``part``'s deferred head as the forward just used it: under FSDP its
    unit (the root) is gathered again if it was freed after forward (a no-op otherwise),
    so the loss gets the whole weight (per vocabulary shard under tensor parallelism)."""
    if isinstance(part, FSDPModule):
        part.unshard()
    return part.get_submodule(path).weight
