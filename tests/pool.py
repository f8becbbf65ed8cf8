"""Multi-rank test scenarios in a pool of long-lived gloo worker processes.

Starting a rank costs seconds (importing torch alone takes ~3 s of CPU), so instead of spawning
a process group per test, each world size gets one pool of worker processes for the whole pytest
session. The workers join a gloo default process group once and then run *scenarios*, one call
after another, for every test module that asks for that world size.

Writing a scenario
------------------
A scenario is a plain module-level function that every rank runs with its rank and world size
(and any keyword arguments the test passes); the default process group is already initialized::

    # tests/my_scenarios.py
    import torch
    import torch.distributed as dist

    def sum_of_ranks(rank: int, world: int, scale: float = 1.0) -> float:
        t = torch.tensor([float(rank) * scale])
        dist.all_reduce(t)
        return t.item()

Put scenarios in a module of their own (workers then import only that module, not pytest and a
test file) and let them raise, usually ``AssertionError``, when something is wrong. Keyword
arguments and return values travel by pickle. Before each call the worker restores what a
previous scenario may have changed: ``torch.manual_seed(0)``, deterministic algorithms off, one
intra-op thread, float32 default dtype, grad mode on, torch._dynamo reset, the working directory,
``os.environ``, root logging handlers and level, and the handlers of SIGTERM, SIGUSR1 and
SIGINT (ignored: Ctrl-C is pytest's). After each call it destroys every process group the
scenario created (``new_group``, DeviceMesh dimensions), so a scenario need not clean up and
nothing it made survives into the next call. A scenario that destroys the default group gets its
result back, then the pool restarts.

Each worker's environment is the one tests give titanlite (``conftest.subprocess_env``: offline
Hugging Face and W&B, ``TITANLITE_CACHE_DIR`` the test cache) plus ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``MASTER_ADDR``/``MASTER_PORT`` (the TCPStore the
default group was built on, hosted by the pytest process), so ``titanlite.runtime.distributed.init``
sees an initialized world. ``sys.path`` is pytest's, so ``tests/`` modules and titanlite import.

Using it from a test
--------------------
::

    from pool import get_pool

    @pytest.mark.slow
    def test_sum() -> None:
        pool = get_pool(2)                    # started on first use, shared by the session
        assert pool.run("my_scenarios:sum_of_ranks", scale=2.0) == [2.0, 2.0]
        assert pool.run(my_scenarios.sum_of_ranks) == [1.0, 1.0]  # or the function itself
        pool.last_logs[1]                     # INFO+ log lines rank 1 emitted in that call
        pool.last_output[1]                   # what rank 1 printed (stdout and stderr)

``run`` returns the per-rank return values, in rank order; ``last_logs`` and ``last_output``
are also set when a call fails. ``WorkerPool(n)`` makes a pool of one's own (start it with a
``run``, stop it with ``close()``) for options such as ``grace_s`` or ``pg_timeout_s``.

Failures
--------
Every failure is a ``ScenarioError`` (a ``pytest.fail`` outcome: pytest shows its message, not
the harness's stack), whose message holds, per failing rank, the full worker traceback, then its
output and last log lines; ``.kind``, ``.tracebacks``, ``.logs`` and ``.output`` hold the parts.

* Every rank finished, some raised (``kind="error"``): the pool stays up for the next call.
* Some ranks raised while others are still running ``grace_s`` (15 s) later, so probably stuck in
  a collective (``"stuck"``), the call ran past ``timeout`` (``"timeout"``), or a worker died
  (``"died"``): the still-running ranks' Python stacks are dumped into their output (shown in the
  message), every worker is killed, and the next ``run`` starts a fresh group transparently.

Workers exit when told to at session end (conftest's session fixture, else atexit), when their
pipe closes, or within a second of the pytest process going away, even while stuck in a
collective.

Start method: ``forkserver`` with torch preloaded (``PRELOAD``), not ``spawn``. A spawned worker
imports torch itself (~2-3 s of CPU each, so ~6 s of wall time for 4 ranks on 2 cores); a
forkserver imports it once per session and forks fresh, thread-free workers from it, so a pool
of 4 starts in ~0.5 s after the first and a restart after a hang costs ~0.2 s. Workers still
share no state with pytest. ``WorkerPool(n, start_method="spawn")`` gives the slower behaviour.

Why groups are destroyed after each call: a gloo group holds sockets and threads in every
member (a (2, 2) DeviceMesh: 10 descriptors and 6 threads per rank), which would pile up over a
session in processes that never exit. Destroyed, a group still lives while anything holds its
mesh: the worker also empties DTensor's caches keyed by mesh (``pool_worker``), else an idle
worker kept the last call's groups and their polling threads (0.5% of a core each, for the
rest of the session). What a worker holds when it starts (torch) is frozen for the garbage
collector (``gc.freeze``): the collection after each call scans only what calls made.
"""

