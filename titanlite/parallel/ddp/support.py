"""Building blocks of the data-parallel engine (ddp.py, ddp_reducer.py) that need no engine state.

Parameter collection, bucket assignment and allocation, the per-iteration bookkeeping and
timing record, graph traversal for unused parameters, and the construction-time collectives
(parameter agreement check, coalesced broadcast).
"""

from __future__ import annotations

import zlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

_MIB = 1024 * 1024
# Construction and buffer broadcasts are flattened into chunks of at most this size, so a
# large model needs a few big collectives instead of one per tensor.
_BROADCAST_CHUNK_BYTES = 250 * _MIB


def trainable_parameters(module: nn.Module) -> tuple[list[str], list[torch.Tensor]]:
    """(names, parameters) that require grad, each once (tied weights are one tensor), in
    ``named_modules()`` / ``named_parameters(recurse=False)`` registration order."""
    names: list[str] = []
    params: list[torch.Tensor] = []
    seen: set[int] = set()
    for module_name, submodule in module.named_modules():
        for param_name, param in submodule.named_parameters(recurse=False):
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                names.append(f"{module_name}.{param_name}" if module_name else param_name)
                params.append(param)
    return names, params


def assign_buckets(
    sizes: Sequence[int],
    keys: Sequence[Hashable],
    order: Sequence[int],
    *,
    first_cap: int,
    cap: int,
) -> list[list[int]]:
    """Group tensor indices into buckets, walking them in ``order``.

    ``sizes`` are bytes and ``keys`` the (dtype, device) of each tensor; only tensors with equal
    keys share a bucket. For each key the first bucket closes once it holds ``first_cap`` bytes
    and later ones at ``cap`` bytes; a tensor larger than the current cap gets a bucket of its
    own. Buckets are returned in the order in which their first tensor appears in ``order``,
    which is the order their gradients are expected to become ready.
    """
    position = {index: pos for pos, index in enumerate(order)}
    open_buckets: dict[Hashable, list[int]] = {}
    open_bytes: dict[Hashable, int] = {}
    closed_per_key: dict[Hashable, int] = {}
    buckets: list[list[int]] = []

    def limit(key: Hashable) -> int:
        return first_cap if closed_per_key.get(key, 0) == 0 else cap

    def close(key: Hashable) -> None:
        buckets.append(open_buckets.pop(key))
        open_bytes[key] = 0
        closed_per_key[key] = closed_per_key.get(key, 0) + 1

    for index in order:
        key = keys[index]
        if open_buckets.get(key) and sizes[index] > limit(key):
            close(key)
        open_buckets.setdefault(key, []).append(index)
        open_bytes[key] = open_bytes.get(key, 0) + sizes[index]
        if open_bytes[key] >= limit(key):
            close(key)
    buckets.extend(open_buckets.values())
    buckets.sort(key=lambda bucket: position[bucket[0]])
    return buckets


@dataclass
class Bucket:
    indices: list[int]
    buffer: torch.Tensor


