"""parallelize(): every parallelism applied to the model, in one fixed order.

The order matters and is the same for every layout:
  1. tensor parallelism (splits layers; must see the plain modules)
  2. activation checkpointing (wraps blocks, so it goes after TP changed their insides)
  3. torch.compile per block (compiles the TP + AC block as one unit)
  4. data parallelism: FSDP2 when dp_shard > 1 (HSDP when dp_replicate > 1 as well),
     otherwise titanlite's own bucketed DDP over dp_replicate.
Nothing else in titanlite changes the model's structure.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import nn
from torch.distributed.fsdp import fully_shard

from titanlite.config import JobConfig
from titanlite.parallel.dims import ParallelDims

logger = logging.getLogger(__name__)


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    cfg: JobConfig,
    materialize: Callable[[nn.Module], None],
) -> nn.Module:
    """Apply the configured parallelisms to a model built on the meta device.

    `materialize` allocates and initializes the (by then sharded) parameters. It runs after
    the sharding steps, so no rank ever holds the whole model, and before DDP, which needs
    real tensors to broadcast. Returns the module to call for training.
    """
    d = dims.degrees
    if d.dp_shard > 1:
        apply_fsdp(model, dims)
    materialize(model)
    if d.dp_shard == 1 and d.dp_replicate > 1:
        model = apply_ddp(model, dims, cfg.parallelism.ddp_bucket_cap_mb)
    return model


def apply_fsdp(model: nn.Module, dims: ParallelDims) -> None:
    """FSDP2 per transformer block, then at the root (embeddings, final norm, output)."""
    d = dims.degrees
    mesh = dims.mesh["dp_replicate", "dp_shard"] if d.dp_replicate > 1 else dims.mesh["dp_shard"]
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them.
        fully_shard(block, mesh=mesh, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=mesh)
    kind = "HSDP" if d.dp_replicate > 1 else "FSDP"
    logger.info("applied %s over %s (%d blocks + root)", kind, mesh.mesh_dim_names, len(blocks))


def apply_ddp(model: nn.Module, dims: ParallelDims, bucket_cap_mb: float) -> nn.Module:
    """titanlite's bucketed, overlapped DDP over the dp_replicate group."""
    from torch.nn.parallel import DistributedDataParallel

    wrapped = DistributedDataParallel(
        model, process_group=dims.group("dp_replicate"), bucket_cap_mb=bucket_cap_mb
    )
    logger.info("applied data parallelism over dp_replicate (bucket cap %.1f MB)", bucket_cap_mb)
    return wrapped
