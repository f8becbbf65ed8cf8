"""This rank's place among the replica groups: torchft's Manager, the step protocol and the
state a healing group receives.

Rank r of every group holds the same slice of the model (every group runs the same layout),
so rank r of each group is one member of a process group across groups, which the Manager
reconfigures at every quorum. A step is: ``start_step`` (the quorum, synchronous: a group
that comes back receives the state of a live peer's rank r right here, before its forward),
forward and backward inside the group as always, ``average_gradients`` (each local gradient
summed across the participating groups in flat buckets, divided by their number),
``should_commit`` (every group agrees whether the step counts; the optimizer steps only if
it does). A collective across groups that fails (a group died) is swallowed by torchft: the
step is not committed and is run again, with the same batches, by the groups still there.

What a healing group receives: every parameter and buffer of its model parts (this rank's
local shards), every optimizer state tensor, the learning-rate schedules and the step and
token counters. Not the data position: each group reads its own share and keeps its own
place (from its own checkpoint when it resumes).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllreduceOptions

from titanlite.errors import UserError
from titanlite.ft.diloco import SemiSync
from titanlite.ft.heal import heal_state, load_heal_state, state_bytes
from titanlite.ft.overlap import CrossGroupAverage
from titanlite.ft.settings import FaultTolerance, lighthouse_address, semi_sync
from titanlite.parallel.ddp.collectives import flat_buckets, local_tensor

logger = logging.getLogger(__name__)

BUCKET_BYTES = 25 * 1024 * 1024
"""The cross-group average's flat buckets: at most this many bytes of one dtype each."""


