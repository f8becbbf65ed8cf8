"""One run per dump folder: the lock file a run holds for its whole life.

Two trainers writing one folder interleave their metrics.jsonl lines and race on the step-N
folders, and both exit 0. So rank 0 creates ``run.lock`` in job.dump_folder before anything
is written there and deletes it after the last save. The file names the holder (host, pid,
SLURM job and attempt, start time) and a heartbeat, rewritten every REFRESH_S by a thread of
its own: it must go on through the final save, after the store heartbeat has stopped, and
single-process runs have no store heartbeat.

A holder on this host is alive while its pid is (and is still the same process: its start
time in /proc matches); on another host, whose pids mean nothing here, while its heartbeat
is younger than STALE_AFTER_S: six missed refreshes, long enough for a filesystem stall and
for clock differences of tens of seconds between nodes, short enough that a run whose node
died restarts elsewhere a minute later. A lock whose holder is gone is taken over with a
warning naming it. A SLURM requeue (same job id, a later attempt) may start while the previous
attempt still finishes its save: it waits for that lock to go, for a bounded time.

Torch-free (the launcher's preflight and the scripts use it); only ``take_for_run`` talks to
the other ranks.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from titanlite.errors import EXIT_USER_ERROR, UserError
from titanlite.runtime import pids

logger = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
REFRESH_S = 10.0
"""How often the holder rewrites its heartbeat."""
STALE_AFTER_S = 60.0
"""A lock from another host whose heartbeat is older than this is taken over."""
REQUEUE_WAIT_S = 300.0
"""The longest a requeued job waits for its previous attempt to release the folder."""
RUN_MARKERS = (LOCK_FILE, "run.json")  # what makes a folder a run's (run.json: written first)


class Ranks(Protocol):  # titanlite.runtime.distributed.DistInfo, without importing torch here
    rank: int
    world_size: int


class RunFolderBusy(UserError):
    """Another live run (or tool) holds the dump folder."""


@dataclass(frozen=True)
class Holder:
    """What a lock file says about the process holding it."""

    host: str
    pid: int
    pid_start: str | None  # the process's start time in /proc (Linux): tells a reused pid
    job: str | None  # SLURM job id
    attempt: str | None  # SLURM restart count
    what: str  # "training", or the script holding the folder
    started: float
    heartbeat: float
    token: str

    def describe(self) -> str:
        now = time.time()
        job = f", SLURM job {self.job}" if self.job else ""
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return (
            f"{self.what}: pid {self.pid} on host {self.host}{job}, started {started}, "
            f"last heartbeat {max(now - self.heartbeat, 0):.0f} s ago"
        )


def this_process(what: str) -> Holder:
    now = time.time()
    return Holder(
        host=socket.gethostname(),
        pid=os.getpid(),
        pid_start=pids.start_time(os.getpid()),
        job=os.environ.get("SLURM_JOB_ID") or None,
        attempt=os.environ.get("SLURM_RESTART_COUNT", "0")
        if os.environ.get("SLURM_JOB_ID")
        else None,
        what=what,
        started=now,
        heartbeat=now,
        token=uuid.uuid4().hex,
    )


def read(path: Path) -> Holder | None:
    """The lock at ``path``; None when there is none. An unreadable one (written by hand, or
    a disk error) is described by its file's age."""
    for attempt in range(3):
        try:
            text = path.read_text()
            mtime = path.stat().st_mtime
            break
        except FileNotFoundError:
            return None
        except OSError as e:  # NFS: the file was replaced under an open handle; look again
            if e.errno != errno.ESTALE or attempt == 2:
                raise
    try:
        fields: dict[str, Any] = json.loads(text)
        return Holder(**fields)
    except (ValueError, TypeError):
        return Holder(
            host="?",
            pid=0,
            pid_start=None,
            job=None,
            attempt=None,
            what="an unreadable lock file",
            started=mtime,
            heartbeat=mtime,
            token="",
        )


def gone(holder: Holder) -> str | None:
    """Why ``holder`` is gone (for the warning), None while it may be alive."""
    if holder.host == socket.gethostname():
        if holder.pid == os.getpid() and holder.token:
            return "left by this process"  # an earlier run in it that was not closed
        if not pids.alive(holder.pid, holder.pid_start):
            return f"process {holder.pid} no longer exists"
        return None
    age = time.time() - holder.heartbeat
    if age > STALE_AFTER_S:
        return f"no heartbeat for {age:.0f} s (more than {STALE_AFTER_S:.0f} s)"
    return None


