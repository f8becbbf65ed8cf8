"""Where each rank's piece of a distributed tensor lies, and the moves of Muon's plans
(``titanlite.optim.orthogonalize``): a whole matrix gathered to its owner over a mesh, one
mesh dim at a time, and its result scattered back; padding for uneven shards.

``piece`` cuts a tensor as ``distribute_tensor`` does, for any coordinate, so a rank can
place every rank's elements (the owner of a gathered plan) or find its own part of a
per-row factor (QK-clip) without communication.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.distributed.tensor.placement_types import _StridedShard


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: a DTensor's local shard, else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass
class Plan:
    """How one parameter's update reaches whole matrices and comes back."""

    kind: str
    """local, replicated, sharded or gathered (see the module's docstring)."""
    group: dist.ProcessGroup | None = None
    owner: int = 0
    """The group rank that orthogonalizes."""
    is_owner: bool = True
    dim: int = 0
    """sharded: the tensor dim split over the group."""
    sizes: list[int] = field(default_factory=list)
    """sharded: every group rank's length along ``dim``."""
    mesh: DeviceMesh | None = None
    placements: tuple[Placement, ...] = ()
    owner_coordinate: tuple[int, ...] = ()
    """gathered: the owner's coordinate on the mesh."""
    counts: list[int] = field(default_factory=list)
    """gathered: every mesh rank's number of elements (mesh coordinates in row-major order)."""
    index: torch.Tensor | None = None
    """gathered, on the owner: the global flat index of every rank's elements, in that
    order."""


def piece(
    tensor: torch.Tensor,
    mesh_shape: tuple[int, ...],
    placements: tuple[Placement, ...],
    coordinate: tuple[int, ...],
) -> torch.Tensor:
    """The part of ``tensor`` the rank at ``coordinate`` holds, cut as distribute_tensor
    cuts it (mesh dim by mesh dim, through the placements' own split)."""
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard | _StridedShard):
            pieces, _ = placement._split_tensor(
                tensor, mesh_shape[mesh_dim], with_padding=False, contiguous=False
            )
            tensor = pieces[coordinate[mesh_dim]]
    return tensor


def participates(coordinate: Sequence[int], owner: Sequence[int], mesh_dim: int) -> bool:
    """Whether a rank takes part in the hop along ``mesh_dim``: it agrees with the owner on
    every inner dim (the hops along those gathered its data there, or will scatter it from
    there)."""
    return all(coordinate[d] == owner[d] for d in range(mesh_dim + 1, len(owner)))


def gather_over_mesh(update: torch.Tensor, plan: Plan, shape: torch.Size) -> torch.Tensor | None:
    """The whole matrix on the owner (None elsewhere): every rank's piece, padded to the
    largest, gathered along the innermost mesh dim to the rank in line with the owner, then
    those along the next dim, and so on out to the owner."""
    mesh, owner = plan.mesh, plan.owner_coordinate
    assert mesh is not None
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    slot = max(plan.counts)
    buf = update.new_zeros(slot)
    buf[: update.numel()] = update.reshape(-1)
    for mesh_dim in reversed(range(mesh.ndim)):
        if not participates(coordinate, owner, mesh_dim):
            break
        receiving = coordinate[mesh_dim] == owner[mesh_dim]
        parts = [torch.empty_like(buf) for _ in range(mesh.size(mesh_dim))] if receiving else None
        dist.gather(buf, parts, group=mesh.get_group(mesh_dim), group_dst=owner[mesh_dim])
        if not receiving:
            return None
        buf = torch.cat(parts)  # type: ignore[arg-type]
    assert plan.index is not None
    values = torch.cat([buf[r * slot : r * slot + n] for r, n in enumerate(plan.counts)])
    return update.new_empty(shape).view(-1).index_copy_(0, plan.index, values).view(shape)


def scatter_over_mesh(
    result: torch.Tensor | None, update: torch.Tensor, plan: Plan
) -> torch.Tensor:
    """This rank's piece of the owner's ``result``: the gather's hops in reverse (outermost
    mesh dim first), each scattering the padded pieces of the ranks behind it."""
    mesh, owner = plan.mesh, plan.owner_coordinate
    assert mesh is not None
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    slot = max(plan.counts)
    buf: torch.Tensor | None = None
    if result is not None:
        assert plan.index is not None
        values = result.reshape(-1)[plan.index]
        buf = update.new_zeros(len(plan.counts) * slot)
        start = 0
        for r, n in enumerate(plan.counts):
            buf[r * slot : r * slot + n] = values[start : start + n]
            start += n
    for mesh_dim in range(mesh.ndim):
        if not participates(coordinate, owner, mesh_dim):
            continue
        behind = slot * math.prod(mesh.shape[mesh_dim + 1 :])
        out = update.new_empty(behind)
        sending = coordinate[mesh_dim] == owner[mesh_dim] and buf is not None
        chunks = list(buf.split(behind)) if sending else None  # type: ignore[union-attr]
        dist.scatter(out, chunks, group=mesh.get_group(mesh_dim), group_src=owner[mesh_dim])
        buf = out
    assert buf is not None
    return buf[: update.numel()].view(update.shape)


def placement_dim(placement: Placement, ndim: int) -> int:
    dim = placement.dim  # type: ignore[attr-defined]
    return dim + ndim if dim < 0 else dim


def padded_shape(t: torch.Tensor, dim: int, length: int) -> list[int]:
    shape = list(t.shape)
    shape[dim] = length
    return shape


def pad(t: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """``t`` zero-padded along ``dim`` to ``length`` (contiguous, as collectives need)."""
    if t.shape[dim] == length:
        return t.contiguous()
    out = t.new_zeros(padded_shape(t, dim, length))
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


def split_by_plan(t: torch.Tensor, plan: Plan) -> list[torch.Tensor]:
    """``t`` cut along the plan's dim into every group rank's share (empty ones included)."""
    starts = [sum(plan.sizes[:r]) for r in range(len(plan.sizes))]
    return [t.narrow(plan.dim, s, n) for s, n in zip(starts, plan.sizes, strict=True)]
