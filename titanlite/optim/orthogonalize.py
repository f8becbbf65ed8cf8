"""Muon's orthogonalization on whole matrices under every layout, each matrix done once.

Newton-Schulz needs the whole matrix: its result is not the concatenation of its shards'
results. How a parameter is stored decides how its update gets there and back (a plan per
parameter, made at its first step):

  local       the rank holds whole matrices: one process, a pipeline stage's own weights,
              expert stacks split by expert (expert parallelism, FSDP by whole experts),
              or weights that are the same on every rank without a replica group
  replicated  plain weights the same on every rank of a replica group (titanlite's DDP):
              matrix i is orthogonalized by rank i mod R of the group and broadcast
  sharded     a DTensor split along one of its matrix dims by one mesh dim (FSDP, HSDP,
              TP alone): the owner (round-robin over that dim's ranks) gathers the shards,
              orthogonalizes, and scatters the result's shards back
  gathered    a DTensor split along both matrix dims or by two mesh dims (FSDP x TP): every
              rank of the mesh gathers it (DTensor's full_tensor), the owner (round-robin
              over the whole mesh) orthogonalizes and broadcasts it (one mesh dim at a time),
              each rank keeps its shard

So each matrix's Newton-Schulz runs on exactly one rank of the ranks that hold it, and the
work per rank falls with the number of those ranks. docs/muon.md counts the bytes per layout.
Every rank of a group sees its parameters in the same order, so the round-robin owners and
the order of collectives agree without any exchange.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

logger = logging.getLogger(__name__)


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


class Orthogonalizer:
    """``orthogonalizer(pairs)``: for (parameter, local update) pairs, each rank's local share
    of the orthogonalized updates. ``newton_schulz`` maps a whole matrix (or a stack) to its
    orthogonal factor; ``replica_group`` is the group over which plain parameters are
    replicated (None: plain parameters are orthogonalized where they are)."""

    def __init__(
        self,
        newton_schulz: Callable[[torch.Tensor], torch.Tensor],
        replica_group: dist.ProcessGroup | None = None,
    ):
        self.newton_schulz = newton_schulz
        self.replica_group = replica_group
        self.plans: dict[int, Plan] = {}
        self._next_owner: dict[tuple[int, ...], int] = {}  # per set of ranks: its position

    def __call__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        first = not self.plans
        plans = [self.plan(p) for p, _ in pairs]
        if first and plans:
            kinds = Counter(plan.kind for plan in plans)
            logger.info(
                "muon: %d matrices (%s); this rank orthogonalizes %d of them",
                len(plans), ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())),
                sum(plan.is_owner for plan in plans),
            )  # fmt: skip
        updates = [u for _, u in pairs]
        # 1. Whole matrices to their owners (asynchronous, all at once).
        whole: list[torch.Tensor | None] = [None] * len(pairs)
        pending: list[tuple[int, list[torch.Tensor], dist.Work]] = []
        for i, (plan, update) in enumerate(zip(plans, updates, strict=True)):
            if plan.kind == "gathered":
                full = DTensor.from_local(
                    update, plan.mesh, plan.placements, run_check=False,
                    shape=pairs[i][0].shape, stride=pairs[i][0].stride(),
                ).full_tensor()  # fmt: skip
                whole[i] = full if plan.is_owner else None
            elif plan.kind == "sharded":
                chunk = max(plan.sizes)
                parts = [_pad(update, plan.dim, chunk)]
                if plan.is_owner:
                    parts += [torch.empty_like(parts[0]) for _ in plan.sizes]
                work = dist.gather(
                    parts[0], parts[1:] if plan.is_owner else None, group=plan.group,
                    group_dst=plan.owner, async_op=True,
                )  # fmt: skip
                pending.append((i, parts[1:], work))
            elif plan.is_owner:
                whole[i] = update
        for i, parts, work in pending:
            work.wait()
            plan = plans[i]
            if plan.is_owner:
                shards = [p.narrow(plan.dim, 0, n) for p, n in zip(parts, plan.sizes, strict=True)]
                whole[i] = torch.cat(shards, dim=plan.dim)
        # 2. Each owner orthogonalizes its matrices.
        result = [None if w is None else self.newton_schulz(w) for w in whole]
        # 3. Results back to every rank that holds a part of them.
        out: list[torch.Tensor | None] = [None] * len(pairs)
        waits: list[tuple[int, torch.Tensor, dist.Work]] = []
        for i, (plan, update) in enumerate(zip(plans, updates, strict=True)):
            ortho = result[i]
            if plan.kind == "local":
                out[i] = ortho
            elif plan.kind == "sharded":
                chunk = max(plan.sizes)
                buf = update.new_empty(_padded_shape(update, plan.dim, chunk))
                chunks = None
                if plan.is_owner:
                    chunks = [_pad(c, plan.dim, chunk) for c in _split(ortho, plan)]
                work = dist.scatter(
                    buf, chunks, group=plan.group, group_src=plan.owner, async_op=True
                )
                waits.append((i, buf, work))
            elif plan.kind == "replicated":
                buf = ortho.contiguous() if plan.is_owner else torch.empty_like(update)
                work = dist.broadcast(buf, group=plan.group, group_src=plan.owner, async_op=True)
                waits.append((i, buf, work))
        for i, buf, work in waits:
            work.wait()
            plan = plans[i]
            if plan.kind == "sharded":
                out[i] = buf.narrow(plan.dim, 0, updates[i].shape[plan.dim])
            else:
                out[i] = buf
        for i, plan in enumerate(plans):
            if plan.kind == "gathered":
                shape = pairs[i][0].shape
                whole_result = _broadcast_over_mesh(result[i], shape, updates[i], plan)
                out[i] = distribute_tensor(
                    whole_result, plan.mesh, plan.placements, src_data_rank=None
                ).to_local()
        return out  # type: ignore[return-value]

    def plan(self, param: torch.Tensor) -> Plan:
        """The plan of ``param`` (made once; owners assigned round-robin per group)."""
        key = id(param)
        if key not in self.plans:
            self.plans[key] = self._make_plan(param)
        return self.plans[key]

    def _next(self, ranks: tuple[int, ...]) -> int:
        """The round-robin owner (an index into ``ranks``) of the next matrix those ranks
        hold."""
        position = self._next_owner.get(ranks, 0)
        self._next_owner[ranks] = position + 1
        return position % len(ranks)

    def _assign(self, plan: Plan, group: dist.ProcessGroup) -> Plan:
        plan.group = group
        plan.owner = self._next(tuple(dist.get_process_group_ranks(group)))
        plan.is_owner = dist.get_rank(group) == plan.owner
        return plan

    def _make_plan(self, param: torch.Tensor) -> Plan:
        if not isinstance(param, DTensor):
            group = self.replica_group
            if group is None or dist.get_world_size(group) == 1:
                return Plan("local")
            return self._assign(Plan("replicated"), group)
        mesh, placements = param.device_mesh, tuple(param.placements)
        matrix_dims = {param.ndim - 2, param.ndim - 1}
        # FSDP over TP's shards splits with _StridedShard, which is not a Shard.
        on_matrix = [
            (i, p)
            for i, p in enumerate(placements)
            if isinstance(p, Shard | _StridedShard)
            and mesh.size(i) > 1
            and _dim(p, param.ndim) in matrix_dims
        ]
        if not on_matrix:  # split by expert only: each rank holds whole matrices
            return Plan("local")
        if len(on_matrix) == 1 and type(on_matrix[0][1]) is Shard:
            mesh_dim, placement = on_matrix[0]
            dim = _dim(placement, param.ndim)
            n, ranks = param.shape[dim], mesh.size(mesh_dim)
            chunk = math.ceil(n / ranks)
            sizes = [max(0, min(chunk, n - r * chunk)) for r in range(ranks)]
            plan = Plan("sharded", dim=dim, sizes=sizes)
            return self._assign(plan, mesh.get_group(mesh_dim))
        owner = self._next(tuple(mesh.mesh.flatten().tolist()))
        coordinate = mesh.get_coordinate()
        assert coordinate is not None  # a parameter lives on the meshes of its ranks
        owner_coordinate = tuple(
            int(c) for c in torch.unravel_index(torch.tensor(owner), mesh.shape)
        )
        return Plan(
            "gathered", mesh=mesh, placements=placements, owner_coordinate=owner_coordinate,
            is_owner=tuple(coordinate) == owner_coordinate,
        )  # fmt: skip


def _broadcast_over_mesh(
    result: torch.Tensor | None, shape: torch.Size, like: torch.Tensor, plan: Plan
) -> torch.Tensor:
    """The owner's whole ``result`` on every rank of the plan's mesh, one mesh dim at a time
    (innermost first: the owner's row, then every row from it, ...), over the groups the
    mesh already has."""
    buf = result.contiguous() if result is not None else like.new_empty(shape)
    mesh, owner = plan.mesh, plan.owner_coordinate
    assert mesh is not None
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    for dim in reversed(range(mesh.ndim)):
        # Those that agree with the owner on the outer dims: their dim group holds a rank
        # that has the result by now (the owner's coordinate along ``dim``).
        if all(coordinate[d] == owner[d] for d in range(dim)):
            dist.broadcast(buf, group=mesh.get_group(dim), group_src=owner[dim])
    return buf


def _dim(placement: Placement, ndim: int) -> int:
    dim = placement.dim  # type: ignore[attr-defined]
    return dim + ndim if dim < 0 else dim


def _padded_shape(t: torch.Tensor, dim: int, length: int) -> list[int]:
    shape = list(t.shape)
    shape[dim] = length
    return shape


def _pad(t: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """``t`` zero-padded along ``dim`` to ``length`` (contiguous, as collectives need)."""
    if t.shape[dim] == length:
        return t.contiguous()
    out = t.new_zeros(_padded_shape(t, dim, length))
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


def _split(t: torch.Tensor, plan: Plan) -> list[torch.Tensor]:
    """``t`` cut along the plan's dim into every group rank's share (empty ones included)."""
    starts = [sum(plan.sizes[:r]) for r in range(len(plan.sizes))]
    return [t.narrow(plan.dim, s, n) for s, n in zip(starts, plan.sizes, strict=True)]
