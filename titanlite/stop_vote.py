"""When every rank stops or saves together: the preemption vote and the timed-save vote.

SIGTERM/SIGUSR1 (cluster preemption, SLURM's warning signal) ask the run to finish the current
step, save, and exit with EXIT_PREEMPTED; checkpoint.interval_minutes asks for a save once
this rank's clock says so. Ranks get signals and read clocks at different moments, but must
stop or save at the same step: after each step every rank votes (an asynchronous all-reduce
of two bits), and the next step's end reads the result, so no step waits for the slowest
rank's vote and every rank acts one step after the first one saw the signal or the time.

The handlers are installed when the vote is made, before the slow start-up (model build,
checkpoint load): a signal then must not kill the process before it can exit with
EXIT_PREEMPTED.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import torch
import torch.distributed as dist

from titanlite import distributed
from titanlite.errors import Preempted

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopVote:
    """This rank's side of the vote; every rank must call ``read`` and ``start`` at the same
    steps (both are collectives with more than one rank)."""

    def __init__(self, world_size: int, interval_minutes: float = 0.0) -> None:
        self.world_size = world_size
        self.interval_minutes = interval_minutes
        self.signal: int | None = None
        """The stop signal this rank got (-1: another rank's), None while there is none."""
        self._vote: tuple[Any, torch.Tensor] | None = None  # the all-reduce in flight
        self._last_save = time.monotonic()
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._request_stop)

    def _request_stop(self, signum: int, frame: object) -> None:
        self.signal = signum

    def saved(self) -> None:
        """A checkpoint was just saved: the timed-save clock starts again."""
        self._last_save = time.monotonic()

    def stop_if_signalled_during_startup(self, next_step: int) -> None:
        """A stop signal that came during start-up: raise Preempted before the first step,
        with nothing new to save (one blocking vote, once)."""
        signalled = self.signal is not None
        if self.world_size > 1:
            flag = torch.tensor(int(signalled))
            signalled = bool(int(distributed.all_reduce(flag, dist.ReduceOp.MAX)))
        if signalled:
            if self.signal is None:
                self.signal = -1  # another rank's signal
            raise Preempted(
                f"stopped during start-up on signal {self.signal}, before step {next_step}; "
                "nothing new to save"
            )

    def _save_due(self) -> bool:
        minutes = self.interval_minutes
        return minutes > 0 and time.monotonic() - self._last_save >= 60 * minutes

    def read(self) -> tuple[bool, bool]:
        """(whether any rank got a stop signal, whether any rank's clock says a timed save is
        due): the vote started at the end of the previous step."""
        if self.world_size == 1:
            return self.signal is not None, self._save_due()
        votes = self.settle()
        stop = bool(votes & 1)
        if stop and self.signal is None:
            self.signal = -1  # another rank's signal
        return stop, bool(votes & 2)

    def start(self) -> None:
        """Vote for the next ``read`` (asynchronous)."""
        if self.world_size == 1:
            return
        votes = int(self.signal is not None) | (int(self._save_due()) << 1)
        flag = torch.tensor(votes)  # CPU: over gloo
        self._vote = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)

    def settle(self) -> int:
        """Wait for the vote in flight (started a step ago); its result (0 when none). Call it
        whatever ends the loop, so that no all-reduce is left in flight."""
        if self._vote is None:
            return 0
        work, flag = self._vote
        self._vote = None
        work.wait()
        return int(flag)
