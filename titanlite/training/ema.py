"""An exponential moving average of the weights (``training.ema_decay``).

The average starts as the weights after the run's first optimizer update; after every later
one, ``average = decay * average + (1 - decay) * weights``, one ``lerp`` over this rank's local
shards: the average is a copy of each parameter sharded as the parameter is (a DTensor under
FSDP and TP, this rank's stages under PP), so it costs one more copy of this rank's weights in
memory and no communication. A skipped update (the spike guard, docs/stability.md) changes
neither the weights nor the average.

It is checkpoint state under the key ``ema`` (tensors named as the model's parameters, a tied
weight's copy under its owner's name, as the optimizer state), so it resumes, under another
layout too, and ``scripts/convert_to_hf.py --ema`` exports it instead of the weights. A run
whose checkpoint has none (the average turned on at a resume, or weights from
``initial_load_path``) starts it at its next update, as a new run does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from titanlite.models.init import canonical_name


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class WeightAverage(Stateful):
    """The average of the trainable parameters of ``parts``, by name."""

    partial_ok = True  # a checkpoint without it: the average starts at the next update

    def __init__(
        self,
        parts: Sequence[nn.Module],
        decay: float,
        renames: Sequence[dict[str, str]] | None = None,
    ) -> None:
        self.decay = decay
        self.params: dict[str, nn.Parameter] = {}
        for part, part_renames in zip(parts, renames or [{}] * len(parts), strict=True):
            for name, param in part.named_parameters():
                if param.requires_grad:
                    name = canonical_name(name)
                    self.params.setdefault(part_renames.get(name, name), param)
        with torch.no_grad():
            self.average = {name: torch.zeros_like(p) for name, p in self.params.items()}
        self.started = False  # the average holds values (after an update, or from a checkpoint)

    @classmethod
    def of(
        cls, parts: Sequence[nn.Module], decay: float, renames: Sequence[dict[str, str]]
    ) -> WeightAverage | None:
        """The average a run's ``training.ema_decay`` asks for (None when 0: off)."""
        return cls(parts, decay, renames) if decay > 0 else None

    @torch.no_grad()
    def update(self) -> None:
        """After an optimizer update: move the average towards the weights (the first time,
        copy them)."""
        names = list(self.params)
        averages = [_local(self.average[n]) for n in names]
        weights = [_local(self.params[n].detach()) for n in names]
        if self.started:
            torch._foreach_lerp_(averages, weights, 1.0 - self.decay)
        else:
            torch._foreach_copy_(averages, weights)
            self.started = True

    def state_dict(self) -> dict[str, Any]:
        """The average's tensors by parameter name, and whether it has started (a plain
        value: the sidecar's)."""
        return {"started": self.started, **self.average}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """DCP has loaded the tensors in place (``state`` holds the same ones); a checkpoint
        without the average gives none, and the average starts at the next update."""
        names = [name for name in self.average if name in state]
        self.started = bool(state.get("started")) and len(names) == len(self.average)
        for name in names:
            if state[name] is not self.average[name]:
                _local(self.average[name]).copy_(_local(state[name]))
