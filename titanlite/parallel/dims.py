"""ParallelDims: the resolved degrees and the one DeviceMesh every parallelism uses.

The mesh always has the five named dimensions of ``titanlite.config.layout.MESH_DIMS``
(size-1 ones included, so every layout addresses the same names), outermost first: pp,
dp_replicate, dp_shard, cp, tp. TP is innermost so its heavy per-layer traffic stays within a
node. Parallelisms ask for the derived meshes by role:

  batch  dp_replicate x dp_shard       ranks that read different data
  loss   dp_replicate x dp_shard x cp  ranks whose loss sums and token counts add up
  fsdp   dp_shard x cp                 ranks that shard parameters (with dp_replicate: HSDP)
  tokens dp_replicate x dp_shard x cp x tp   ranks that hold different tokens of a stage where
                                       a layer runs on sequence shards (the loss mesh without TP)
  sequence  cp x tp                    ranks that hold shards of the same sequences (a layer
                                       that routes its own tokens: a mixture of experts)
  expert_fsdp  dp_shard_out x cp       under expert parallelism with cp > 1: the ranks that
                                       shard each ep rank's experts (ep then sits inside cp)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titanlite.config.layout import MESH_DIMS, Degrees

logger = logging.getLogger(__name__)

_DERIVED = {
    "batch": ("dp_replicate", "dp_shard"),
    "loss": ("dp_replicate", "dp_shard", "cp"),
    "fsdp": ("dp_shard", "cp"),
}


@dataclass
class ParallelDims:
    degrees: Degrees
    device_type: str
    mesh: DeviceMesh = field(init=False)
    _derived: dict[str, DeviceMesh] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        d = self.degrees
        names, sizes = list(MESH_DIMS), [d.of(n) for n in MESH_DIMS]
        shard = ("dp_shard",)
        if d.ep > 1:  # dp_shard split in two: the experts' FSDP ranks outside, ep inside
            i = names.index("dp_shard")
            names[i : i + 1] = shard = ("dp_shard_out", "ep")
            sizes[i : i + 1] = (d.dp_shard // d.ep, d.ep)
            if d.cp > 1:  # ep inside cp too: the experts' FSDP ranks (dp_shard_out x cp) and
                # the ep ranks, each contiguous, as DTensor redistributions need (torch 2.13)
                j = names.index("cp")
                names[i + 1 : j + 1] = names[i + 2 : j + 1] + ["ep"]
                sizes[i + 1 : j + 1] = sizes[i + 2 : j + 1] + [d.ep]
        self.mesh = init_device_mesh(self.device_type, tuple(sizes), mesh_dim_names=tuple(names))
        if d.ep > 1:
            self._derived["dp_shard"] = self.mesh[shard]._flatten(mesh_dim_name="dp_shard")
        roles = dict(_DERIVED, tokens=(*_DERIVED["loss"], "tp")) if d.tp > 1 else dict(_DERIVED)
        if d.cp > 1 and d.tp > 1:
            roles["sequence"] = ("cp", "tp")
        for role, dims in roles.items():
            dims = [n for dim in dims for n in (shard if dim == "dp_shard" else (dim,))]
            dims = tuple(sorted(dims, key=names.index))  # (slices keep the mesh's order)
            self._derived[role] = self.mesh[dims]._flatten(mesh_dim_name=role)
        if d.tp == 1:
            self._derived["tokens"] = self._derived["loss"]
        if d.ep > 1 and d.cp > 1:
            self._derived["expert_fsdp"] = self.mesh["dp_shard_out", "cp"]._flatten(
                mesh_dim_name="expert_fsdp"
            )
        logger.info("device mesh: %s", d.describe())

    def __getitem__(self, name: str) -> DeviceMesh:
        """A named dimension (pp, dp_replicate, dp_shard, cp, tp) or a derived mesh (batch,
        loss, fsdp, tokens)."""
        return self._derived[name] if name in self._derived else self.mesh[name]

    def size(self, name: str) -> int:
        return self[name].size()

    def local_rank(self, name: str) -> int:
        return self[name].get_local_rank()

    def group(self, name: str) -> dist.ProcessGroup:
        return self[name].get_group()

    @property
    def batch_rank(self) -> int:
        """Which share of each global batch this rank reads."""
        return self.local_rank("batch")

    @property
    def batch_size(self) -> int:
        """How many shares each global batch is cut into."""
        return self.degrees.dp

    @property
    def grad_average_size(self) -> int:
        """How many ranks' gradients the data-parallel engine averages: every rank whose loss
        is a part of the total (batch x cp), since context-parallel ranks hold parts of the
        same sequences and their gradients must add up too."""
        return self.degrees.loss

    def expert_fsdp_mesh(self) -> DeviceMesh:
        """FSDP's mesh for expert weights under expert parallelism: the dp_shard ranks outside
        the expert-parallel group, and the cp ranks (their tokens meet the same experts: the
        gradients add up over them, as the other weights' do over the fsdp mesh); with
        dp_replicate: 2-D, HSDP."""
        shard = "expert_fsdp" if self.degrees.cp > 1 else "dp_shard_out"
        if self.degrees.dp_replicate > 1:
            return self.mesh["dp_replicate", shard]
        return self[shard]

    def sequence_group(self) -> tuple[dist.ProcessGroup, int]:
        """The ranks holding shards of this rank's sequences (cp x tp) and how many they are:
        per-sequence statistics of a layer that runs on its own tokens add up over them."""
        d = self.degrees
        name = "sequence" if d.cp > 1 and d.tp > 1 else ("cp" if d.cp > 1 else "tp")
        return self.group(name), d.cp * d.tp

    def hsdp_or_fsdp_mesh(self) -> DeviceMesh:
        """FSDP's mesh: 2-D (replicate, shard) for HSDP, else the shard dimension; the shard
        dimension takes in the context-parallel ranks (dp_shard x cp)."""
        shard = "fsdp" if self.degrees.cp > 1 else "dp_shard"
        if self.degrees.dp_replicate > 1:
            return self.mesh["dp_replicate", shard]
        return self[shard]

    def replica_group(self) -> dist.ProcessGroup:
        """The group titanlite's DDP engine averages over when nothing is sharded: the
        replicas and, under context parallelism, their cp ranks (dp_replicate x cp)."""
        return self.group("loss" if self.degrees.cp > 1 else "dp_replicate")