def grad_like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A gradient tensor for ``param`` whose (local) storage is ``local``."""
    if isinstance(param, DTensor):
        return DTensor.from_local(
            local,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    return local


@torch.no_grad()
def allocate_buckets(
    assignment: list[list[int]],
    params: Sequence[torch.Tensor],
    locals_: Sequence[torch.Tensor],
    as_view: bool,
) -> tuple[list[Bucket], list[torch.Tensor], list[int]]:
    """One flat buffer per bucket: (buckets, each parameter's slot view, its bucket index).

    With ``as_view`` an existing gradient is copied into its slot and ``.grad`` re-pointed
    at it, so gradients live in the buckets from then on.
    """
    buckets: list[Bucket] = []
    slots: list[torch.Tensor] = [torch.empty(0)] * len(locals_)
    bucket_of: list[int] = [0] * len(locals_)
    for bucket_index, indices in enumerate(assignment):
        first = locals_[indices[0]]
        numels = [locals_[i].numel() for i in indices]
        buffer = torch.zeros(sum(numels), dtype=first.dtype, device=first.device)
        offset = 0
        for i, numel in zip(indices, numels, strict=True):
            slot = buffer[offset : offset + numel].view(locals_[i].shape)
            offset += numel
            slots[i] = slot
            bucket_of[i] = bucket_index
            grad = params[i].grad
            if grad is not None and as_view:
                slot.copy_(local_tensor(grad))
                params[i].grad = grad_like(params[i], slot)
        buckets.append(Bucket(indices, buffer))
    return buckets, slots, bucket_of


class Iteration:
    """Bookkeeping of one synchronised iteration, from forward to the end of backward."""

    __slots__ = (
        "ready",
        "pending",
        "next_to_launch",
        "next_to_check",
        "futures",
        "fixups",
        "callback_queued",
        "used_map",
        "used_work",
        "stats",
    )

    def __init__(self, num_params: int, bucket_sizes: list[int], stats: IterationStats) -> None:
        self.ready = [False] * num_params
        self.pending = bucket_sizes
        self.next_to_launch = 0
        self.next_to_check = 0
        self.futures: list[torch.futures.Future | None] = [None] * len(bucket_sizes)
        self.fixups: list[int] = []
        self.callback_queued = False
        self.used_map: torch.Tensor | None = None
        self.used_work: Any = None
        self.stats = stats


@dataclass
class IterationStats:
    """Timestamps (``time.perf_counter()`` seconds) of one synchronised iteration.

    ``bucket_done_s`` is when the engine first saw the bucket's reduction complete (it checks
    at each later launch and while waiting at the end of backward), so it is an upper bound on
    the true completion time. On NCCL all times are host-side.
    """

    bucket_bytes: list[int]
    bucket_launch_s: list[float | None] = field(default_factory=list)
    bucket_done_s: list[float | None] = field(default_factory=list)
    backward_start_s: float | None = None
    """When the first gradient of this iteration became ready."""
    backward_end_s: float | None = None
    """When autograd finished computing gradients (before waiting for communication)."""
    finished_s: float | None = None
    """When every reduction had finished and gradients were final."""

    def launched_before_backward_end(self) -> int:
        """How many buckets were already on the wire while backward was still computing."""
        end = self.backward_end_s
        return sum(1 for t in self.bucket_launch_s if t is not None and end is not None and t < end)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: the local shard of a DTensor, else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def all_reduce_after_backward(
    grads: list[torch.Tensor], group: dist.ProcessGroup, divide_by: int = 1
) -> None:
    """Sum (then divide) gradients over ``group`` once backward is over, in flat buckets of
    at most 25 MiB of one dtype: for what the engine does not overlap with backward."""
    local = [local_tensor(g) for g in grads]
    for bucket in _flat_buckets(local, 25 * _MIB):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, dist.ReduceOp.SUM, group=group)
        if divide_by != 1:
            flat /= divide_by
        for g, piece in zip(bucket, flat.split([g.numel() for g in bucket]), strict=True):
            g.copy_(piece.view_as(g))


def _flat_buckets(tensors: list[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
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


def _collect_tensors(obj: Any, out: list[torch.Tensor]) -> None:
    """Find every tensor in a forward output (nested lists, tuples, dicts, dataclasses)."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _collect_tensors(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            _collect_tensors(item, out)
    elif is_dataclass(obj) and not isinstance(obj, type):
        for f in fields(obj):
            _collect_tensors(getattr(obj, f.name), out)


def reached_leaves(output: Any) -> set[int]:
    """ids of the leaf tensors that backward from ``output`` can reach."""
    tensors: list[torch.Tensor] = []
    _collect_tensors(output, tensors)
    reached = {id(t) for t in tensors if t.requires_grad and t.grad_fn is None}
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    seen = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            reached.add(id(variable))
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    return reached


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
