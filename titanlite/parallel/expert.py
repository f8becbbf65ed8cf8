"""Expert parallelism: each mixture-of-experts layer's experts split over the ep ranks.

Runs before FSDP. Every expert weight ([experts, in, out]) becomes a DTensor sharded by expert
(Shard(0)) over the ``ep`` mesh dimension, and the layer dispatches its token rows to the
ranks holding their experts (``titanlite.models.moe.expert_parallel``). FSDP then shards the
experts further over the rest of dp_shard (``apply_fsdp``'s expert units), so checkpoints hold
expert weights at their global shape and resume under any expert-parallel degree.
"""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from titanlite.models.moe import GroupedExperts

logger = logging.getLogger(__name__)


def expert_modules(model: nn.Module) -> list[GroupedExperts]:
    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


def apply_ep(model: nn.Module, mesh: DeviceMesh) -> None:
    degree = mesh.size()
    layers = expert_modules(model)
    for experts in layers:
        if experts.w1.shape[0] % degree:
            raise ValueError(
                f"parallelism.expert_parallel_degree {degree} does not divide the "
                f"{experts.w1.shape[0]} experts"
            )
        for name, param in list(experts.named_parameters(recurse=False)):
            shard = distribute_tensor(param.data, mesh, [Shard(0)])
            experts.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))
        experts.ep = (mesh.get_group(), degree)
    logger.info(
        "expert parallelism: the experts of %d layers split over ep=%d ranks (all-to-all "
        "dispatch and combine)", len(layers), degree,
    )  # fmt: skip
