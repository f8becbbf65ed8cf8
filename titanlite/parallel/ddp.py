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
import functools
import logging
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.parallel.comm_hooks import CommHook, GradBucket, bf16_compress_hook
from titanlite.parallel.ddp_support import (
    Iteration,
    IterationStats,
    allocate_buckets,
    assign_buckets,
    broadcast_coalesced,
    check_same_parameters,
    grad_like,
    local_tensor,
    reached_leaves,
    trainable_parameters,
)

__all__ = [
    "BucketedDDP",
    "CommHook",
    "GradBucket",
    "IterationStats",
    "assign_buckets",
    "bf16_compress_hook",
]

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
        self._param_names = names
        self._params = params
        with torch.no_grad():
            self._locals = [local_tensor(p) for p in params]
        self._comm_device = self._locals[0].device

        check_same_parameters(self._param_names, self._locals, process_group)
        if self.world_size > 1:
            buffers = [local_tensor(b) for b in module.buffers()]
            broadcast_coalesced([*self._locals, *buffers], process_group)

        self._comm_hook: CommHook | None = None
        self._comm_hook_state: Any = None
        # The group object itself: calling its allreduce skips the Python wrapper of
        # dist.all_reduce, which matters on the per-bucket hot path.
        self._group = process_group if process_group is not None else dist.group.WORLD
        self._is_dtensor = [isinstance(p, DTensor) for p in params]
        self._divisor = self.world_size  # gradients are pre-divided as they are marked ready
        self._require_sync = True
        # State of the synchronised iteration in flight (None between iterations). A plain
        # object, not module attributes: nn.Module.__setattr__ is slow on the hot path.
        self._iteration: Iteration | None = None
        self._last_stats: IterationStats | None = None
        # Bucket rebuild: record the ready order during the first synchronised backward.
        self._record_order = True
        self._ready_order: list[int] = []
        self._rebuild_pending = False
        self.buckets_rebuilt = False

        self._build_buckets(list(reversed(range(len(params)))))
        self_ref = weakref.ref(self)
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(functools.partial(_grad_hook, self_ref, i))
            for i, p in enumerate(params)
        ]
        logger.info(
            "BucketedDDP: %d parameters in %d buckets over %d ranks",
            len(params),
            len(self._buckets),
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
        if self._iteration is not None:
            raise RuntimeError("register_comm_hook must not be called between forward and backward")
        self._comm_hook = hook
        self._comm_hook_state = state
        self._divisor = 1  # a hook receives local sums and does its own averaging

    def last_iteration_stats(self) -> IterationStats | None:
        """Launch and completion times of each bucket in the last synchronised iteration."""
        return self._last_stats

    def bucket_parameter_names(self) -> list[list[str]]:
        """The names of the parameters in each bucket, in launch order."""
        return [[self._param_names[i] for i in b.indices] for b in self._buckets]

    def bucket_buffers(self) -> list[torch.Tensor]:
        """The flat gradient buffer of each bucket, in launch order."""
        return [b.buffer for b in self._buckets]

    # ----- forward --------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        grad_enabled = torch.is_grad_enabled()
        if self._iteration is not None and grad_enabled:
            # A forward without grad creates no hooks to confuse with the pending ones.
            self._raise_unfinished_reduction()
        if grad_enabled and self._rebuild_pending:
            self._rebuild_buckets()
        if self.broadcast_buffers and self.world_size > 1:
            buffers = [local_tensor(b) for b in self.module.buffers()]
            if buffers:
                broadcast_coalesced(buffers, self.process_group)
        output = self.module(*args, **kwargs)
        if grad_enabled and self._require_sync:
            self._prepare_for_backward(output)
        return output

    # ----- internals --------------------------------------------------------------------------------

    def _build_buckets(self, order: list[int]) -> None:
        """(Re)allocate the flat buffers for ``order`` and point gradients into them."""
        locals_ = self._locals
        sizes = [t.numel() * t.element_size() for t in locals_]
        keys = [(t.dtype, t.device) for t in locals_]
        assignment = assign_buckets(
            sizes, keys, order, self.first_bucket_cap_bytes, self.bucket_cap_bytes
        )
        self._buckets, self._slots, self._bucket_of = allocate_buckets(
            assignment, self._params, locals_, self.gradient_as_bucket_view
        )

    def _rebuild_buckets(self) -> None:
        """Re-bucket in the observed ready order, taking the group's first rank's order."""
        self._rebuild_pending = False
        observed = set(self._ready_order)
        order = self._ready_order + [
            i for i in reversed(range(len(self._params))) if i not in observed
        ]
        order_tensor = torch.tensor(order, dtype=torch.int64, device=self._comm_device)
        if self.world_size > 1:
            dist.broadcast(order_tensor, group=self.process_group, group_src=0)
        self._build_buckets(order_tensor.tolist())
        self.buckets_rebuilt = True
        logger.info("BucketedDDP: rebuilt %d buckets in gradient-ready order", len(self._buckets))

    def _prepare_for_backward(self, output: Any) -> None:
        stats = IterationStats([b.buffer.numel() * b.buffer.element_size() for b in self._buckets])
        stats.bucket_launch_s = [None] * len(self._buckets)
        stats.bucket_done_s = [None] * len(self._buckets)
        it = Iteration(len(self._params), [len(b.indices) for b in self._buckets], stats)
        self._iteration = it
        if self._record_order:
            self._ready_order = []
        if not self.find_unused_parameters:
            return
        reached = reached_leaves(output)
        unused = [i for i, p in enumerate(self._params) if id(p) not in reached]
        # A parameter no rank used in this graph and no rank holds a gradient for keeps
        # .grad = None, as with torch DDP. One that holds a gradient (accumulated under
        # no_sync, or zeroed in place) counts as used, so that gradient gets averaged.
        used = torch.ones(len(self._params), dtype=torch.int32, device=self._comm_device)
        without_grad = [i for i in unused if self._params[i].grad is None]
        if without_grad:
            used[without_grad] = 0
        it.used_map = used
        it.used_work = self._group.allreduce([used])
        with torch.no_grad():
            for index in unused:
                self._mark_ready(it, index)

    def _on_grad_ready(self, index: int) -> None:
        # Runs inside backward (grad mode is off there), once per parameter per backward.
        it = self._iteration
        if it is None:
            return  # the forward ran under no_sync (or without grad): accumulate locally
        if not it.callback_queued:
            # Queued from inside backward so it runs once the whole graph task has finished.
            it.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            if it.stats.backward_start_s is None:
                it.stats.backward_start_s = time.perf_counter()
        if it.ready[index]:
            raise RuntimeError(
                f"BucketedDDP: parameter '{self._param_names[index]}' received a gradient twice "
                "in one iteration (reentrant activation checkpointing, or backward run twice "
                "through one forward); use torch.utils.checkpoint with use_reentrant=False"
            )
        if self._record_order:
            self._ready_order.append(index)
        self._mark_ready(it, index)

    def _mark_ready(self, it: Iteration, index: int) -> None:
        """Put parameter ``index``'s local gradient into its slot; launch what is ready."""
        it.ready[index] = True
        slot = self._slots[index]
        param = self._params[index]
        grad = param.grad
        if grad is None:
            # Unused here: contribute zeros, and fix .grad up once the average is known.
            slot.zero_()
            it.fixups.append(index)
        else:
            # Dividing here, fused with the copy when there is one, saves a separate pass
            # over the bucket; dividing before the sum keeps low-precision sums in range.
            divisor = self._divisor
            if self._is_dtensor[index] and grad.placements != param.placements:
                # TP can produce a gradient laid out unlike its parameter (the vocab-parallel
                # embedding's comes back Replicate); take this rank's shard of it.
                grad = grad.redistribute(param.device_mesh, param.placements)
            local = grad.to_local() if self._is_dtensor[index] else grad
            if local.data_ptr() == slot.data_ptr():
                if divisor != 1:
                    slot.div_(divisor)
            else:
                # A fresh gradient (after zero_grad(set_to_none=True)) or a separate one
                # (gradient_as_bucket_view=False): copy it in, and re-point .grad at the view.
                if divisor != 1:
                    torch.div(local, divisor, out=slot)
                else:
                    slot.copy_(local)
                if self.gradient_as_bucket_view:
                    param.grad = grad_like(self._params[index], slot)
                else:
                    it.fixups.append(index)
        bucket_index = self._bucket_of[index]
        pending = it.pending
        pending[bucket_index] -= 1
        if pending[bucket_index] == 0:
            # Launch strictly in index order so every rank issues the same collectives.
            while it.next_to_launch < len(pending) and pending[it.next_to_launch] == 0:
                self._launch(it, it.next_to_launch)
                it.next_to_launch += 1

    def _launch(self, it: Iteration, bucket_index: int) -> None:
        bucket = self._buckets[bucket_index]
        it.stats.bucket_launch_s[bucket_index] = time.perf_counter()
        if self._comm_hook is None:
            future = self._group.allreduce([bucket.buffer]).get_future()
        else:
            view = GradBucket(
                index=bucket_index,
                buffer=bucket.buffer,
                parameter_names=tuple(self._param_names[i] for i in bucket.indices),
                process_group=self.process_group,
                world_size=self.world_size,
            )
            future = self._comm_hook(self._comm_hook_state, view)
        it.futures[bucket_index] = future
        # Note completions by polling rather than with future callbacks: a Python callback
        # would make the communication thread wait for the GIL before its next collective.
        done = it.stats.bucket_done_s
        while it.next_to_check < bucket_index and it.futures[it.next_to_check].done():
            done[it.next_to_check] = time.perf_counter()
            it.next_to_check += 1

    @torch.no_grad()
    def _finish_backward(self) -> None:
        it = self._iteration
        if it is None:
            return
        it.callback_queued = False
        if it.next_to_launch < len(self._buckets):
            # Some gradients are still missing. A later backward in the same iteration may
            # supply them; otherwise the next forward reports which ones.
            return
        stats = it.stats
        stats.backward_end_s = time.perf_counter()
        for index, (bucket, future) in enumerate(zip(self._buckets, it.futures, strict=True)):
            assert future is not None
            result = future.wait()
            if stats.bucket_done_s[index] is None:
                stats.bucket_done_s[index] = time.perf_counter()
            if isinstance(result, list):
                result = result[0]
            if result is not bucket.buffer and result.data_ptr() != bucket.buffer.data_ptr():
                bucket.buffer.copy_(result.view(-1))
        globally_used: list[int] | None = None
        if it.used_work is not None:
            it.used_work.wait()
            assert it.used_map is not None
            globally_used = it.used_map.tolist()
        for index in it.fixups:
            if globally_used is not None and globally_used[index] == 0:
                continue  # no rank used it: leave .grad as it was, like torch DDP
            param = self._params[index]
            slot = self._slots[index]
            if param.grad is None:
                local = slot if self.gradient_as_bucket_view else slot.clone()
                param.grad = grad_like(self._params[index], local)
            else:
                local = local_tensor(param.grad)
                if local.data_ptr() != slot.data_ptr():
                    local.copy_(slot)
        stats.finished_s = time.perf_counter()
        self._last_stats = stats
        self._iteration = None
        if self._record_order:
            self._record_order = False
            self._rebuild_pending = True

    def _raise_unfinished_reduction(self) -> None:
        it = self._iteration
        assert it is not None
        missing = [
            name for name, ready in zip(self._param_names, it.ready, strict=True) if not ready
        ]
        self._iteration = None
        raise RuntimeError(
            "BucketedDDP: the previous iteration's gradient reduction did not finish because "
            f"these parameters received no gradient: {', '.join(missing)}. Either make every "
            "parameter take part in computing the loss, construct BucketedDDP with "
            "find_unused_parameters=True, or run forward passes whose outputs are not "
            "backpropagated under torch.no_grad()."
        )


def _grad_hook(engine_ref: weakref.ref, index: int, param: torch.Tensor) -> None:
    # A weak reference lets the engine be garbage-collected while the module lives on.
    engine = engine_ref()
    if engine is not None:
        engine._on_grad_ready(index)