from __future__ import annotations

import atexit
import itertools
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import pool_worker
import pytest
from conftest import subprocess_env

# Imported once by the forkserver that all workers are forked from. Besides torch, `datasets`
# and its text builder: a worker's first training run otherwise imports them, about 0.8 s of
# CPU per worker started. They read only the pinned Hugging Face variables, the same in every
# pool. The one thread they start (pyarrow's jemalloc background purger) is not carried into a
# fork: a worker's allocator then purges inline, as with that thread disabled.
PRELOAD = [
    "pool_worker",
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch._dynamo",
    "datasets",
    "datasets.packaged_modules.text.text",
]
DIR_PREFIX = "titanlite-pool-"  # + the pytest pid: one folder of rank outputs per started pool
OUTPUT_CHARS = 20_000  # per rank, in a failure message
LOG_LINES = 40  # last log lines per rank in a failure message


class ScenarioError(pytest.fail.Exception):
    """A scenario failed, hung or lost a worker; the message shows every failing rank."""

    def __init__(
        self,
        message: str,
        *,
        kind: str,
        tracebacks: dict[int, str],
        logs: list[list[str]],
        output: list[str],
    ) -> None:
        super().__init__(message, pytrace=False)
        self.kind = kind
        self.tracebacks = tracebacks
        self.logs = logs
        self.output = output


