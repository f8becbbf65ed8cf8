"""Muon's orthogonalization on whole matrices under every layout, each matrix done once.

Newton-Schulz needs the whole matrix: its result is not the concatenation of its shards'
results. How a parameter is stored decides how its update gets there and back (a plan per
parameter, made at its first step):

  local       the rank holds whole matrices: one process, a pipeline stage's own weights,
              expert stacks split by expert (expert parallelism, FSDP by whole experts),
              or weights that are the same on every rank without a replica group
  replicated  plain weights the same on every rank of a replica group (titanlite's DDP):
              each matrix is orthogonalized by its owner in the group and broadcast
  sharded     a DTensor split along one of its matrix dims by one mesh dim (FSDP, HSDP,
              TP alone): the owner (the least loaded of that dim's ranks) gathers the shards,
              orthogonalizes, and scatters the result's shards back
  gathered    a DTensor split along both matrix dims or by two mesh dims (FSDP x TP,
              FSDP's strided rows included): the same gather to an owner (the least loaded
              of the whole mesh) and scatter back, one mesh dim at a time over the groups the
              mesh already has, each rank's piece padded to the largest; the owner places
              the pieces by their global indices (computed once, as DTensor splits)

So each matrix's Newton-Schulz runs on exactly one rank of the ranks that hold it, and the
work per rank falls with the number of those ranks. docs/muon.md counts the bytes per layout.
Owners are chosen greedily, largest matrix first (then in parameter order), as the holder
with the least Newton-Schulz work so far (ties to the lowest rank): for matrices of one size
that is round-robin; for mixed sizes it keeps the busiest rank near the even share. Every
rank of a group sees its parameters in the same order and shapes, so the owners and the
order of collectives agree without any exchange.

Per-head blocks (``muon.block = "head"``): a matrix given a block (dim, size) is
orthogonalized as a stack of blocks of ``size`` rows (dim 0: wq, wk, wv) or columns (dim 1:
wo), each block on its own, which needs only the blocks, not the matrix. Where every rank's
piece is whole blocks (TP, which splits by heads; FSDP when its shards hold whole heads) the
plan is local: no communication. Under FSDP x TP the owner gathers TP's piece only, over the
FSDP ranks that share it (sharded). Otherwise the whole matrix travels as above.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from titanlite.optim.pieces import (
    Plan,
    gather_over_mesh,
    pad,
    padded_shape,
    piece,
    placement_dim,
    scatter_over_mesh,
    split_by_plan,
)

logger = logging.getLogger(__name__)


class Orthogonalizer:
    """``orthogonalizer(pairs)``: for (parameter, local update) pairs, each rank's local share
    of the orthogonalized updates. ``newton_schulz`` maps a whole matrix (or a stack) to its
    orthogonal factor; ``replica_group`` is the group over which plain parameters are
    replicated (None: plain parameters are orthogonalized where they are); ``blocks`` the
    parameters orthogonalized block by block (per head)."""

    def __init__(
        self,
        newton_schulz: Callable[[torch.Tensor], torch.Tensor],
        replica_group: dist.ProcessGroup | None = None,
        blocks: dict[int, Block] | None = None,
    ):
        self.newton_schulz = newton_schulz
        self.replica_group = replica_group
        self.blocks = blocks or {}
        """id(parameter) -> (dim, size): orthogonalized in blocks of ``size`` along ``dim``."""
        self.plans: dict[int, Plan] = {}
        self._load: dict[tuple[int, ...], list[float]] = {}  # per set of ranks: work so far
        self._counts: dict[tuple, list[int]] = {}  # gathered plans' piece sizes, by layout
        self._whole: dict[tuple, bool] = {}  # whole_blocks, by layout and block

    def __call__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        first = not self.plans
        # Owners are picked largest matrix first (then in parameter order): the greedy
        # choice then leaves the busiest rank within one small matrix of the even share.
        for p, _ in sorted(pairs, key=lambda pair: -newton_schulz_flops(self.work(pair[0]))):
            self.plan(p)
        plans = [self.plan(p) for p, _ in pairs]
        if first and plans:
            kinds = Counter(plan.kind for plan in plans)
            logger.info(
                "muon: %d matrices (%s); this rank orthogonalizes %d of them",
                len(plans),
                ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())),
                sum(plan.is_owner for plan in plans),
            )
        updates = [u for _, u in pairs]
        # 1. Whole matrices to their owners (asynchronous, all at once).
        whole: list[torch.Tensor | None] = [None] * len(pairs)
        pending: list[tuple[int, list[torch.Tensor], dist.Work]] = []
        for i, (plan, update) in enumerate(zip(plans, updates, strict=True)):
            if plan.kind == "gathered":
                whole[i] = gather_over_mesh(update, plan, pairs[i][0].shape)
            elif plan.kind == "sharded":
                chunk = max(plan.sizes)
                parts = [pad(update, plan.dim, chunk)]
                if plan.is_owner:
                    parts += [torch.empty_like(parts[0]) for _ in plan.sizes]
                work = dist.gather(
                    parts[0],
                    parts[1:] if plan.is_owner else None,
                    group=plan.group,
                    group_dst=plan.owner,
                    async_op=True,
                )
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
        result = [
            None if w is None else in_blocks(self.newton_schulz, w, self.blocks.get(id(p)))
            for w, (p, _) in zip(whole, pairs, strict=True)
        ]
        # 3. Results back to every rank that holds a part of them.
        out: list[torch.Tensor | None] = [None] * len(pairs)
        waits: list[tuple[int, torch.Tensor, dist.Work]] = []
        for i, (plan, update) in enumerate(zip(plans, updates, strict=True)):
            ortho = result[i]
            if plan.kind == "local":
                out[i] = ortho
            elif plan.kind == "sharded":
                chunk = max(plan.sizes)
                buf = update.new_empty(padded_shape(update, plan.dim, chunk))
                chunks = None
                if plan.is_owner:
                    chunks = [pad(c, plan.dim, chunk) for c in split_by_plan(ortho, plan)]
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
                out[i] = scatter_over_mesh(result[i], updates[i], plan)
        return out  # type: ignore[return-value]

    def plan(self, param: torch.Tensor) -> Plan:
        """The plan of ``param`` (made once; its owner the least loaded of its holders)."""
        key = id(param)
        if key not in self.plans:
            self.plans[key] = self._make_plan(param)
        return self.plans[key]

    def work(self, param: torch.Tensor) -> tuple[int, ...]:
        """The shape Newton-Schulz sees of ``param``: its blocks as a stack, else itself."""
        return blocked(param.shape, self.blocks.get(id(param)))

    def _next(self, ranks: tuple[int, ...], shape: tuple[int, ...]) -> int:
        """The owner (an index into ``ranks``) of the next matrix those ranks hold: the one
        with the least Newton-Schulz work so far, the lowest on a tie."""
        load = self._load.setdefault(ranks, [0.0] * len(ranks))
        owner = min(range(len(ranks)), key=lambda r: (load[r], r))
        load[owner] += newton_schulz_flops(shape)
        return owner

    def _assign(self, plan: Plan, group: dist.ProcessGroup, shape: tuple[int, ...]) -> Plan:
        plan.group = group
        plan.owner = self._next(tuple(dist.get_process_group_ranks(group)), shape)
        plan.is_owner = dist.get_rank(group) == plan.owner
        return plan

    def _make_plan(self, param: torch.Tensor) -> Plan:
        if not isinstance(param, DTensor):
            group = self.replica_group
            if group is None or dist.get_world_size(group) == 1:
                return Plan("local")
            return self._assign(Plan("replicated"), group, self.work(param))
        mesh, placements = param.device_mesh, tuple(param.placements)
        matrix_dims = {param.ndim - 2, param.ndim - 1}
        # FSDP over TP's shards splits with _StridedShard, which is not a Shard.
        on_matrix = [
            (i, p)
            for i, p in enumerate(placements)
            if isinstance(p, Shard | _StridedShard)
            and mesh.size(i) > 1
            and placement_dim(p, param.ndim) in matrix_dims
        ]
        if not on_matrix:  # split by expert only: each rank holds whole matrices
            return Plan("local")
        block = self.blocks.get(id(param))
        if block is not None and (plan := self._block_plan(param, on_matrix, block)):
            return plan
        if len(on_matrix) == 1 and type(on_matrix[0][1]) is Shard:
            mesh_dim, placement = on_matrix[0]
            dim = placement_dim(placement, param.ndim)
            n, ranks = param.shape[dim], mesh.size(mesh_dim)
            chunk = math.ceil(n / ranks)
            sizes = [max(0, min(chunk, n - r * chunk)) for r in range(ranks)]
            plan = Plan("sharded", dim=dim, sizes=sizes)
            return self._assign(plan, mesh.get_group(mesh_dim), self.work(param))
        owner = self._next(tuple(mesh.mesh.flatten().tolist()), self.work(param))
        coordinate = mesh.get_coordinate()
        assert coordinate is not None  # a parameter lives on the meshes of its ranks
        coordinates = list(itertools.product(*(range(n) for n in mesh.shape)))
        # Every rank's piece of the whole, as distribute_tensor cuts it; sizes from a meta
        # tensor (no memory), global indices only on the owner.
        key = (tuple(param.shape), mesh.shape, placements)
        if key not in self._counts:
            meta = torch.empty(param.shape, device="meta")
            self._counts[key] = [
                piece(meta, mesh.shape, placements, c).numel() for c in coordinates
            ]
        counts = self._counts[key]
        plan = Plan(
            "gathered",
            mesh=mesh,
            placements=placements,
            owner_coordinate=coordinates[owner],
            is_owner=tuple(coordinate) == coordinates[owner],
            counts=counts,
        )
        if plan.is_owner:
            flat = torch.arange(param.numel(), device=param.device).view(param.shape)
            pieces = [piece(flat, mesh.shape, placements, c).reshape(-1) for c in coordinates]
            plan.index = torch.cat(pieces)
        return plan

    def _block_plan(
        self, param: DTensor, splits: list[tuple[int, Placement]], block: Block
    ) -> Plan | None:
        """A plan that moves less than the whole matrix, when blocks allow one: local when
        every rank's piece is whole blocks; under FSDP x TP, where TP (the inner mesh dim)
        splits the blocks evenly, a gather of TP's piece over the FSDP ranks alone (FSDP
        cuts TP's piece: _StridedShard along the same dim, or Shard along the other).
        None: the whole matrix moves."""
        dim, size = block
        mesh, ndim = param.device_mesh, param.ndim
        if all(placement_dim(p, ndim) == dim for _, p in splits):
            key = (tuple(param.shape), mesh.shape, tuple(param.placements), block)
            if key not in self._whole:  # once per layout and shape, not per layer
                self._whole[key] = whole_blocks(param, dim, size)
            if self._whole[key]:
                return Plan("local")
        if len(splits) != 2:
            return None
        (outer, cut), (inner, heads) = splits
        tp = mesh.size(inner)
        if type(heads) is not Shard or placement_dim(heads, ndim) != dim:
            return None
        if param.shape[dim] % (tp * size):
            return None
        along = placement_dim(cut, ndim)
        if along == dim and not (isinstance(cut, _StridedShard) and cut.split_factor == tp):
            return None
        if along != dim and type(cut) is not Shard:
            return None
        shape = list(param.shape)
        shape[dim] //= tp  # TP's piece, which FSDP's ranks gather
        n, ranks = shape[along], mesh.size(outer)
        chunk = math.ceil(n / ranks)
        sizes = [max(0, min(chunk, n - r * chunk)) for r in range(ranks)]
        plan = Plan("sharded", dim=along, sizes=sizes)
        return self._assign(plan, mesh.get_group(outer), blocked(tuple(shape), block))


def newton_schulz_flops(shape: torch.Size | tuple[int, ...]) -> float:
    """FLOPs of one Newton-Schulz iteration on a matrix of ``shape`` (or a stack of them):
    X X^T, its square and the product with X, on the wide orientation (m <= n)."""
    m, n = sorted(shape[-2:])
    return math.prod(shape[:-2]) * (4 * m * m * n + 2 * m**3)


Block = tuple[int, int]
"""(dim, size): a matrix cut into blocks of ``size`` rows (dim 0) or columns (dim 1)."""


def blocked(shape: Sequence[int], block: Block | None) -> tuple[int, ...]:
    """The shape of a matrix's blocks as a stack ([blocks, rows, cols]); ``shape`` if none."""
    if block is None:
        return tuple(shape)
    dim, size = block
    rows, cols = shape
    return (rows // size, size, cols) if dim == 0 else (cols // size, rows, size)


def in_blocks(
    newton_schulz: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, block: Block | None
) -> torch.Tensor:
    """``newton_schulz`` of each block of the matrix ``x`` on its own, put back in place."""
    if block is None:
        return newton_schulz(x)
    dim, size = block
    stack = x.unflatten(dim, (-1, size)).movedim(dim, 0)
    return newton_schulz(stack).movedim(0, dim).flatten(dim, dim + 1)


def whole_blocks(param: DTensor, dim: int, size: int) -> bool:
    """Whether every rank's piece of ``param`` (a matrix split along ``dim`` only) is made of
    whole blocks of ``size``; found from an index view (no memory), the same on every rank."""
    mesh = param.device_mesh
    index = torch.arange(param.shape[dim]).view([-1 if d == dim else 1 for d in range(2)])
    index = index.expand(param.shape)
    for coordinate in itertools.product(*(range(n) for n in mesh.shape)):
        held = piece(index, mesh.shape, tuple(param.placements), coordinate)
        rows = held.narrow(1 - dim, 0, 1).reshape(-1) if held.numel() else held.reshape(-1)
        if rows.numel() % size:
            return False
        starts = rows.view(-1, size)
        if (starts[:, 0] % size).any() or (starts - starts[:, :1] != torch.arange(size)).any():
            return False
    return True
