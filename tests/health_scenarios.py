"""Scenarios of the health tests (tests/test_health.py) run on every rank of a worker pool:
training with titanlite's real Trainer while one rank is made slower. The slowdown is a
test-only hook on titanlite's own step (never a mock of torch.distributed): before each
step the slow rank sleeps half as long as its previous step took, so its own work per step
is about 1.5 times the others'."""

from __future__ import annotations

import time
from typing import Any

import train_scenarios

from titanlite.trainer import Trainer


def train_with_a_slow_rank(
    rank: int, world: int, argv: list[str], slow_rank: int = -1, factor: float = 2.0
) -> dict[str, Any] | None:
    """train_scenarios.train, with ``slow_rank`` (-1: none) slowed by ``factor``."""
    original = Trainer.train_step
    if rank == slow_rank:
        last = [0.0]

        def slowed(self: Trainer, *args: Any, **kwargs: Any) -> Any:
            time.sleep(factor * last[0])
            start = time.perf_counter()
            result = original(self, *args, **kwargs)
            last[0] = time.perf_counter() - start
            return result

        Trainer.train_step = slowed  # type: ignore[method-assign]
    try:
        return train_scenarios.train(rank, world, argv)
    finally:
        Trainer.train_step = original  # type: ignore[method-assign]
