"""Collective timeouts, and naming the rank that was lost when a collective fails.

A rank that dies, or a node that vanishes, leaves the others waiting in a collective: gloo
fails at once when the peer's connection is reset, but a frozen process or a node gone from
the network keeps them waiting for the collective timeout (30 minutes by default for gloo, 10
for NCCL). titanlite sets every process group's timeout from ``[comm]``: the start-up one until
the first step is done, then the training one.

The error gloo or NCCL gives then names an address at best. To name the rank, every rank
writes a heartbeat (the time and its step) into the rendezvous store every few seconds from a
background thread; when a collective fails, ``Heartbeat.diagnose`` reads them all and names
the ranks whose heartbeat stopped (or, if none did, the ranks that are behind). The thread
also warns by itself when this rank has been stuck in one step for half the timeout while
another rank's heartbeat has stopped, which is the only message NCCL users see before NCCL's
own watchdog ends the process.
"""

from __future__ import annotations

import logging
import re
import signal
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from titanlite.runtime import stop_signals

logger = logging.getLogger(__name__)

KEY = "titanlite/heartbeat/{rank}"

ACTIVE: Heartbeat | None = None
"""The heartbeat of the trainer running in this process (for failure_message)."""


class CommFailure(RuntimeError):
    """A collective failed or timed out; the message names the lost rank(s) where it can."""


def set_timeouts(seconds: float) -> int:
    """Give every process group this rank belongs to a collective timeout of ``seconds``
    (the default group, the mesh's and any later one); returns how many groups were set."""
    timeout = timedelta(seconds=seconds)
    groups = list(getattr(dist.distributed_c10d._world, "pg_map", {}))
    done = 0
    for group in groups:
        try:
            dist.distributed_c10d._set_pg_timeout(timeout, group)
            done += 1
        except (ValueError, RuntimeError, AssertionError):  # not ours, or not gloo/NCCL
            continue
    # Groups made later (a checkpoint's gloo group, a verification group) start with it too.
    dist.distributed_c10d.default_pg_timeout = timeout
    if hasattr(dist.distributed_c10d, "default_pg_nccl_timeout"):
        dist.distributed_c10d.default_pg_nccl_timeout = timeout
    return done


def is_comm_failure(error: BaseException) -> bool:
    """Whether ``error`` is a failed or timed-out collective (gloo and NCCL raise plain
    RuntimeErrors; newer versions a DistError)."""
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    if not isinstance(error, RuntimeError):
        return False
    text = str(error)
    return any(
        mark in text
        for mark in (
            "gloo/transport",
            "Connection reset",
            "Connection closed",
            "Timed out waiting",
            "NCCL",
        )
    )


