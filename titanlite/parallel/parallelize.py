"""parallelize(): every parallelism applied to the model, in one fixed order.

The order matters and is the same for every layout:
  0. model converters (``model.converters``, e.g. float8 linears): they replace modules of
     the whole meta-device model, so every later step sees the converted modules; with
     training.fused_loss the output projection deferred to the loss (``head.py``); then,
     under pipeline parallelism, the model is cut into this rank's stages, and steps 1-6
     apply to each stage as they would to a whole model
  1. tensor parallelism (splits layers; must see the plain modules), then context
     parallelism (points the attention cores at the cp group; linear-attention cores at
     its state-passing form; layers with per-sequence statistics, mixtures of experts, at
     the cp x tp ranks), then expert parallelism (splits the experts of MoE layers over ep)
  2. activation checkpointing (wraps blocks, so it goes after TP changed their insides)
  3. torch.compile per block (compiles the TP + AC block as one unit)
  4. FSDP2 when dp_shard > 1 (HSDP when dp_replicate > 1 as well)
  5. materialize: allocate this rank's shards and initialize only their elements
  6. titanlite's own bucketed DDP over dp_replicate (x cp) when nothing is sharded (it needs
     real tensors to broadcast)
  7. the pipeline schedule over this rank's stages, when pp > 1
Each step returns what it leaves for later (expert parallelism the experts' gradient scale,
tensor parallelism the TP sum of the layers that run on each rank's own tokens, materialize
its costs, DDP the modules to call, the pipeline its schedule), and the ``ParallelModel`` is
built from those once, at the end, and never changed. Nothing else in titanlite changes the
model's structure. The model is addressed only through its spec (block container, TP plan)
and the interfaces of ``titanlite.models.interfaces``, never through its classes or module
names.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from titanlite.config.job_config import ActivationCheckpoint, Compile, Parallelism, Training
from titanlite.config.layout import PipelinePlan, pipeline_plan
from titanlite.models.spec import ModelSpec
from titanlite.parallel.blocks import apply_ac, apply_compile
from titanlite.parallel.context.attention import ContextParallel, apply_cp
from titanlite.parallel.context.recurrent import apply_linear_cp
from titanlite.parallel.ddp import BucketedDDP
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.expert import ExpertGrads, apply_ep
from titanlite.parallel.fsdp import apply_fsdp
from titanlite.parallel.head import defer_head
from titanlite.parallel.materialize import materialize
from titanlite.parallel.parallel_model import DocumentStructure, LossSum, ParallelModel
from titanlite.parallel.pipeline import Pipeline, split_stage, tied_copy, tied_stage_group
from titanlite.parallel.sequence_shards import apply_sequence_shards
from titanlite.parallel.tensor import LocalTokenGrads, apply_tp

logger = logging.getLogger(__name__)

Converter = Any
"""A model converter's torch side (``titanlite.converters``): ``convert(model, spec)``."""


def uses_loss_parallel(dims: ParallelDims, parallelism: Parallelism) -> bool:
    return dims.degrees.tp > 1 and not parallelism.disable_loss_parallel


