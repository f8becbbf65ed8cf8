"""--job.dry_run: the layout, model size, per-rank memory and FLOPs of a run, without it.

Runs in one process over a fake process group of the full world size, with the model on
the meta device, so the 405B layout for thousands of GPUs is checked on a laptop: every
parallelism is applied exactly as in training, and the shapes of the local shards give the
memory each rank will hold.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from titanlite.config import (
    JobConfig,
    global_batch_size,
    gradient_accumulation_steps,
    resolve_degrees,
)
from titanlite.metrics import local_bytes
from titanlite.models.llama import Transformer, count_params, flops_per_token
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.parallelize import parallelize
from titanlite.preflight import build_model_args

# fp32 master weights, fp32 gradients, and AdamW's two fp32 moments.
BYTES_PER_PARAM = {"params": 4, "grads": 4, "optimizer": 8}


def dry_run(cfg: JobConfig, world_size: int, tokenizer_vocab: int) -> str:
    """The report (several lines) for this config at this world size."""
    degrees = resolve_degrees(cfg, world_size)
    args = build_model_args(cfg, tokenizer_vocab)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        dims = ParallelDims(degrees, "cpu")
        with torch.device("meta"):
            model = Transformer(args)
        total = count_params(model)
        parallelize(model, dims, cfg, materialize=None)
        # Shards are the same size on every rank up to rounding; rank 0 holds the largest.
        params = list({id(p): p for p in model.parameters()}.values())
        local_numel = local_bytes(params) // 4  # still float32 on meta
    finally:
        dist.destroy_process_group()
    gib = 2**30
    state = {k: local_numel * b / gib for k, b in BYTES_PER_PARAM.items()}
    accum = gradient_accumulation_steps(cfg, degrees)
    gbs = global_batch_size(cfg, degrees)
    lines = [
        f"dry run: {cfg.model.name}/{cfg.model.flavor} on {world_size} ranks",
        f"  mesh            dp_replicate={degrees.dp_replicate} x dp_shard={degrees.dp_shard}"
        f" x tp={degrees.tp}",
        f"  parameters      {total:,} ({total / 1e9:.2f} B); {local_numel:,} per rank",
        f"  model state     {sum(state.values()):.2f} GiB per rank (params {state['params']:.2f}"
        f" + grads {state['grads']:.2f} + AdamW {state['optimizer']:.2f}), before activations",
        f"  FLOPs per token {flops_per_token(args, cfg.training.seq_len):.4g} (seq_len "
        f"{cfg.training.seq_len})",
        f"  global batch    {gbs} sequences = {gbs * cfg.training.seq_len:,} tokens "
        f"({accum} micro-batch{'es' if accum > 1 else ''} per step)",
    ]
    return "\n".join(lines)
