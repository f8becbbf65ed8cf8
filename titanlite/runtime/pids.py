"""Whether a pid still names the process it named: pids are reused once their process is gone,
so a record naming a process (titanlite.runtime.run_lock) keeps its start time too. Linux's /proc
tells both; elsewhere only whether the pid answers."""

from __future__ import annotations

import os
from pathlib import Path


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name (which may hold spaces): the state first."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rpartition(")")[2].split()


def start_time(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot), None without /proc."""
    fields = _stat_fields(pid)
    return fields[19] if fields and len(fields) > 19 else None  # stat's field 22


def alive(pid: int, start: str | None) -> bool:
    """Whether ``pid`` runs and (``start`` given, with /proc) is the process started then."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, not ours to judge further
        return True
    fields = _stat_fields(pid)
    if fields is None:  # no /proc: the pid answering is all we know
        return True
    if fields[0] == "Z":  # exited, not yet reaped by its parent
        return False
    return start is None or len(fields) <= 19 or fields[19] == start
