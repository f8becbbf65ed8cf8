"""Collectives outside the backward pass: the construction-time agreement check and
coalesced broadcast of the engine, and the after-backward all-reduce that the pipeline and
tensor parallelism use for gradients the engine does not overlap. ``local_tensor`` is what
each of them sends of a (possibly DTensor) tensor: this rank's shard.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

_MIB = 1024 * 1024
# Construction and buffer broadcasts are flattened into chunks of at most this size, so a
# large model needs a few big collectives instead of one per tensor.
_BROADCAST_CHUNK_BYTES = 250 * _MIB


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: the local shard of a DTensor, else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor gathered (a loss or logits under loss parallelism), else
    the tensor itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def all_reduce_after_backward(
    grads: list[torch.Tensor], group: dist.ProcessGroup, divide_by: int = 1
) -> None:
    """Sum (then divide) gradients over ``group`` once backward is over, in flat buckets of
    at most 25 MiB of one dtype: for what the engine does not overlap with backward."""
    local = [local_tensor(g) for g in grads]
    for bucket in flat_buckets(local, 25 * _MIB):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, dist.ReduceOp.SUM, group=group)
        if divide_by != 1:
            flat /= divide_by
        for g, piece in zip(bucket, flat.split([g.numel() for g in bucket]), strict=True):
            g.copy_(piece.view_as(g))


def flat_buckets(tensors: list[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive groups of same-dtype tensors of at most ``cap_bytes`` each."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not buckets or size + nbytes > cap_bytes or buckets[-1][0].dtype != t.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += nbytes
    return buckets


@torch.no_grad()
def broadcast_coalesced(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None, src: int = 0
) -> None:
    """Overwrite ``tensors`` with the group's rank ``src`` values, a few big messages at a time."""
    by_key: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        if tensor.numel() > 0:
            by_key.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for group_tensors in by_key.values():
        chunk: list[torch.Tensor] = []
        chunk_bytes = 0
        for tensor in [*group_tensors, None]:
            nbytes = 0 if tensor is None else tensor.numel() * tensor.element_size()
            if chunk and (tensor is None or chunk_bytes + nbytes > _BROADCAST_CHUNK_BYTES):
                flat = torch.cat([t.reshape(-1) for t in chunk])
                dist.broadcast(flat, group=group, group_src=src)
                for t, piece in zip(chunk, flat.split([t.numel() for t in chunk]), strict=True):
                    t.copy_(piece.view_as(t))
                chunk, chunk_bytes = [], 0
            if tensor is not None:
                chunk.append(tensor)
                chunk_bytes += nbytes


def check_same_parameters(
    names: Sequence[str], locals_: Sequence[torch.Tensor], group: dist.ProcessGroup | None
) -> None:
    """Raise on every rank, naming the first differing parameter, unless all ranks agree.

    Each rank encodes (ndim, shape, dtype) of its local tensors as integers; an element-wise
    MAX of the encoding and of its negation gives every rank the same max and min, so all
    ranks find the same first difference and raise together instead of hanging later.
    """
    rank = dist.get_rank(group)
    encoding: list[int] = []
    owner: list[int] = []
    for index, local in enumerate(locals_):
        entry = [local.dim(), *local.shape, zlib.crc32(str(local.dtype).encode())]
        encoding += entry
        owner += [index] * len(entry)
    device = locals_[0].device
    longest_t = torch.tensor([len(encoding)], dtype=torch.int64, device=device)
    dist.all_reduce(longest_t, op=dist.ReduceOp.MAX, group=group)
    longest = int(longest_t[0])
    padded = encoding + [-1] * (longest - len(encoding))
    both = torch.tensor(padded + [-v for v in padded], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    differing = (both[:longest] != -both[longest:]).nonzero()
    if differing.numel() == 0:
        return
    position = int(differing[0])
    if position >= len(encoding):
        raise RuntimeError(
            f"BucketedDDP: ranks hold different numbers of parameters ({len(locals_)} on rank "
            f"{rank}); the module must be identical on every rank"
        )
    index = owner[position]
    local = locals_[index]
    raise RuntimeError(
        f"BucketedDDP: parameter '{names[index]}' has local shape {tuple(local.shape)} and "
        f"dtype {local.dtype} on rank {rank}, but the ranks of the data-parallel group disagree "
        "on it; the module must be identical on every rank"
    )
