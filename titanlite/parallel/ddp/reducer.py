"""The reducer of the data-parallel engine (``ddp.BucketedDDP``): gradients into buckets, each
bucket's all-reduce launched as soon as it is full, the wait at the end of backward.

BucketedDDP is the ``nn.Module`` a user holds (construction, the wrapped module's names,
``no_sync``, forward); the Reducer is everything that happens between a synchronised forward
and the end of its backward, and the bucket layout it works on. A plain object, not module
attributes: ``nn.Module.__setattr__`` is slow on the per-gradient hot path.
"""

from __future__ import annotations

import functools
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titanlite.parallel.ddp.buckets import allocate_buckets, assign_buckets, grad_like
from titanlite.parallel.ddp.collectives import local_tensor
from titanlite.parallel.ddp.comm_hooks import CommHook, GradBucket
from titanlite.parallel.ddp.iteration import Iteration, IterationStats, reached_leaves


class Reducer:
    """Averages the gradients of ``params`` (named ``names``; ``locals_`` are the tensors this
    rank stores of them) over ``process_group`` during backward. The options are
    BucketedDDP's, in bytes."""

    def __init__(
        self,
        names: list[str],
        params: list[torch.Tensor],
        locals_: list[torch.Tensor],
        process_group: dist.ProcessGroup | None,
        *,
        first_bucket_cap_bytes: int,
        bucket_cap_bytes: int,
        find_unused_parameters: bool,
        gradient_as_bucket_view: bool,
    ) -> None:
        self.names = names
        self.params = params
        self.locals = locals_
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.first_bucket_cap_bytes = first_bucket_cap_bytes
        self.bucket_cap_bytes = bucket_cap_bytes
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.comm_device = locals_[0].device
        self.comm_hook: CommHook | None = None
        self.comm_hook_state: Any = None
        # The group object itself: calling its allreduce skips the Python wrapper of
        # dist.all_reduce, which matters on the per-bucket hot path.
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.is_dtensor = [isinstance(p, DTensor) for p in params]
        self.divisor = self.world_size  # gradients are pre-divided as they are marked ready
        # State of the synchronised iteration in flight (None between iterations).
        self.iteration: Iteration | None = None
        self.last_stats: IterationStats | None = None
        # Bucket rebuild: record the ready order during the first synchronised backward.
        self.record_order = True
        self.ready_order: list[int] = []
        self.rebuild_pending = False
        self.buckets_rebuilt = False
        self.build_buckets(list(reversed(range(len(params)))))
        self_ref = weakref.ref(self)
        self.hook_handles = [
            p.register_post_accumulate_grad_hook(functools.partial(_grad_hook, self_ref, i))
            for i, p in enumerate(params)
        ]

    def set_comm_hook(self, state: Any, hook: CommHook) -> None:
        if self.iteration is not None:
            raise RuntimeError("register_comm_hook must not be called between forward and backward")
        self.comm_hook = hook
        self.comm_hook_state = state
        self.divisor = 1  # a hook receives local sums and does its own averaging

    # ----- the bucket layout -------------------------------------------------------------------

    def build_buckets(self, order: list[int]) -> None:
        """(Re)allocate the flat buffers for ``order`` and point gradients into them."""
        locals_ = self.locals
        sizes = [t.numel() * t.element_size() for t in locals_]
        keys = [(t.dtype, t.device) for t in locals_]
        assignment = assign_buckets(
            sizes, keys, order, first_cap=self.first_bucket_cap_bytes, cap=self.bucket_cap_bytes
        )
        self.buckets, self.slots, self.bucket_of = allocate_buckets(
            assignment, self.params, locals_, self.gradient_as_bucket_view
        )

    def rebuild_buckets(self) -> None:
        """Re-bucket in the observed ready order, taking the group's first rank's order."""
        self.rebuild_pending = False
        observed = set(self.ready_order)
        order = self.ready_order + [
            i for i in reversed(range(len(self.params))) if i not in observed
        ]
        order_tensor = torch.tensor(order, dtype=torch.int64, device=self.comm_device)
        if self.world_size > 1:
            dist.broadcast(order_tensor, group=self.process_group, group_src=0)
        self.build_buckets(order_tensor.tolist())
        self.buckets_rebuilt = True

    # ----- one synchronised iteration ------------------------------------------------------------

    def prepare_for_backward(self, output: Any) -> None:
        stats = IterationStats([b.buffer.numel() * b.buffer.element_size() for b in self.buckets])
        stats.bucket_launch_s = [None] * len(self.buckets)
        stats.bucket_done_s = [None] * len(self.buckets)
        it = Iteration(len(self.params), [len(b.indices) for b in self.buckets], stats)
        self.iteration = it
        if self.record_order:
            self.ready_order = []
        if not self.find_unused_parameters:
            return
        reached = reached_leaves(output)
        unused = [i for i, p in enumerate(self.params) if id(p) not in reached]
        # A parameter no rank used in this graph and no rank holds a gradient for keeps
        # .grad = None, as with torch DDP. One that holds a gradient (accumulated under
        # no_sync, or zeroed in place) counts as used, so that gradient gets averaged.
        used = torch.ones(len(self.params), dtype=torch.int32, device=self.comm_device)
        without_grad = [i for i in unused if self.params[i].grad is None]
        if without_grad:
            used[without_grad] = 0
        it.used_map = used
        it.used_work = self.group.allreduce([used])
        with torch.no_grad():
            for index in unused:
                self._mark_ready(it, index)

    def on_grad_ready(self, index: int) -> None:
        # Runs inside backward (grad mode is off there), once per parameter per backward.
        it = self.iteration
        if it is None:
            return  # the forward ran under no_sync (or without grad): accumulate locally
        if not it.callback_queued:
            # Queued from inside backward so it runs once the whole graph task has finished.
            it.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)
            if it.stats.backward_start_s is None:
                it.stats.backward_start_s = time.perf_counter()
        if it.ready[index]:
            raise RuntimeError(
                f"BucketedDDP: parameter '{self.names[index]}' received a gradient twice "
                "in one iteration (reentrant activation checkpointing, or backward run twice "
                "through one forward); use torch.utils.checkpoint with use_reentrant=False"
            )
        if self.record_order:
            self.ready_order.append(index)
        self._mark_ready(it, index)

    def _mark_ready(self, it: Iteration, index: int) -> None:
        """Put parameter ``index``'s local gradient into its slot; launch what is ready."""
        it.ready[index] = True
        slot = self.slots[index]
        param = self.params[index]
        grad = param.grad
        if grad is None:
            # Unused here: contribute zeros, and fix .grad up once the average is known.
            slot.zero_()
            it.fixups.append(index)
        else:
            # Dividing here, fused with the copy when there is one, saves a separate pass
            # over the bucket; dividing before the sum keeps low-precision sums in range.
            divisor = self.divisor
            if self.is_dtensor[index] and grad.placements != param.placements:
                # TP can produce a gradient laid out unlike its parameter (the vocab-parallel
                # embedding's comes back Replicate); take this rank's shard of it.
                grad = grad.redistribute(param.device_mesh, param.placements)
            local = grad.to_local() if self.is_dtensor[index] else grad
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
                    param.grad = grad_like(self.params[index], slot)
                else:
                    it.fixups.append(index)
        bucket_index = self.bucket_of[index]
        pending = it.pending
        pending[bucket_index] -= 1
        if pending[bucket_index] == 0:
            # Launch strictly in index order so every rank issues the same collectives.
            while it.next_to_launch < len(pending) and pending[it.next_to_launch] == 0:
                self._launch(it, it.next_to_launch)
                it.next_to_launch += 1

    def _launch(self, it: Iteration, bucket_index: int) -> None:
        bucket = self.buckets[bucket_index]
        it.stats.bucket_launch_s[bucket_index] = time.perf_counter()
        if self.comm_hook is None:
            future = self.group.allreduce([bucket.buffer]).get_future()
        else:
            view = GradBucket(
                index=bucket_index,
                buffer=bucket.buffer,
                parameter_names=tuple(self.names[i] for i in bucket.indices),
                process_group=self.process_group,
                world_size=self.world_size,
            )
            future = self.comm_hook(self.comm_hook_state, view)
        it.futures[bucket_index] = future
        # Note completions by polling rather than with future callbacks: a Python callback
        # would make the communication thread wait for the GIL before its next collective.
        done = it.stats.bucket_done_s
        while it.next_to_check < bucket_index and it.futures[it.next_to_check].done():
            done[it.next_to_check] = time.perf_counter()
            it.next_to_check += 1

    @torch.no_grad()
    def finish_backward(self) -> None:
        it = self.iteration
        if it is None:
            return
        it.callback_queued = False
        if it.next_to_launch < len(self.buckets):
            # Some gradients are still missing. A later backward in the same iteration may
            # supply them; otherwise the next forward reports which ones.
            return
        stats = it.stats
        stats.backward_end_s = time.perf_counter()
        for index, (bucket, future) in enumerate(zip(self.buckets, it.futures, strict=True)):
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
            param = self.params[index]
            slot = self.slots[index]
            if param.grad is None:
                local = slot if self.gradient_as_bucket_view else slot.clone()
                param.grad = grad_like(self.params[index], local)
            else:
                local = local_tensor(param.grad)
                if local.data_ptr() != slot.data_ptr():
                    local.copy_(slot)
        stats.finished_s = time.perf_counter()
        self.last_stats = stats
        self.iteration = None
        if self.record_order:
            self.record_order = False
            self.rebuild_pending = True

    def raise_unfinished_reduction(self) -> None:
        it = self.iteration
        assert it is not None
        missing = [name for name, ready in zip(self.names, it.ready, strict=True) if not ready]
        self.iteration = None
        raise RuntimeError(
            "BucketedDDP: the previous iteration's gradient reduction did not finish because "
            f"these parameters received no gradient: {', '.join(missing)}. Either make every "
            "parameter take part in computing the loss, construct BucketedDDP with "
            "find_unused_parameters=True, or run forward passes whose outputs are not "
            "backpropagated under torch.no_grad()."
        )


def _grad_hook(reducer_ref: weakref.ref, index: int, param: torch.Tensor) -> None:
    # A weak reference lets the engine be garbage-collected while the module lives on.
    reducer = reducer_ref()
    if reducer is not None:
        reducer.on_grad_ready(index)