class ReplicaGroups:
    """torchft's Manager for this rank, and what the trainer asks of it."""

    def __init__(
        self,
        settings: FaultTolerance,
        *,
        rank: int,
        world_size: int,
        state: Callable[[], dict[str, Any]],
        load_state: Callable[[dict[str, Any]], None],
        parts: Sequence[torch.nn.Module] = (),
        optimizers: Sequence[torch.optim.Optimizer] = (),
        log: Callable[[dict[str, Any], str], None] | None = None,
    ) -> None:
        # torchft logs every quorum and commit at INFO (its Rust side reads RUST_LOG once,
        # at import): titanlite's own lines say what a user needs.
        os.environ.setdefault("RUST_LOG", "warn")
        for name in ("torchft", "torchft_commits", "torchft_quorums", "torchft_errors"):
            logging.getLogger(name).setLevel(logging.WARNING)
        import torchft
        from torchft import process_group as ft_pg

        self.settings = settings
        timeout = timedelta(milliseconds=settings.process_group_timeout_ms)
        backend = (
            ft_pg.ProcessGroupNCCL if settings.process_group == "nccl" else ft_pg.ProcessGroupGloo
        )
        self.pg = backend(timeout=timeout)
        addr, port, self._store = _group_store(world_size)
        lighthouse = lighthouse_address(settings)
        quorum = timedelta(seconds=settings.quorum_timeout_s)
        try:
            self.manager = torchft.Manager(
                pg=self.pg,
                load_state_dict=self._healing(load_state),
                state_dict=state,
                min_replica_size=settings.min_replica_size,
                use_async_quorum=False,
                timeout=timeout,
                quorum_timeout=quorum,
                connect_timeout=quorum,
                rank=rank,
                world_size=world_size,
                store_addr=addr,
                store_port=port,
                lighthouse_addr=lighthouse,
                replica_id=f"titanlite_{settings.replica_id}",
                init_sync=False,
            )
        except RuntimeError as e:
            if "connect" in str(e).lower():
                raise UserError(
                    f"fault_tolerance.lighthouse: no lighthouse answers at {lighthouse!r} "
                    f"within {settings.quorum_timeout_s:g} s (start one with torchft_lighthouse "
                    "--min_replicas N, or scripts/ft_local.sh)"
                ) from None
            raise
        self.healed: tuple[float, int] | None = None  # (load seconds, bytes) of a heal
        self.semi_loaded = False
        self.log = log
        self.counters_step: Callable[[], int] = lambda: 0  # the trainer's step (join sets it)
        self.inside: CrossGroupAverage | None = None  # the average inside backward (attach)
        self.bytes_sent = 0  # across groups, by this rank (the gradient averages)
        semi = semi_sync(settings)
        self.semi: SemiSync | None = None
        if semi is not None:
            if len(parts) != 1:
                raise UserError(
                    f"fault_tolerance.semi_sync_method: DiLoCo steps one optimizer per rank, and "
                    f"this pipeline schedule gives each rank {len(parts)} stages; use a schedule "
                    "with one stage per rank (1F1B, GPipe)"
                )
            self.semi = SemiSync(self.manager, semi, parts[0], optimizers[0])
        logger.info(
            "fault tolerance: replica group %d of %d, lighthouse %s%s",
            settings.replica_id,
            settings.group_size,
            lighthouse,
            f", {settings.semi_sync_method} every {settings.sync_steps} steps"
            + (f" in {semi.num_fragments} fragments" if semi and semi.num_fragments > 1 else "")
            if semi
            else "",
        )
        if semi is not None and semi.should_quantize and not torch.cuda.is_available():
            logger.warning(
                "fault_tolerance.should_quantize: torchft quantizes on a GPU only; on this "
                "machine the pseudo-gradients go unquantized"
            )

    # ------------------------------------------------------------------ a step
    def _healing(self, load: Callable[[dict[str, Any]], None]) -> Callable[[dict, Any], None]:
        """``load`` (a live group's state into this one's tensors), timed and measured."""

        def healing(state: dict[str, Any]) -> None:
            start = time.perf_counter()
            load(state)
            self.healed = (time.perf_counter() - start, state_bytes(state))

        return healing

    def start_step(self) -> None:
        """The quorum of this step; a group that was away is healed before this returns.
        (DiLoCo: the quorum of a synchronization, in the optimizer's step.)"""
        start = time.perf_counter()
        if self.semi is None:
            self.manager.start_quorum()
        if self.healed is not None:  # (DiLoCo: healed during the last step)
            self._report_heal(time.perf_counter() - start if self.semi is None else None)

    def _report_heal(self, quorum_s: float | None) -> None:
        """One metrics record and line: when this group healed, how long it took."""
        load_s, nbytes = self.healed or (0.0, 0)
        self.healed = None
        record: dict[str, Any] = {
            "step": self.counters_step(),  # the live group's, which this one now holds
            "kind": "heal",
            "time": time.time(),
            "replicas": self.participants(),
            "heal_mib": nbytes / 2**20,
            "heal_load_s": load_s,
        }
        if quorum_s is not None:
            record["heal_s"] = quorum_s  # the quorum, the transfer and the load
        took = f" in {quorum_s:.2f} s" if quorum_s is not None else ""
        line = (
            f"healed from a live replica group at step {record['step']}{took} "
            f"({record['heal_mib']:.1f} MiB of state; {record['replicas']} groups)"
        )
        logger.info(line)
        if self.log is not None:
            self.log(record, None)

    def participants(self) -> int:
        return self.manager.num_participants()

    def metrics(self) -> dict[str, float]:
        """For a logged record: how many groups took part in the step (DiLoCo: in the latest
        synchronization) and the MiB this rank has sent across groups so far."""
        sent = self.bytes_sent + sum(h.bytes_sent for h in (self.semi, self.inside) if h)
        groups = self.participants()  # (0 before DiLoCo's first synchronization: none yet)
        counted = {"replicas": float(groups)} if groups else {}
        return counted | {"replica_sent_mib": sent / 2**20}

    def mean_over_groups(self, values: torch.Tensor) -> torch.Tensor:
        """The mean of ``values`` (a logged step's loss terms) over the groups that took part
        in the step; this group's own if the collective fails (a group just died), and under
        DiLoCo, whose groups exchange nothing between synchronizations."""
        if self.semi is not None:
            return values
        total = values.detach().clone()
        try:
            self._sum(total).wait()
        except Exception:  # noqa: BLE001 - torchft's process group raises anything
            return values
        return total / self.participants()

    def _sum(self, tensor: torch.Tensor) -> Any:
        """Start summing ``tensor`` in place across the groups (the process group's Work)."""
        opts = AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        return self.pg.allreduce([tensor], opts)

    def attach(self, model: Any) -> None:
        """Average across groups inside backward (ft/overlap.py) where the group's layout has a
        data-parallel reduction to follow; otherwise ``average_gradients`` does it after."""
        if self.semi is None:
            self.inside = CrossGroupAverage(self.manager, self.pg)
            if not self.inside.attach(model.modules, model.parts):
                self.inside = None

    def average_gradients(self, params: Sequence[torch.Tensor]) -> None:
        """Each local gradient of ``params`` summed across the participating groups (flat
        buckets of one dtype, all in flight at once) and divided by their number; a group
        healing this step contributes zeros. An error (a group gone) is swallowed: the step
        will not commit. (DiLoCo: nothing, the groups step on their own.)"""
        manager = self.manager
        if self.semi or self.inside or manager.errored() is not None:
            return
        n = manager.num_participants()
        local = [local_tensor(p.grad) for p in params if p.grad is not None]
        if not manager.is_participating():
            for g in local:
                g.zero_()
        pending = []
        for bucket in flat_buckets(local, BUCKET_BYTES):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            self.bytes_sent += flat.nbytes
            try:
                pending.append((bucket, flat, self._sum(flat)))
            except Exception as e:  # noqa: BLE001 - torchft's process group raises anything
                manager.report_error(e)
                return
        for bucket, flat, work in pending:
            try:
                work.wait()
            except Exception as e:  # noqa: BLE001
                manager.report_error(e)
                return
            flat /= n
            for g, piece in zip(bucket, flat.split([g.numel() for g in bucket]), strict=True):
                g.copy_(piece.view_as(g))

    def should_commit(self) -> bool:
        """Whether every participating group got through the step (then the optimizer steps);
        the same answer on every rank of this group. (DiLoCo: every inner step counts; a
        synchronization that fails is undone inside torchft.)"""
        return True if self.semi is not None else self.manager.should_commit()

    def set_step(self, step: int) -> None:
        """The committed step after a resume from this group's own checkpoint (DiLoCo: its
        synchronizations, restored with its state, or none in a checkpoint without it)."""
        if self.semi is None:
            self.manager.load_state_dict({"step": step, "batches_committed": 0})
        elif not self.semi_loaded:
            self.semi.restart_from_weights()

    def can_save(self) -> bool:
        """Whether a checkpoint may be taken after this step (not while a fragment's exchange
        is in flight)."""
        return self.semi is None or not self.semi.in_flight()

    def checkpoint_states(self) -> dict[str, Any]:
        """What a checkpoint adds under its own key: DiLoCo's state (ft/diloco.py)."""
        return {"diloco": _SemiSyncState(self)} if self.semi is not None else {}

    def close(self) -> None:
        if self.semi is not None:
            self.semi.close()
        self.manager.shutdown(wait=False)


