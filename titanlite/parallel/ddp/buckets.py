"""Where the data-parallel engine's gradients live: the parameters it averages, their
grouping into buckets (by size, dtype and device, in expected ready order) and one flat
buffer per bucket whose slices are the gradients.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.parallel.ddp.collectives import local_tensor


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
