"""Per-bucket communication hooks for :class:`titanlite.parallel.ddp.engine.BucketedDDP`.

The contract is small on purpose. A hook is a callable ``hook(state, bucket) -> Future``:

- ``state`` is whatever object was given to ``register_comm_hook`` (may be ``None``); the engine
  never looks inside it, so a hook can keep error-feedback buffers or counters there.
- ``bucket`` is a :class:`GradBucket`. Its ``buffer`` holds this rank's local gradient *sums*
  for the bucket, **not yet divided by the group size**: when a hook is registered the engine
  skips its own pre-division, so the hook decides where the division happens (before a
  compressing cast, for example, to keep values in range).
- The hook must launch its communication asynchronously (``async_op=True``) and return a
  ``torch.futures.Future`` whose value is the *averaged* gradient as one flat tensor with
  ``buffer.numel()`` elements. Returning ``buffer`` itself (reduced in place) avoids a copy;
  any other tensor is copied into ``buffer`` by the engine when backward finishes.

Hooks are called during backward, on the autograd thread, strictly in bucket-index order and
exactly once per bucket per synchronised iteration, on every rank of the group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CommHook", "GradBucket", "allreduce_hook", "bf16_compress_hook"]


@dataclass(frozen=True)
class GradBucket:
    """What a communication hook sees of one bucket."""

    index: int
    """Position of the bucket in launch order (0 is launched first)."""
    buffer: torch.Tensor
    """Flat local gradient sums of the bucket's parameters (not divided by world_size)."""
    parameter_names: tuple[str, ...]
    """Names of the parameters whose gradients live in ``buffer``, in buffer order."""
    process_group: dist.ProcessGroup | None
    """The data-parallel group to reduce over (``None`` means the default group)."""
    world_size: int
    """Number of ranks in ``process_group``."""


CommHook = Callable[[Any, GradBucket], torch.futures.Future]


def allreduce_hook(state: Any, bucket: GradBucket) -> torch.futures.Future:
    """Average the bucket exactly; the same result as running without a hook."""
    bucket.buffer.div_(bucket.world_size)
    work = dist.all_reduce(bucket.buffer, group=bucket.process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def bf16_compress_hook(state: Any, bucket: GradBucket) -> torch.futures.Future:
    """Average the bucket in bfloat16: half the bytes on the wire, about 3 significant digits.

    The division happens before the cast so large sums do not lose range; the reduced values
    are written back into the full-precision bucket, which keeps ``param.grad`` a view.
    """
    compressed = bucket.buffer.to(torch.bfloat16).div_(bucket.world_size)
    work = dist.all_reduce(compressed, group=bucket.process_group, async_op=True)
    buffer = bucket.buffer

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return work.get_future().then(decompress)
