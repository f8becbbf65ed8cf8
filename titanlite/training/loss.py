"""The training loss: sums over target tokens, which the trainer divides by the global count
of target tokens (so accumulation, data parallelism and padding never change the result).

The objective is the cross-entropy plus, with ``training.z_loss_weight``, the z-loss: the
weight times the square of each target position's log-partition ``logsumexp(logits)``,
which keeps the output logits from drifting to large magnitudes (PaLM, OLMo 2). Both are
reported as separate terms (``loss`` and ``z_loss`` in metrics.jsonl); the objective that is
differentiated is their sum.

With multi-token prediction (``model.mtp_layers``, ``titanlite.models.mtp``) the training
logits carry each depth's after the main ones, and the labels are ``mtp_labels``' [batch,
1 + depths, seq]; ``mtp_loss`` is the mean over the depths of their summed cross-entropies
and joins the objective times ``model.mtp_loss_weight``. Like every term it is divided by the
global count of the main loss's target tokens (DeepSeek-V3's 1/T), so it is exact under any
layout.

With ``training.fused_loss`` the model outputs its final hidden states instead of logits and
the loss gets the output projection's weight (``head``): every term above is computed from
each position's log-partition and target logit (``titanlite.training.fused_loss``), equal to
the unfused terms to float32 rounding, without the [tokens, vocab] logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from titanlite.data.batches import IGNORE_INDEX
from titanlite.parallel.ddp.collectives import full_tensor
from titanlite.runtime import distributed
from titanlite.training.fused_loss import head_objective, head_scores


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy of logits [batch, seq, vocab] against labels [batch, seq]
    (positions labelled IGNORE_INDEX count for nothing)."""
    return F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX
    )


def log_partition(logits: torch.Tensor) -> torch.Tensor:
    """``logsumexp`` over the vocabulary: [batch, seq, vocab] -> [batch, seq], a plain tensor.

    Logits sharded over the vocabulary (loss parallelism, a DTensor) are reduced where they
    lie: the maximum and the sum of exponentials are [batch, seq] reductions over the shards,
    never a gather of the full logits (DTensor's own logsumexp would gather them)."""
    if not isinstance(logits, DTensor):
        return torch.logsumexp(logits, dim=-1)
    # The shift is constant for the gradient (it cancels exactly), so it takes none.
    shift = logits.detach().amax(dim=-1, keepdim=True)
    total = torch.exp(logits - shift).sum(dim=-1)
    return (torch.log(total) + shift.squeeze(-1)).full_tensor()


