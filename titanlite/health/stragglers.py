"""Stragglers: the rank whose own work per step stays slower than the others'.

In synchronous training every rank's step takes as long as the slowest rank's: the others
wait for it inside collectives (FSDP's all-gathers, the gradient all-reduce, tensor
parallelism's reductions, the pipeline's sends). So the step time itself names nobody. What
differs is each rank's *own* time: its step time minus the time it spent blocked in
collectives (``titanlite.health.record``). A rank slowed by a bad GPU, a throttled CPU or a
slow disk has the most own time and waits the least.

Every rank adds its phase times step by step (``add``: data wait, forward and backward,
optimizer, blocked); at each logged step one all-gather of a few numbers per rank brings
everyone's sums since the last logged step to every rank (``report``). A rank whose own time
per step exceeds the median rank's by ``ratio`` for ``steps`` logged steps in a row is named
once, in one console line (rank, host, how much slower, and which phase accounts for most of
it), and its rank and ratio go into the logged record; a run without one records
``straggler_rank`` -1. The record also carries the spread of the ranks' own step times.
"""

from __future__ import annotations

import logging
import socket
import statistics
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

PHASES = ("data", "forward_backward", "optimizer")
"""The phases a rank's own time is split into (the console line names the one that grew)."""


@dataclass
class Window:
    """One rank's times summed over the steps since the last logged step (seconds)."""

    steps: int = 0
    step_s: float = 0.0
    blocked_s: float = 0.0
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    def add(self, *, step_s: float, blocked_s: float, phases: dict[str, float]) -> None:
        self.steps += 1
        self.step_s += step_s
        self.blocked_s += blocked_s
        for name, seconds in phases.items():
            self.phases[name] += seconds

    def as_row(self) -> list[float]:
        """[steps, own seconds, step seconds, blocked seconds, each phase's own seconds]; the
        blocked time is taken out of forward and backward, where the collectives are."""
        own = max(self.step_s - self.blocked_s, 0.0)
        phases = dict(self.phases)
        phases["forward_backward"] = max(phases["forward_backward"] - self.blocked_s, 0.0)
        return [float(self.steps), own, self.step_s, self.blocked_s, *phases.values()]


class StragglerDetector:
    """Names the rank that stays slower than the median (``report`` is a collective: every
    rank of ``group`` calls it at the same steps)."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        ratio: float,
        steps: int,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.ratio, self.steps = ratio, steps
        self.device, self.group = device, group
        self.window = Window()
        self.slow_in_a_row = [0] * world_size
        self.named: set[int] = set()  # ranks named in their current slow episode
        self.hosts: list[str] | None = None
        self.reports = 0

    def add(self, *, step_s: float, blocked_s: float, phases: dict[str, float]) -> None:
        """One step of this rank: its wall time, the time it was blocked in collectives, and
        its phases' wall times (no collective, no host sync)."""
        self.window.add(step_s=step_s, blocked_s=blocked_s, phases=phases)

    def report(self, step: int) -> dict[str, float]:
        """Gather every rank's window, name a straggler if one is due, start a new window;
        the fields for the logged record (the same on every rank)."""
        rows = self._gather(self.window.as_row())
        self.window = Window()
        per_step = [row[1] / max(row[0], 1.0) for row in rows]  # own seconds per step
        median = statistics.median(per_step)
        ratios = [t / median if median > 0 else 1.0 for t in per_step]
        self.reports += 1
        # The first window holds start-up's first step (allocation, first kernels, the
        # files rank 0 writes): a skew there says nothing of the hardware.
        for r, ratio in enumerate(ratios if self.reports > 1 else []):
            self.slow_in_a_row[r] = self.slow_in_a_row[r] + 1 if ratio > self.ratio else 0
            if not self.slow_in_a_row[r]:
                self.named.discard(r)  # a later episode is named again
        slowest = max(range(len(rows)), key=lambda r: ratios[r])
        due = [r for r, n in enumerate(self.slow_in_a_row) if n >= self.steps]
        for r in due:
            if r not in self.named:
                self.named.add(r)
                logger.warning("%s", self._line(step, r, rows=rows, ratio=ratios[r], median=median))
        flagged = max(due, key=lambda r: ratios[r]) if due else -1
        return {
            "straggler_rank": float(flagged),
            "straggler_ratio": ratios[flagged] if due else ratios[slowest],
            "own_step_s_min": min(per_step),
            "own_step_s_median": median,
            "own_step_s_max": max(per_step),
        }

    def _gather(self, row: list[float]) -> list[list[float]]:
        if self.world_size == 1:
            return [row]
        mine = torch.tensor(row, dtype=torch.float64, device=self.device)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(rows, mine, group=self.group)
        if self.hosts is None:  # once: who runs where, for the console line
            self.hosts = [""] * self.world_size
            dist.all_gather_object(self.hosts, socket.gethostname(), group=self.group)
        return torch.stack(rows).tolist()

    def _line(
        self, step: int, rank: int, *, rows: list[list[float]], ratio: float, median: float
    ) -> str:
        """ "straggler: rank 3 (host n7) takes 1.52x the median rank's own time per step
        (0.412 s vs 0.271 s) for 3 logged steps, most of it in forward_backward"."""
        per_phase = {
            name: [row[4 + i] / max(row[0], 1.0) for row in rows] for i, name in enumerate(PHASES)
        }
        excess = {name: times[rank] - statistics.median(times) for name, times in per_phase.items()}
        phase = max(excess, key=lambda name: excess[name])
        host = f" (host {self.hosts[rank]})" if self.hosts else ""
        own = rows[rank][1] / max(rows[rank][0], 1.0)
        return (
            f"straggler at step {step}: rank {rank}{host} takes {ratio:.2f}x the median "
            f"rank's own time per step ({own:.3f} s vs {median:.3f} s, waits in collectives "
            f"left out) for {self.slow_in_a_row[rank]} logged steps, most of it in {phase}"
        )
