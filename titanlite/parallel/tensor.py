"""Tensor parallelism from a spec's plan: Megatron-style splits with sequence parallelism.

The plan (``ModelSpec.tp_plan``) names a style per module; this file is the only place that
turns those names into torch's ParallelStyle objects. Between sub-layers, activations stay
sharded along the sequence (norms run on their shard); with loss parallel the logits stay
sharded along the vocabulary and the cross-entropy is computed on the shards (with the
fused loss the projection's weight is split the same way and the loss works on its shards).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titanlite.models.interfaces import LowRankLinear
from titanlite.models.spec import ModelSpec, TPStyle
from titanlite.parallel.ddp.collectives import all_reduce_after_backward, local_tensor
from titanlite.parallel.head import DeferredHead, deferred_head_style
from titanlite.parallel.sequence_shards import SequenceShardGroup

logger = logging.getLogger(__name__)


class LocalTokens(ParallelStyle):
    """The module runs unchanged on this rank's shard of each sequence (a local tensor, as
    sequence parallelism leaves it) with its weights whole on every TP rank: a mixture of
    experts routes its own tokens. Each TP rank's weight gradients then cover its tokens
    only; ``LocalTokenGrads`` sums them over TP after backward.
    The module gets ``sequence_shards`` (``titanlite.models.interfaces.SequenceShards``)
    over the TP group, for statistics that are per whole sequence."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(_local_inputs)
        module.sequence_shards = SequenceShardGroup(device_mesh.get_group(), device_mesh.size())
        return module


class HeadParameters(ParallelStyle):
    """Parameters with one entry per query head (attention sinks) split along dimension 0
    like the column-wise q projection splits the heads, so each rank holds its own heads'
    entries (the module reads them with ``to_local``)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for key, param in list(mod.named_parameters(recurse=False)):
                shard = distribute_tensor(param, mesh, [Shard(0)])
                mod.register_parameter(key, nn.Parameter(shard, param.requires_grad))

        return distribute_module(module, device_mesh, partition)


class Latent(ParallelStyle):
    """A module every TP rank runs whole on the whole (gathered) sequence: a latent
    projection of latent attention or its norm. Weights replicated; inputs taken as
    replicated. Its output stays a replicated DTensor when a head-split projection consumes
    it (that projection's input gradient, a partial sum over the ranks' heads, then reaches
    these weights as one); ``local_output`` hands on a local tensor that this rank's heads
    use alone, whose gradient is therefore marked a partial sum."""

    def __init__(self, local_output: bool) -> None:
        super().__init__()
        self.local_output = local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicate_inputs(_: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> Any:
            return tuple(
                a
                if isinstance(a, DTensor) or not isinstance(a, torch.Tensor)
                else DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                for a in inputs
            )

        def hand_on(_: nn.Module, out: DTensor, mesh: DeviceMesh) -> torch.Tensor:
            return out.to_local(grad_placements=[Partial()]) if self.local_output else out

        return distribute_module(module, device_mesh, input_fn=replicate_inputs, output_fn=hand_on)


class ShardChannels(ParallelStyle):
    """The module's own per-channel parameters (a depthwise convolution's taps, per-head
    decays) split along dim 0 in the order a colwise projection splits its outputs, so each
    rank holds the rows of its own heads; the module reads them with ``to_local`` and runs
    on the local tensors the projections give it."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, device_mesh, [Shard(0)])
            module.register_parameter(name, nn.Parameter(sharded, param.requires_grad))
        return module


def _distribute(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Any]) -> None:
    for name, placement in placements.items():
        param = getattr(module, name)
        if param is not None:
            shard = distribute_tensor(param, mesh, [placement])
            module.register_parameter(name, nn.Parameter(shard, param.requires_grad))


