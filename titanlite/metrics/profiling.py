"""[profiling]: torch profiler traces and memory timelines, every profile_freq steps.

Traces go to DUMP/save_traces_folder/iteration_N/rankR_trace.json (chrome://tracing or
ui.perfetto.dev). Memory, under DUMP/save_memory_snapshot_folder/iteration_N/: on CUDA the
allocator's snapshot, rankR_memory_snapshot.pickle (pytorch.org/memory_viz); on a CPU the peak
resident memory of each phase of the step, rankR_memory_timeline.json
(``titanlite.metrics.memory_timeline``). Both cost nothing when disabled.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

from titanlite.config.job_config import Profiling
from titanlite.metrics.memory_timeline import MemoryTimeline, available

logger = logging.getLogger(__name__)

# Allocation events the CUDA allocator keeps for a snapshot (older ones are dropped).
MEMORY_HISTORY_ENTRIES = 100_000


class Profiler:
    """Call step() after every training step; records what the config asks for.

    Profiles steps that are multiples of profile_freq, each after one warm-up step (the
    profiler's first recorded step carries its own start-up cost). Counting is by the global
    step, so a resumed run profiles the same steps as an uninterrupted one.
    """

    def __init__(self, p: Profiling, dump_folder: Path, rank: int, first_step: int):
        self.freq = p.profile_freq
        self.rank = rank
        self.traces = dump_folder / p.save_traces_folder
        self.snapshots = dump_folder / p.save_memory_snapshot_folder
        self.enabled = p.enable_profiling
        self.torch_profiler: torch.profiler.profile | None = None
        self.step_num = first_step - 1  # the step that just finished
        if self.enabled:
            logger.info("profiling one step in every %d into %s", self.freq, self.traces)
            self._maybe_start()
        self.memory = p.enable_memory_snapshot and torch.cuda.is_available()
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        self.timeline: MemoryTimeline | None = None  # on a CPU: peak memory per phase
        if p.enable_memory_snapshot and not self.memory:
            if available():
                self.timeline = MemoryTimeline(self.snapshots, rank)
                where = self.snapshots
                logger.info("memory per phase of one step in every %d into %s", self.freq, where)
                self._maybe_record()
            else:
                logger.warning(
                    "profiling.enable_memory_snapshot needs CUDA, or Linux's /proc on a CPU: "
                    "no memory timeline here"
                )

    def watch(self, parts: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]):
        """Let the memory timeline see the phases of a step (the model's forward, the output's
        gradient, the optimizers' steps)."""
        if self.timeline is not None:
            self.timeline.watch(parts, optimizers)

    def _maybe_record(self) -> None:
        """Start the memory timeline when the next step is one that is profiled."""
        if self.timeline is not None and (self.step_num + 1) % self.freq == 0:
            self.timeline.start(self.step_num + 1)

    def _maybe_start(self) -> None:
        """Start recording when the next step is the warm-up of a profiled step."""
        if (self.step_num + 2) % self.freq:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.torch_profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=1),
            on_trace_ready=self._write_trace,
            record_shapes=True,
        )
        self.torch_profiler.start()

    def step(self) -> None:
        self.step_num += 1
        if self.torch_profiler is not None:
            self.torch_profiler.step()  # after the profiled step this writes its trace
            if self.step_num % self.freq == 0:
                self.torch_profiler.stop()
                self.torch_profiler = None
        if self.enabled:
            self._maybe_start()
        if self.memory and self.step_num % self.freq == 0:
            self.dump_memory(f"iteration_{self.step_num}")
        if self.timeline is not None:
            self.timeline.finish()
            self._maybe_record()

    def _write_trace(self, prof: torch.profiler.profile) -> None:
        folder = self.traces / f"iteration_{self.step_num}"
        folder.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        path = folder / f"rank{self.rank}_trace.json"
        prof.export_chrome_trace(str(path))
        logger.info("profiler trace %s written in %.1f s", path, time.perf_counter() - started)

    def dump_memory(self, name: str) -> None:
        folder = self.snapshots / name
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}_memory_snapshot.pickle"
        with open(path, "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)
        logger.info("memory snapshot %s written", path)

    def close(self) -> None:
        if self.torch_profiler is not None:
            with contextlib.suppress(Exception):
                self.torch_profiler.stop()
            self.torch_profiler = None
        if self.memory:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.memory = False
        if self.timeline is not None:
            self.timeline.close()  # a step cut short is not written


@contextlib.contextmanager
def profiling(
    settings: Profiling, dump_folder: Path, rank: int, first_step: int
) -> Iterator[Profiler]:
    """The profiler for a training loop; on CUDA out-of-memory, a snapshot before re-raising."""
    profiler = Profiler(settings, dump_folder, rank, first_step)
    try:
        yield profiler
    except torch.OutOfMemoryError:
        if profiler.memory:
            profiler.dump_memory("oom")
        raise
    finally:
        profiler.close()
