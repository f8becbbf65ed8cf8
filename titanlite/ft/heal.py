"""What a group coming back receives from a live one (the heal): references to this rank's
tensors on the sending side, copies into them on the receiving side."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from titanlite.parallel.ddp.collectives import local_tensor


def heal_state(
    parts: Sequence[torch.nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    schedulers: Sequence[Any],
    counters: Callable[[], dict[str, int]],
) -> dict[str, Any]:
    """What a live group sends a healing one (references, no copies: torchft serializes
    them while this group waits in its quorum)."""
    state: dict[str, Any] = {"counters": counters()}
    for i, part in enumerate(parts):
        for name, tensor in [*part.named_parameters(), *part.named_buffers()]:
            state[f"model.{i}.{name}"] = local_tensor(tensor.detach())
    for j, optimizer in enumerate(optimizers):
        for index, param in enumerate(_params(optimizer)):
            for key, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    state[f"optim.{j}.{index}.{key}"] = local_tensor(value)
    for j, scheduler in enumerate(schedulers):
        state[f"schedule.{j}"] = scheduler.state_dict()
    return state


def load_heal_state(
    state: dict[str, Any],
    parts: Sequence[torch.nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    schedulers: Sequence[Any],
    *,
    set_counters: Callable[[dict[str, int]], None],
) -> None:
    """Copy a live group's state into this one's tensors (on the main thread, before the
    forward of the step it rejoins at). Optimizer state that does not exist yet (a group
    started afresh) is created first, as a checkpoint load does."""
    with torch.no_grad():
        for i, part in enumerate(parts):
            for name, tensor in [*part.named_parameters(), *part.named_buffers()]:
                local_tensor(tensor.detach()).copy_(state[f"model.{i}.{name}"])
        for j, optimizer in enumerate(optimizers):
            params = _params(optimizer)
            if any(p not in optimizer.state for p in params):
                from torch.distributed.checkpoint.state_dict import _init_optim_state

                _init_optim_state(optimizer)
            for index, param in enumerate(params):
                for key, value in optimizer.state[param].items():
                    if isinstance(value, torch.Tensor):
                        local_tensor(value).copy_(state[f"optim.{j}.{index}.{key}"])
    for j, scheduler in enumerate(schedulers):
        scheduler.load_state_dict(state[f"schedule.{j}"])
        # The state says where the schedule is; the rate the optimizer steps with is in its
        # groups, which only scheduler.step() writes: set it, or the first step after a heal
        # would use a fresh process's warm-up rate.
        groups = scheduler.optimizer.param_groups
        for group, lr in zip(groups, scheduler.get_last_lr(), strict=True):
            group["lr"] = lr
    set_counters(state["counters"])


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def state_bytes(state: dict[str, Any]) -> int:
    """The tensor bytes of a heal state (what crossed the network)."""
    return sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor))
