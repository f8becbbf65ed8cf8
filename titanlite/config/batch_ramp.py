"""Batch-size and sequence-length warmup (``training.batch_size_schedule``,
``training.seq_len_schedule``): smaller global batches, or shorter sequences, for the first
tokens of a run, growing to ``training.global_batch_size`` and ``training.seq_len``.

Both schedules are ``"TOKENS:VALUE"`` entries: the value applies to every step that starts
before the run has trained TOKENS tokens (sequences x seq_len per step, counted on the host,
so no step waits for a device value to know its shape); after the last entry the configured
value applies. A stage that would end inside a step ends after it. Together they make each
step's global batch ``sequences(step)`` windows of ``seq_len(step)`` tokens, a function of
the step alone: the same under any layout, and a resume (which knows its step) continues the
ramps exactly.

A batch stage grows by gradient-accumulation micro-batches, each the same ``local_batch_size
x data-parallel degree`` sequences as without the ramp, so it must be a multiple of that. A
sequence stage keeps the sequences and shortens them (fewer tokens per step), so it must split
as training.seq_len does: by 2 x cp x tp under context parallelism, else by tp (sequence
parallelism). Plain Python: the launcher's checks use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from titanlite.config.job_config import ConfigError, JobConfig
from titanlite.config.layout import Degrees, global_batch_size


def parse_schedule(entries: list[str], value: str = "SEQUENCES") -> list[tuple[int, int]]:
    """[(tokens, value)] of ``"TOKENS:VALUE"`` entries (TOKENS may be written 2e6); ValueError
    naming the first bad entry. ``value`` names the second field in messages."""
    stages: list[tuple[int, int]] = []
    for entry in entries:
        tokens, _, size = entry.partition(":")
        try:
            stage = (int(float(tokens)), int(size))
        except (ValueError, OverflowError):  # OverflowError: inf
            raise ValueError(f"{entry!r} is not TOKENS:{value} (e.g. 2e6:64)") from None
        if stage[1] < 1 or stage[0] <= (stages[-1][0] if stages else 0):
            raise ValueError(
                f"{entry!r}: tokens must grow from one entry to the next (above 0) and "
                f"{value.lower()} be at least 1"
            )
        stages.append(stage)
    return stages


def sequence_multiple(degrees: Degrees) -> int:
    """What every sequence length must be a multiple of under this layout: context
    parallelism cuts it into 2 x cp chunks, each split again by tensor (sequence) parallelism."""
    return 2 * degrees.cp * degrees.tp if degrees.cp > 1 else degrees.tp


def check_seq_len_schedule(cfg: JobConfig, degrees: Degrees) -> list[tuple[int, int]]:
    """training.seq_len_schedule's stages; ConfigError (one line) for a length this layout
    cannot take."""
    t = cfg.training
    try:
        stages = parse_schedule(t.seq_len_schedule, "SEQ_LEN")
    except ValueError as e:
        raise ConfigError(f"training.seq_len_schedule: {e}") from None
    if stages and degrees.pp > 1:
        raise ConfigError(
            "training.seq_len_schedule does not combine with pipeline parallelism yet (its "
            "stages infer their shapes once); set parallelism.pipeline_parallel_degree to 1"
        )
    multiple = sequence_multiple(degrees)
    for _, length in stages:
        if length > t.seq_len or length % multiple:
            raise ConfigError(
                f"training.seq_len_schedule: seq_len {length} must be at most training.seq_len "
                f"{t.seq_len} and a multiple of {multiple} (2 x cp x tp under context "
                "parallelism, else tp)"
            )
    return stages


@dataclass(frozen=True)
class BatchRamp:
    """The global batch of every step: ``sequences(step)`` windows of ``seq_len(step)``
    tokens, ``micro_batches(step)`` per rank."""

    micro: int
    """Sequences of one micro-batch over all data-parallel ranks."""
    full: int
    """training.global_batch_size (sequences), after the ramp."""
    stage_ends: tuple[tuple[int, int, int], ...] = ()
    """(the last step of a stage, its sequences, its seq_len), in order."""
    seq_len_full: int = 0
    """training.seq_len, after the ramp."""

    @classmethod
    def of(cls, cfg: JobConfig, degrees: Degrees) -> BatchRamp:
        """This run's ramps (none without schedules); ConfigError for a stage the layout
        cannot make."""
        t = cfg.training
        micro, full = t.local_batch_size * degrees.dp, global_batch_size(cfg, degrees)
        batches = parse_schedule(t.batch_size_schedule)
        for _, sequences in batches:
            if sequences > full:
                raise ConfigError(
                    f"training.batch_size_schedule: {sequences} sequences is above the global "
                    f"batch {full} (the schedule ramps up to it)"
                )
            if sequences % micro:
                raise ConfigError(
                    f"training.batch_size_schedule: {sequences} sequences is not a multiple of "
                    f"local_batch_size x data-parallel degree = {micro}"
                )
        lengths = check_seq_len_schedule(cfg, degrees)
        ends: list[tuple[int, int, int]] = []
        step, trained = 0, 0
        while batches or lengths:  # one stage of both until the earlier one ends
            sequences = batches[0][1] if batches else full
            length = lengths[0][1] if lengths else t.seq_len
            until = min(s[0][0] for s in (batches, lengths) if s)
            steps = math.ceil((until - trained) / (sequences * length))
            step, trained = step + steps, trained + steps * sequences * length
            ends.append((step, sequences, length))
            for schedule in (batches, lengths):  # drop the stages the tokens trained passed
                while schedule and schedule[0][0] <= trained:
                    schedule.pop(0)
        return cls(micro, full, tuple(ends), t.seq_len)

    def _stage(self, step: int) -> tuple[int, int]:
        for end, sequences, length in self.stage_ends:
            if step <= end:
                return sequences, length
        return self.full, self.seq_len_full

    def sequences(self, step: int) -> int:
        """The global batch of ``step`` (counted from 1), in sequences."""
        return self._stage(step)[0]

    def seq_len(self, step: int) -> int:
        """The tokens of each sequence of ``step``'s batch."""
        return self._stage(step)[1]

    def micro_batches(self, step: int) -> int:
        """Micro-batches each rank takes at ``step``."""
        return self.sequences(step) // self.micro

    @property
    def seq_len_ramped(self) -> bool:
        return any(length != self.seq_len_full for _, _, length in self.stage_ends)

    def take(self, step: int, batches: Any, loader: Any) -> list[Any]:
        """``step``'s micro-batches from the iterator ``batches`` over ``loader`` (a
        ``titanlite.data.base.Loader``, told the step's sequence length when it ramps)."""
        if self.seq_len_ramped:
            loader.set_seq_len(self.seq_len(step))
        return [next(batches) for _ in range(self.micro_batches(step))]
