"""Per-sequence statistics of layers that run on this rank's tokens only.

A mixture of experts routes the tokens each rank holds. When a rank holds only a shard of
each sequence (tensor parallelism's sequence shards, context parallelism's chunks, or both),
statistics that are per whole sequence (the sequence-wise balancing loss's expert shares)
need a sum over the ranks holding the other shards. Such a layer has a ``sequence_shards``
attribute (``titanlite.models.interfaces.SequenceShards``); this module sets it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class SequenceShardGroup:
    """The ranks that hold the other shards of this rank's sequences (``degree`` of them,
    this one included)."""

    def __init__(self, group: dist.ProcessGroup, degree: int) -> None:
        self.group, self.degree = group, degree

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=self.group)
        return tensor


def apply_sequence_shards(model: nn.Module, group: dist.ProcessGroup, degree: int) -> int:
    """Point every layer of ``model`` that keeps per-sequence statistics at ``group``
    (replacing tensor parallelism's TP-only group under context parallelism); returns how
    many layers there are."""
    layers = [m for m in model.modules() if hasattr(m, "sequence_shards")]
    for layer in layers:
        layer.sequence_shards = SequenceShardGroup(group, degree)
    return len(layers)
