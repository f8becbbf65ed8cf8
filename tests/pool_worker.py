"""The worker side of tests/pool.py: one rank of a long-lived gloo process group.

Started by ``WorkerPool`` (never imported by tests). It joins the default process group once,
then runs one scenario per message from the parent until it is told to stop, its pipe closes
or the pytest process goes away. Everything it prints (and faulthandler's stack dumps) goes to
a file the parent reads; its log records go back with each reply.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

# Signals a scenario may take over (train.py handles SIGTERM/SIGUSR1): restored before each call.
RESET_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# The parent sends this to a stuck rank to get every thread's Python stack in its output file.
DUMP_SIGNAL = signal.SIGUSR2
LOG_FORMAT = logging.Formatter("%(levelname)s %(name)s: %(message)s")


def _watch_owner(owner_pid: int) -> None:
    """Exit as soon as the pytest process is gone, even while the main thread is stuck in C++."""
    parent = os.getppid()
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(70)
        try:
            os.kill(owner_pid, 0)
        except ProcessLookupError:
            os._exit(70)
        except PermissionError:  # the pid was reused by another user's process
            os._exit(70)


class _LogCapture:
    """Collects every record of level >= INFO created during a call, from any logger.

    It hooks the record factory rather than a root handler, so a scenario that reconfigures
    logging (``basicConfig(force=True)``) or uses a logger that does not propagate is still seen.
    """

    def __init__(self) -> None:
        self.records: list[logging.LogRecord] = []
        self._previous = logging.getLogRecordFactory()
        self._lock = threading.Lock()

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = self._previous(*args, **kwargs)
            if record.levelno >= logging.INFO:
                with self._lock:
                    self.records.append(record)
            return record

        logging.setLogRecordFactory(factory)

    def close(self) -> list[str]:
        logging.setLogRecordFactory(self._previous)
        lines = []
        for record in self.records:
            try:
                lines.append(LOG_FORMAT.format(record))
            except Exception as err:  # noqa: BLE001 - a bad format string must not kill the call
                lines.append(f"{record.levelname} {record.name}: <unformattable: {err!r}>")
        return lines


class _State:
    """What a scenario may change in this process, as it was when the worker started."""

    def __init__(self) -> None:
        root = logging.getLogger()
        self.cwd = os.getcwd()
        self.environ = dict(os.environ)
        self.root_level = root.level
        self.root_handlers = list(root.handlers)
        self.signals = {sig: signal.getsignal(sig) for sig in RESET_SIGNALS}

    def restore(self) -> None:
        import torch

        os.chdir(self.cwd)
        os.environ.clear()
        os.environ.update(self.environ)
        root = logging.getLogger()
        for handler in list(root.handlers):
            if handler not in self.root_handlers:
                root.removeHandler(handler)
                handler.close()
        for handler in self.root_handlers:
            if handler not in root.handlers:
                root.addHandler(handler)
        root.setLevel(self.root_level)
        logging.disable(logging.NOTSET)
        for sig, handler in self.signals.items():
            signal.signal(sig, handler)
        faulthandler.register(DUMP_SIGNAL, all_threads=True)
        torch.manual_seed(0)
        # Only when needed: the call imports torch._inductor (1.2 s and 800 modules) the first time.
        if torch.are_deterministic_algorithms_enabled():
            torch.use_deterministic_algorithms(False)
        if torch.is_deterministic_algorithms_warn_only_enabled():
            torch.use_deterministic_algorithms(False, warn_only=False)
        torch.set_num_threads(1)
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        if "torch._dynamo" in sys.modules:  # compiled code and recompile counters of old calls
            torch._dynamo.reset()


def _destroy_subgroups() -> None:
    """Destroy the process groups (new_group, DeviceMesh dimensions) a scenario left behind.

    Each gloo group holds sockets and threads (about 5 descriptors and 3 threads per 2-rank
    group): in a process that lives for the whole session they would pile up call after call.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not dist.is_initialized():
        return
    world = dist.group.WORLD
    for group in [g for g in list(distributed_c10d._world.pg_map) if g is not world]:
        dist.destroy_process_group(group)
    _clear_dtensor_caches()
    gc.collect()


