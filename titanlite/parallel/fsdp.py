"""FSDP2 (fully_shard) per block, then at the root; HSDP over a 2-D mesh."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from titanlite.dtypes import DTYPES
from titanlite.models.spec import ModelSpec
from titanlite.parallel.ddp.collectives import local_tensor

logger = logging.getLogger(__name__)


def apply_fsdp(
    model: nn.Module,
    spec: ModelSpec,
    mesh: DeviceMesh,
    *,
    param_dtype: str,
    reduce_dtype: str,
    reshard_after_forward: str,
    expert_units: Sequence[nn.Module] = (),
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """Each block is one FSDP unit (gathered just before it runs), and so is each child of
    the plan's other containers (``TensorParallelPlan.extra``: multi-token prediction
    depths); the root unit holds what is left (embeddings, final norm, output).

    ``expert_units`` over ``expert_mesh``, under expert parallelism: each block's expert
    weights are a unit of their own over that mesh (the dp_shard ranks outside the ep
    group). Their gradients come out ep times too large (they already sum the ep group's
    tokens, and FSDP divides by its own mesh's size): ``apply_ep``'s ``ExpertGrads`` scales
    them after backward."""
    policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype]
    )
    blocks = list(getattr(model, spec.blocks).values())
    for container in spec.tp_plan.extra:  # units beside the blocks (multi-token prediction)
        if getattr(model, container, None) is not None:
            blocks += list(getattr(model, container).values())
    for i, block in enumerate(blocks):
        # By default the last block stays gathered: backward needs it again at once.
        keep = reshard_after_forward == "never" or (
            reshard_after_forward == "default" and i == len(blocks) - 1
        )
        for module in block.modules():
            if expert_mesh is not None and any(module is unit for unit in expert_units):
                fully_shard(
                    module,
                    mesh=expert_mesh,
                    mp_policy=policy,
                    reshard_after_forward=not keep,
                    shard_placement_fn=_expert_placement(expert_mesh.size(expert_mesh.ndim - 1)),
                )
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=not keep)
    fully_shard(
        model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward == "always"
    )
    kind = "HSDP" if mesh.ndim > 1 else "FSDP"
    logger.info(
        "applied %s over %s (%d blocks + root), params in %s, reduce in %s",
        kind,
        mesh.mesh_dim_names,
        len(blocks),
        param_dtype,
        reduce_dtype,
    )


def _expert_placement(shards: int) -> Callable[[nn.Parameter], Shard]:
    """How FSDP splits a rank's experts ([experts, in, out]) over ``shards`` ranks: by whole
    experts when they divide evenly, else each expert along its next dimension, so that no
    rank holds more than its share (16 experts over 32 ranks would leave half of the ranks
    one whole expert each and the other half none)."""

    def placement(param: nn.Parameter) -> Shard:
        return Shard(0) if local_tensor(param).shape[0] % shards == 0 else Shard(1)

    return placement
