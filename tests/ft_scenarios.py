"""Test-only hooks for replica groups (tests/test_ft.py): a sitecustomize that records and paces
every training step of a trainer process, and the helpers that read what it wrote.

The hook wraps titanlite.trainer as it is imported (as tests/conftest.py's SLOW_STEPS does);
all of it is steered through files in one control folder (TITANLITE_FT_TEST_DIR):

- ``ready-<group>-<pid>``: written when the trainer is built (its Manager heartbeats the
  lighthouse); then ``train`` waits until ``go`` exists, so that every group asks for the first
  quorum together (a process started later, as a restart, finds ``go`` there and goes on).
- ``pace``: "SECONDS FROM_STEP": seconds every step from FROM_STEP on sleeps before its forward
  (read again at each step), so the test sets the pace of the run while it goes on (slow while
  a group is away and coming back), or makes a given step last. A process asked to stop
  (SIGTERM, SIGUSR1, Ctrl-C: titanlite.runtime.stop_signals) ends its sleep there: a step made
  long for a signal to land in costs only until the signal came.
- ``trace-<group>-<rank>.jsonl``: one record per step attempt of that rank of the group: pid,
  rank, step, committed, the groups in the step, how long its quorum took (a heal included),
  whether that quorum healed this process, a sha256 of the rank's parameters (its local shards
  under FSDP: compare rank r of one group with rank r of another) at the start of the step
  (after a heal, before the forward) and at its end, and the wall times of both.
- ``step-<group>-<rank>``: "STEP PACE" of the step that rank is in, written before its pace
  sleep: a test that sees every group in the same step's sleep knows where they all are.
- ``late-<group>``: "STEP SECONDS", written by the test: that group asks for the quorum of STEP
  SECONDS late (as after a slow save or validation, a pause of its node), heartbeating.
- ``healing-<group>-<pid>``: with TITANLITE_FT_TEST_HEAL_PAUSE=S set, a process that heals
  writes it when a live group's state has arrived and waits S seconds before copying it into its
  tensors: the test kills it there, in the middle of a heal.
- ``pause-save-<group>``: "STEP SECONDS", written by the test: that group's save of STEP, once
  every rank's shards and the metadata are in step-STEP.partial, waits SECONDS before rank 0
  writes the sidecar and renames the folder (the mark of a complete checkpoint; rank 0 does it
  on its finishing thread while training goes on), after writing ``saving-<group>-<pid>``: the
  test kills the group there, in the middle of a save.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HOOK = r"""
import hashlib, importlib.util, json, os, sys, time

_DIR = os.environ["TITANLITE_FT_TEST_DIR"]
_GROUP = []  # this process's replica_id, once the trainer is built
_RANK = [0]  # its rank inside the group
_QUORUM = [0.0]  # how long the latest quorum took (a heal included)
_HEALED = [False]  # whether the latest quorum healed this process
_STEP = [0]  # the last step this process ended (committed or not)


def _path(name):
    return os.path.join(_DIR, name)


def _sha(trainer):
    import torch
    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()
    with torch.no_grad():
        for part in trainer.model.parts:
            for _, p in part.named_parameters():
                t = p.to_local() if isinstance(p, DTensor) else p
                h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _write(name, text):
    tmp = _path(name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, _path(name))  # never read half-written


def _asked_to_stop():
    signals = sys.modules.get("titanlite.runtime.stop_signals")
    return signals is not None and (
        signals.preempt_signal() is not None or signals.interrupted()
    )


def _sleep(seconds):  # that long, or until this process is asked to stop
    deadline = time.monotonic() + seconds
    while not _asked_to_stop() and time.monotonic() < deadline:
        time.sleep(min(0.02, max(deadline - time.monotonic(), 0.0)))


def _pace(step):
    try:
        with open(_path("pace")) as f:
            seconds, since = f.read().split()
        return float(seconds) if step >= int(since) else 0.0
    except (OSError, ValueError):
        return 0.0


