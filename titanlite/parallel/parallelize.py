"""parallelize(): every parallelism applied to the model, in one fixed order.

The order matters and is the same for every layout:
  1. tensor parallelism (splits layers; must see the plain modules)
  2. activation checkpointing (wraps blocks, so it goes after TP changed their insides)
  3. torch.compile per block (compiles the TP + AC block as one unit)
  4. data parallelism: FSDP2 when dp_shard > 1 (HSDP when dp_replicate > 1 as well),
     otherwise titanlite's own bucketed DDP over dp_replicate.
Nothing else in titanlite changes the model's structure. The model is addressed only
through module names (layers.N.attention.wq, ...), never through its classes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titanlite.config import JobConfig
from titanlite.parallel.ddp import BucketedDDP
from titanlite.parallel.dims import ParallelDims

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    cfg: JobConfig,
    materialize: Callable[[nn.Module], None] | None,
) -> nn.Module:
    """Apply the configured parallelisms to a model built on the meta device.

    `materialize` allocates and initializes the (by then sharded) parameters. It runs after
    the sharding steps, so no rank ever holds the whole model, and before DDP, which needs
    real tensors to broadcast. With None (a dry run) the model stays on the meta device and
    DDP, which shards nothing, is left out. Returns the module to call for training.
    """
    d = dims.degrees
    if d.tp > 1:
        apply_tp(model, dims, loss_parallel=uses_loss_parallel(dims, cfg))
    if cfg.activation_checkpoint.mode != "none":
        apply_ac(
            model, cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_ac_option
        )
    if cfg.compile.enable:
        apply_compile(model)
    if d.dp_shard > 1:
        apply_fsdp(model, dims, cfg)
    if materialize is None:
        return model
    materialize(model)
    if d.dp_shard == 1 and d.dp_replicate > 1:
        model = apply_ddp(model, dims, cfg.parallelism.ddp_bucket_cap_mb)
    return model


def uses_loss_parallel(dims: ParallelDims, cfg: JobConfig) -> bool:
    return dims.degrees.tp > 1 and not cfg.parallelism.disable_loss_parallel


def apply_tp(model: nn.Module, dims: ParallelDims, loss_parallel: bool) -> None:
    """Megatron-style tensor parallelism with sequence parallelism.

    Column-wise q/k/v and w1/w3, row-wise wo and w2, so each block needs one all-gather in and
    one reduce-scatter out per sub-layer. Between sub-layers activations stay sharded along the
    sequence (norms run on their shard). The output projection is vocab-parallel; with loss
    parallel the logits stay sharded and the cross-entropy is computed on the shards.
    """
    tp_mesh = dims.mesh["tp"]
    tied = model.output.weight is model.tok_embeddings.weight
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(
                input_layouts=Shard(1),
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            ),
        },
    )
    block_plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan)
    if tied:
        # Sharding replaced both weights; both are split along the vocabulary, so the
        # embedding's shards serve the output projection too.
        model.output.weight = model.tok_embeddings.weight
    logger.info(
        "applied tensor parallelism (degree %d) with sequence parallelism%s",
        dims.degrees.tp, " and loss parallelism" if loss_parallel else "",
    )  # fmt: skip


# Ops whose outputs selective activation checkpointing keeps (the expensive ones).
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _save_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:  # noqa: ANN001
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: nn.Module, mode: str, selective_option: str) -> None:
    """Non-reentrant activation checkpointing of transformer blocks."""
    every = int(selective_option) if mode == "selective" and selective_option != "op" else 1
    kwargs = {}
    if mode == "selective" and selective_option == "op":
        kwargs["context_fn"] = lambda: create_selective_checkpoint_contexts(_save_matmuls_policy)
    wrapped = 0
    for name, block in list(model.layers.named_children()):
        if int(name) % every == 0:
            model.layers.register_module(
                name, checkpoint_wrapper(block, preserve_rng_state=False, **kwargs)
            )
            wrapped += 1
    logger.info(
        "applied %s activation checkpointing to %d of %d blocks",
        mode if selective_option != "op" or mode == "full" else "selective (op)",
        wrapped, len(model.layers),
    )  # fmt: skip


def apply_compile(model: nn.Module) -> None:
    """torch.compile each block on its own: small graphs compile fast, and the data-parallel
    hooks stay outside compiled code."""
    for block in model.layers.values():
        block.compile(fullgraph=True)
    logger.info("compiled %d transformer blocks with torch.compile", len(model.layers))


def apply_fsdp(model: nn.Module, dims: ParallelDims, cfg: JobConfig) -> None:
    """FSDP2 per transformer block, then at the root (embeddings, final norm, output)."""
    d = dims.degrees
    mesh = dims.mesh["dp_replicate", "dp_shard"] if d.dp_replicate > 1 else dims.mesh["dp_shard"]
    t = cfg.training
    policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[t.mixed_precision_param], reduce_dtype=DTYPES[t.mixed_precision_reduce]
    )
    reshard = cfg.parallelism.fsdp_reshard_after_forward
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # By default the last block stays gathered: backward needs it again at once.
        keep = reshard == "never" or (reshard == "default" and i == len(blocks) - 1)
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=not keep)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard == "always")
    kind = "HSDP" if d.dp_replicate > 1 else "FSDP"
    logger.info(
        "applied %s over %s (%d blocks + root), params in %s, reduce in %s",
        kind, mesh.mesh_dim_names, len(blocks), t.mixed_precision_param, t.mixed_precision_reduce,
    )  # fmt: skip


def apply_ddp(model: nn.Module, dims: ParallelDims, bucket_cap_mb: float) -> nn.Module:
    """titanlite's bucketed, overlapped DDP over the dp_replicate group."""
    wrapped = BucketedDDP(
        model, process_group=dims.group("dp_replicate"), bucket_cap_mb=bucket_cap_mb
    )
    logger.info("applied data parallelism over dp_replicate (bucket cap %.1f MB)", bucket_cap_mb)
    return wrapped