class Heartbeat:
    """This rank's heartbeat in the rendezvous store, and a reader of everyone's."""

    def __init__(self, rank: int, world: int, timeout_s: float) -> None:
        self.rank, self.world = rank, world
        self.set_timeout(timeout_s)
        self.step = 0
        self._step_since = time.monotonic()
        self._warned_step = -1
        self._stop = threading.Event()
        self._store = _default_store() if world > 1 else None
        self._thread: threading.Thread | None = None
        if self._store is not None:
            self._write()
            self._thread = threading.Thread(
                target=self._run, name="titanlite-heartbeat", daemon=True
            )
            self._thread.start()

    def beat(self, step: int) -> None:
        """The trainer started ``step`` (no I/O: the thread publishes it)."""
        if step != self.step:
            self.step = step
            self._step_since = time.monotonic()

    def set_timeout(self, seconds: float) -> None:
        """The collective timeout now in force: beats come at a fifth of it (0.5-10 s), and
        a heartbeat three intervals old counts as stopped."""
        self.timeout_s = seconds
        self.interval_s = min(max(seconds / 5, 0.5), 10.0)
        self.stale_s = 3 * self.interval_s

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s)

    # -- writing -----------------------------------------------------------------------------

    def _write(self) -> None:
        assert self._store is not None
        self._store.set(KEY.format(rank=self.rank), f"{time.time():.3f} {self.step}")

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(0.5):  # short naps: a new interval applies at once
            if time.monotonic() - last < self.interval_s:
                continue
            last = time.monotonic()
            try:
                self._write()
            except Exception:  # the store's host is gone: nothing left to report to
                return
            stuck = time.monotonic() - self._step_since
            if stuck > self.timeout_s / 2 and self._warned_step != self.step:
                lost = self._stale_ranks(self._read_all())
                if lost:
                    self._warned_step = self.step
                    logger.error(
                        "step %d has waited %.0f s for other ranks; %s",
                        self.step,
                        stuck,
                        self._describe(lost, self._read_all()),
                    )

    # -- reading -----------------------------------------------------------------------------

    def _read_all(self) -> dict[int, tuple[float, int] | None]:
        assert self._store is not None
        beats: dict[int, tuple[float, int] | None] = {}
        for rank in range(self.world):
            key = KEY.format(rank=rank)
            if not self._store.check([key]):
                beats[rank] = None
                continue
            wall, step = self._store.get(key).decode().split()
            beats[rank] = (float(wall), int(step))
        return beats

    def _stale_ranks(self, beats: dict[int, tuple[float, int] | None]) -> list[int]:
        now = time.time()
        return [
            r
            for r, b in beats.items()
            if r != self.rank and (b is None or now - b[0] > self.stale_s)
        ]

    def _describe(self, lost: list[int], beats: dict[int, tuple[float, int] | None]) -> str:
        now = time.time()
        parts = []
        for r in lost[:8]:
            b = beats.get(r)
            parts.append(
                f"rank {r} (no heartbeat ever)"
                if b is None
                else f"rank {r} (no heartbeat for {now - b[0]:.0f} s, last at step {b[1]})"
            )
        more = f" and {len(lost) - 8} more" if len(lost) > 8 else ""
        return f"lost {', '.join(parts)}{more}"

    def diagnose(self) -> str:
        """Which ranks were lost, waiting until a dead rank's heartbeat is old enough to tell
        (at most a few heartbeat intervals), or until this process is told to stop: torchrun
        tears the group down with SIGTERM as soon as a worker died, and kills what is still
        running 30 s later, which would lose this message and delay its restart."""
        if self._store is None:
            return "this run has one rank"
        deadline = time.monotonic() + self.stale_s + self.interval_s
        try:
            while True:
                beats = self._read_all()
                lost = self._stale_ranks(beats)
                if lost or time.monotonic() >= deadline or _told_to_stop(self.interval_s / 2):
                    break
        except Exception:  # noqa: BLE001 - the store went with its host
            return "lost the rendezvous store (its host is gone: rank 0's node, or torchrun's)"
        if lost:
            return self._describe(lost, beats)
        stop = _stop_asked()
        if stop:
            return f"told to stop ({stop}) before the lost rank could be named"
        steps = {r: b[1] for r, b in beats.items() if b is not None}
        low = min(steps.values(), default=self.step)
        behind = sorted(r for r, s in steps.items() if s == low)
        if steps and low < max(steps.values()):
            return (
                f"every rank still has a heartbeat; rank(s) {_ranks(behind)} are behind at "
                f"step {low} (hung, or slower than the timeout)"
            )
        return "every rank still has a heartbeat, all at the same step (a rank may be hung)"


def failure_message(error: BaseException) -> str:
    """One line for a failed collective: where, which rank was lost, and the backend's words
    (without its source-file prefix)."""
    beat = ACTIVE
    where = f"at step {beat.step}" if beat is not None and beat.step else "during start-up"
    who = beat.diagnose() if beat is not None else "no heartbeat to tell which rank was lost"
    cause = " ".join(str(error).split())
    cause = re.sub(r"\[[^\]]*\.(cc|cpp|h)p?:\d+\]\s*", "", cause)  # gloo's "[.../pair.cc:537] "
    cause = cause.split(" This is typically caused")[0][:200]
    return (
        f"a collective failed {where}: {who} ({cause}); the checkpoints on disk are "
        "intact: run the same command to resume (torchrun restarts by itself with "
        "MAX_RESTARTS > 0)"
    )


def _stop_asked() -> str | None:
    """The stop signal this process has had (SIGTERM, SIGUSR1, Ctrl-C), None while none."""
    stop = stop_signals.preempt_signal()
    if stop is not None:
        return signal.Signals(stop).name
    return "Ctrl-C" if stop_signals.interrupted() else None


def _told_to_stop(seconds: float) -> bool:
    """Sleep ``seconds``, or less once a stop signal has arrived; whether one has."""
    end = time.monotonic() + seconds
    while True:
        if _stop_asked():
            return True
        left = end - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(left, 0.1))


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8])
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def _default_store() -> dist.Store | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None