def busy_error(folder: Path, holder: Holder) -> RunFolderBusy:
    return RunFolderBusy(
        f"job.dump_folder '{folder}' is in use by another run ({holder.describe()}); let it "
        "finish or stop it (Ctrl-C), or choose another --job.dump_folder"
    )


def check_free(folder: Path) -> None:
    """RunFolderBusy when a live run holds ``folder`` (the launcher's preflight: fail before
    starting anything). A stale lock, and the previous attempt of this SLURM job, are left
    for the trainer (it takes over, or waits)."""
    try:
        holder = read(Path(folder) / LOCK_FILE)
    except OSError as e:
        raise UserError(f"job.dump_folder '{folder}': cannot read its {LOCK_FILE}: {e}") from None
    me = this_process("")
    if holder is None or gone(holder) is not None or _earlier_attempt(holder, me):
        return
    raise busy_error(Path(folder), holder)


class RunLock:
    """A lock this process holds; refreshed on a thread of its own until ``release``."""

    def __init__(self, path: Path, holder: Holder) -> None:
        self.path, self.holder = path, holder
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._refresh_loop, name="titanlite-run-lock", daemon=True
        )
        self._thread.start()

    def refresh(self) -> None:
        current = read(self.path)
        if current is None:  # deleted by hand: this run still holds the folder
            logger.warning(
                "%s was deleted while this run holds the folder; writing it again", self.path
            )
        elif current.token != self.holder.token:
            # Another run judged this one gone (its heartbeat stopped for over a minute: the
            # process was frozen, or the filesystem away) and holds the folder now. Writing
            # on would make two runs in one folder: stop here, saving nothing.
            logger.error(
                "lost job.dump_folder %s to another run (%s): exiting without saving",
                self.path.parent,
                current.describe(),
            )
            os._exit(EXIT_USER_ERROR)
        self.holder = _replace_heartbeat(self.holder)
        _write(self.path, self.holder)

    def _refresh_loop(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                self.refresh()
            except OSError as e:  # a filesystem hiccup: the next refresh tries again
                logger.warning("could not refresh %s: %s", self.path, e)

    def release(self) -> None:
        """Stop refreshing and delete the lock (if it is still this process's)."""
        global _held
        self._stop.set()
        self._thread.join()
        current = read(self.path)
        if current is not None and current.token == self.holder.token:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        if _held is self:
            _held = None


_held: RunLock | None = None


def acquire(folder: Path, what: str, wait_s: float = 0.0) -> RunLock:
    """Take ``folder`` for this process: at once when free, taking over a lock whose holder is
    gone (with a warning), waiting up to ``wait_s`` for the previous attempt of this SLURM
    job; RunFolderBusy naming the holder otherwise. Creates the folder."""
    try:
        return _acquire(Path(folder), what, wait_s)
    except OSError as e:  # FileExistsError is handled inside: this is a folder we cannot use
        raise UserError(
            f"job.dump_folder '{folder}': cannot write its {LOCK_FILE}: {e.strerror or e}"
        ) from None


def _acquire(folder: Path, what: str, wait_s: float) -> RunLock:
    global _held
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    me = this_process(what)
    deadline = time.monotonic() + wait_s
    waited = False
    for _ in range(1000):  # each round either wins, waits a second, or ends
        if _create(path, me):
            _held = RunLock(path, me)
            return _held
        holder = read(path)
        if holder is None:  # released between the two looks
            continue
        reason = gone(holder)
        if reason is not None:
            if _take_over(path, holder, me.token):
                logger.warning(
                    "taking over job.dump_folder %s from a run that is gone (%s: %s)",
                    folder,
                    holder.describe(),
                    reason,
                )
            continue
        left = deadline - time.monotonic()
        if _earlier_attempt(holder, me) and left > 0:
            if not waited:
                logger.warning(
                    "waiting up to %g s for the previous attempt of SLURM job %s "
                    "to release %s (%s)",
                    wait_s,
                    me.job,
                    folder,
                    holder.describe(),
                )
                waited = True
            time.sleep(min(1.0, left))  # not past the deadline
            continue
        raise busy_error(folder, holder)
    raise RunFolderBusy(
        f"could not take job.dump_folder '{folder}': its {LOCK_FILE} keeps changing"
    )


def release_held() -> None:
    """Release the lock this process holds, if any (the entry points' last word)."""
    if _held is not None:
        _held.release()


def take_for_run(folder: str | Path, dist_info: Ranks, init_timeout_s: float) -> RunLock | None:
    """Rank 0 takes the run's folder; every rank learns whether it could and raises the same
    RunFolderBusy if not (a collective when there are several ranks). A requeue waits for its
    previous attempt within the start-up timeout, which the other ranks wait under."""
    lock, problem = None, ""
    if dist_info.rank == 0:
        try:
            wait_s = min(REQUEUE_WAIT_S, 0.8 * init_timeout_s)
            lock = acquire(Path(folder), "training", wait_s=wait_s)
        except UserError as e:
            problem = str(e)
    if dist_info.world_size > 1:
        import torch.distributed as dist  # only here: this module is torch-free otherwise

        shared = [problem]
        dist.broadcast_object_list(shared, src=0)
        problem = shared[0]
    if problem:
        raise RunFolderBusy(problem)
    return lock


def run_folder_of(path: Path) -> Path | None:
    """The run folder ``path`` belongs to (itself or one of its two parents holding a run's
    lock or run.json), None when it is in none."""
    path = Path(path).absolute()
    for folder in (path, path.parent, path.parent.parent):
        if any((folder / marker).exists() for marker in RUN_MARKERS):
            return folder
    return None


@contextlib.contextmanager
def hold(path: Path, what: str) -> Iterator[Path | None]:
    """For a script writing ``path``: hold the run folder it lies in meanwhile (RunFolderBusy
    when a live run holds it); nothing when it is in no run's folder. Yields that folder."""
    folder = run_folder_of(path)
    if folder is None:
        yield None
        return
    lock = acquire(folder, what)
    try:
        yield folder
    finally:
        lock.release()


def live_holder(path: Path) -> Holder | None:
    """The live holder of the run folder ``path`` lies in, if any (for read-only tools)."""
    folder = run_folder_of(path)
    holder = read(folder / LOCK_FILE) if folder is not None else None
    return holder if holder is not None and gone(holder) is None else None


# -------------------------------------------------------------------------------- helpers


def _earlier_attempt(holder: Holder, me: Holder) -> bool:
    return bool(me.job) and holder.job == me.job and holder.attempt != me.attempt


def _replace_heartbeat(holder: Holder) -> Holder:
    return Holder(**{**asdict(holder), "heartbeat": time.time()})


def _write_aside(path: Path, holder: Holder) -> Path:
    tmp = path.with_name(f".{path.name}.{holder.token}")
    tmp.write_text(json.dumps(asdict(holder)) + "\n")
    return tmp


def _write(path: Path, holder: Holder) -> None:
    """Replace the lock's content in one rename: a reader never sees half a file."""
    os.replace(_write_aside(path, holder), path)


def _create(path: Path, holder: Holder) -> bool:
    """Create the lock unless one exists, in one atomic step that also works on NFS: the
    content goes to a file of its own, hard-linked to the lock's name (the link fails when
    the name exists). Without hard links, an exclusive create."""
    tmp = _write_aside(path, holder)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:  # a filesystem without hard links
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(tmp.read_text())
        return True
    finally:
        tmp.unlink(missing_ok=True)


def _take_over(path: Path, stale: Holder, token: str) -> bool:
    """Remove the stale lock, unless another newcomer got there first. Renaming is atomic:
    of several newcomers one moves the file; one that moved a fresh lock instead (another
    newcomer's, made meanwhile) puts it back."""
    moved = path.with_name(f".{path.name}.stale.{token}")
    try:
        os.replace(path, moved)
    except FileNotFoundError:
        return False
    took = read(moved)
    try:
        if took is not None and took.token != stale.token:
            with contextlib.suppress(FileExistsError):
                os.link(moved, path)
            return False
        return True
    finally:
        moved.unlink(missing_ok=True)