def _clear_dtensor_caches() -> None:
    """DTensor caches sharding decisions keyed by specs whose meshes compare by value: a new
    mesh of the same shape in a later call would get the old mesh back, with destroyed
    groups ("Could not resolve the process group registered under the name ...")."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    import torch
    from torch.distributed.tensor import DTensor, _redistribute

    if hasattr(torch._C, "_clear_DTensor_sharding_propagator_cache"):  # the C++ fast path's
        torch._C._clear_DTensor_sharding_propagator_cache()
    propagator = DTensor._op_dispatcher.sharding_propagator
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        cached = getattr(propagator, name, None)
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    if hasattr(_redistribute, "clear_redistribute_planner_cache"):
        _redistribute.clear_redistribute_planner_cache()
    if hasattr(_redistribute._gen_transform_infos, "cache_clear"):
        _redistribute._gen_transform_infos.cache_clear()
    # Keyed by mesh, it also kept every mesh of the call alive, and with them their destroyed
    # groups' gloo threads: 8 process groups' worth (24 threads) per worker after a tp=2 run,
    # whose polling cost each idle worker about 0.5% of a core for the rest of the session.
    from torch.distributed.tensor import _collective_utils

    topology = getattr(_collective_utils, "MeshTopoInfo", None)
    if hasattr(getattr(topology, "build_from_mesh", None), "cache_clear"):
        topology.build_from_mesh.cache_clear()


def _call(module: str, qualname: str, rank: int, world: int, kwargs: dict[str, Any]) -> Any:
    fn: Any = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    return fn(rank, world, **kwargs)


def serve(
    conn: Any,
    rank: int,
    world: int,
    store_port: int,
    pg_timeout_s: float,
    env: dict[str, str],
    sys_path: list[str],
    output_file: str,
    owner_pid: int,
) -> None:
    """Main function of one worker process (the target given to multiprocessing)."""
    out = os.open(output_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - lives as long as we do
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    faulthandler.enable(all_threads=True)  # a crash leaves every thread's stack in the file
    faulthandler.register(DUMP_SIGNAL, all_threads=True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is pytest's to handle: it stops us
    threading.Thread(target=_watch_owner, args=(owner_pid,), daemon=True).start()
    sys.path[:] = sys_path
    os.environ.update(env)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        timeout = timedelta(seconds=pg_timeout_s)
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    except BaseException:  # noqa: B036 - the parent reports why this rank never came up
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    # What exists now (torch and the other preloaded modules, forked from the forkserver) lives
    # as long as the worker: moved out of the collector's sight, the full collection after each
    # call (and those the interpreter runs itself during a call) scans only what scenarios made:
    # 35 ms instead of 130 ms per rank and call, and the forked pages stay shared.
    gc.freeze()
    # INFO records are created (and captured), not printed: the root logger has no handler.
    logging.getLogger().setLevel(logging.INFO)
    state = _State()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if message[0] == "stop":
            break
        _, call_id, module, qualname, kwargs = message
        capture = _LogCapture()
        try:
            state.restore()
            reply: tuple = ("ok", call_id, _call(module, qualname, rank, world, kwargs))
        except BaseException:  # noqa: B036 - SystemExit and KeyboardInterrupt are failures too
            reply = ("error", call_id, traceback.format_exc())
        try:
            _destroy_subgroups()
        except Exception:  # noqa: BLE001 - reported as this call's failure
            if reply[0] == "ok":
                reply = (
                    "error",
                    call_id,
                    "destroying the scenario's groups failed:\n" + traceback.format_exc(),
                )
        logs = capture.close()
        sys.stdout.flush()
        sys.stderr.flush()
        healthy = dist.is_initialized()
        try:
            conn.send((*reply, logs, healthy))
        except Exception:  # noqa: BLE001 - e.g. a return value that does not pickle
            conn.send(("error", call_id, traceback.format_exc(), logs, healthy))
    if dist.is_initialized():
        dist.destroy_process_group()
