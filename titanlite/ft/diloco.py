"""Semi-synchronous replica groups: DiLoCo and Streaming DiLoCo, through torchft.local_sgd.

With ``semi_sync_method = "diloco"`` the groups do not average gradients at every step. Each
takes its own optimizer steps (the *inner* steps: AdamW or Muon, on its own share of the data,
with any layout inside the group), and every ``sync_steps`` steps the groups average their
*pseudo-gradients* (the global parameters of the last synchronization minus their own) and an
outer optimizer, SGD with Nesterov momentum, moves the global parameters by that average; every
group then starts again from the new global parameters.

Streaming DiLoCo (``num_fragments`` > 1) cuts the model into fragments of consecutive blocks,
about equal in bytes, and synchronizes one fragment every ``sync_steps / num_fragments`` steps
(each fragment still every ``sync_steps``): the bytes in flight at once are a fragment's.
``fragment_sync_delay`` = d sends a fragment's pseudo-gradient d steps before it is needed
(the exchange overlaps d inner steps, whose updates of that fragment are then dropped, or
mixed in with weight ``fragment_update_alpha``).

torchft does the algorithm (its ``DiLoCo`` hooks the inner optimizer's step); this module
cuts the fragments, builds the outer optimizers, counts the bytes sent and holds what a
checkpoint must add: each fragment's global parameters and outer momentum, the inner step
within the period and the synchronizations so far, so that a resume in the middle of an outer
step continues exactly.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.errors import UserError
from titanlite.parallel.ddp.collectives import local_tensor


def fragment_units(part: nn.Module) -> list[tuple[str, list[tuple[str, nn.Parameter]]]]:
    """The model's trainable parameters in order, grouped into the units a fragment boundary
    never cuts: a block (``layers.<i>``) or a top-level module (the embeddings, the norm, the
    output). A tied parameter is listed once, where it first appears."""
    units: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for name, param in part.named_parameters():
        if not param.requires_grad:
            continue
        pieces = name.split(".")
        key = ".".join(pieces[:2]) if len(pieces) > 2 and pieces[1].isdigit() else pieces[0]
        units.setdefault(key, []).append((name, param))
    return list(units.items())


def split_balanced(sizes: Sequence[int], n: int) -> list[range]:
    """``n`` consecutive, non-empty ranges of ``sizes`` whose sums are as near a ``1/n`` share
    of the total as the units allow."""
    if not 1 <= n <= len(sizes):
        raise ValueError(f"cannot cut {len(sizes)} units into {n} fragments")
    prefix = [0, *itertools.accumulate(sizes)]
    cuts = [0]
    for k in range(1, n):
        target = prefix[-1] * k / n
        candidates = range(cuts[-1] + 1, len(sizes) - (n - k) + 1)
        cuts.append(min(candidates, key=lambda c: abs(prefix[c] - target)))
    cuts.append(len(sizes))
    return [range(a, b) for a, b in itertools.pairwise(cuts)]


def fragments_of(part: nn.Module, n: int) -> list[list[tuple[str, nn.Parameter]]]:
    """``part``'s trainable parameters, by name, in ``n`` fragments of consecutive units."""
    units = fragment_units(part)
    if n > len(units):
        raise UserError(
            f"fault_tolerance.num_fragments = {n}: the model has only {len(units)} blocks and "
            "top-level modules to cut into fragments"
        )
    sizes = [sum(p.numel() * p.element_size() for _, p in params) for _, params in units]
    return [[np for i in r for np in units[i][1]] for r in split_balanced(sizes, n)]


class Fragment(nn.Module):
    """A fragment as torchft wants it, a module: the model's own parameters (shared, not
    copied), registered under their names with "/" for ".". ``fqns`` maps back."""

    def __init__(self, named: Sequence[tuple[str, nn.Parameter]]) -> None:
        super().__init__()
        self.fqns: dict[str, str] = {}
        for name, param in named:
            key = name.replace(".", "/")
            self.register_parameter(key, param)
            self.fqns[key] = name