class Colwise(ColwiseParallel):
    """torch's column-wise split; a low-rank update's factors (``LowRankLinear``) split to
    match: A whole on every rank, B's rows (the outputs) like the weight's."""

    def _partition_linear_fn(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if not isinstance(module, LowRankLinear):
            return super()._partition_linear_fn(name, module, mesh)
        s = Shard(0)
        _distribute(module, mesh, {"weight": s, "bias": s, "lora_a": Replicate(), "lora_b": s})


class Rowwise(RowwiseParallel):
    """torch's row-wise split; a low-rank update's A split by its columns (the inputs) like
    the weight, B whole: each rank's update is a partial sum, reduced with the weight's."""

    def _partition_linear_fn(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if not isinstance(module, LowRankLinear):
            return super()._partition_linear_fn(name, module, mesh)
        s, r = Shard(1), Replicate()
        _distribute(module, mesh, {"weight": s, "bias": r, "lora_a": s, "lora_b": r})


def _local_inputs(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(local_tensor(a) for a in args)  # DTensors to local tensors, the rest as is


@dataclass(frozen=True)
class LocalTokenGrads:
    """What tensor parallelism leaves to do after each step's backward: the modules split as
    ``local_tokens`` run on each TP rank's own tokens with their weights whole on every rank,
    so each rank's weight gradients cover its tokens only; ``finish`` sums them over
    ``group`` (the tp ranks). ``units`` are those modules; their parameters are read when
    finishing, since FSDP replaces a module's parameters after ``apply_tp`` returned."""

    units: tuple[nn.Module, ...]
    group: dist.ProcessGroup

    @staticmethod
    def join(pieces: Sequence[LocalTokenGrads]) -> LocalTokenGrads | None:
        """One fix-up for every pipeline stage of this rank, so their gradients are summed in
        the same flat buckets (None: no pieces)."""
        if not pieces:
            return None
        return LocalTokenGrads(tuple(u for piece in pieces for u in piece.units), pieces[0].group)

    def finish(self) -> None:
        partial = [p.grad for m in self.units for p in m.parameters() if p.grad is not None]
        if partial:
            all_reduce_after_backward(partial, self.group)


def _style(name: TPStyle, loss_parallel: bool) -> ParallelStyle:
    if name == "embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if name == "norm":
        return SequenceParallel()
    if name == "head_norm":
        # Input [batch, seq, local heads, head_dim]: whole heads per rank, so the norm runs
        # on the local tensor; seen as sharded along the heads, the replicated weight's
        # gradient is summed over the TP ranks.
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    if name == "gather_input":
        return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    if name == "colwise":
        return Colwise()
    if name == "rowwise":
        return Rowwise(output_layouts=Shard(1))
    if name == "output":
        return ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if name == "heads":
        return HeadParameters()
    if name == "local_tokens":
        return LocalTokens()
    if name in ("latent", "latent_local"):
        return Latent(local_output=name == "latent_local")
    if name == "channels":
        return ShardChannels()
    raise ValueError(f"unknown tensor-parallel style {name!r}")


def shared_parameters(model: nn.Module) -> list[tuple[str, str]]:
    """(alias, owner) module paths of parameters used under two names (tied weights)."""
    first: dict[int, str] = {}
    pairs = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            pairs.append((name, first[id(param)]))
        else:
            first[id(param)] = name
    return pairs


def retie(model: nn.Module, pairs: list[tuple[str, str]]) -> None:
    """Point each alias at its owner again after a transformation replaced both."""
    for alias, owner in pairs:
        module_path, _, attr = alias.rpartition(".")
        setattr(model.get_submodule(module_path), attr, model.get_parameter(owner))


def _has(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:  # absent, or set to None
        return False
    return True


def apply_tp(
    model: nn.Module, spec: ModelSpec, tp_mesh: DeviceMesh, loss_parallel: bool
) -> LocalTokenGrads:
    """Split ``model`` over ``tp_mesh`` by the spec's plan; returns the modules that run on
    each rank's own tokens, whose gradients need a sum over TP (``LocalTokenGrads``)."""
    plan = spec.tp_plan
    tied = shared_parameters(model)
    # Some of torch's styles (SequenceParallel) make every parameter they replace trainable;
    # frozen ones (a LoRA converter's base weights) must stay frozen.
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    # A pipeline stage holds only some of the root modules (the others are None).
    root = {path: _style(s, loss_parallel) for path, s in plan.root.items() if _has(model, path)}
    for path in root:  # the fused loss's head: hidden states replicated, weight split
        if isinstance(model.get_submodule(path), DeferredHead):
            root[path] = deferred_head_style()
    parallelize_module(model, tp_mesh, root)
    block_plan = {path: _style(s, loss_parallel) for path, s in plan.block.items()}
    units = [(block, block_plan) for block in getattr(model, spec.blocks).values()]
    for container, styles in plan.extra.items():
        if _has(model, container):
            child_plan = {path: _style(s, loss_parallel) for path, s in styles.items()}
            units += [(child, child_plan) for child in model.get_submodule(container).values()]
    for unit, unit_plan in units:
        # A hybrid's blocks differ (attention or linear attention): each takes its paths.
        present = {path: style for path, style in unit_plan.items() if _has(unit, path)}
        parallelize_module(unit, tp_mesh, present)
    # Tied weights (embedding and output) are both split along the vocabulary, so the
    # owner's shards serve the alias too.
    retie(model, tied)
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    logger.info(
        "applied tensor parallelism (degree %d) with sequence parallelism%s",
        tp_mesh.size(),
        " and loss parallelism" if loss_parallel else "",
    )
    local = [m for m in model.modules() if getattr(m, "sequence_shards", None) is not None]
    return LocalTokenGrads(tuple(local), tp_mesh.get_group())
