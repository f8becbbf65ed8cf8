"""Replica fingerprints: finding the rank whose parameters or optimizer state went wrong.

Data-parallel replicas hold bit-identical parameters and optimizer state after every step
(the same reduced gradient, the same update), and so do the ranks over which a DTensor is
replicated (HSDP's replicate dim, tensor parallelism's norms). Any difference between them is
corruption (a flipped bit in memory, a GPU computing wrong numbers), not rounding. A
``ReplicaCheck`` compares them every ``health.sdc_check_interval`` steps and before every
checkpoint save (``titanlite.health.monitor`` calls it), so that nothing a bad rank holds
reaches a checkpoint.

Which ranks must agree is read from the tensors themselves, so no layout needs code of its
own: a DTensor's local tensor is the same on every rank of each mesh dim where its placement
is Replicate (the process group of that dim); a parameter, and the optimizer state shaped
like it, is the same on every rank of titanlite's DDP replica group (plain tensors, and the
local shards of tensor-parallel ones). Sharded dims and pipeline stages hold different data
and are never compared.

Per tensor two exact integers are computed on the device: the sum of its raw bits read as
integers (int32 for float32, int16 for bfloat16) and the same sum weighted by row number,
both in int64 with wrap-around. Integer sums do not depend on the order of the reduction, so
identical bytes give identical numbers on any device and thread count (a clean run never
raises a false alarm); one flipped bit changes the first by 2**k; the second also sees
values moved between rows. Each group of ranks all-gathers one small [tensors, 2] tensor,
then one all-reduce of a flag over the world makes every rank stop at the same step; only a
mismatch reads more to the host. A mismatch names the rank by majority (3 or more replicas)
or every rank of the group (2 replicas), and the tensor, in one line: ``SilentCorruption``.
"""

from __future__ import annotations

import logging
import socket
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite import errors

logger = logging.getLogger(__name__)

# Wrappers (activation checkpointing, torch.compile) that add to a parameter's name.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The integer type each element size is read as."""


class SilentCorruption(errors.SilentCorruption):
    """Replicas that must hold identical bytes do not (``titanlite.errors.SilentCorruption``,
    a RuntimeError the entry point maps to exit status 4), with what was found: one line names
    the rank(s), their host, the step and the tensor; ``ranks`` are the ranks suspected (every
    rank of the group when there is no majority), ``tensors`` every tensor that differed."""

    def __init__(self, line: str, *, step: int, ranks: Sequence[int], tensors: Sequence[str]):
        super().__init__(line)
        self.step = step
        self.ranks = tuple(ranks)
        self.tensors = tuple(tensors)


@dataclass(frozen=True)
class Finding:
    """One tensor that differs within one group (the same on every member that saw it)."""

    tensor: str
    group: tuple[int, ...]
    """The group's global ranks."""
    suspects: tuple[int, ...]
    """The ranks outside the majority, or every rank of the group when there is none."""
    majority: bool


def fingerprint(tensor: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """[2] int64 on the tensor's device: the sum of its raw bits as integers, and that sum
    weighted by (row number + 1) over its first dim. ``weights``: that arange, if at hand."""
    if tensor.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=tensor.device)
    bits = tensor.detach().view(_BITS[tensor.element_size()])
    rows = bits.shape[0] if bits.dim() else 1
    per_row = bits.reshape(rows, -1).sum(1, dtype=torch.int64)
    if weights is None:
        weights = torch.arange(1, rows + 1, dtype=torch.int64, device=tensor.device)
    return torch.stack([per_row.sum(), (per_row * weights[:rows]).sum()])


def _name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


