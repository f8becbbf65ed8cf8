"""parallelize(): every parallelism applied to the model, in one fixed order.

The order matters and is the same for every layout:
  1. tensor parallelism (splits layers; must see the plain modules), then context
     parallelism (points the attention kernels at the cp group)
  2. activation checkpointing (wraps blocks, so it goes after TP changed their insides)
  3. torch.compile per block (compiles the TP + AC block as one unit)
  4. FSDP2 when dp_shard > 1 (HSDP when dp_replicate > 1 as well)
  5. materialize: allocate this rank's shards and initialize only their elements
  6. titanlite's own bucketed DDP over dp_replicate (x cp) when nothing is sharded (it needs
     real tensors to broadcast)
  7. the pipeline schedule over this rank's stages, when pp > 1
Under pipeline parallelism the model is first cut into this rank's stages (0. below), and
steps 1-6 apply to each stage as they would to a whole model.
Nothing else in titanlite changes the model's structure. The model is addressed only through
its spec (block container, TP plan), never through its classes or module names.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from titanlite.config import JobConfig
from titanlite.config.layout import pipeline_plan
from titanlite.models.attention import document_ids, document_positions
from titanlite.models.spec import ModelSpec
from titanlite.parallel.blocks import apply_ac, apply_compile
from titanlite.parallel.context import ContextParallel, apply_cp
from titanlite.parallel.ddp import BucketedDDP
from titanlite.parallel.ddp_support import all_reduce_after_backward, local_tensor
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.expert import apply_ep, expert_modules
from titanlite.parallel.fsdp import apply_fsdp
from titanlite.parallel.materialize import materialize
from titanlite.parallel.pipeline import Pipeline, split_stage, tied_copy, tied_stage_group
from titanlite.parallel.tensor import apply_tp, local_token_params

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DocumentMask:
    """training.document_mask: attention stays within the documents of a packed window, found
    by the tokenizer's BOS (or, without one, after its EOS); ``reset_positions`` restarts RoPE
    positions at each document."""

    bos_id: int
    eos_id: int
    reset_positions: bool = False

    def ids(self, tokens: torch.Tensor) -> torch.Tensor:
        return document_ids(tokens, self.bos_id, self.eos_id)


@dataclass
class ParallelModel:
    """What the trainer needs of a parallelized model.

    ``parts`` are the model's modules as built (checkpoints, optimizers and initialization
    use them; the whole model, or this rank's pipeline stages); ``modules`` are what to call
    for a forward pass (the parts, wrapped by the data-parallel engine where it applies).
    With pipeline parallelism, ``pipeline`` runs them (forward and backward of a whole local
    batch in one call) instead of calling the model. With context parallelism, ``context``
    splits each sequence: ``local_batch`` gives this rank's share, which the call expects.
    """

    parts: list[nn.Module]
    modules: list[nn.Module]
    loss_parallel: bool = False
    autocast_dtype: torch.dtype | None = None
    materialize_stats: dict[str, float] = field(default_factory=dict)
    pipeline: Pipeline | None = None
    context: ContextParallel | None = None
    documents: DocumentMask | None = None
    expert_params: list[nn.Parameter] = field(default_factory=list)
    """Under expert parallelism: the expert weights, whose gradients come out ep times too
    large from the data-parallel engine (``expert_scale`` undoes it)."""
    expert_scale: float = 1.0
    local_token_params: list[nn.Parameter] = field(default_factory=list)
    """Under tensor parallelism: weights of layers that run on each rank's sequence shard
    (a mixture of experts), whose gradients are partial sums over ``tp_group``."""
    tp_group: dist.ProcessGroup | None = None

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of this rank's tokens from whole sequences [batch, seq] of ids: under
        context parallelism the call keeps this rank's chunks itself (document boundaries and
        positions come from the whole sequence), so its logits pair with ``local_batch``'s
        labels."""
        if self.pipeline is not None:
            raise RuntimeError("a pipelined model runs through its pipeline, not a call")
        positions = documents = None
        if self.documents is not None:
            documents = self.documents.ids(tokens)
            if self.documents.reset_positions:
                positions = document_positions(documents)
        if self.context is not None:
            mine = self.context.positions(tokens.shape[1] // self.context.degree, tokens.device)
            tokens = tokens[:, mine]
            positions = mine if positions is None else positions[:, mine]
        if positions is None and documents is None:
            return self.modules[0](tokens)
        return self.modules[0](tokens, positions=positions, documents=documents)

    def local_batch(
        self, inputs: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A [batch, seq] batch as this rank uses it: the whole input sequences (the call
        splits them) and this rank's share of the labels (its context chunks under CP)."""
        if self.context is None:
            return inputs, labels
        return inputs, self.context.shard(labels)

    @contextlib.contextmanager
    def train_context(self) -> Iterator[None]:
        """Around forward and loss: loss parallel (TP) and bf16 autocast where they apply."""
        with contextlib.ExitStack() as stack:
            if self.loss_parallel:
                stack.enter_context(loss_parallel())
            if self.autocast_dtype is not None:
                device_type = next(self.parts[0].parameters()).device.type
                stack.enter_context(torch.autocast(device_type, dtype=self.autocast_dtype))
            yield

    def grad_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Whether the backward inside this context (and, for DDP, the forward) reduces
        gradients: off for all but the last micro-batch of an accumulated step."""
        stack = contextlib.ExitStack()
        for module in self.modules:
            if isinstance(module, BucketedDDP):
                if not enabled:
                    stack.enter_context(module.no_sync())
            elif hasattr(module, "set_requires_gradient_sync"):  # fully_shard's own switch
                module.set_requires_gradient_sync(enabled)
        return stack

    @property
    def norm_skip(self) -> set[int]:
        """Parameters (by id) the gradient norm must not count again (tied copies)."""
        return self.pipeline.norm_skip if self.pipeline is not None else set()

    def finish_gradients(self) -> None:
        """After a step's last backward: what the data-parallel engines do not (pipeline
        replicas and tied copies)."""
        if self.pipeline is not None:
            self.pipeline.finish_gradients()
        grads = [p.grad for p in self.expert_params if p.grad is not None]
        if grads and self.expert_scale != 1.0:
            torch._foreach_mul_([local_tensor(g) for g in grads], self.expert_scale)
        partial = [p.grad for p in self.local_token_params if p.grad is not None]
        if partial:
            all_reduce_after_backward(partial, self.tp_group)

    def train(self, mode: bool = True) -> None:
        for module in self.modules:
            module.train(mode)


def uses_loss_parallel(dims: ParallelDims, cfg: JobConfig) -> bool:
    return dims.degrees.tp > 1 and not cfg.parallelism.disable_loss_parallel


def parallelize(
    model: nn.Module,
    spec: ModelSpec,
    args: Any,
    dims: ParallelDims,
    cfg: JobConfig,
    device: torch.device | None,
    init_weights: bool = True,
    loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> ParallelModel:
    """Apply the configured parallelisms to a model built on the meta device.

    With ``device`` None (a dry run) the model stays on the meta device and DDP, which
    shards nothing, is left out. ``init_weights`` False skips initialization when a
    checkpoint will overwrite every weight. ``loss_sum(logits, labels)`` is the summed loss a
    pipeline's last stage computes (needed when pp > 1).
    """
    d, t, p = dims.degrees, cfg.training, cfg.parallelism
    lp = uses_loss_parallel(dims, cfg)
    # 0. pipeline stages: this rank's share of the blocks, each a model of its own.
    plan = pipeline_plan(cfg, d, len(getattr(model, spec.blocks)))
    stage_ids = plan.rank_stages(dims.local_rank("pp")) if plan else []
    parts = [split_stage(model, spec, plan, s) for s in stage_ids] if plan else [model]
    context = ContextParallel(dims.group("cp"), d.cp, dims.local_rank("cp")) if d.cp > 1 else None
    for part in parts:
        if d.tp > 1:
            apply_tp(part, spec, dims["tp"], loss_parallel=lp)
        if context is not None:
            apply_cp(part, context)
        if d.ep > 1:
            apply_ep(part, dims["ep"])
        ac = cfg.activation_checkpoint
        if ac.mode != "none":
            apply_ac(part, spec, ac.mode, ac.selective_ac_option)
        if cfg.compile.enable:
            apply_compile(part, spec)
        if d.dp_shard > 1:
            # Under PP a stage's blocks run again for every micro-batch's backward, and the
            # zero-bubble schedules give wrong gradients when blocks reshard after forward
            # (measured on torch 2.13): "default" keeps them gathered there.
            reshard = p.fsdp_reshard_after_forward
            if plan is not None and reshard == "default":
                reshard = "never"
            apply_fsdp(
                part, spec, dims.hsdp_or_fsdp_mesh(), t.mixed_precision_param,
                t.mixed_precision_reduce, reshard,
                experts=dims.expert_fsdp_mesh() if d.ep > 1 else None,
            )  # fmt: skip
    autocast = None if d.dp_shard > 1 or t.mixed_precision_param == "float32" else torch.bfloat16
    result = ParallelModel(
        parts, list(parts), loss_parallel=lp, autocast_dtype=autocast, context=context
    )
    if d.ep > 1:
        result.expert_params = [
            p for part in parts for m in expert_modules(part) for p in m.parameters()
        ]
        result.expert_scale = 1.0 / d.ep
    if d.tp > 1:
        result.local_token_params = [p for part in parts for p in local_token_params(part)]
        result.tp_group = dims.group("tp")
    if device is None:
        return result
    for part in parts:
        aliases = tied_copy(part, spec, args)
        stats = materialize(part, spec, args, device, t.seed, init_weights, aliases)
        for key, value in stats.items():
            result.materialize_stats[key] = result.materialize_stats.get(key, 0) + value
    replicas = d.dp_shard == 1 and d.dp_replicate * d.cp > 1
    if replicas and plan is None:
        result.modules = [
            BucketedDDP(part, process_group=dims.replica_group(), bucket_cap_mb=p.ddp_bucket_cap_mb)
            for part in parts
        ]
        logger.info(
            "applied data parallelism over dp_replicate%s (bucket cap %.1f MB)",
            " x cp" if d.cp > 1 else "", p.ddp_bucket_cap_mb,
        )  # fmt: skip
    if context is not None:
        logger.info(
            "context parallelism: each sequence in %d chunks, 2 per rank; keys and values "
            "all-gathered over cp=%d", 2 * d.cp, d.cp,
        )  # fmt: skip
    if plan is not None:
        if loss_sum is None:
            raise ValueError("pipeline parallelism needs the loss_sum function")
        tie = getattr(args, "tie_embeddings", False)
        result.pipeline = Pipeline(
            plan, stage_ids, result.modules, dims.group("pp"), device, loss_sum,
            tied=spec.tied_weights if tie else None,
            tie_group=tied_stage_group(plan, dims) if tie else None,
            # titanlite's DDP engine reduces in backward hooks, one backward per forward: the
            # schedules run many, so replicas average once after the step instead.
            replica_group=dims.group("dp_replicate") if replicas else None,
        )  # fmt: skip
        logger.info(
            "pipeline: %s%s", "tied embeddings synchronized; " if tie else "",
            "gradients averaged over dp_replicate after each step" if replicas else "",
        )  # fmt: skip
    return result
