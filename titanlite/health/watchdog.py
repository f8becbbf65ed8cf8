"""The hang watchdog: a rank that makes no progress for ``health.hang_timeout_s`` says why.

A daemon thread per rank watches for progress: the trainer's ``beat(step)`` at each step's
start, and any collective entered or left, or wait ended (``record.last_activity``), from the
second step on (start-up and the first step are left to the start-up collective timeout).
When there has been none for the timeout, the rank is hung, usually in a collective that some
rank never joined (a pause of the whole process, as when a job is suspended, is not: the
thread notices it slept through it and counts afresh). It then, from the thread (the main
thread is stuck in C++):

1. writes ``DUMP_FOLDER/health/hang-<step>/rank-<r>.txt`` (atomically): host, pid, step, its
   collective record and the Python stacks of all its threads (``hang_report.dump_text``);
2. waits up to ``grace_s`` for the other ranks' dumps (they time out at about the same time);
3. the lowest rank that wrote one reads them all and logs ONE line naming the rank(s) the
   others wait for and the collective (``hang_report.diagnose``), in ``summary.txt`` beside
   the dumps too; the other ranks wait for that file. Every rank records the line for its
   launcher (TITANLITE_ERROR_FILE, which ./run_train.sh repeats once at the end);
4. ends the process with exit status 4 (EXIT_COMM_FAILURE), as a lost rank ends the run
   (``runtime.heartbeat``): the checkpoints on disk are intact and the same command resumes.

The heartbeat names a lost rank once a collective *fails* (at ``comm.timeout_seconds``); the
watchdog fires earlier, while it still hangs, and names the collective too, so the settings
require ``hang_timeout_s < comm.timeout_seconds``. A rank that is stopped or gone writes no
dump: the line says so. A rank's survivors exit within the timeout plus ``grace_s`` plus a
few polls of 1 s at most; under torchrun, a frozen (SIGSTOPped) rank cannot take the SIGTERM
that torchrun then sends, so the run as a whole ends when torchrun kills it (30 s later).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from titanlite.errors import EXIT_COMM_FAILURE, error_lines
from titanlite.files import atomic_write
from titanlite.health import hang_report
from titanlite.health.hang_report import diagnose
from titanlite.health.record import CollectiveRecord

__all__ = ["Watchdog", "diagnose"]

logger = logging.getLogger(__name__)

RESUME = "the checkpoints on disk are intact: run the same command to resume"


class Watchdog:
    """One rank's hang watchdog; see the module docstring. ``on_hang(line)`` replaces the
    default ending (record the line for the launcher, exit 4): it gets the diagnosis on the
    rank that made it, None on the others."""

    def __init__(
        self,
        *,
        timeout_s: float,
        rank: int,
        world_size: int,
        dump_folder: str | os.PathLike[str],
        record: CollectiveRecord | None = None,
        grace_s: float = 10.0,
        on_hang: Callable[[str | None], None] | None = None,
    ) -> None:
        self.timeout_s, self.grace_s = float(timeout_s), float(grace_s)
        self.rank, self.world_size = rank, world_size
        self.health_folder = Path(dump_folder) / "health"
        self.record = record
        self.on_hang = on_hang
        self.step = 0
        self.fired_at: Path | None = None  # the dump folder, once it fired
        self._beat = self._resumed = 0.0
        self._armed = False
        self._steps_seen = 0
        self._poll_s = min(1.0, max(0.05, self.timeout_s / 20))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error_file: str | None = None

    def start(self) -> None:
        if self._thread is None and self.timeout_s > 0:
            self._thread = threading.Thread(
                target=self._run, name="titanlite-watchdog", daemon=True
            )
            self._thread.start()

    def beat(self, step: int | None = None) -> None:
        """Progress: at each step's start, with its number (or anywhere, without). The
        watchdog is armed from the second step on: start-up and the first step (its first
        batch, compilation) are timed by the start-up collective timeout, as for the
        heartbeat."""
        if step is not None and step != self.step:
            self._armed = self._steps_seen > 0
            self._steps_seen += 1
            self.step = step
        self._beat = time.time()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self._poll_s + 1)
        self._thread = None

    # -- the thread ----------------------------------------------------------------------------

    def _idle_s(self) -> float:
        if not self._armed:
            return 0.0
        last = max(self._beat, self._resumed)
        if self.record is not None:
            last = max(last, self.record.last_activity())
        return time.time() - last

    def _run(self) -> None:
        idle, woke = 0.0, time.monotonic()
        while idle <= self.timeout_s:
            if self._stop.wait(self._poll_s):
                return
            now = time.monotonic()
            if now - woke > self._poll_s + max(2.0, self.timeout_s / 4):
                # This thread slept far past its poll: the process itself was stopped (a
                # suspended job, Ctrl-Z) or starved, which is no hang of the run: count afresh.
                self._resumed = time.time()
            woke = now
            idle = self._idle_s()
        step = self.step
        if self.on_hang is None:
            # From now on this process ends by our line alone: a collective that fails in
            # the main thread when another rank exits must not add its own to the launcher's.
            self._error_file = os.environ.pop("TITANLITE_ERROR_FILE", None)
        try:
            line, reported = self._report(self._dump(idle))
        except Exception as e:  # noqa: BLE001 - no dump: still end the hung run, saying so
            logger.exception("rank %d: the hang dump failed", self.rank)
            line = f"hang at step {step}: rank {self.rank} made no progress for {idle:.0f} s "
            line += f"and could not write its dump ({e})"
            reported = True
        if self.on_hang is not None:
            self.on_hang(line if reported else None)
        else:
            self._end_run(line)

    def _dump(self, idle: float) -> Path:
        """This rank's dump; the folder it is in."""
        folder = self.health_folder / f"hang-{self.step}"
        self.fired_at = folder
        folder.mkdir(parents=True, exist_ok=True)
        header = {
            "rank": self.rank,
            "world_size": self.world_size,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "step": self.step,
            "written": f"{time.time():.6f}",
            "idle_s": f"{idle:.3f}",
            "timeout_s": f"{self.timeout_s:g}",
            "attempt": hang_report.attempt_tag(),
            "where": hang_report.main_thread_place(),
        }
        lines = self.record.format_lines() if self.record is not None else ["no record"]
        path = folder / f"rank-{self.rank}.txt"
        atomic_write(path, hang_report.dump_text(header, lines))
        logger.error(
            "rank %d made no progress for %.0f s at step %d (health.hang_timeout_s %g): its "
            "stacks and collective record are in %s",
            self.rank,
            idle,
            self.step,
            self.timeout_s,
            path,
        )
        return folder

    def _report(self, folder: Path) -> tuple[str, bool]:
        """(the line, whether this rank made it): the lowest rank with a dump reads them all
        and writes ``summary.txt``; the others take its line from there (every launcher of a
        multi-node job repeats it), or make their own if it never comes."""
        window = self.timeout_s + self.grace_s
        ranks = self._wait_for_dumps(folder, window)
        summary = folder / "summary.txt"
        if ranks and self.rank == min(ranks):
            line = diagnose(folder, window_s=window)
            logger.error("%s", line)
            atomic_write(summary, line + "\n")
            return line, True
        since = time.time() - window
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and not self._stop.is_set():
            with contextlib.suppress(OSError):
                if summary.stat().st_mtime >= since:
                    return summary.read_text().strip(), False
            time.sleep(min(self._poll_s, 0.1))
        line = diagnose(folder, window_s=window)  # the lowest rank's line never came
        logger.error("%s", line)
        return line, True

    def _wait_for_dumps(self, folder: Path, window: float) -> list[int]:
        """The ranks with a dump of this hang in ``folder``, once all are there or after
        ``grace_s`` (only names and times are read meanwhile: a thousand ranks poll it)."""
        deadline = time.monotonic() + self.grace_s
        since = time.time() - window
        while True:
            ranks = hang_report.dumped_ranks(folder, since)
            if len(ranks) >= self.world_size or time.monotonic() >= deadline:
                return ranks
            if self._stop.wait(min(self._poll_s, 0.2)):
                return ranks

    def _end_run(self, line: str) -> None:
        """Exit 4 now, as a lost rank ends the run, with the line for the launcher."""
        if self._error_file:
            try:
                with open(self._error_file, "a") as f:
                    f.writelines(
                        f"{EXIT_COMM_FAILURE}\t{text}\n"
                        for text in error_lines(RuntimeError(f"{line}; {RESUME}"))
                    )
            except OSError:  # nowhere to say it: the logs have it
                pass
        for handler in logging.getLogger().handlers:
            try:
                handler.flush()
            except Exception:  # noqa: BLE001 - ending anyway
                pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(EXIT_COMM_FAILURE)