class ReplicaCheck:
    """Compares what replicas must hold bit-identically: ``check(step)`` on every rank at
    the same steps (it runs collectives), before a checkpoint is saved."""

    def __init__(
        self,
        parameters: Sequence[tuple[str, torch.Tensor]],
        optimizers: Sequence[torch.optim.Optimizer],
        *,
        replica_group: dist.ProcessGroup | None,
        rank: int,
    ):
        self.parameters = list(parameters)
        self.optimizers = list(optimizers)
        self.replica_group = replica_group
        self.rank = rank
        self.active = dist.is_initialized() and dist.get_world_size() > 1
        self._ranks: dict[int, tuple[int, ...]] = {}  # id(process group) -> its global ranks
        self._weights: torch.Tensor | None = None
        self.device = self.parameters[0][1].device if self.parameters else torch.device("cpu")

    @classmethod
    def of(
        cls,
        parts: Sequence[nn.Module],
        optimizers: Sequence[torch.optim.Optimizer],
        *,
        replica_group: dist.ProcessGroup | None,
        rank: int,
    ) -> ReplicaCheck:
        """The check of a model's ``parts`` (their parameters, by the names the model gives
        them) and of the state their ``optimizers`` hold; ``replica_group``: titanlite's DDP
        replicas (``ParallelDims.replica_group()``) when the run has them, else None."""
        named = [(_name(n), p) for part in parts for n, p in part.named_parameters()]
        return cls(named, optimizers, replica_group=replica_group, rank=rank)

    # ------------------------------------------------------------------ what to compare
    def _group_ranks(self, group: dist.ProcessGroup) -> tuple[int, ...]:
        if id(group) not in self._ranks:
            self._ranks[id(group)] = tuple(dist.get_process_group_ranks(group))
        return self._ranks[id(group)]

    def _groups_of(self, tensor: torch.Tensor) -> Iterator[dist.ProcessGroup]:
        """The process groups over which ``tensor`` (its local part) is the same on every
        member."""
        if self.replica_group is not None:
            yield self.replica_group
        if isinstance(tensor, DTensor):
            mesh = tensor.device_mesh
            for dim, placement in enumerate(tensor.placements):
                if placement.is_replicate() and mesh.size(dim) > 1:
                    yield mesh.get_group(dim)

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every parameter and of its optimizer state shaped like it
        (moments, momentum; not the step count), in the model's order: the same on every
        member of a group, since the members hold the same stage of the same model."""
        states = [optimizer.state for optimizer in self.optimizers]
        for name, param in self.parameters:
            yield name, param
            for state in states:
                for key, value in sorted((state.get(param) or {}).items()):
                    if isinstance(value, torch.Tensor) and value.shape == param.shape:
                        yield f"optimizer state {key} of {name}", value

    def _by_group(self) -> dict[tuple[int, ...], tuple[dist.ProcessGroup, list[tuple]]]:
        """group ranks -> (the group, [(name, local tensor)]) for every group of 2+ ranks."""
        groups: dict[tuple[int, ...], tuple[dist.ProcessGroup, list[tuple]]] = {}
        for name, tensor in self._tensors():
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            seen: set[tuple[int, ...]] = set()
            for group in self._groups_of(tensor):
                ranks = self._group_ranks(group)
                if len(ranks) > 1 and ranks not in seen:
                    seen.add(ranks)
                    groups.setdefault(ranks, (group, []))[1].append((name, local))
        return groups

    def plan(self) -> dict[tuple[int, ...], list[str]]:
        """What ``check`` compares now: group ranks -> the names of the tensors compared over
        them (the optimizer state appears after the first step)."""
        return {
            ranks: [name for name, _ in tensors] for ranks, (_, tensors) in self._by_group().items()
        }

    # ------------------------------------------------------------------ the check
    @torch.no_grad()
    def check(self, step: int) -> int:
        """Compare every group's fingerprints; return how many of this rank's tensors were
        compared. Raises SilentCorruption, on every rank at the same step, when any group
        disagrees. Call it on every rank (it runs collectives)."""
        if not self.active:
            return 0
        # A global order (by their ranks) in which every rank visits its groups: no two ranks
        # can wait for each other in different groups.
        groups = sorted(self._by_group().items())
        pending = []
        for ranks, (group, tensors) in groups:
            mine = torch.stack([self._fingerprint(local) for _, local in tensors])
            gathered = [torch.empty_like(mine) for _ in ranks]
            work = dist.all_gather(gathered, mine, group=group, async_op=True)
            pending.append((ranks, tensors, gathered, work))
        differing = torch.zeros((), dtype=torch.int64, device=self.device)
        for *_, gathered, work in pending:
            work.wait()
            stacked = torch.stack(gathered)  # [ranks, tensors, 2]
            differing += (stacked != stacked[:1]).any(dim=2).any(dim=0).sum().to(self.device)
        dist.all_reduce(differing)  # the world: every rank learns of any mismatch
        compared = len({name for _, tensors, *_ in pending for name, _ in tensors})
        if differing.item() == 0:  # the one host synchronization of a clean check
            logger.debug("step %d: %d tensors agree with their replicas", step, compared)
            return compared
        findings = [
            finding
            for ranks, tensors, gathered, _ in pending
            for finding in _findings(ranks, [name for name, _ in tensors], gathered)
        ]
        raise self._corruption(step, findings)

    def _fingerprint(self, local: torch.Tensor) -> torch.Tensor:
        rows = local.shape[0] if local.dim() else 1
        if self._weights is None or len(self._weights) < rows:  # one arange, kept
            self._weights = torch.arange(1, rows + 1, dtype=torch.int64, device=self.device)
        weights = self._weights.to(local.device, non_blocking=True)
        return fingerprint(local, weights).to(self.device, non_blocking=True)

    def _corruption(self, step: int, findings: list[Finding]) -> SilentCorruption:
        """Every rank's findings and host to every rank (one all-gather over the world, only
        once corruption is found): all ranks raise the same line."""
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (self.rank, socket.gethostname(), findings))
        hosts = {rank: host for rank, host, _ in everyone}
        unique = list(dict.fromkeys(f for *_, mine in everyone for f in mine))
        if dist.get_rank() == 0 and len(unique) > 1:  # the error's line names the first only
            for f in unique:
                logger.error(
                    "step %d: ranks %s of %s differ on %s", step, f.suspects, f.group, f.tensor
                )
        return corruption_error(step, unique, hosts)


def _findings(
    ranks: tuple[int, ...], names: list[str], gathered: list[torch.Tensor]
) -> Iterable[Finding]:
    """The tensors on which the group ``ranks`` disagree, with the ranks to blame."""
    table = torch.stack(gathered).cpu()  # [ranks, tensors, 2]
    for index in torch.nonzero((table != table[:1]).any(dim=2).any(dim=0)).flatten().tolist():
        values = [tuple(table[r, index].tolist()) for r in range(len(ranks))]
        common, count = Counter(values).most_common(1)[0]
        if len(ranks) > 2 and count * 2 > len(ranks):
            suspects = tuple(r for r, v in zip(ranks, values, strict=True) if v != common)
            yield Finding(names[index], ranks, suspects, majority=True)
        else:
            yield Finding(names[index], ranks, ranks, majority=False)


def corruption_error(step: int, findings: list[Finding], hosts: dict[int, str]) -> SilentCorruption:
    """The one line naming the first finding's rank(s), their host, the step and the tensor
    (and how many more tensors differ)."""
    first = findings[0]
    if first.majority:
        others = ", ".join(str(r) for r in first.group if r not in first.suspects)
        line = (
            f"{_ranks(first.suspects, hosts)} differ{'s' if len(first.suspects) == 1 else ''} "
            f"from {'its' if len(first.suspects) == 1 else 'their'} replicas (ranks {others}) "
            f"on {first.tensor}"
        )
    else:
        line = (
            f"{_ranks(first.suspects, hosts)} disagree on {first.tensor} "
            "(no majority tells which is wrong)"
        )
    tensors = list(dict.fromkeys(f.tensor for f in findings))
    if len(tensors) > 1:
        line += f"; {len(tensors) - 1} more tensor{'s' if len(tensors) > 2 else ''} differ"
    suspects = sorted({r for f in findings for r in f.suspects})
    return SilentCorruption(
        f"silent data corruption at step {step}: {line}",
        step=step,
        ranks=suspects,
        tensors=tensors,
    )


def _ranks(ranks: Sequence[int], hosts: dict[int, str]) -> str:
    """ "rank 1 (host a)", "ranks 0 and 1 (host a)", "ranks 0 (host a) and 2 (host b)"."""
    known = {hosts[r] for r in ranks if r in hosts}
    if len(known) == 1 and all(r in hosts for r in ranks):
        parts, suffix = [str(r) for r in ranks], f" (host {known.pop()})"
    else:
        parts = [f"{r} (host {hosts[r]})" if r in hosts else str(r) for r in ranks]
        suffix = ""
    listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"rank{'s' if len(ranks) > 1 else ''} {listed}{suffix}"
