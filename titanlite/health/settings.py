"""[health]: straggler detection, the hang watchdog and replica fingerprints (all on by
default, each cheap: docs/reliability.md, BENCHMARKS.md). Plain Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from titanlite.config.catalog import Section


@dataclass
class HealthSettings:
    """[health]: what titanlite watches for on a large cluster besides a lost rank."""

    enable: bool = True
    """Watch for stragglers, hangs and silent data corruption (the settings below)."""
    straggler_ratio: float = 1.3
    """A rank whose own time per step (step time minus the time it waited in collectives)
    exceeds the median rank's by this factor is slow (clean runs of 4 ranks sharing 2 CPU
    cores stayed below 1.22)."""
    straggler_steps: int = 3
    """Logged steps in a row a rank must be slow before it is named (once per episode)."""
    hang_timeout_s: float = 300.0
    """A step that makes no progress for this long is a hang: every rank that can still act
    writes its stacks and collective record to DUMP_FOLDER/health/, one line names the
    rank(s) the others wait for, and the run stops with exit status 4 (0 = off). Off as well
    when comm.timeout_seconds is not longer: the collective timeout comes first."""
    sdc_check_interval: int = 100
    """Every this many steps, and before every checkpoint save, replicas compare fingerprints
    of what they must hold bit-identically (0 = off)."""


def check(cfg: Any, problems: Any) -> None:
    """The [health] values."""
    h = cfg.health
    if not h.straggler_ratio > 1:
        problems.add(f"health.straggler_ratio: must be > 1, got {h.straggler_ratio!r}")
    if h.straggler_steps < 1:
        problems.add(f"health.straggler_steps: must be at least 1, got {h.straggler_steps!r}")
    if h.hang_timeout_s < 0:
        problems.add(f"health.hang_timeout_s: must be >= 0 (0 = off), got {h.hang_timeout_s!r}")
    if h.sdc_check_interval < 0:
        problems.add(
            f"health.sdc_check_interval: must be >= 0 (0 = off), got {h.sdc_check_interval!r}"
        )


def hang_timeout(settings: HealthSettings, comm_timeout_s: float) -> float:
    """The watchdog's timeout, 0 when it is off: health.hang_timeout_s when the collective
    timeout comes later; otherwise the collective timeout ends a hung run first, as it did
    before the watchdog existed (its heartbeat names the lost rank), and the watchdog stays
    off."""
    h = settings.hang_timeout_s
    return h if settings.enable and 0 < h < comm_timeout_s else 0.0


SECTION = Section("health", HealthSettings, after="comm", check=check)
