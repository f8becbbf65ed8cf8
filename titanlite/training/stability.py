"""Skipping a step's update when its loss or gradient norm spikes or is not finite
(``training.skip_spikes``, ``spike_window``, ``spike_sigmas``, ``max_skipped``).

With ``max_skipped`` above 0 the trainer hands every step's global loss and gradient norm
to a ``SpikeGuard`` before the optimizer step. Both are the same on every rank (the loss is
an all-reduce over the loss group, made once per step and reused by the log; the gradient
norm is already global), so every rank reaches the same decision without a further
collective. A skipped step leaves the parameters and the optimizer state as they were; the
learning-rate schedule still advances, and the step's data count as read. A non-finite
value is always skipped; with ``skip_spikes`` a value above the mean + ``spike_sigmas``
standard deviations of the last ``spike_window`` accepted steps is too. More than
``max_skipped`` skips in a row stop the run (exit 3), as a non-finite loss does without the
guard. The window and the counts are checkpoint state (inside ``train_state``), so a resumed
run decides exactly as the uninterrupted one.

The price is one device-to-host read per step (the two values), just before the optimizer
step that needs the decision; without the guard titanlite reads values only at log steps.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from typing import Any

import torch

from titanlite.config.job_config import Training
from titanlite.errors import TrainingDiverged

logger = logging.getLogger(__name__)


def check_finite(loss: float, grad_norm: float, step: int) -> None:
    """Without the guard: stop the run at a non-finite loss or gradient norm (exit 3)."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise TrainingDiverged(
            f"loss became non-finite at step {step} (loss {loss}, grad norm {grad_norm}); "
            "try a lower optimizer.lr, a longer warmup, or training.max_skipped to skip such "
            "steps (docs/stability.md)"
        )


def finite_or_guarded(
    guard: SpikeGuard | None, loss: float, grad_norm: float, step: int
) -> dict[str, float]:
    """At a logged step: without the guard, stop at a non-finite value (``check_finite``);
    with it (which skipped such a step already), its fields for the record."""
    if guard is None:
        check_finite(loss, grad_norm, step)
        return {}
    return guard.metrics()


class SpikeGuard:
    """Decides, step by step, whether the optimizer update goes ahead (``accept``).

    ``log(record, console)`` is where a skip is reported (the run's metrics logger)."""

    def __init__(self, training: Training, log: Any = None) -> None:
        self.watch = tuple(training.skip_spikes)
        self.size = training.spike_window
        self.sigmas = training.spike_sigmas
        self.max_skipped = training.max_skipped
        self.log = log
        self.windows: dict[str, deque[float]] = {k: deque(maxlen=self.size) for k in self.watch}
        self.in_a_row = 0
        self.skipped = 0

    @classmethod
    def of(
        cls, training: Training, log: Any = None, checkpointed: dict[str, Any] | None = None
    ) -> SpikeGuard | None:
        """The guard a run's settings ask for (None: no per-step check), entered as
        "spike_guard" into ``checkpointed`` (the nested states of ``train_state``)."""
        if training.max_skipped <= 0:
            return None
        guard = cls(training, log)
        if checkpointed is not None:
            checkpointed["spike_guard"] = guard
        return guard

    def accept(self, loss: torch.Tensor, grad_norm: torch.Tensor, step: int) -> bool:
        """Whether ``step``'s update goes ahead, from its global mean loss and gradient norm
        (device tensors: one host read of both). A skip is logged; one skip more than
        ``max_skipped`` in a row raises TrainingDiverged."""
        both = torch.stack([loss.float(), grad_norm.float().to(loss.device)]).tolist()
        values = dict(zip(("loss", "grad_norm"), both, strict=True))
        reason = self.judge(values)
        if reason is None:
            for name, window in self.windows.items():
                window.append(values[name])
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        self.skipped += 1
        if self.in_a_row > self.max_skipped:
            raise TrainingDiverged(
                f"{self.in_a_row} steps in a row skipped, more than training.max_skipped "
                f"{self.max_skipped} (step {step}: {reason}); try a lower optimizer.lr or a "
                "longer warmup"
            )
        if self.log is not None:
            record = {"step": step, "kind": "skip", "reason": reason, **values}
            self.log(
                {**record, "skipped_steps": self.skipped, "time": time.time()},
                f"step {step}: update skipped ({reason})",
            )
        return False

    def judge(self, values: dict[str, float]) -> str | None:
        """Why a step with these values is skipped (None: it is not)."""
        for name, value in values.items():
            if not math.isfinite(value):
                return f"{name} is {value}"
        for name, window in self.windows.items():
            if len(window) < self.size:
                continue  # the window is still filling: no spike can be told yet
            mean, std = statistics.fmean(window), statistics.pstdev(window)
            bound = mean + self.sigmas * std
            if values[name] > bound:
                return (
                    f"{name} {values[name]:.6g} > mean {mean:.6g} + {self.sigmas:g} sigma "
                    f"{std:.3g} of the last {self.size} steps"
                )
        return None

    def metrics(self) -> dict[str, float]:
        """Fields for a logged step's record."""
        return {"skipped_steps": self.skipped}

    def state_dict(self) -> dict[str, Any]:
        """Plain values (the checkpoint's sidecar keeps floats exactly)."""
        return {
            "windows": {name: list(window) for name, window in self.windows.items()},
            "in_a_row": self.in_a_row,
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("windows", {})
        for name, window in self.windows.items():
            window.clear()
            window.extend(float(v) for v in saved.get(name, []))  # maxlen keeps the latest
        self.in_a_row = int(state.get("in_a_row", 0))
        self.skipped = int(state.get("skipped", 0))
