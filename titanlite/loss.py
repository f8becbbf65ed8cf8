"""The training loss: a sum over target tokens, which the trainer divides by the global count
of target tokens (so accumulation, data parallelism and padding never change the result)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titanlite.data.batches import IGNORE_INDEX


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy of logits [batch, seq, vocab] against labels [batch, seq]
    (positions labelled IGNORE_INDEX count for nothing)."""
    return F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX
    )
