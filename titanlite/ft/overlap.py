"""The average across replica groups inside backward, where the group's own data-parallel
reduction of each gradient ends, so that it overlaps the rest of backward as that reduction
does.

- titanlite's bucketed DDP (replicas inside the group): a communication hook per bucket sums
  the bucket over the group's replicas, then launches its sum across the groups through
  torchft's process group and returns that future; the engine waits for it when backward ends,
  as for its own all-reduce. The buckets are kept as first built: a group that rejoins must
  pack its gradients as the others do.
- FSDP2 (sharded inside the group, HSDP too): FSDP's all-reduce hook takes each reduce-scattered
  shard and averages it across the groups.

Layouts with neither (one process per group, tensor or pipeline parallelism without data
parallelism inside) average after backward (``ReplicaGroups.average_gradients``). A failure
across groups is swallowed as there: the step does not commit.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllreduceOptions

from titanlite.parallel.ddp.comm_hooks import GradBucket
from titanlite.parallel.ddp.engine import BucketedDDP

logger = logging.getLogger(__name__)


def _done(tensor: torch.Tensor) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(tensor)
    return future


class CrossGroupAverage:
    """The hooks, over this rank's torchft Manager and cross-group process group; counts the
    bytes it sends (``bytes_sent``)."""

    def __init__(self, manager: Any, pg: Any) -> None:
        self.manager, self.pg = manager, pg
        self.bytes_sent = 0

    def attach(self, modules: Sequence[torch.nn.Module], parts: Sequence[torch.nn.Module]) -> bool:
        """Hook every bucketed DDP module of ``modules`` and every FSDP module of ``parts``;
        whether every trainable parameter is then averaged inside backward."""
        from torch.distributed.fsdp import FSDPModule

        ddp = [m for m in modules if isinstance(m, BucketedDDP)]
        for module in ddp:
            module.keep_buckets()
            module.register_comm_hook(self, bucket_hook)
        fsdp = [m for part in parts for m in part.modules() if isinstance(m, FSDPModule)]
        for module in fsdp:
            module.set_all_reduce_hook(self.shard_hook)
        return bool(ddp) or bool(fsdp)

    def _start(self, tensor: torch.Tensor) -> Any:
        """Launch the sum of ``tensor`` across the participating groups (None: nothing to
        launch, an error already or now reported)."""
        manager = self.manager
        if manager.errored() is not None:
            return None
        if not manager.is_participating():
            tensor.zero_()  # a healing group contributes nothing this step
        opts = AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        try:
            work = self.pg.allreduce([tensor], opts)
        except Exception as e:  # noqa: BLE001 - torchft's process group raises anything
            manager.report_error(e)
            return None
        self.bytes_sent += tensor.nbytes
        return work

    def shard_hook(self, shard: torch.Tensor) -> None:
        """FSDP: a reduce-scattered (HSDP: and all-reduced) gradient shard, averaged across
        the groups in place."""
        work = self._start(shard)
        if work is None:
            return
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001
            self.manager.report_error(e)
            return
        shard.div_(self.manager.num_participants())


def bucket_hook(state: CrossGroupAverage, bucket: GradBucket) -> torch.futures.Future:
    """Bucketed DDP: the bucket's local sums summed over the group's replicas (here, at once)
    and across the groups (in flight when this returns), divided by both counts."""
    buffer = bucket.buffer
    if bucket.world_size > 1:
        dist.all_reduce(buffer, group=bucket.process_group)
    work = state._start(buffer)
    if work is None:
        return _done(buffer)
    divisor = bucket.world_size * state.manager.num_participants()

    def average(future: torch.futures.Future) -> torch.Tensor:
        future.value()  # raises a communication error, which wrap_future swallows
        return buffer.div_(divisor)

    return state.manager.wrap_future(work.get_future().then(average), default=buffer)