def z_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The sum of ``logsumexp(logits)^2`` over the target positions of ``labels``."""
    targets = (labels != IGNORE_INDEX).to(torch.float32)
    return (log_partition(logits).square() * targets).sum()


def mtp_labels(
    labels: torch.Tensor, depths: int, documents: torch.Tensor | None = None
) -> torch.Tensor:
    """[batch, seq] labels -> [batch, 1 + depths, seq]: the labels, then depth d's targets
    (the label d places later; none for the last d positions). With ``documents`` ([batch,
    seq] document numbers of the input tokens) a target outside the document of its
    position is ignored: depth d at position i sees only its own document."""
    rows = [labels]
    if documents is not None:  # each label's document (the window's last: its last token's)
        label_docs = torch.cat([documents[:, 1:], documents[:, -1:]], dim=1)
    for d in range(1, depths + 1):
        ahead = torch.full_like(labels, IGNORE_INDEX)
        ahead[:, :-d] = labels[:, d:]
        if documents is not None:
            apart = torch.ones_like(labels, dtype=torch.bool)
            apart[:, :-d] = label_docs[:, d:] != documents[:, :-d]
            ahead = ahead.masked_fill(apart, IGNORE_INDEX)
        rows.append(ahead)
    return torch.stack(rows, dim=1)


class TrainingLoss:
    """``(logits, labels) -> (objective, terms)``: the objective summed over the target tokens
    (to differentiate) and its reported terms, detached, as a vector named by ``names``:
    [cross-entropy], then the weighted z-loss and the (unweighted) MTP loss when on. Without
    either the objective is exactly ``cross_entropy_sum``. Labels of [batch, seq] (an
    evaluation: the logits have no MTP depths) give an MTP term of 0."""

    def __init__(
        self,
        z_loss_weight: float = 0.0,
        mtp_layers: int = 0,
        mtp_weight: float = 0.0,
        *,
        chunk: int = 8192,
        recompute: bool = False,
        tokens: int = 0,
    ) -> None:
        self.z_loss_weight = z_loss_weight
        self.mtp_layers, self.mtp_weight = mtp_layers, mtp_weight
        # The fused loss: gradients in its forward, `tokens` per block (0: automatic), or
        # with `recompute` recomputed in backward, `chunk` vocabulary rows at a time.
        self.chunk, self.recompute, self.tokens = chunk, recompute, tokens
        self.names: tuple[str, ...] = (
            ("loss",) + ("z_loss",) * (z_loss_weight > 0) + ("mtp_loss",) * (mtp_layers > 0)
        )

    @classmethod
    def of(cls, training: object, model_args: object) -> TrainingLoss:
        """The loss of a run: ``training``'s z_loss_weight and fused_loss_* settings, the
        model's MTP depths, if any."""
        depths = getattr(model_args, "mtp_layers", 0)
        weight = getattr(model_args, "mtp_loss_weight", 0.0)
        return cls(
            training.z_loss_weight,
            depths,
            weight,
            chunk=training.fused_loss_chunk,
            recompute=training.fused_loss_recompute,
            tokens=training.fused_loss_tokens,
        )

    def targets(self, labels: torch.Tensor, documents: torch.Tensor | None) -> torch.Tensor:
        """The labels ``__call__`` takes in training: with MTP depths, ``mtp_labels``."""
        return mtp_labels(labels, self.mtp_layers, documents) if self.mtp_layers else labels

    def __call__(
        self, logits: torch.Tensor, labels: torch.Tensor, head: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if head is not None:
            return self._fused(logits, labels, head)
        ahead = None
        if labels.dim() == 3:  # mtp_labels: the main labels, then each depth's
            seq = labels.shape[2]
            logits, *ahead_logits = logits.split(seq, dim=1)
            ahead = list(zip(ahead_logits, labels[:, 1:].unbind(1), strict=True))
            labels = labels[:, 0]
        ce = cross_entropy_sum(logits, labels)
        if len(self.names) == 1:
            return ce, full_tensor(ce.detach()).reshape(1)
        ce = full_tensor(ce)
        objective, terms = ce, [ce.detach()]
        if self.z_loss_weight > 0:
            z = self.z_loss_weight * z_loss_sum(logits, labels)
            objective, terms = objective + z, [*terms, z.detach()]
        if self.mtp_layers > 0:
            mtp = ce.new_zeros(())
            if ahead is not None:
                mtp = sum(full_tensor(cross_entropy_sum(x, y)) for x, y in ahead) / len(ahead)
                objective = objective + self.mtp_weight * mtp
            terms.append(mtp.detach())
        return objective, torch.stack(terms)

    def _fused(
        self, hidden: torch.Tensor, labels: torch.Tensor, head: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``__call__`` from the final hidden states [batch, (1 + depths) x seq, dim] and the
        output weight: one pass over the main positions and every depth's together (their
        hidden states follow each other along the sequence as the labels' rows do)."""
        rows = labels.shape[1] if labels.dim() == 3 else 1
        flat = labels.flatten(1)  # [batch, rows x seq], in the order of the hidden states
        counted = (flat != IGNORE_INDEX).view(len(flat), rows, -1)
        mtp_on = self.mtp_layers > 0 and rows > 1
        fused = None
        if self.recompute:
            lse, target = head_scores(hidden, head, flat, chunk=self.chunk)
        else:  # each position's weight in the objective: the terms below, differentiated
            share = torch.ones(rows, device=flat.device)
            share[1:] = self.mtp_weight / (rows - 1) if mtp_on else 0.0
            ce_weight = counted * share.view(1, rows, 1)
            z_weight = torch.zeros_like(ce_weight)
            z_weight[:, 0] = self.z_loss_weight * counted[:, 0]
            weights = torch.stack([ce_weight, z_weight]).view(2, *flat.shape)
            fused, lse, target = head_objective(hidden, head, flat, weights, tokens=self.tokens)
        lse, target = lse.view(counted.shape), target.view(counted.shape)
        per_row = torch.where(counted, lse - target, 0.0).sum((0, 2))
        ce = per_row[0]
        objective, terms = ce, [ce.detach()]
        if self.z_loss_weight > 0:
            z = self.z_loss_weight * torch.where(counted[:, 0], lse[:, 0].square(), 0.0).sum()
            objective, terms = objective + z, [*terms, z.detach()]
        if self.mtp_layers > 0:
            mtp = per_row[1:].mean() if rows > 1 else ce.new_zeros(())
            if mtp_on:
                objective = objective + self.mtp_weight * mtp
            terms.append(mtp.detach())
        return (objective if fused is None else fused), torch.stack(terms)


class StepLoss:
    """A step's loss terms: this rank's sums over its target tokens, and ``mean()``, the
    means over the global batch (one all-reduce over the loss group, made once, at the first
    call: a step that is not logged and not checked never makes it)."""

    def __init__(
        self, sums: torch.Tensor, n_tokens: torch.Tensor, group: dist.ProcessGroup | None
    ) -> None:
        self.sums = sums
        self.n_tokens = n_tokens
        self.group = group
        self._mean: torch.Tensor | None = None

    def mean(self) -> torch.Tensor:
        """[terms] on the device, the same on every rank: each summed term over the global
        count of target tokens (a collective: every rank of the group calls it at the same
        steps)."""
        if self._mean is None:
            total = distributed.all_reduce(self.sums, dist.ReduceOp.SUM, self.group)
            self._mean = total / self.n_tokens
        return self._mean
