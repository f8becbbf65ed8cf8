"""Where a step's memory goes on a CPU: the peak resident memory of each phase of a step.

CUDA has the allocator's own history (``profiling.enable_memory_snapshot`` dumps it); a CPU
process has only its resident memory, which the kernel measures exactly, peak included. On
Linux the peak can be reset (``/proc/self/clear_refs``), so reading it at each phase's end and
resetting it gives the peak of that phase alone, with no sampling and nothing missed.

The phases of one step, in order (with gradient accumulation, forward, loss and backward once
per micro-batch):

- ``data``: from the end of the previous step to the first forward (the batch, the replica
  groups' quorum);
- ``forward``: the model's forward (its parts: under pipeline parallelism this rank's stages);
- ``loss``: from the model's output to the gradient of it: the loss, forward and backward (the
  logits' log-softmax and their gradient when the loss is unfused; a stage without the output
  head waits here for the next stage's gradient);
- ``backward``: the rest of backward, the gradients' reduction and clipping;
- ``optimizer``: the optimizers' steps;
- ``after_step``: logging, validation and checkpoint saves, until the next step begins.

Under pipeline parallelism the micro-batches' phases interleave as the schedule runs them.
"""

from __future__ import annotations

import json
import logging
import re
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

GIB = 2**30
PHASES = ("data", "forward", "loss", "backward", "optimizer", "after_step")
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def resident() -> tuple[int, int]:
    """(resident bytes now, peak resident bytes since the last reset) of this process."""
    status = _STATUS.read_text()
    found = {k: int(v) * 1024 for k, v in re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", status, re.M)}
    return found["VmRSS"], found["VmHWM"]


_peak_before_resets = 0  # the highest peak a reset erased (the kernel's then starts again)


def reset_peak(peak: int | None = None) -> None:
    """Start the kernel's peak resident memory again from what is resident now (Linux 4.0 and
    later); ``process_peak`` still knows the process's highest."""
    global _peak_before_resets
    seen = resident()[1] if peak is None else peak  # (a caller that just read it passes it)
    _peak_before_resets = max(_peak_before_resets, seen)
    _CLEAR_REFS.write_text("5")


def process_peak() -> int:
    """The process's peak resident bytes since it started, across the timeline's resets (the
    kernel's own figure, getrusage's ru_maxrss, counts only since the last one)."""
    return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, _peak_before_resets)


def available() -> bool:
    """Whether this system can measure a phase's peak (Linux's /proc, writable clear_refs)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        resident()
        reset_peak()
    except (OSError, KeyError):
        return False
    return True


class MemoryTimeline:
    """Records the phases of the steps it is started for; ``watch`` hooks the model's parts
    and the optimizers so that the phases mark themselves. Nothing is read between
    recordings (the hooks return at once)."""

    def __init__(self, folder: Path, rank: int) -> None:
        self.folder = folder
        self.rank = rank
        self.step: int | None = None  # the step being recorded
        self.phase = ""
        self.events: list[dict] = []
        self.handles: list = []
        self._started = 0.0
        self._phase_started = 0.0
        self._rss_at_start = 0
        self._microbatch = -1

    def watch(self, parts: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]):
        for part in parts:
            self.handles.append(part.register_forward_pre_hook(self._forward_starts))
            self.handles.append(part.register_forward_hook(self._forward_ends))
        if optimizers:
            self.handles.append(optimizers[0].register_step_pre_hook(self._optimizer_starts))
            self.handles.append(optimizers[-1].register_step_post_hook(self._optimizer_ends))

    def start(self, step: int) -> None:
        """Record step ``step``, which begins now (its ``data`` phase)."""
        self.step, self.events, self._microbatch = step, [], -1
        self._started = time.perf_counter()
        self._begin("data")

    def mark(self, phase: str) -> None:
        """The phase so far ended; ``phase`` begins."""
        if self.step is None or phase == self.phase:
            return
        self._begin(phase, self._end())

    def finish(self) -> Path | None:
        """End the step being recorded: write its timeline, log its summary; the file."""
        if self.step is None:
            return None
        self._end()
        peaks = {}
        for event in self.events:
            peaks[event["phase"]] = max(peaks.get(event["phase"], 0), event["peak_bytes"])
        folder = self.folder / f"iteration_{self.step}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}_memory_timeline.json"
        record = {"step": self.step, "rank": self.rank, "peak_bytes": peaks, "phases": self.events}
        path.write_text(json.dumps(record, indent=1) + "\n")
        top = max(peaks, key=peaks.get)
        logger.info(
            "memory of step %d (rank %d): peak %.2f GiB in %s; per phase %s GiB; %s",
            self.step,
            self.rank,
            peaks[top] / GIB,
            top,
            ", ".join(f"{p} {peaks[p] / GIB:.2f}" for p in PHASES if p in peaks),
            path,
        )
        self.step, self.phase = None, ""
        return path

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.step = None

    # ------------------------------------------------------------------ phases
    def _begin(self, phase: str, peak: int | None = None) -> None:
        self.phase = phase
        if phase == "forward":
            self._microbatch += 1
        reset_peak(peak)
        self._rss_at_start = resident()[0]
        self._phase_started = time.perf_counter()

    def _end(self) -> int:
        """Close the phase's entry; the kernel's peak it read (for the next reset)."""
        now, peak = resident()
        in_batches = self.phase in ("forward", "loss", "backward")
        self.events.append(
            {
                "phase": self.phase,
                "microbatch": self._microbatch if in_batches else None,
                "start_s": round(self._phase_started - self._started, 6),
                "seconds": round(time.perf_counter() - self._phase_started, 6),
                "rss_start_bytes": self._rss_at_start,
                "rss_end_bytes": now,
                "peak_bytes": max(peak, now, self._rss_at_start),
            }
        )
        return peak

    def _forward_starts(self, module: nn.Module, args: object) -> None:
        if self.step is not None and self.phase != "forward" and torch.is_grad_enabled():
            self.mark("forward")

    def _forward_ends(self, module: nn.Module, args: object, output: object) -> None:
        if self.step is None or not torch.is_grad_enabled():
            return
        self.mark("loss")
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self._output_gradient)

    def _output_gradient(self, grad: torch.Tensor) -> None:
        self.mark("backward")

    def _optimizer_starts(self, optimizer: object, args: object, kwargs: object) -> None:
        self.mark("optimizer")

    def _optimizer_ends(self, optimizer: object, args: object, kwargs: object) -> None:
        self.mark("after_step")
