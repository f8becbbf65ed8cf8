"""The training loss: sums over target tokens, which the trainer divides by the global count
of target tokens (so accumulation, data parallelism and padding never change the result).

The objective is the cross-entropy plus, with ``training.z_loss_weight``, the z-loss: the
weight times the square of each target position's log-partition ``logsumexp(logits)``,
which keeps the output logits from drifting to large magnitudes (PaLM, OLMo 2). Both are
reported as separate terms (``loss`` and ``z_loss`` in metrics.jsonl); the objective that is
differentiated is their sum.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from titanlite import distributed
from titanlite.data.batches import IGNORE_INDEX


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


class TrainingLoss:
    """``(logits, labels) -> (objective, terms)``: the objective summed over the target tokens
    (to differentiate) and its reported terms, detached, as a vector named by ``names``:
    [cross-entropy] or [cross-entropy, weighted z-loss]. Without a z-loss the objective is
    exactly ``cross_entropy_sum``."""

    def __init__(self, z_loss_weight: float = 0.0) -> None:
        self.z_loss_weight = z_loss_weight
        self.names: tuple[str, ...] = ("loss", "z_loss") if z_loss_weight > 0 else ("loss",)

    def __call__(
        self, logits: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ce = cross_entropy_sum(logits, labels)
        if self.z_loss_weight <= 0:
            return ce, plain(ce.detach()).reshape(1)
        ce = plain(ce)
        z = self.z_loss_weight * z_loss_sum(logits, labels)
        return ce + z, torch.stack([ce.detach(), z.detach()])


def plain(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a possibly distributed one (a loss or logits under loss parallel)."""
    return value.full_tensor() if isinstance(value, DTensor) else value


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
