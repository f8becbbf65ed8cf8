"""Pool scenarios (tests/pool.py) for the collective record and the hang watchdog
(tests/test_health_hang.py): real gloo collectives on every rank, nothing mocked."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def _ops(record: Any, since: int = 0) -> list[tuple[str, str, str]]:
    """(op, channel, state) of the entries after the first ``since``."""
    return [(e.op, e.channel.name, e.state()) for e in record.entries()[since:]]


def _waits_for_late_peer(record: Any, rank: int, delay_s: float, call: Any) -> float:
    """Blocked seconds ``call`` added on this rank while rank 1 started it ``delay_s`` late."""
    dist.barrier()
    if rank == 1:
        time.sleep(delay_s)
    before = record.blocked_seconds()
    call()
    return record.blocked_seconds() - before


def _entry_points() -> tuple:
    """What the record wraps, one of each kind: a torch.distributed function (as dist.X and
    distributed_c10d.X), a ProcessGroup method, Work's and Future's wait, a functional
    collective and its wait."""
    import torch.distributed._functional_collectives as funcol

    return (
        dist.all_reduce,
        dist.distributed_c10d.isend,
        vars(dist.ProcessGroup)["allreduce"],
        vars(dist.Work)["wait"],
        vars(torch._C.Future)["wait"],
        funcol.all_reduce,
        funcol.wait_tensor,
    )


def record_paths(rank: int, world: int, delay_s: float) -> dict[str, Any]:
    """Every path a layout's collectives take, recorded on real gloo: a sync and an async
    all_reduce (rank 1 late to both), FSDP2's all-gather and reduce-scatter, a DTensor (tensor
    parallel) redistribution and a TP layer, the pipeline schedule's P2P and titanlite's DDP
    engine. What each saw, then whether uninstall put every entry point back."""
    from titanlite.health import record as record_module
    from titanlite.health.record import CollectiveRecord

    originals = _entry_points()
    record = CollectiveRecord()
    record.install()
    record.install()  # idempotent
    seen: dict[str, Any] = {"active": record_module.ACTIVE is record}
    try:
        seen["wrapped"] = [a is not b for a, b in zip(_entry_points(), originals, strict=True)]
        _exercise_layouts(record, rank, world, delay_s, seen)
        seen["in_flight_at_end"] = [e.op for e in record.in_flight()]
        seen["lines"] = record.format_lines()
    finally:
        record.uninstall()
    record.uninstall()  # idempotent
    seen["restored"] = [a is b for a, b in zip(_entry_points(), originals, strict=True)]
    seen["inactive"] = record_module.ACTIVE is None
    mark = len(record.entries())
    dist.all_reduce(torch.ones(2))
    seen["after_uninstall"] = len(record.entries()) - mark
    return seen


def _exercise_layouts(
    record: Any, rank: int, world: int, delay_s: float, seen: dict[str, Any]
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from titanlite.parallel.ddp import BucketedDDP

    t = torch.ones(8)
    seen["sync_blocked"] = _waits_for_late_peer(record, rank, delay_s, lambda: dist.all_reduce(t))
    seen["sync"] = _ops(record, -1)[0]

    def async_all_reduce() -> None:
        work = dist.all_reduce(t, async_op=True)
        seen["async_in_flight"] = [e.op for e in record.in_flight()]
        work.wait()

    seen["async_blocked"] = _waits_for_late_peer(record, rank, delay_s, async_all_reduce)
    seen["async"] = _ops(record, -1)[0]

    mesh = init_device_mesh("cpu", (world,))
    mark = len(record.entries())
    model = nn.Linear(8, 8)
    fully_shard(model, mesh=mesh)
    model(torch.ones(2, 8)).sum().backward()
    seen["fsdp"] = _ops(record, mark)

    mark = len(record.entries())
    sharded = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0)])
    full = sharded.redistribute(mesh, [Replicate()]).to_local()
    seen["dtensor_sum"] = float(full.sum())
    mlp = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    mlp = parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    mlp(torch.ones(2, 8)).sum().backward()
    seen["tp"] = _ops(record, mark)

    mark = len(record.entries())
    _pipeline_step(rank, world)
    seen["pipeline"] = _ops(record, mark)

    mark = len(record.entries())
    ddp = BucketedDDP(nn.Linear(8, 8))
    ddp(torch.ones(2, 8)).sum().backward()
    seen["ddp"] = _ops(record, mark)


def _pipeline_step(rank: int, world: int) -> None:
    """One GPipe step of a two-stage pipeline (torch.distributed.pipelining, as titanlite's
    pipeline runs it): activations and gradients cross between the ranks by P2P."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.manual_seed(0)
    stage = PipelineStage(nn.Linear(4, 4), rank, world, torch.device("cpu"))

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (out - target).pow(2).mean()

    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=loss_fn)
    if rank == 0:
        schedule.step(torch.ones(4, 4))
    else:
        schedule.step(target=torch.zeros(4, 4))


def never_entered(
    rank: int, world: int, dump_folder: str, timeout_s: float, grace_s: float
) -> dict[str, Any]:
    """Rank 1 stays out of an all_reduce the others enter (busy elsewhere, in Python) until
    its watchdog has fired: every rank's watchdog dumps, the lowest reports; then rank 1
    joins and the collective completes. The diagnosis (rank 0's) and each rank's dump path."""
    from titanlite.health.record import CollectiveRecord
    from titanlite.health.watchdog import Watchdog

    record = CollectiveRecord()
    record.install()
    fired = threading.Event()
    lines: list[str | None] = []

    def on_hang(line: str | None) -> None:
        lines.append(line)
        fired.set()

    watchdog = Watchdog(
        timeout_s=timeout_s,
        rank=rank,
        world_size=world,
        dump_folder=dump_folder,
        record=record,
        grace_s=grace_s,
        on_hang=on_hang,
    )
    watchdog.start()
    try:
        t = torch.ones(4)
        for step in (1, 2, 3):
            watchdog.beat(step)
            dist.all_reduce(t)
        if rank == 1:
            _stay_busy_until(fired, 300)  # never enters the all_reduce below in time
        dist.all_reduce(t)
        assert fired.wait(300), "the watchdog never fired"
    finally:
        watchdog.stop()
        record.uninstall()
    dist.barrier()
    return {"line": lines[0], "dump": str(watchdog.fired_at / f"rank-{rank}.txt")}


def _stay_busy_until(event: threading.Event, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while not event.is_set() and time.monotonic() < deadline:
        time.sleep(0.05)
