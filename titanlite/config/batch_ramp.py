"""Batch-size warmup (``training.batch_size_schedule``): smaller global batches for the first
tokens of a run, growing to ``training.global_batch_size``.

Each entry ``"TOKENS:SEQUENCES"`` makes the global batch SEQUENCES sequences per step until the
run has trained TOKENS tokens (sequences x seq_len, counted on the host, so no step waits for a
device value to know its size); after the last entry the configured global batch applies. A
step's batch grows by gradient-accumulation micro-batches, each the same ``local_batch_size x
data-parallel degree`` sequences as without the ramp, so every stage must be a multiple of
that: the global batches, taken in order from the one global stream of windows, are then the
same under any layout, and a resume (which knows its step) continues the ramp exactly.
Plain Python: the launcher's checks use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from titanlite.config.job_config import ConfigError, JobConfig
from titanlite.config.layout import Degrees, global_batch_size


def parse_schedule(entries: list[str]) -> list[tuple[int, int]]:
    """[(tokens, sequences)] of ``"TOKENS:SEQUENCES"`` entries (TOKENS may be written 2e6);
    ValueError naming the first bad entry."""
    stages: list[tuple[int, int]] = []
    for entry in entries:
        tokens, _, sequences = entry.partition(":")
        try:
            stage = (int(float(tokens)), int(sequences))
        except ValueError:
            raise ValueError(f"{entry!r} is not TOKENS:SEQUENCES (e.g. 2e6:64)") from None
        if stage[1] < 1 or stage[0] <= (stages[-1][0] if stages else 0):
            raise ValueError(
                f"{entry!r}: tokens must grow from one entry to the next (above 0) and "
                "sequences be at least 1"
            )
        stages.append(stage)
    return stages


@dataclass(frozen=True)
class BatchRamp:
    """The global batch of every step: ``sequences(step)``, ``micro_batches(step)``."""

    micro: int
    """Sequences of one micro-batch over all data-parallel ranks."""
    full: int
    """training.global_batch_size (sequences), after the ramp."""
    stage_ends: tuple[tuple[int, int], ...] = ()
    """(the last step of a stage, its sequences), in order."""

    @classmethod
    def of(cls, cfg: JobConfig, degrees: Degrees) -> BatchRamp:
        """This run's ramp (none without a schedule); ConfigError for a stage the layout's
        micro-batches cannot make."""
        t = cfg.training
        micro, full = t.local_batch_size * degrees.dp, global_batch_size(cfg, degrees)
        ends: list[tuple[int, int]] = []
        step, trained = 0, 0
        for tokens, sequences in parse_schedule(t.batch_size_schedule):
            if sequences % micro or sequences > full:
                raise ConfigError(
                    f"training.batch_size_schedule: {sequences} sequences is not a multiple of "
                    f"local_batch_size x data-parallel degree = {micro} up to the global batch "
                    f"{full}"
                )
            steps = max(0, math.ceil((tokens - trained) / (sequences * t.seq_len)))
            if steps:
                step, trained = step + steps, trained + steps * sequences * t.seq_len
                ends.append((step, sequences))
        return cls(micro, full, tuple(ends))

    def sequences(self, step: int) -> int:
        """The global batch of ``step`` (counted from 1)."""
        for end, sequences in self.stage_ends:
            if step <= end:
                return sequences
        return self.full

    def micro_batches(self, step: int) -> int:
        """Micro-batches each rank takes at ``step``."""
        return self.sequences(step) // self.micro
