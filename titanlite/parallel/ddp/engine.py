"""Bucketed, overlapped data parallelism: the algorithm of the PyTorch DDP paper, in Python.

``BucketedDDP`` wraps a module replicated on every rank of a data-parallel group and averages
its gradients over that group during backward: gradients are packed into flat buckets (views,
no extra memory), each bucket is all-reduced asynchronously as soon as its gradients are ready
(in bucket order, so every rank issues the same collectives), a callback at the end of
backward waits for the reductions, and after the first iteration the buckets are rebuilt in the
observed ready order. docs/ddp.md describes the algorithm step by step, how to use it and how
to pick ``bucket_cap_mb``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titanlite.parallel.ddp.buckets import trainable_parameters
from titanlite.parallel.ddp.collectives import (
    broadcast_coalesced,
    check_same_parameters,
    local_tensor,
)
from titanlite.parallel.ddp.comm_hooks import CommHook
from titanlite.parallel.ddp.iteration import IterationStats
from titanlite.parallel.ddp.reducer import Reducer

__all__ = ["BucketedDDP"]

logger = logging.getLogger(__name__)

_MIB = 1024 * 1024


class BucketedDDP(nn.Module):
    """Data parallelism with bucketed, overlapped gradient all-reduce (see the module docstring).

    Args:
        module: the model replica on this rank. Parameters may be DTensors (tensor
            parallelism); then their local shards are bucketed and reduced over
            ``process_group`` only.
        process_group: the data-parallel group (``None``: the default group), e.g.
            ``mesh["dp_replicate"].get_group()``.
        bucket_cap_mb: size of a bucket in MiB (all but the first).
        first_bucket_cap_mb: size of the first bucket in MiB; small so the first all-reduce
            starts early in backward.
        find_unused_parameters: walk the autograd graph after each forward and treat
            parameters it cannot reach as ready (with zero gradient) so their buckets still
            launch. Costs a graph traversal per iteration; leave off when every parameter
            always gets a gradient.
        broadcast_buffers: broadcast buffers from the group's first rank before each forward.
        gradient_as_bucket_view: make each ``param.grad`` a view into its bucket (no extra
            gradient memory, no copy back after the reduction).
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
        *,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        gradient_as_bucket_view: bool = True,
    ) -> None:
        super().__init__()
        if bucket_cap_mb <= 0 or first_bucket_cap_mb <= 0:
            raise ValueError("bucket_cap_mb and first_bucket_cap_mb must be positive")
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.bucket_cap_bytes = max(1, int(bucket_cap_mb * _MIB))
        self.first_bucket_cap_bytes = max(1, int(first_bucket_cap_mb * _MIB))
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.gradient_as_bucket_view = gradient_as_bucket_view

        names, params = trainable_parameters(module)
        if not params:
            raise ValueError("BucketedDDP: the module has no parameter that requires grad")
        with torch.no_grad():
            locals_ = [local_tensor(p) for p in params]
        check_same_parameters(names, locals_, process_group)
        if self.world_size > 1:
            buffers = [local_tensor(b) for b in module.buffers()]
            broadcast_coalesced([*locals_, *buffers], process_group)

        self._require_sync = True
        self._reducer = Reducer(
            names,
            params,
            locals_,
            process_group,
            first_bucket_cap_bytes=self.first_bucket_cap_bytes,
            bucket_cap_bytes=self.bucket_cap_bytes,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
        )
        logger.info(
            "BucketedDDP: %d parameters in %d buckets over %d ranks",
            len(params),
            len(self._reducer.buckets),
            self.world_size,
        )

    # ----- the wrapped module, seen without a prefix -------------------------------------------

    def __getattr__(self, name: str) -> Any:
        # Attributes the wrapper lacks resolve on the wrapped module, so FQN-walking code
        # (distributed checkpointing, the trainer) sees the same names with or without it.
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped module's state dict: no ``module.`` prefix, so checkpoints are portable."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load into the wrapped module (keys without a ``module.`` prefix)."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The wrapped module's parameters, named without a ``module.`` prefix."""
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The wrapped module's buffers, named without a ``module.`` prefix."""
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    # ----- public controls ----------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forwards run inside this context accumulate gradients locally, without communication.

        The forward decides: a backward of an output produced inside the context does not
        communicate, wherever the backward is called. The next synchronised iteration reduces
        the accumulated sum.
        """
        previous = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = previous

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduce each bucket with ``hook(state, bucket)`` (contract in comm_hooks.py)."""
        self._reducer.set_comm_hook(state, hook)

    def keep_buckets(self) -> None:
        """Never rebuild the buckets in the observed order: keep the first layout (replica
        groups: a group that rejoins must pack its gradients as the others do)."""
        self._reducer.record_order = False

    def last_iteration_stats(self) -> IterationStats | None:
        """Launch and completion times of each bucket in the last synchronised iteration."""
        return self._reducer.last_stats

    @property
    def buckets_rebuilt(self) -> bool:
        """Whether the buckets were rebuilt in the ready order the first backward showed."""
        return self._reducer.buckets_rebuilt

    def bucket_parameter_names(self) -> list[list[str]]:
        """The names of the parameters in each bucket, in launch order."""
        names = self._reducer.names
        return [[names[i] for i in b.indices] for b in self._reducer.buckets]

    def bucket_buffers(self) -> list[torch.Tensor]:
        """The flat gradient buffer of each bucket, in launch order."""
        return [b.buffer for b in self._reducer.buckets]

    # ----- forward --------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        reducer = self._reducer
        grad_enabled = torch.is_grad_enabled()
        if reducer.iteration is not None and grad_enabled:
            # A forward without grad creates no hooks to confuse with the pending ones.
            reducer.raise_unfinished_reduction()
        if grad_enabled and reducer.rebuild_pending:
            reducer.rebuild_buckets()
            logger.info(
                "BucketedDDP: rebuilt %d buckets in gradient-ready order", len(reducer.buckets)
            )
        if self.broadcast_buffers and self.world_size > 1:
            buffers = [local_tensor(b) for b in self.module.buffers()]
            if buffers:
                broadcast_coalesced(buffers, self.process_group)
        output = self.module(*args, **kwargs)
        if grad_enabled and self._require_sync:
            reducer.prepare_for_backward(output)
        return output
