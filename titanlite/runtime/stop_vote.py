"""When every rank stops or saves together: the stop vote and the timed-save vote.

SIGTERM/SIGUSR1 (cluster preemption, SLURM's warning signal) ask the run to finish the current
step, save, and exit with EXIT_PREEMPTED; Ctrl-C (SIGINT) does the same and exits with
EXIT_INTERRUPTED (titanlite.runtime.stop_signals records them, and handles a second Ctrl-C);
checkpoint.interval_minutes asks for a save once this rank's clock says so. Ranks get signals
and read clocks at different moments, but must stop or save at the same step: after each step
every rank votes (an asynchronous all-reduce of one small integer), and the next step's end
reads the result, so no step waits for the slowest rank's vote and every rank acts one step
after the first one saw the signal or the time.

The handlers are in place when the vote is made at the latest, before the slow start-up
(model build, checkpoint load): a signal then must not kill the process before it can exit
with its status.

A vote is one integer, reduced with MAX: ``level << 1 | save_due``, the level 0 (go on), 1
(preempted) or 2 (interrupted). So any stop outweighs a timed save (the stop saves anyway),
and a Ctrl-C on one rank outweighs a preemption on another: the user asked for the run to
end, and SLURM must not requeue it.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import torch
import torch.distributed as dist

from titanlite.errors import Interrupted, Preempted
from titanlite.runtime import distributed, stop_signals

PREEMPTED, INTERRUPTED = 1, 2  # vote levels


class StopVote:
    """This rank's side of the vote; every rank must call ``read`` and ``start`` at the same
    steps (both are collectives with more than one rank)."""

    def __init__(self, world_size: int, interval_minutes: float = 0.0) -> None:
        self.world_size = world_size
        self.interval_minutes = interval_minutes
        self.signal: int | None = None
        """The stop signal this rank got (-1: another rank's), None while there is none."""
        self.level = 0
        """Why the run stops: 0 it does not, PREEMPTED or INTERRUPTED (the ranks' maximum)."""
        self._vote: tuple[Any, torch.Tensor] | None = None  # the all-reduce in flight
        self._last_save = time.monotonic()
        stop_signals.install()

    def _local_level(self) -> int:
        if stop_signals.interrupted():
            self.signal = signal.SIGINT
            return INTERRUPTED
        if stop_signals.preempt_signal() is not None:
            self.signal = stop_signals.preempt_signal()
            return PREEMPTED
        return 0

    def _agree(self, level: int) -> bool:
        """Take the ranks' level; whether the run stops."""
        self.level = max(self.level, level)
        if self.level and self.signal is None:
            self.signal = -1  # another rank's signal
        return self.level > 0

    def saved(self) -> None:
        """A checkpoint was just saved: the timed-save clock starts again."""
        self._last_save = time.monotonic()

    def stop_if_signalled_during_startup(self, next_step: int) -> None:
        """A stop signal that came during start-up: raise Preempted before the first step,
        with nothing new to save (one blocking vote, once); Interrupted after a Ctrl-C."""
        level = self._local_level()
        if self.world_size > 1:
            flag = torch.tensor(level)
            level = int(distributed.all_reduce(flag, dist.ReduceOp.MAX))
        if self._agree(level):
            raise self.stopped(next_step, saved=False, startup=True)

    def stopped(self, step: int, saved: bool, startup: bool = False) -> RuntimeError:
        """The exception that ends a run the vote stopped: at ``step`` (``saved``: its
        checkpoint is complete), or during start-up, before ``step``."""
        if self.level == INTERRUPTED:
            where = f"during start-up, before step {step}" if startup else f"at step {step}"
            return Interrupted.at(where, saved)
        if startup:
            return Preempted(
                f"stopped during start-up on signal {self.signal}, before step "
                f"{step}; nothing new to save"
            )
        done = "; checkpoint saved" if saved else ""
        return Preempted(f"stopped at step {step} on signal {self.signal}{done}")

    def _save_due(self) -> bool:
        minutes = self.interval_minutes
        return minutes > 0 and time.monotonic() - self._last_save >= 60 * minutes

    def read(self) -> tuple[bool, bool]:
        """(whether any rank got a stop signal, whether any rank's clock says a timed save is
        due): the vote started at the end of the previous step."""
        if self.world_size == 1:
            return self._agree(self._local_level()), self._save_due()
        votes = self.settle()
        return self._agree(votes >> 1), bool(votes & 1)

    def start(self) -> None:
        """Vote for the next ``read`` (asynchronous)."""
        if self.world_size == 1:
            return
        votes = self._local_level() << 1 | int(self._save_due())
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