class SemiSync:
    """torchft's DiLoCo over one model part and its inner optimizer, with the outer optimizers
    (one per fragment) and the state a checkpoint holds (``checkpoint_state``)."""

    def __init__(
        self, manager: Any, settings: Any, part: nn.Module, optimizer: torch.optim.Optimizer
    ) -> None:
        from torchft.local_sgd import DiLoCo

        self.manager = manager
        self.fragments = [Fragment(f) for f in fragments_of(part, settings.num_fragments)]
        self.outer = [
            torch.optim.SGD(
                f.parameters(),
                lr=settings.outer_lr,
                momentum=settings.outer_momentum,
                nesterov=settings.outer_momentum > 0,
            )
            for f in self.fragments
        ]
        # The momentum exists from the start (zeros: SGD's first step then gives the same
        # buffer as creating it from the gradient), so a checkpoint always has it.
        if settings.outer_momentum > 0:
            for outer in self.outer:
                for p in outer.param_groups[0]["params"]:
                    outer.state[p]["momentum_buffer"] = torch.zeros_like(p.detach())
        self.diloco = DiLoCo(
            manager,
            list(self.fragments),
            optimizer,
            self.outer,
            sync_every=settings.sync_steps,
            backup_device=None,
            pin_memory=False,
            should_quantize=settings.should_quantize,
            fragment_sync_delay=settings.fragment_sync_delay,
            fragment_update_alpha=settings.fragment_update_alpha,
        )
        self.period = settings.sync_steps // settings.num_fragments
        self.delay = settings.fragment_sync_delay
        self.bytes_sent = 0
        for fragment, inner in zip(self.fragments, self.diloco._fragments, strict=True):
            inner.prepare_sync = self._counting(inner.prepare_sync, fragment)
        self.diloco.__enter__()  # the optimizer's step hooks

    def _counting(self, prepare: Any, fragment: Fragment) -> Any:
        size = sum(local_tensor(p.detach()).nbytes for p in fragment.parameters())

        def prepare_sync() -> None:
            self.bytes_sent += size
            prepare()

        return prepare_sync

    def in_flight(self) -> bool:
        """Whether a fragment's pseudo-gradient is being exchanged across steps (only with a
        fragment_sync_delay): no checkpoint can be taken then."""
        local = self.diloco._local_step
        return self.delay > 0 and self.period - self.delay <= local < self.period

    def close(self) -> None:
        self.diloco.__exit__(None, None, None)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_state(self) -> dict[str, Any]:
        """Each fragment's global parameters and outer momentum by parameter name (sharded as
        the parameters are), the inner step within the period, the synchronizations so far."""
        state: dict[str, Any] = {
            "local_step": self.diloco._local_step,
            "syncs": self.manager.current_step(),
        }
        for fragment, inner, outer in zip(
            self.fragments, self.diloco._fragments, self.outer, strict=True
        ):
            for key, param in fragment.named_parameters():
                name = fragment.fqns[key]
                state[f"global.{name}"] = _like(inner.original_parameters[key], param)
                buffer = outer.state.get(param, {}).get("momentum_buffer")
                if buffer is not None:
                    state[f"momentum.{name}"] = buffer
        return state

    def load_checkpoint_state(self, state: dict[str, Any]) -> bool:
        """Restore what ``checkpoint_state`` gave; False when ``state`` has no global
        parameters (a checkpoint of a run without DiLoCo: they start from the weights)."""
        if not any(k.startswith("global.") for k in state):
            return False
        with torch.no_grad():
            for fragment, inner, outer in zip(
                self.fragments, self.diloco._fragments, self.outer, strict=True
            ):
                for key, param in fragment.named_parameters():
                    name = fragment.fqns[key]
                    inner.original_parameters[key].copy_(local_tensor(state[f"global.{name}"]))
                    buffer = outer.state.get(param, {}).get("momentum_buffer")
                    if buffer is not None and f"momentum.{name}" in state:
                        local_tensor(buffer).copy_(local_tensor(state[f"momentum.{name}"]))
        self.diloco._local_step = int(state["local_step"])
        self.manager.load_state_dict({"step": int(state["syncs"]), "batches_committed": 0})
        return True

    def restart_from_weights(self) -> None:
        """The global parameters := the model's (after a load that had none of its own)."""
        self.diloco._save_parameters()


def _like(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's piece) as ``param`` is laid out: a DTensor of the same
    placements for a sharded parameter, so that a checkpoint shards it as the weights."""
    if isinstance(param, DTensor):
        return DTensor.from_local(
            local,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    return local