def parallelize(
    model: nn.Module,
    spec: ModelSpec,
    args: Any,
    dims: ParallelDims,
    *,
    parallelism: Parallelism,
    training: Training,
    activation_checkpoint: ActivationCheckpoint,
    compile: Compile,
    device: torch.device | None,
    loss_sum: LossSum,
    converters: Sequence[Converter] = (),
    init_weights: bool = True,
    documents: DocumentStructure | None = None,
) -> ParallelModel:
    """Apply the configured parallelisms to a model built on the meta device.

    With ``device`` None (a dry run) the model stays on the meta device and DDP, which
    shards nothing, is left out. ``init_weights`` False skips initialization when a
    checkpoint will overwrite every weight. ``loss_sum(logits, labels)`` is the summed
    objective and its reported terms (a pipeline's last stage computes them). ``documents``
    makes attention block-causal within the documents of each window (training.document_mask).
    """
    d, t, p = dims.degrees, training, parallelism
    lp = uses_loss_parallel(dims, p)
    # 0. converters, then pipeline stages: this rank's share of the blocks, each a model.
    for converter in converters:
        converter.convert(model, spec)
    head = spec.head if t.fused_loss else None
    if head is not None:  # the loss projects the hidden states itself (titanlite.parallel.head)
        defer_head(model, spec)
    plan = pipeline_plan(p, d, len(getattr(model, spec.blocks)), t.local_batch_size)
    stage_ids = plan.rank_stages(dims.local_rank("pp")) if plan else []
    parts = [split_stage(model, spec, plan, s) for s in stage_ids] if plan else [model]
    context = ContextParallel(dims.group("cp"), d.cp, dims.local_rank("cp")) if d.cp > 1 else None
    experts: list[ExpertGrads] = []
    local_tokens: list[LocalTokenGrads] = []
    recurrent_cp = False
    for part in parts:
        if d.tp > 1:
            local_tokens.append(apply_tp(part, spec, dims["tp"], loss_parallel=lp))
        if context is not None:
            apply_cp(part, context, seq_len=t.seq_len)
            if apply_linear_cp(part, context) is not None:
                recurrent_cp = True
            apply_sequence_shards(part, *dims.sequence_group())
        if d.ep > 1:
            experts.append(apply_ep(part, dims["ep"]))
        ac = activation_checkpoint
        if ac.mode != "none":
            apply_ac(part, spec, ac.mode, ac.selective_ac_option)
        if compile.enable:
            apply_compile(part, spec)
        if d.dp_shard > 1:
            # Under PP a stage's blocks run again for every micro-batch's backward, and the
            # zero-bubble schedules give wrong gradients when blocks reshard after forward
            # (measured on torch 2.13): "default" keeps them gathered there.
            reshard = p.fsdp_reshard_after_forward
            if plan is not None and reshard == "default":
                reshard = "never"
            apply_fsdp(
                part,
                spec,
                dims.hsdp_or_fsdp_mesh(),
                param_dtype=t.mixed_precision_param,
                reduce_dtype=t.mixed_precision_reduce,
                reshard_after_forward=reshard,
                expert_units=experts[-1].units if experts else (),
                expert_mesh=dims.expert_fsdp_mesh() if d.ep > 1 else None,
            )
    # The experts' scale before the TP sum: an MoE layer's experts are in both under TP x EP.
    fixes = (ExpertGrads.join(experts), LocalTokenGrads.join(local_tokens))
    stats: dict[str, float] = {}
    modules: list[nn.Module] = list(parts)
    pipeline = None
    replicas = d.dp_shard == 1 and d.dp_replicate * d.cp > 1
    if device is not None:
        stats = _materialize(parts, spec, args, device, seed=t.seed, init_weights=init_weights)
        if replicas and plan is None:
            modules = _replicate(parts, dims, p.ddp_bucket_cap_mb)
        if context is not None:
            logger.info(
                "context parallelism: each sequence in %d chunks, 2 per rank; keys and values "
                "all-gathered over cp=%d%s",
                2 * d.cp,
                d.cp,
                "; linear-attention layers gather each chunk's state transition instead"
                if recurrent_cp
                else "",
            )
        if plan is not None:
            pipeline = _pipeline(
                plan,
                stage_ids,
                modules,
                dims,
                spec=spec,
                args=args,
                device=device,
                loss_sum=loss_sum,
                replicas=replicas,
                head=head,
            )
    autocast = None if d.dp_shard > 1 or t.mixed_precision_param == "float32" else torch.bfloat16
    result = ParallelModel(
        parts,
        modules,
        loss_sum,
        loss_parallel=lp,
        autocast_dtype=autocast,
        materialize_stats=stats,
        pipeline=pipeline,
        context=context,
        documents=documents,
        gradient_fixes=tuple(fix for fix in fixes if fix is not None),
        mtp_depths=getattr(args, "mtp_layers", 0),
        head=head,
    )
    if pipeline is not None and spec.experts:
        # The schedule's first step also runs the stages on placeholder tensors to infer
        # shapes; layers that count what their forwards see (routing) must not count those
        # in a real step: one step of zeros now, its gradients dropped.
        pipeline.warm_up(
            t.local_batch_size, t.seq_len, device, forward_backward=result.forward_backward
        )
    return result


def _materialize(
    parts: list[nn.Module],
    spec: ModelSpec,
    args: Any,
    device: torch.device,
    *,
    seed: int,
    init_weights: bool,
) -> dict[str, float]:
    """5. Every part allocated on ``device`` and (unless a checkpoint will overwrite them)
    initialized; returns what it cost, summed over the parts."""
    stats: dict[str, float] = {}
    for part in parts:
        aliases = tied_copy(part, spec, args)
        cost = materialize(
            part, spec, args, device, seed=seed, init_weights=init_weights, aliases=aliases
        )
        for key, value in cost.items():
            stats[key] = stats.get(key, 0) + value
    return stats


def _replicate(parts: list[nn.Module], dims: ParallelDims, bucket_cap_mb: float) -> list[nn.Module]:
    """6. titanlite's bucketed DDP around each part, over the replicas (x cp): what to call."""
    modules: list[nn.Module] = [
        BucketedDDP(part, process_group=dims.replica_group(), bucket_cap_mb=bucket_cap_mb)
        for part in parts
    ]
    logger.info(
        "applied data parallelism over dp_replicate%s (bucket cap %.1f MB)",
        " x cp" if dims.degrees.cp > 1 else "",
        bucket_cap_mb,
    )
    return modules


def _pipeline(
    plan: PipelinePlan,
    stage_ids: list[int],
    modules: list[nn.Module],
    dims: ParallelDims,
    *,
    spec: ModelSpec,
    args: Any,
    device: torch.device,
    loss_sum: LossSum,
    replicas: bool,
    head: str | None,
) -> Pipeline:
    """7. The schedule over this rank's stages (``modules``), with the tied embeddings'
    and the replicas' gradient exchanges it runs after each step."""
    tie = getattr(args, "tie_embeddings", False)
    pipeline = Pipeline(
        plan,
        stage_ids,
        modules,
        dims.group("pp"),
        device=device,
        loss_sum=loss_sum,
        n_terms=len(loss_sum.names),
        head=head,
        tied=spec.tied_weights if tie else None,
        tie_group=tied_stage_group(plan, dims) if tie else None,
        # titanlite's DDP engine reduces in backward hooks, one backward per forward: the
        # schedules run many, so replicas average once after the step instead.
        replica_group=dims.group("dp_replicate") if replicas else None,
    )
    logger.info(
        "pipeline: %s%s",
        "tied embeddings synchronized; " if tie else "",
        "gradients averaged over dp_replicate after each step" if replicas else "",
    )
    return pipeline
