"""Test-only hooks for replica groups (tests/test_ft.py): a sitecustomize that records and paces
every training step of a trainer process, and the helpers that read what it wrote.

The hook wraps titanlite.trainer as it is imported (as tests/conftest.py's SLOW_STEPS does);
all of it is steered through files in one control folder (TITANLITE_FT_TEST_DIR):

- ``ready-<group>-<pid>``: written when the trainer is built (its Manager heartbeats the
  lighthouse); then ``train`` waits until ``go`` exists, so that every group asks for the first
  quorum together (a process started later, as a restart, finds ``go`` there and goes on).
- ``pace``: seconds every step sleeps before its forward (read again at each step), so the test
  sets the pace of the run while it goes on (slow while a group is away and coming back).
- ``trace-<group>.jsonl``: one record per step attempt: pid, step, committed, the groups in the
  step, how long its quorum took (a heal included), a sha256 of all parameters at the start of
  the step (after a heal, before the forward) and at its end, and the wall times of both.
- ``healing-<group>-<pid>``: with TITANLITE_FT_TEST_HEAL_PAUSE=S set, a process that heals
  writes it when a live group's state has arrived and waits S seconds before copying it into its
  tensors: the test kills it there, in the middle of a heal.
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
_QUORUM = [0.0]  # how long the latest quorum took (a heal included)


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


def _pace():
    try:
        with open(_path("pace")) as f:
            return float(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0.0


def _patch(module):
    train, train_step = module.Trainer.train, module.Trainer.train_step

    def paced_train(trainer, *args, **kwargs):
        _GROUP[:] = [trainer.cfg.fault_tolerance.replica_id]
        open(_path(f"ready-{_GROUP[0]}-{os.getpid()}"), "w").close()
        deadline = time.monotonic() + 300
        while not os.path.exists(_path("go")) and time.monotonic() < deadline:
            time.sleep(0.02)
        return train(trainer, *args, **kwargs)

    def traced_step(trainer, *args, **kwargs):
        t0, before = time.time(), _sha(trainer)
        replicas = trainer.replicas.participants()
        pace = _pace()
        if pace > 0:
            time.sleep(pace)
        out = train_step(trainer, *args, **kwargs)
        record = {
            "pid": os.getpid(),
            "step": trainer.state.step,
            "committed": bool(trainer.committed),
            "replicas": replicas,
            "quorum_s": _QUORUM[0],
            "before": before,
            "after": _sha(trainer),
            "t0": t0,
            "t1": time.time(),
        }
        with open(_path(f"trace-{_GROUP[0]}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        return out

    module.Trainer.train, module.Trainer.train_step = paced_train, traced_step
    replicas = sys.modules["titanlite.ft.replicas"]
    start_step = replicas.ReplicaGroups.start_step

    def timed_start_step(self, *args, **kwargs):
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
        return load(*args, **kwargs)

    replicas.load_heal_state = paused_load


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


def set_pace(control: Path, seconds: float) -> None:
    tmp = control / "pace.tmp"
    tmp.write_text(str(seconds))
    tmp.replace(control / "pace")  # never read half-written


def trace(control: Path, group: int) -> list[dict[str, Any]]:
    """Every step attempt group ``group``'s processes recorded so far (a line still being
    written is left for the next read)."""
    path = control / f"trace-{group}.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def committed(control: Path, group: int, pid: int | None = None) -> list[dict[str, Any]]:
    return [r for r in trace(control, group) if r["committed"] and (pid is None or r["pid"] == pid)]


def last_step(control: Path, group: int) -> int:
    steps = [r["step"] for r in committed(control, group)]
    return max(steps, default=0)


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
