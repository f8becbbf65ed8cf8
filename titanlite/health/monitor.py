"""The trainer's one handle on cluster health ([health]): it installs the collective record,
starts the hang watchdog, times each step's phases for the straggler detector and runs the
replica fingerprints at their interval and before every checkpoint save.

The trainer calls, per step: ``step_started`` (the watchdog's beat), ``data_ready``,
``optimizer_started``, ``step_finished`` (at logged steps: the straggler fields for the
record, from one small all-gather), then ``after_step`` and ``before_save``. None of these
adds a host synchronization to a step that is not logged or checked.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from titanlite.health.settings import HealthSettings, hang_timeout
from titanlite.health.stragglers import StragglerDetector

logger = logging.getLogger(__name__)


class HealthMonitor:
    def __init__(
        self,
        settings: HealthSettings,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        dump_folder: Path,
        comm_timeout_s: float,
        replicas: Any = None,
    ) -> None:
        from titanlite.health.record import CollectiveRecord
        from titanlite.health.watchdog import Watchdog

        self.settings = settings
        self.record = CollectiveRecord()
        self.record.install()
        self.stragglers = StragglerDetector(
            rank=rank,
            world_size=world_size,
            ratio=settings.straggler_ratio,
            steps=settings.straggler_steps,
            device=device,
        )
        self.watchdog = None
        timeout = hang_timeout(settings, comm_timeout_s)
        if settings.hang_timeout_s > 0 and not timeout:
            logger.info(
                "health: hang watchdog off: comm.timeout_seconds %g is not longer than "
                "health.hang_timeout_s %g (the collective timeout names a lost rank)",
                comm_timeout_s,
                settings.hang_timeout_s,
            )
        if timeout:
            self.watchdog = Watchdog(
                timeout_s=timeout,
                rank=rank,
                world_size=world_size,
                dump_folder=dump_folder,
                record=self.record,
            )
            self.watchdog.start()
        self.replicas = replicas  # a fingerprints.ReplicaCheck, or None
        self._checked_step = -1
        self._t0 = self._t_data = self._t_opt = 0.0
        self._blocked0 = 0.0

    @classmethod
    def of(
        cls,
        settings: HealthSettings,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        dump_folder: Path,
        comm_timeout_s: float,
        parts: list[Any],
        optimizers: list[Any],
        replica_group: dist.ProcessGroup | None,
    ) -> HealthMonitor | HealthOff:
        """The run's monitor (one that does nothing with health.enable false)."""
        if not settings.enable:
            return HealthOff()
        replicas = None
        if settings.sdc_check_interval > 0 and world_size > 1:
            from titanlite.health.fingerprints import ReplicaCheck

            replicas = ReplicaCheck.of(parts, optimizers, replica_group=replica_group, rank=rank)
        return cls(
            settings,
            rank=rank,
            world_size=world_size,
            device=device,
            dump_folder=dump_folder,
            comm_timeout_s=comm_timeout_s,
            replicas=replicas,
        )

    # ------------------------------------------------------------------ a step's phases
    def step_started(self, step: int) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(step)
        self._t0 = self._t_data = self._t_opt = time.perf_counter()
        self._blocked0 = self.record.blocked_seconds()

    def data_ready(self) -> None:
        self._t_data = time.perf_counter()

    def optimizer_started(self) -> None:
        self._t_opt = time.perf_counter()

    def step_finished(self, step: int, log: bool) -> dict[str, float] | None:
        """Adds the step to the straggler window; at a logged step (a collective over every
        rank) the straggler fields of the record."""
        end = time.perf_counter()
        self.stragglers.add(
            step_s=end - self._t0,
            blocked_s=self.record.blocked_seconds() - self._blocked0,
            phases={
                "data": self._t_data - self._t0,
                "forward_backward": self._t_opt - self._t_data,
                "optimizer": end - self._t_opt,
            },
        )
        # (one rank has no one to be slower than: its records carry no straggler fields)
        return self.stragglers.report(step) if log and self.stragglers.world_size > 1 else None

    # ------------------------------------------------------------------ replicas
    def after_step(self, step: int) -> None:
        """The replicas' fingerprints every health.sdc_check_interval steps."""
        interval = self.settings.sdc_check_interval
        if self.replicas is not None and interval and step % interval == 0:
            self._check_replicas(step)

    def before_save(self, step: int) -> None:
        """Nothing from a corrupt rank reaches a checkpoint: the replicas compare first."""
        if self.replicas is not None:
            self._check_replicas(step)

    def _check_replicas(self, step: int) -> None:
        if self._checked_step == step:
            return
        self._checked_step = step
        n = self.replicas.check(step)
        logger.debug("step %d: %d replicated tensors agree across their replicas", step, n)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        self.record.uninstall()


class HealthOff:
    """health.enable = false: the same calls, doing nothing."""

    def step_started(self, step: int) -> None:
        pass

    def data_ready(self) -> None:
        pass

    def optimizer_started(self) -> None:
        pass

    def step_finished(self, step: int, log: bool) -> None:
        return None

    def after_step(self, step: int) -> None:
        pass

    def before_save(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass
