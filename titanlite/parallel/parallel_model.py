"""ParallelModel: what the trainer and the validator see of a parallelized model.

Whatever the layout, one call runs a micro-batch's forward and backward
(``forward_backward``: the summed loss terms) and one its forward only (``evaluate``: the
summed cross-entropy), over the micro-batch's target tokens, the same on every rank that
holds part of it. Pipeline stages, context-parallel chunks, loss parallelism and autocast
stay inside.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from titanlite.data.batches import IGNORE_INDEX
from titanlite.parallel.context.attention import ContextParallel
from titanlite.parallel.ddp import BucketedDDP
from titanlite.parallel.ddp.collectives import full_tensor
from titanlite.parallel.head import head_weight
from titanlite.parallel.pipeline import Pipeline


class LossSum(Protocol):
    """The training loss (``titanlite.training.loss.TrainingLoss``): (logits, labels) -> (the
    objective summed over the target tokens, to differentiate; its reported terms, detached,
    a vector named by ``names`` whose first entry is the cross-entropy). Given ``head``,
    the output projection's weight (training.fused_loss), the first argument is the final
    hidden states, which the loss projects itself."""

    names: tuple[str, ...]

    def __call__(
        self, logits: torch.Tensor, labels: torch.Tensor, head: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def targets(self, labels: torch.Tensor, documents: torch.Tensor | None) -> torch.Tensor:
        """[batch, seq] labels -> what ``__call__`` takes as labels in training (with
        multi-token prediction: [batch, 1 + depths, seq], no target across a document
        boundary when ``documents``, the inputs' document numbers, are given)."""
        ...


class DocumentStructure(Protocol):
    """training.document_mask: where the documents of a packed window start (the trainer
    builds it from the tokenizer's BOS/EOS: ``titanlite.data.documents.DocumentMask``)."""

    reset_positions: bool

    def ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """[batch, seq] token ids -> [batch, seq] document numbers."""
        ...

    def positions(self, documents: torch.Tensor) -> torch.Tensor:
        """[batch, seq] document numbers -> each token's position within its document."""
        ...


class GradientFix(Protocol):
    """A parallelism's correction to the gradients that the data-parallel engines leave,
    run once after a step's last backward (``parallelize`` collects them from the
    ``apply_*`` functions: ``ExpertGrads``, ``LocalTokenGrads``)."""

    def finish(self) -> None: ...


@dataclass(frozen=True)
class ParallelModel:
    """A model after ``parallelize``, built once, complete, and never changed afterwards.

    ``parts`` are the model's modules as built (checkpoints, optimizers and initialization
    use them; the whole model, or this rank's pipeline stages); ``modules`` are what to call
    for a forward pass (the parts, wrapped by the data-parallel engine where it applies).
    With pipeline parallelism, ``pipeline`` runs them (forward and backward of a whole local
    batch in one call) instead of calling the model. With context parallelism, ``context``
    splits each sequence: this rank computes the loss of its chunks of the labels.
    """

    parts: list[nn.Module]
    modules: list[nn.Module]
    loss_sum: LossSum
    loss_parallel: bool = False
    autocast_dtype: torch.dtype | None = None
    materialize_stats: dict[str, float] = field(default_factory=dict)
    """What allocating and initializing this rank's parts cost (``materialize``), summed over
    the parts: seconds and elements written; empty on the meta device."""
    pipeline: Pipeline | None = None
    context: ContextParallel | None = None
    documents: DocumentStructure | None = None
    gradient_fixes: tuple[GradientFix, ...] = ()
    """Run in this order by ``finish_gradients``: under expert parallelism the experts'
    scale, under tensor parallelism the sum over TP of layers that run on each rank's own
    tokens (a mixture of experts)."""
    mtp_depths: int = 0
    """Multi-token prediction depths of the model (``model.mtp_layers``): training logits
    carry theirs, and the loss gets their targets (``LossSum.targets``)."""
    head: str | None = None
    """With training.fused_loss, the module path of the deferred output projection
    (``titanlite.parallel.head``): the model outputs hidden states, and the loss gets this
    module's weight to project them itself."""

    # ------------------------------------------------------------------ one micro-batch
    def forward_backward(
        self, inputs: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor | float
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch of whole sequences [batch, seq] (on the
        device): the gradients are those of the summed objective times ``scale``. Returns
        the summed loss terms over this rank's target tokens (detached, a vector: see
        ``LossSum``; under pipeline parallelism the micro-batch's, the same on every stage)."""
        with self._train_context():
            if self.pipeline is not None:  # forward and backward in every stage
                return self.pipeline.forward_backward(
                    inputs, self.training_labels(inputs, labels), scale
                )
            outputs = self(inputs)
            labels = self.training_labels(inputs, labels)
            objective, terms = self.loss_sum(outputs, labels, head=self.head_weight())
            del outputs  # unfused, the logits: backward needs none of them (one copy less)
            (objective * scale).backward()  # MoE layers add their balancing loss's gradient
        return terms

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The summed cross-entropy of one micro-batch, forward only (as
        ``forward_backward``)."""
        with self._train_context():
            if self.pipeline is not None:
                return self.pipeline.evaluate(inputs, labels)
            outputs = self(inputs)
            return self.loss_sum(outputs, self.local_labels(labels), head=self.head_weight())[1][0]

    def row_scores(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward only, [2, batch]: per row, the summed loss over this rank's target tokens,
        and how many of them are not the model's most likely token there (0 for every token
        of a row: greedy decoding would produce its targets). This rank's context chunks under
        CP: add both up over the loss group. Under PP the same on every stage."""
        with self._train_context():
            if self.pipeline is not None:
                pipeline = self.pipeline
                score = lambda h, y: _row_scores(_logits(h, pipeline.head_weight()), y)  # noqa: E731
                return pipeline.forward_only(inputs, labels, score, width=2, per_row=True)
            outputs = self(inputs)
            return _row_scores(_logits(outputs, self.head_weight()), self.local_labels(labels))

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of this rank's tokens (with the fused loss, ``head``: the final hidden
        states, which the loss projects) from whole sequences [batch, seq] of ids: under
        context parallelism the call keeps this rank's chunks itself (document boundaries and
        positions come from the whole sequence), so its logits pair with this rank's labels."""
        if self.pipeline is not None:
            raise RuntimeError("a pipelined model runs through its pipeline, not a call")
        positions = documents = None
        extra = {}
        if self.documents is not None:
            documents = self.documents.ids(tokens)
            if self.documents.reset_positions:
                positions = self.documents.positions(documents)
        if self.context is not None:
            mine = self.context.positions(tokens.shape[1] // self.context.degree, tokens.device)
            if self.mtp_depths and self.parts[0].training:  # (the depths run in training)
                # each depth's ids d places later in the whole sequence (the model's tokens_ahead)
                later = [torch.roll(tokens, -d, dims=1) for d in range(1, self.mtp_depths + 1)]
                extra["ahead"] = torch.stack(later)[:, :, mine]
            tokens = tokens[:, mine]
            positions = mine if positions is None else positions[:, mine]
        if positions is None and documents is None and not extra:
            return self.modules[0](tokens)
        return self.modules[0](tokens, positions=positions, documents=documents, **extra)

    def head_weight(self) -> torch.Tensor | None:
        """The output projection's weight the fused loss applies (None without it); called
        after the forward."""
        return None if self.head is None else head_weight(self.parts[0], self.head)

    def local_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """This rank's share of a micro-batch's labels, whose loss it computes (its context
        chunks under CP): what to count target tokens in."""
        return labels if self.context is None else self.context.shard(labels)

    def training_labels(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """This rank's labels, with each MTP depth's targets when the model has depths (no
        target across a document boundary under training.document_mask)."""
        if not self.mtp_depths:
            return self.local_labels(labels)
        documents = self.documents.ids(inputs) if self.documents is not None else None
        labels = self.loss_sum.targets(labels, documents)  # from the whole sequences
        if self.context is None:
            return labels
        return labels[
            ..., self.context.positions(labels.shape[-1] // self.context.degree, labels.device)
        ]

    @contextlib.contextmanager
    def _train_context(self) -> Iterator[None]:
        """Around forward and loss: loss parallel (TP) and bf16 autocast where they apply."""
        with contextlib.ExitStack() as stack:
            if self.loss_parallel:
                stack.enter_context(loss_parallel())
            if self.autocast_dtype is not None:
                device_type = next(self.parts[0].parameters()).device.type
                stack.enter_context(torch.autocast(device_type, dtype=self.autocast_dtype))
            yield

    # ------------------------------------------------------------------ one step
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
        replicas and tied copies, then ``gradient_fixes``)."""
        if self.pipeline is not None:
            self.pipeline.finish_gradients()
        for fix in self.gradient_fixes:
            fix.finish()

    def train(self, mode: bool = True) -> None:
        for module in self.modules:
            module.train(mode)


def _logits(outputs: torch.Tensor, head: torch.Tensor | None) -> torch.Tensor:
    """The model's outputs as logits: with the fused loss (``head`` given) the hidden states
    projected (whole, vocabulary-sharded under TP: evaluation batches are small)."""
    return outputs if head is None else F.linear(outputs, head.to(outputs.dtype)).float()


def _row_scores(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[2, batch]: each row's summed cross-entropy and count of targets that are not the most
    likely token (under loss parallel the vocabulary is gathered for this: eval batches are
    small)."""
    ce = F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), reduction="none", ignore_index=IGNORE_INDEX
    )
    misses = (full_tensor(logits).argmax(-1) != labels) & (labels != IGNORE_INDEX)
    return torch.stack([full_tensor(ce).view(labels.shape).sum(1), misses.sum(1).to(ce.dtype)])