def _remove_stale_dirs() -> None:
    """Remove the output folders of pools whose pytest process was killed before cleaning up."""
    for path in Path(tempfile.gettempdir()).glob(f"{DIR_PREFIX}*"):
        pid = path.name[len(DIR_PREFIX) :].split("-")[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:  # another user's live process
            pass


def _resolve(target: str | Callable[..., Any]) -> tuple[str, str]:
    """(module, qualname) of a "module:function" string or a module-level function."""
    if isinstance(target, str):
        module, _, qualname = target.partition(":")
        if not module or not qualname:
            raise ValueError(f"expected 'module:function', got {target!r}")
        return module, qualname
    module, qualname = target.__module__, target.__qualname__
    if "<locals>" in qualname or module == "__main__":
        raise ValueError(f"{module}.{qualname}: scenarios must be module-level functions")
    return module, qualname


class WorkerPool:
    """``world_size`` gloo ranks that run scenarios; see the module docstring."""

    def __init__(
        self,
        world_size: int,
        *,
        pg_timeout_s: float = 90.0,
        grace_s: float = 15.0,
        start_timeout_s: float = 180.0,
        start_method: str = "forkserver",
    ) -> None:
        self.world_size = world_size
        self.pg_timeout_s = pg_timeout_s
        self.grace_s = grace_s
        self.start_timeout_s = start_timeout_s
        self.start_method = start_method
        self.starts = 0  # how many times workers were started (1 + restarts)
        self.last_logs: list[list[str]] = [[] for _ in range(world_size)]
        self.last_output: list[str] = ["" for _ in range(world_size)]
        self._calls = itertools.count()
        self._processes: list[Any] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._store: Any = None
        self._dir: Path | None = None

    # ----- life cycle ---------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return bool(self._processes) and all(p.is_alive() for p in self._processes)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    def start(self) -> None:
        """Start the workers and wait until every rank has joined the group."""
        import torch.distributed as dist

        self.close()
        self.starts += 1
        _remove_stale_dirs()
        self._dir = Path(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-w{self.world_size}-"))
        timeout = timedelta(seconds=self.pg_timeout_s)
        self._store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout
        )
        env = subprocess_env(self._dir)
        env.update(
            WORLD_SIZE=str(self.world_size),
            LOCAL_WORLD_SIZE=str(self.world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(self._store.port),
        )
        context = multiprocessing.get_context(self.start_method)
        if self.start_method == "forkserver":
            # One process imports torch (~2 s of CPU) and forks every worker of the session from
            # it. Not titanlite: it may read the environment that workers set at import.
            context.set_forkserver_preload(PRELOAD)
        for rank in range(self.world_size):
            ours, theirs = context.Pipe()
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
            process = context.Process(
                target=pool_worker.serve,
                args=(
                    theirs,
                    rank,
                    self.world_size,
                    self._store.port,
                    self.pg_timeout_s,
                    rank_env,
                    list(sys.path),
                    str(self._output_file(rank)),
                    os.getpid(),
                ),
                name=f"pool{self.world_size}-rank{rank}",
                # Not daemonic: scenarios may start processes of their own (DataLoader workers).
                daemon=False,
            )
            process.start()
            theirs.close()
            self._processes.append(process)
            self._conns.append(ours)
        deadline = time.monotonic() + self.start_timeout_s
        problems: dict[int, str] = {}
        for rank in range(self.world_size):
            problem = self._wait_ready(rank, deadline)
            if problem is not None:
                problems[rank] = problem
                break
        if problems:
            output = [self._read_output(r, 0) for r in range(self.world_size)]
            self.close(graceful=False)
            raise ScenarioError(
                self._message(f"pool of {self.world_size} ranks failed to start", problems, output),
                kind="start",
                tracebacks=problems,
                logs=[[] for _ in output],
                output=output,
            )

    def _wait_ready(self, rank: int, deadline: float) -> str | None:
        """None once ``rank`` has joined the group, else why it did not."""
        conn, process = self._conns[rank], self._processes[rank]
        while time.monotonic() < deadline:
            if conn.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
                try:
                    reply = conn.recv()
                except (EOFError, OSError):  # it died before saying why: see its output
                    process.join(5)
                    return f"exited with code {process.exitcode} while starting"
                return None if reply[0] == "ready" else reply[1]
            if not process.is_alive():
                return f"exited with code {process.exitcode} while starting"
        return f"not ready after {self.start_timeout_s:g} s"

    def close(self, graceful: bool = True) -> None:
        """Stop the workers (killing any that do not stop within a few seconds)."""
        if graceful:
            for conn, process in zip(self._conns, self._processes, strict=True):
                if process.is_alive():
                    try:
                        conn.send(("stop",))
                    except OSError:
                        pass
            deadline = time.monotonic() + 10
            for process in self._processes:
                process.join(max(0.0, deadline - time.monotonic()))
        for process in self._processes:
            if process.is_alive():
                process.kill()
            process.join(5)
        for conn in self._conns:
            conn.close()
        self._processes, self._conns, self._store = [], [], None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    # ----- calls --------------------------------------------------------------------------------

    def run(self, target: str | Callable[..., Any], *, timeout: float = 300, **kwargs: Any) -> list:
        """Run ``target(rank, world, **kwargs)`` on every rank; return the values in rank order.

        Raises ScenarioError when any rank fails; see the module docstring."""
        module, qualname = _resolve(target)
        name = f"{module}:{qualname}"
        call_id = next(self._calls)
        # Pickled here, once: arguments that do not pickle fail the test, not the workers.
        message = ForkingPickler.dumps(("run", call_id, module, qualname, kwargs))
        if not self.alive:
            self.start()
        offsets = [self._output_size(r) for r in range(self.world_size)]
        try:
            for conn in self._conns:
                conn.send_bytes(message)
            replies, pending, died = self._collect(call_id, timeout)
        except BaseException:  # Ctrl-C or a failed send: the workers' state is unknown
            self.close(graceful=False)
            raise
        if pending:  # dump the stuck ranks' stacks into their output before killing them
            for rank in pending:
                try:
                    os.kill(self._processes[rank].pid, pool_worker.DUMP_SIGNAL)
                except ProcessLookupError:
                    pass
            self._await_dumps(pending, offsets)
        self.last_logs = [replies[r][3] if r in replies else [] for r in range(self.world_size)]
        self.last_output = [self._read_output(r, offsets[r]) for r in range(self.world_size)]
        problems = {r: reply[2] for r, reply in sorted(replies.items()) if reply[0] == "error"}
        errored = bool(problems)
        unhealthy = any(not reply[4] for reply in replies.values())
        if died:
            codes = {rank: self._exitcode(rank) for rank in died}
        if pending or died or unhealthy:
            self.close(graceful=not (pending or died))
        if pending or died:
            for rank in died:
                problems[rank] = f"rank {rank} died (exit code {codes[rank]}) during the call"
            for rank in pending:
                problems[rank] = f"rank {rank} was still running; its stacks are in its output"
            if died:
                kind, what = "died", f"lost rank(s) {sorted(died)}"
            elif errored:
                kind = "stuck"
                what = (
                    f"ranks {sorted(pending)} still running {self.grace_s:g} s after others "
                    "failed (stuck in a collective?)"
                )
            else:
                kind, what = "timeout", f"timed out after {timeout:g} s on ranks {sorted(pending)}"
            headline = f"scenario {name} {what}; the pool was killed and restarts on the next run"
        elif problems:
            kind = "error"
            headline = f"scenario {name} failed on ranks {sorted(problems)} of {self.world_size}"
        else:
            return [replies[r][2] for r in range(self.world_size)]
        raise ScenarioError(
            self._message(headline, problems, self.last_output, self.last_logs),
            kind=kind,
            tracebacks=problems,
            logs=self.last_logs,
            output=self.last_output,
        )

    def _collect(self, call_id: int, timeout: float) -> tuple[dict[int, tuple], set, set]:
        """Wait for the ranks' replies: (replies by rank, ranks still running, ranks that died)."""
        replies: dict[int, tuple] = {}
        pending, died = set(range(self.world_size)), set()
        deadline = time.monotonic() + timeout
        failed_at: float | None = None
        while pending and not died:
            limit = deadline if failed_at is None else min(deadline, failed_at + self.grace_s)
            left = limit - time.monotonic()
            if left <= 0:
                break
            waiting = {self._conns[r]: r for r in pending}
            waiting.update({self._processes[r].sentinel: r for r in pending})
            ready = multiprocessing.connection.wait(list(waiting), left)
            for rank in sorted({waiting[obj] for obj in ready}):
                conn = self._conns[rank]
                try:
                    if not conn.poll():  # woken by the process sentinel: it exited
                        raise EOFError
                    reply = conn.recv()
                except (EOFError, OSError):  # exited, or closed its end on the way out
                    died.add(rank)
                    pending.discard(rank)
                    continue
                if reply[1] != call_id:
                    continue  # cannot happen: a pool with a call in flight is killed
                replies[rank] = reply
                pending.discard(rank)
                if reply[0] == "error" and failed_at is None:
                    failed_at = time.monotonic()
        return replies, pending, died

    # ----- output and messages ------------------------------------------------------------------

    def _output_file(self, rank: int) -> Path:
        assert self._dir is not None
        return self._dir / f"rank{rank}.out"

    def _output_size(self, rank: int) -> int:
        try:
            return self._output_file(rank).stat().st_size
        except OSError:
            return 0

    def _await_dumps(self, ranks: Iterable[int], offsets: list[int], within: float = 10.0) -> None:
        """Until each rank's stack dump is in its output (a loaded machine may run the dumping
        process late), or ``within`` seconds; a rank that died has none."""
        deadline = time.monotonic() + within
        ranks = list(ranks)
        waiting = set(ranks)
        while waiting and time.monotonic() < deadline:
            waiting = {
                r
                for r in waiting
                if "most recent call first" not in self._read_output(r, offsets[r])
                and self._processes[r].is_alive()
            }
            time.sleep(0.05)
        # The dump's first thread is there; the rest (the main thread's frames come after the
        # helper threads') is complete once the output stops growing for 0.2 s.
        sizes = None
        while time.monotonic() < deadline:
            now = [self._output_size(r) for r in ranks]
            if now == sizes:
                break
            sizes = now
            time.sleep(0.2)

    def _read_output(self, rank: int, offset: int) -> str:
        try:
            with open(self._output_file(rank), "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def _exitcode(self, rank: int) -> str:
        process = self._processes[rank]
        process.join(10)
        code = process.exitcode
        if code is not None and code < 0:
            return f"{code}, {signal.Signals(-code).name}"
        return str(code)

    def _message(
        self,
        headline: str,
        problems: dict[int, str],
        output: list[str],
        logs: list[list[str]] | None = None,
    ) -> str:
        parts = [headline]
        for rank, text in problems.items():  # errors first, then lost and stuck ranks
            parts.append(f"----- rank {rank} -----\n{text.rstrip()}")
            if output[rank].strip():
                parts.append(f"----- rank {rank} output -----\n{output[rank][-OUTPUT_CHARS:]}")
            if logs and logs[rank]:
                parts.append(f"----- rank {rank} logs -----\n" + "\n".join(logs[rank][-LOG_LINES:]))
        return "\n".join(parts)


_POOLS: dict[int, WorkerPool] = {}


def get_pool(world_size: int) -> WorkerPool:
    """The session's pool for ``world_size`` ranks (its workers start on the first run)."""
    if world_size not in _POOLS:
        _POOLS[world_size] = WorkerPool(world_size)
    return _POOLS[world_size]


def close_pool(world_size: int) -> None:
    """Stop the pool of ``world_size`` ranks, if any (a later get_pool starts a new one). For
    the 8-rank pool at the end of a module that used it: idle, each worker's gloo event-loop
    thread still takes about 3 ms of CPU per second (measured), which the rest of the session
    would pay for nothing."""
    pool = _POOLS.pop(world_size, None)
    if pool is not None:
        pool.close()


def shutdown_pools() -> None:
    """Stop every pool's workers (at session end; also registered with atexit)."""
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


atexit.register(shutdown_pools)
