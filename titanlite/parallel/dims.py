"""ParallelDims: the resolved degrees and the one DeviceMesh every parallelism uses."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titanlite.config import Degrees

logger = logging.getLogger(__name__)


@dataclass
class ParallelDims:
    degrees: Degrees
    device_type: str
    mesh: DeviceMesh = field(init=False)
    dp_mesh: DeviceMesh = field(init=False)
    """The batch dimension (dp_replicate x dp_shard flattened): ranks that see different data."""

    def __post_init__(self) -> None:
        d = self.degrees
        # Outer to inner: replicas, shards, tensor parallel (TP innermost so its heavy
        # per-layer traffic stays within a node).
        self.mesh = init_device_mesh(
            self.device_type,
            (d.dp_replicate, d.dp_shard, d.tp),
            mesh_dim_names=("dp_replicate", "dp_shard", "tp"),
        )
        self.dp_mesh = self.mesh["dp_replicate", "dp_shard"]._flatten(mesh_dim_name="dp")
        logger.info(
            "device mesh: dp_replicate=%d x dp_shard=%d x tp=%d", d.dp_replicate, d.dp_shard, d.tp
        )

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.degrees.dp

    def group(self, name: str) -> torch.distributed.ProcessGroup:
        """Process group of a mesh dimension: dp_replicate, dp_shard, tp, or dp."""
        return self.dp_mesh.get_group() if name == "dp" else self.mesh[name].get_group()
