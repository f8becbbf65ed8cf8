"""Pipeline parallelism: the model's blocks cut into stages over the mesh's pp dimension and
run by a ``torch.distributed.pipelining`` schedule.

Each stage is a copy of the meta-device model that keeps only its blocks (the first stage
also the input modules, the last the output modules): parameter names are the model's own
(``layers.7.attention.wq.weight`` on whichever stage holds block 7), so checkpoints,
initialization and the Hugging Face export see the same names under any pipeline layout.
The split itself (``titanlite.config.layout.pipeline_plan``) is torch-free and checked before
any process starts.

The loss follows titanlite's rule: each micro-batch's loss is its sum over target tokens times
``batch ranks / global target count``, so the gradients are those of one process on the same
global batch, whatever the micro-batching (the schedule's own 1/n scaling is off).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titanlite.config.layout import PipelinePlan
from titanlite.models.spec import ModelSpec
from titanlite.parallel.ddp.collectives import all_reduce_after_backward, local_tensor
from titanlite.parallel.head import head_weight

logger = logging.getLogger(__name__)

# The schedule classes of torch.distributed.pipelining by their config names. That package
# (it imports torch._dynamo, ~0.5 s) is imported only when a pipeline is built. A training
# process imports torch._dynamo anyway with its optimizer (torch.optim does); processes that
# build no optimizer (dry runs, scripts) are spared it.
SCHEDULES = {
    "GPipe": "ScheduleGPipe",
    "1F1B": "Schedule1F1B",
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "LoopedBFS": "ScheduleLoopedBFS",
    "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
    "ZBVZeroBubble": "ScheduleZBVZeroBubble",
}


def tied_copy(part: nn.Module, spec: ModelSpec, args: Any) -> dict[str, str]:
    """{alias: owner} when ``part`` holds a tied weight's alias without its owner (the last
    stage's output projection, the embedding being on the first): the names whose values,
    optimizer state and gradients it shares."""
    alias, owner = spec.tied_weights
    names = {name for name, _ in part.named_parameters()}
    if getattr(args, "tie_embeddings", False) and alias in names and owner not in names:
        return {alias: owner}
    return {}


def tied_stage_group(plan: PipelinePlan, dims: Any) -> dist.ProcessGroup | None:
    """The group of this rank and its counterpart holding the other copy of the tied weight
    (the first and the last stage's ranks, at the same coordinate of every other dimension);
    None when both copies are on this rank's pp rank or this rank holds neither."""
    first, last = plan.stage_rank(0), plan.stage_rank(plan.n_stages - 1)
    if first == last:
        return None
    columns = dims.mesh.mesh.reshape(plan.pp, -1).t().tolist()  # one pp group per column
    group, _ = dist.new_subgroups_by_enumeration([[c[first], c[last]] for c in columns])
    return group


def split_stage(model: nn.Module, spec: ModelSpec, plan: PipelinePlan, stage: int) -> nn.Module:
    """A copy of the (meta-device) model holding only ``stage``'s modules, names unchanged."""
    part = copy.deepcopy(model)
    keep = {str(i) for i in plan.stage_blocks[stage]}
    blocks = getattr(part, spec.blocks)
    for name in list(blocks.keys()):
        if name not in keep:
            del blocks[name]
    if stage != 0:
        for name in spec.input_modules:
            setattr(part, name, None)
    if stage != plan.n_stages - 1:
        for name in spec.output_modules:
            setattr(part, name, None)
    return part


class Pipeline:
    """This rank's stages and the schedule that runs them; one call per local batch."""

    def __init__(
        self,
        plan: PipelinePlan,
        stage_ids: list[int],
        modules: list[nn.Module],
        group: dist.ProcessGroup,
        *,
        device: torch.device,
        loss_sum: Callable[..., tuple[torch.Tensor, torch.Tensor]],
        n_terms: int = 1,
        head: str | None = None,
        tied: tuple[str, str] | None = None,
        tie_group: dist.ProcessGroup | None = None,
        replica_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.plan = plan
        self.group = group
        # Tied weights (``tied`` = (alias, owner) names): the embedding on the first stage and
        # its copy as the output projection on the last get the sum of both gradients, so the
        # two copies stay equal; the gradient norm counts the weight once.
        self.tie_group = tie_group
        self.replica_group = replica_group
        self.tied_params: list[nn.Parameter] = []
        self.norm_skip: set[int] = set()
        if tied is not None:
            alias, owner = tied
            for module in modules:
                params = dict(module.named_parameters())
                if alias in params and owner not in params:
                    self.tied_params.append(params[alias])
                    self.norm_skip.add(id(params[alias]))
                elif owner in params and alias not in params:
                    self.tied_params.append(params[owner])
        self.pp_rank = dist.get_rank(group)
        self.local = dict(zip(stage_ids, modules, strict=True))
        self.has_first = 0 in stage_ids
        self.has_last = plan.n_stages - 1 in stage_ids
        # loss_sum(logits, labels, head=) -> (objective, its n_terms reported terms): the last
        # stage's loss, see titanlite.parallel.parallel_model.LossSum. With the fused loss
        # the last stage outputs hidden states and ``head`` names the projection's module.
        self._loss_sum = loss_sum
        self._head = head
        self._n_terms = n_terms
        self._scale = 1.0
        self._terms_of: dict[int, torch.Tensor] = {}
        from torch.distributed.pipelining import PipelineStage, schedules

        stages = [
            PipelineStage(module, stage, plan.n_stages, device, group=group)
            for stage, module in zip(stage_ids, modules, strict=True)
        ]
        schedule_cls = getattr(schedules, SCHEDULES[plan.schedule])
        stage_arg = stages if plan.style != "single" else stages[0]
        self.schedule = schedule_cls(
            stage_arg, n_microbatches=plan.microbatches, loss_fn=self._loss, scale_grads=False
        )
        logger.info(
            "applied pipeline parallelism: %s; this rank runs stage(s) %s",
            plan.describe(),
            ", ".join(map(str, stage_ids)),
        )

    def head_weight(self) -> torch.Tensor | None:
        """The last stage's output projection weight under the fused loss (else None): only
        on the rank that holds the last stage, after its forward."""
        if self._head is None:
            return None
        return head_weight(self.local[self.plan.n_stages - 1], self._head)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        objective, terms = self._loss_sum(logits, labels, head=self.head_weight())
        scaled = objective * self._scale
        # The schedule also calls this on placeholder tensors while it infers the backward's
        # shapes (first step): only the losses it reports back are the micro-batches' own.
        self._terms_of[id(scaled)] = terms
        return scaled

    def forward_backward(
        self, inputs: torch.Tensor, labels: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Forward and backward of one local batch through every stage (gradients of the
        objective's sum times ``scale``); the sums of the loss terms over its target tokens
        (the cross-entropy first), the same on every pp rank."""
        self._scale = scale
        args = (inputs,) if self.has_first else ()
        target = labels if self.has_last else None
        losses: list[torch.Tensor] = []
        try:
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
            terms = torch.zeros(self._n_terms, device=labels.device)
            for loss in losses:
                terms = terms + self._terms_of[id(loss)]
        finally:
            self._terms_of.clear()
        dist.all_reduce(terms, dist.ReduceOp.SUM, group=self.group)  # from the last stage
        return terms

    def warm_up(
        self,
        batch: int,
        seq_len: int,
        device: torch.device,
        forward_backward: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None,
    ) -> None:
        """One forward and backward of a batch of zeros, gradients dropped: the schedule's
        first step also runs its stages on placeholder tensors to infer shapes, and a layer
        that keeps statistics of its forwards (a mixture of experts) must not count those
        in a real step. ``forward_backward`` runs it as a real step does
        (``ParallelModel.forward_backward``: under its loss-parallel context, with the
        multi-token prediction depths' labels); default this pipeline's own."""
        tokens = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
        (forward_backward or self.forward_backward)(tokens, tokens, 0.0)
        for module in self.local.values():
            for param in module.parameters():
                param.grad = None

    @torch.no_grad()
    def finish_gradients(self) -> None:
        """After the last backward of a step: average over replicas (titanlite's own data
        parallelism under PP, not overlapped with backward) and sum the tied copies."""
        if self.replica_group is not None:
            size = dist.get_world_size(self.replica_group)
            for module in self.local.values():
                grads = [p.grad for p in module.parameters() if p.grad is not None]
                all_reduce_after_backward(grads, self.replica_group, divide_by=size)
        for p in self.tied_params:
            # Tensor parallelism splits both copies along the vocabulary, but the embedding's
            # gradient comes back whole (Replicate): cut it like its weight before summing.
            if p.grad is not None and getattr(p.grad, "placements", None) != getattr(
                p, "placements", None
            ):
                p.grad = p.grad.redistribute(p.grad.device_mesh, p.placements)
        grads = [local_tensor(p.grad) for p in self.tied_params if p.grad is not None]
        if len(grads) == 2:  # both copies on this rank (the V schedules)
            total = grads[0] + grads[1]
            for g in grads:
                g.copy_(total)
        elif len(grads) == 1 and self.tie_group is not None:
            dist.all_reduce(grads[0], dist.ReduceOp.SUM, group=self.tie_group)

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The summed loss of a local batch, forward only, the same on every pp rank."""
        loss = lambda out, y: self._loss_sum(out, y, head=self.head_weight())[1][0]  # noqa: E731
        return self.forward_only(inputs, labels, loss, width=1, per_row=False).sum()

    def forward_only(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        score: Callable[..., torch.Tensor],
        *,
        width: int,
        per_row: bool,
    ) -> torch.Tensor:
        """``score(logits, labels)`` of each micro-batch of a local batch, forward only: a
        [width, rows] tensor (``per_row``) or ``width`` values per micro-batch, side by side
        in micro-batch order, the same on every pp rank.

        Not through the schedule: ``eval()`` of the V schedules fails in torch 2.13 (their
        actions still include backward steps). Each micro-batch goes through the stages in
        order; every rank walks the same (micro-batch, stage) sequence, so each send meets
        its receive. Validation is rare: no overlap is needed.
        """
        plan, n = self.plan, self.plan.n_stages
        m = plan.microbatches
        chunks = list(zip(inputs.chunk(m), labels.chunk(m), strict=True))
        columns = [len(y) if per_row else 1 for _, y in chunks]
        out = torch.zeros(width, sum(columns), device=labels.device)
        at = 0
        for (inputs_mb, labels_mb), cols in zip(chunks, columns, strict=True):
            hidden: torch.Tensor | None = None
            for stage in range(n):
                if stage not in self.local:
                    continue
                if stage == 0:
                    x = inputs_mb
                elif plan.stage_rank(stage - 1) == self.pp_rank:
                    x = hidden
                else:
                    x = self._receive(plan.stage_rank(stage - 1), labels.device)
                hidden = self.local[stage](x)
                if stage == n - 1:
                    out[:, at : at + cols] = score(hidden, labels_mb).reshape(width, cols)
                elif plan.stage_rank(stage + 1) != self.pp_rank:
                    self._send(hidden, plan.stage_rank(stage + 1))
            at += cols
        dist.all_reduce(out, dist.ReduceOp.SUM, group=self.group)  # from the last stage
        return out

    def _send(self, tensor: torch.Tensor, pp_rank: int) -> None:
        tensor = tensor.contiguous()
        header = torch.zeros(8, dtype=torch.int64)
        header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
        dist.send(header.to(tensor.device), group=self.group, group_dst=pp_rank)
        dist.send(tensor, group=self.group, group_dst=pp_rank)

    def _receive(self, pp_rank: int, device: torch.device) -> torch.Tensor:
        header = torch.zeros(8, dtype=torch.int64, device=device)
        dist.recv(header, group=self.group, group_src=pp_rank)
        dtype, ndim = _DTYPES[int(header[0])], int(header[1])
        tensor = torch.empty(header[2 : 2 + ndim].tolist(), dtype=dtype, device=device)
        dist.recv(tensor, group=self.group, group_src=pp_rank)
        return tensor


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
