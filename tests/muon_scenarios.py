"""Pool scenarios for Muon's distributed orthogonalization (workers import only this module)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from titanlite.optim.muon import NewtonSchulz
from titanlite.optim.orthogonalize import Orthogonalizer, in_blocks

NS = NewtonSchulz()


def orthogonalizes_whole_matrices_once(rank: int, world: int) -> dict:
    """On 4 ranks: matrices split in every way a layout splits them (FSDP rows, uneven rows
    with a rank holding none, TP columns, HSDP, FSDP x TP on a 2 x 2 mesh (FSDP's strided
    split of TP's rows included), expert stacks
    split by expert, plain replicas). Each rank's result must equal its shard of the
    orthogonalized whole matrix bit for bit, and each rank must orthogonalize its share only.
    Returns {"plans": kinds by case, "owned": matrices this rank orthogonalized}."""
    assert world == 4
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    square = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    torch.manual_seed(0)  # the same whole matrices on every rank
    cases = {
        "fsdp rows": (flat, [Shard(0)], torch.randn(12, 8)),
        "fsdp uneven rows": (flat, [Shard(0)], torch.randn(5, 16)),
        "tp columns": (flat, [Shard(1)], torch.randn(8, 20)),
        "hsdp": (square, [Replicate(), Shard(0)], torch.randn(10, 6)),
        "fsdp x tp": (square, [Shard(0), Shard(1)], torch.randn(8, 12)),
        "two splits of rows": (square, [Shard(0), Shard(0)], torch.randn(16, 4)),
        "fsdp x tp, strided rows": (
            square,
            [_StridedShard(0, split_factor=2), Shard(0)],
            torch.randn(8, 6),
        ),
        "experts by expert": (flat, [Shard(0)], torch.randn(8, 6, 10)),
        "experts by rows": (square, [Shard(0), Shard(1)], torch.randn(4, 6, 10)),
    }
    params, pairs, expected = [], [], []
    for mesh, placements, whole in cases.values():
        param = distribute_tensor(torch.zeros_like(whole), mesh, placements)
        update = distribute_tensor(whole, mesh, placements).to_local()
        params.append(param)
        pairs.append((param, update))
        expected.append(distribute_tensor(NS(whole), mesh, placements).to_local())
    replicas = [torch.randn(6, 9) for _ in range(4)]
    plain = Orthogonalizer(NS, replica_group=dist.group.WORLD)
    replica_out = plain([(torch.zeros(6, 9), r) for r in replicas])
    for got, whole in zip(replica_out, replicas, strict=True):
        assert torch.equal(got, NS(whole)), "replicated"
    ortho = Orthogonalizer(NS)
    got = ortho(pairs)
    for name, g, e in zip(cases, got, expected, strict=True):
        assert g.shape == e.shape and torch.equal(g, e), f"{name}: rank {rank} differs"
    owned = sum(ortho.plan(p).is_owner for p in params)
    return {
        "plans": {name: ortho.plan(p).kind for name, p in zip(cases, params, strict=True)},
        "owned": owned,
        "replicas_owned": sum(plan.is_owner for plan in plain.plans.values()),
    }


def orthogonalizes_head_blocks(rank: int, world: int) -> dict[str, str]:
    """On 4 ranks, matrices cut into heads (blocks of rows, or of columns) and split as
    layouts split them: each rank's result must be its piece of the whole matrix's heads
    orthogonalized one by one, and the plan must move no more than the heads need (local
    where every piece is whole heads; FSDP x TP: TP's piece gathered over FSDP only).
    Returns the plan kind of each case."""
    assert world == 4
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    square = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    strided = [_StridedShard(0, split_factor=2), Shard(0)]  # FSDP over TP's rows
    torch.manual_seed(0)
    cases = {  # mesh, placements, whole matrix, (dim, head size)
        "tp rows": (flat, [Shard(0)], torch.randn(32, 12), (0, 4)),
        "fsdp whole heads": (square, [Replicate(), Shard(0)], torch.randn(32, 12), (0, 8)),
        "fsdp split heads": (flat, [Shard(0)], torch.randn(24, 12), (0, 8)),
        "fsdp x tp rows": (square, strided, torch.randn(32, 12), (0, 8)),
        "fsdp x tp split heads": (square, strided, torch.randn(16, 12), (0, 8)),
        "fsdp x tp columns": (square, [Shard(0), Shard(1)], torch.randn(12, 16), (1, 8)),
        "fsdp x tp rows, 3 per tp rank": (square, strided, torch.randn(12, 12), (0, 4)),
    }
    params, pairs, expected, blocks = [], [], [], {}
    for mesh, placements, whole, block in cases.values():
        param = distribute_tensor(torch.zeros_like(whole), mesh, placements)
        blocks[id(param)] = block
        params.append(param)
        pairs.append((param, distribute_tensor(whole, mesh, placements).to_local()))
        heads = in_blocks(NS, whole, block)
        expected.append(distribute_tensor(heads, mesh, placements).to_local())
    ortho = Orthogonalizer(NS, blocks=blocks)
    for name, got, want in zip(cases, ortho(pairs), expected, strict=True):
        assert got.shape == want.shape, name
        assert (got - want).abs().max().item() <= 1e-6, f"{name}: rank {rank} differs"
    return {name: ortho.plan(p).kind for name, p in zip(cases, params, strict=True)}