def _patch(module):
    train, train_step = module.Trainer.train, module.Trainer.train_step

    def paced_train(trainer, *args, **kwargs):
        _GROUP[:] = [trainer.cfg.fault_tolerance.replica_id]
        _RANK[:] = [trainer.dist.rank]
        _STEP[:] = [trainer.state.step]
        open(_path(f"ready-{_GROUP[0]}-{os.getpid()}"), "w").close()
        deadline = time.monotonic() + 300
        while not os.path.exists(_path("go")) and time.monotonic() < deadline:
            time.sleep(0.02)
        return train(trainer, *args, **kwargs)

    def traced_step(trainer, *args, **kwargs):
        t0, before = time.time(), _sha(trainer)
        healed, _HEALED[0] = _HEALED[0], False
        replicas = trainer.replicas.participants()
        pace = _pace(trainer.state.step)
        _write(f"step-{_GROUP[0]}-{_RANK[0]}", f"{trainer.state.step} {pace}")
        if pace > 0:
            _sleep(pace)
        out = train_step(trainer, *args, **kwargs)
        record = {
            "pid": os.getpid(),
            "rank": _RANK[0],
            "step": trainer.state.step,
            "committed": bool(trainer.committed),
            "replicas": replicas,
            "quorum_s": _QUORUM[0],
            "healed": healed,
            "before": before,
            "after": _sha(trainer),
            "t0": t0,
            "t1": time.time(),
        }
        with open(_path(f"trace-{_GROUP[0]}-{_RANK[0]}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        _STEP[0] = trainer.state.step if trainer.committed else trainer.state.step - 1
        return out

    module.Trainer.train, module.Trainer.train_step = paced_train, traced_step
    replicas = sys.modules["titanlite.ft.replicas"]
    start_step = replicas.ReplicaGroups.start_step

    def timed_start_step(self, *args, **kwargs):
        try:
            with open(_path(f"late-{_GROUP[0]}")) as f:
                step, seconds = f.read().split()
        except (OSError, ValueError):
            step, seconds = "-1", "0"
        if _STEP[0] + 1 == int(step):
            time.sleep(float(seconds))
        t0 = time.perf_counter()
        try:
            return start_step(self, *args, **kwargs)
        finally:
            _QUORUM[:] = [time.perf_counter() - t0]

    replicas.ReplicaGroups.start_step = timed_start_step
    load, pause = replicas.load_heal_state, float(
        os.environ.get("TITANLITE_FT_TEST_HEAL_PAUSE", "0")
    )

    def paused_load(*args, **kwargs):
        if pause > 0:
            group = _GROUP[0] if _GROUP else "x"
            open(_path(f"healing-{group}-{os.getpid()}"), "w").close()
            time.sleep(pause)
        _HEALED[0] = True
        return load(*args, **kwargs)

    replicas.load_heal_state = paused_load
    checkpointer = sys.modules["titanlite.checkpoint.checkpointer"]
    write_sidecar = checkpointer.write_sidecar

    def paused_sidecar(folder, fields):
        try:
            with open(_path(f"pause-save-{_GROUP[0]}")) as f:
                step, seconds = f.read().split()
        except (OSError, ValueError):
            step, seconds = "-1", "0"
        if int(step) == fields["step"]:
            open(_path(f"saving-{_GROUP[0]}-{os.getpid()}"), "w").close()
            time.sleep(float(seconds))
        return write_sidecar(folder, fields)

    checkpointer.write_sidecar = paused_sidecar


class _Wrap:
    def find_spec(self, name, path=None, target=None):
        if name != "titanlite.trainer":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Wrap())
"""


def ft_hooks(folder: Path, control: Path) -> dict[str, str]:
    """Environment for trainers that run under HOOK, steered through ``control``."""
    hook = folder / "ft-hooks"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOOK)
    control.mkdir(exist_ok=True)
    return {"PYTHONPATH": str(hook), "TITANLITE_FT_TEST_DIR": str(control)}


def set_pace(control: Path, seconds: float, from_step: int = 0) -> None:
    """Every step from ``from_step`` on sleeps ``seconds`` (read again at each step)."""
    tmp = control / "pace.tmp"
    tmp.write_text(f"{seconds} {from_step}")
    tmp.replace(control / "pace")  # never read half-written


def trace(control: Path, group: int, rank: int = 0) -> list[dict[str, Any]]:
    """Every step attempt rank ``rank`` of group ``group`` recorded so far, whichever of the
    group's processes it was (a line still being written is left for the next read)."""
    path = control / f"trace-{group}-{rank}.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def committed(
    control: Path, group: int, pid: int | None = None, rank: int = 0
) -> list[dict[str, Any]]:
    return [
        r
        for r in trace(control, group, rank)
        if r["committed"] and (pid is None or r["pid"] == pid)
    ]


def last_step(control: Path, group: int, rank: int = 0) -> int:
    steps = [r["step"] for r in committed(control, group, rank=rank)]
    return max(steps, default=0)


def in_step(control: Path, group: int, rank: int = 0) -> tuple[int, float] | None:
    """(step, pace) of the step rank ``rank`` of group ``group`` is in (None before its first)."""
    try:
        step, pace = (control / f"step-{group}-{rank}").read_text().split()
    except (OSError, ValueError):
        return None
    return int(step), float(pace)


def markers(control: Path, prefix: str) -> dict[int, list[int]]:
    """{group: [pids]} of the ``<prefix>-<group>-<pid>`` files."""
    found: dict[int, list[int]] = {}
    for path in control.glob(f"{prefix}-*-*"):
        _, group, pid = path.name.rsplit("-", 2)
        if group.isdigit():
            found.setdefault(int(group), []).append(int(pid))
    return found


def wait_for(
    what: str, check: Callable[[], Any], timeout: float, alive: Callable[[], None] | None = None
) -> Any:
    """Poll ``check`` until it returns something true (returned) or ``timeout`` passes (an
    AssertionError naming ``what``); ``alive`` raises when waiting is pointless."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if alive is not None:
            alive()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)