class _SemiSyncState:
    """DiLoCo's checkpoint entry ("diloco"): absent from a checkpoint of a run without it,
    then the global parameters start from the loaded weights."""

    partial_ok = True

    def __init__(self, groups: ReplicaGroups) -> None:
        self.groups = groups

    def state_dict(self) -> dict[str, Any]:
        assert self.groups.semi is not None
        return self.groups.semi.checkpoint_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.groups.semi is not None
        self.groups.semi_loaded = self.groups.semi.load_checkpoint_state(state)


def _group_store(world_size: int) -> tuple[str, int, Any]:
    """The address of this group's TCPStore, which the Manager joins: torchrun's (its
    rendezvous store), or for a group of one process without torchrun a store of its own."""
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None
    if world_size != 1:
        raise UserError("fault_tolerance: a group of several processes must start under torchrun")
    # It listens on every interface; the other groups (the cross-group process groups meet in
    # the first group's store) reach it by this host's name, as torchft advertises its own.
    host = socket.gethostname()
    store = dist.TCPStore(host, 0, 1, is_master=True, wait_for_workers=False)
    return host, store.port, store


class Solo:
    """fault_tolerance.enable = false: one group, every step commits."""

    def start_step(self) -> None:
        pass

    def participants(self) -> int:
        return 1

    def metrics(self) -> dict[str, float]:
        return {}

    def mean_over_groups(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def attach(self, model: Any) -> None:
        pass

    def average_gradients(self, params: Sequence[torch.Tensor]) -> None:
        pass

    def should_commit(self) -> bool:
        return True

    def set_step(self, step: int) -> None:
        pass

    def can_save(self) -> bool:
        return True

    def checkpoint_states(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


def join(
    settings: FaultTolerance,
    dist_info: Any,
    *,
    model: Any,
    optimizers: Sequence[torch.optim.Optimizer],
    schedulers: Sequence[Any],
    counters: Any,
    log: Callable[[dict[str, Any], str], None] | None = None,
) -> ReplicaGroups | Solo:
    """This rank's replica groups (or ``Solo`` without fault tolerance). ``dist_info``: the
    run's process facts (rank, world_size); ``model``: the ParallelModel (its parts, and the
    modules whose hooks take the average inside backward); ``counters``: the train state
    (step, tokens), a Stateful that a heal overwrites; ``log``: metrics' (a heal's record)."""
    if not settings.enable:
        return Solo()
    parts = model.parts
    groups = ReplicaGroups(
        settings,
        rank=dist_info.rank,
        world_size=dist_info.world_size,
        state=lambda: heal_state(parts, optimizers, schedulers, counters.state_dict),
        load_state=lambda state: load_heal_state(
            state, parts, optimizers, schedulers, set_counters=counters.load_state_dict
        ),
        parts=parts,
        optimizers=optimizers,
        log=log,
    )
    groups.counters_step = lambda: int(counters.state_dict()["step"])
    groups.attach(model)
    return groups
