"""FSDP2 (fully_shard) per block, then at the root; HSDP over a 2-D mesh."""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from titanlite.dtypes import DTYPES
from titanlite.models.spec import ModelSpec

logger = logging.getLogger(__name__)


def apply_fsdp(
    model: nn.Module,
    spec: ModelSpec,
    mesh: DeviceMesh,
    param_dtype: str,
    reduce_dtype: str,
    reshard_after_forward: str,
) -> None:
    """Each block is one FSDP unit (gathered just before it runs); the root unit holds what
    is left (embeddings, final norm, output)."""
    policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype]
    )
    blocks = list(getattr(model, spec.blocks).values())
    for i, block in enumerate(blocks):
        # By default the last block stays gathered: backward needs it again at once.
        keep = reshard_after_forward == "never" or (
            reshard_after_forward == "default" and i == len(blocks) - 1
        )
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=not keep)
    fully_shard(
        model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward == "always"
    )
    kind = "HSDP" if mesh.ndim > 1 else "FSDP"
    logger.info(
        "applied %s over %s (%d blocks + root), params in %s, reduce in %s",
        kind, mesh.mesh_dim_names, len(blocks), param_dtype, reduce_dtype,
    )  # fmt: skip
