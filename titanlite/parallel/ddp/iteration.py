"""One synchronised iteration of the data-parallel engine, from forward to the end of
backward: which gradients and buckets are ready (``Iteration``), when each bucket was
launched and finished (``IterationStats``), and which parameters the backward of a forward's
output can reach at all (``reached_leaves``: the unused ones are marked ready at once).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

import torch


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
