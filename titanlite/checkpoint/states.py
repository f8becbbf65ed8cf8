"""Everything resumable, as Stateful objects in one registry (``build_states``).

The checkpointer saves each entry's ``state_dict()``: tensors (DTensors included) go into
torch.distributed.checkpoint, sharded as trained; every other value goes into the JSON
sidecar, written by rank 0, so plain values must be the same on every rank. State that
differs per rank (RNG) is kept as tensors under a per-rank key.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from titanlite.checkpoint.keys import STATE_KEYS

logger = logging.getLogger(__name__)


class ModelState(Stateful):
    """The weights of every model part (one part, or one per pipeline stage), by name.

    A model with frozen weights (LoRA's base, ``titanlite.converters.lora``) keeps only its
    trained ones in training checkpoints (``frozen``): the frozen ones never change and come
    back from the base they were loaded from (``base_view``), or from the seed."""

    def __init__(self, parts: Sequence[nn.Module]):
        self.parts = list(parts)
        self.frozen = any(not p.requires_grad for part in self.parts for p in part.parameters())

    def whole_state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part in self.parts:
            merged.update(get_model_state_dict(part))
        return merged

    def state_dict(self) -> dict[str, Any]:
        whole = self.whole_state_dict()
        return {k: v for k, v in whole.items() if k in self._trained()} if self.frozen else whole

    def _trained(self) -> set[str]:
        return {n for part in self.parts for n, p in _named_params(part) if p.requires_grad}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        own = self.state_dict().keys()
        options = StateDictOptions(strict=not self.frozen)
        for part in self.parts:
            mine = get_model_state_dict(part).keys() & own
            set_model_state_dict(part, {k: state[k] for k in mine}, options=options)

    def adapters(self) -> dict[str, Any]:
        """What an export needs to merge the trained low-rank updates into their weights:
        each update's scale (``scale`` of the modules that have ``adapter_init``)."""
        scales = {
            m.scale for part in self.parts for m in part.modules() if hasattr(m, "adapter_init")
        }
        return {"adapter_scale": scales.pop()} if len(scales) == 1 else {}

    def base_view(self) -> Stateful:
        """The frozen weights alone, as a state to load a base model's checkpoint into."""
        return _FrozenWeights(self)


def _named_params(part: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters by the names ``get_model_state_dict`` gives them (wrappers' prefixes out)."""
    prefixes = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
    named = []
    for name, param in part.named_parameters():
        for prefix in prefixes:
            name = name.replace(prefix, "")
        named.append((name, param))
    return named


class _FrozenWeights(Stateful):
    def __init__(self, model: ModelState):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        trained = self.model._trained()
        return {k: v for k, v in self.model.whole_state_dict().items() if k not in trained}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        options = StateDictOptions(strict=False)
        for part in self.model.parts:
            mine = get_model_state_dict(part).keys() & state.keys()
            set_model_state_dict(part, {k: state[k] for k in mine}, options=options)


class OptimizerState(Stateful):
    """The optimizers' per-parameter state (moments, step counts), by parameter name.

    Hyper-parameters (param_groups) are not saved: they come from this run's config, so a
    resume with another ``--optimizer.lr`` or weight decay takes effect.
    """

    def __init__(
        self,
        parts: Sequence[nn.Module],
        optimizers: Sequence[torch.optim.Optimizer],
        renames: Sequence[dict[str, str]] | None = None,
    ):
        self.parts = list(parts)
        self.optimizers = list(optimizers)
        # Per part, {alias: owner}: a tied weight's copy on another pipeline stage keeps its
        # state under the owner's name, as a one-process model stores it.
        self.renames = list(renames or [{}] * len(self.parts))

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        options = StateDictOptions(flatten_optimizer_state_dict=False)
        for part, optimizer, renames in zip(self.parts, self.optimizers, self.renames, strict=True):
            # torch creates the state lazily; a template to load into needs it.
            _create_optimizer_state(part, optimizer)
            own = get_optimizer_state_dict(part, optimizer, options=options)["state"]
            merged.update({renames.get(k, k): v for k, v in own.items()})
        return {"state": merged}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part, optimizer, renames in zip(self.parts, self.optimizers, self.renames, strict=True):
            current = get_optimizer_state_dict(part, optimizer)
            own = {k: state["state"][renames.get(k, k)] for k in current["state"]}
            set_optimizer_state_dict(
                part, optimizer, {"state": own, "param_groups": current["param_groups"]}
            )


def _create_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One step with zero gradients and a zero learning rate: creates the state tensors and
    changes no weight."""
    if optimizer.state:
        return
    saved_lrs = [g["lr"] for g in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, saved_lrs, strict=True):
        group["lr"] = lr


class LRSchedulerState(Stateful):
    """The schedule's position; its peak LR comes from this run's config on a resume."""

    def __init__(self, schedulers: Sequence[torch.optim.lr_scheduler.LambdaLR]):
        self.schedulers = list(schedulers)

    def state_dict(self) -> dict[str, Any]:
        # Every part's scheduler steps together: one state describes them all.
        state = self.schedulers[0].state_dict()
        state.pop("lr_lambdas", None)  # functions; rebuilt from the config
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for scheduler in self.schedulers:
            # torch's state also restores the old base LRs; keeping the configured ones makes
            # `--optimizer.lr` on a resume take effect (and changes nothing when unchanged).
            base_lrs = list(scheduler.base_lrs)
            scheduler.load_state_dict(dict(state, lr_lambdas=[None] * len(base_lrs)))
            scheduler.base_lrs = base_lrs
            epoch = scheduler.last_epoch
            for group, base, factor in zip(
                scheduler.optimizer.param_groups, base_lrs, scheduler.lr_lambdas, strict=True
            ):
                group["lr"] = base * factor(epoch)
            scheduler._last_lr = [g["lr"] for g in scheduler.optimizer.param_groups]


@dataclasses.dataclass
class TrainState(Stateful):
    step: int = 0
    _tokens_seen: int = 0
    # Steps' global token counts still on the device: reading one is a device-to-host
    # synchronization, so they are added up there and read only when tokens_seen is.
    _pending: torch.Tensor | None = dataclasses.field(default=None, repr=False, compare=False)
    nested: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    """More of the loop's state, saved inside train_state under its own key: objects whose
    ``state_dict()`` holds plain values only (the spike guard's window). A checkpoint without
    the key loads ``{}`` into it (a run that turned the component on at its resume)."""

    @property
    def tokens_seen(self) -> int:
        if self._pending is not None:
            self._tokens_seen += int(self._pending)
            self._pending = None
        return self._tokens_seen

    def add_tokens(self, count: torch.Tensor) -> None:
        """Add a step's global target-token count (a device tensor) without reading it."""
        self._pending = count if self._pending is None else self._pending + count

    def state_dict(self) -> dict[str, Any]:
        nested = {name: part.state_dict() for name, part in self.nested.items()}
        return {"step": self.step, "tokens_seen": self.tokens_seen, **nested}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self._tokens_seen = int(state["tokens_seen"])
        self._pending = None
        for name, part in self.nested.items():
            part.load_state_dict(state.get(name, {}))


class RNGState(Stateful):
    """This rank's CPU (and CUDA) generator state, under the rank's own key.

    Resumed under another world size, ranks without a saved state keep their seeded
    generators (titanlite draws nothing from them for data or initialization).
    """

    partial_ok = True

    def __init__(self) -> None:
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    def state_dict(self) -> dict[str, Any]:
        own: dict[str, torch.Tensor] = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            own["cuda"] = torch.cuda.get_rng_state()
        return {f"rank{self.rank}": own}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        own = state.get(f"rank{self.rank}")
        if not own or "cpu" not in own:
            logger.info(
                "checkpoint has no RNG state for rank %d; keeping the seeded one", self.rank
            )
            return
        torch.set_rng_state(own["cpu"])
        if "cuda" in own and torch.cuda.is_available():
            torch.cuda.set_rng_state(own["cuda"])


def build_states(
    parts: Sequence[nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    schedulers: Sequence[torch.optim.lr_scheduler.LambdaLR],
    dataloader: Stateful,
    *,
    train_state: TrainState,
    renames: Sequence[dict[str, str]] | None = None,
    ema: Stateful | None = None,
) -> dict[str, Stateful]:
    """The registry the checkpointer saves and restores, under the fixed STATE_KEYS
    (``renames``: see OptimizerState; ``ema``, the average of the weights, only when on)."""
    entries = (
        ModelState(parts),
        OptimizerState(parts, optimizers, renames),
        LRSchedulerState(schedulers),
        dataloader,
        train_state,
        RNGState(),
    )
    states = dict(zip(STATE_KEYS, entries, strict=False))
    if ema is not None:
        states["ema"] = ema
    return states
