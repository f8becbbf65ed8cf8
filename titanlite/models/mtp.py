"""Multi-token prediction (DeepSeek-V3): extra depths that each predict one token further.

Depth d (1, 2, ...) at position i combines depth d - 1's hidden state there (depth 0: the main
model's last block output, before its final norm) with the embedding of token i + d: both
RMS-normalized (``enorm``, ``hnorm``), concatenated embedding first, projected back to the
model width (``eh_proj``), then one transformer block (attention and feed-forward as the
model's later blocks) and the depth's own final norm before the shared output head. Its logits
at position i predict token i + d + 1. The embedding and the output head are the model's.

Training only: the decoder appends each depth's logits to the main ones along the sequence
(``titanlite.training.loss.TrainingLoss`` splits them, ``titanlite.training.loss.mtp_labels``
builds the targets); evaluation and generation never run the depths. Published checkpoints keep
depth d as block ``n_layers + d - 1`` (``models/deepseek_v3/hf.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from titanlite.models.layers import RMSNorm


class MTPDepth(nn.Module):
    """One prediction depth: (embedded next tokens, previous hidden) -> its hidden state."""

    def __init__(self, args: Any, block: nn.Module) -> None:
        super().__init__()
        self.enorm = RMSNorm(args.dim, args.norm_eps)
        self.hnorm = RMSNorm(args.dim, args.norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = block
        self.norm = RMSNorm(args.dim, args.norm_eps)  # before the shared output head

    def forward(
        self,
        embedded: torch.Tensor,
        hidden: torch.Tensor,
        rope: torch.Tensor,
        documents: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this depth's hidden state, for the next depth; the same normalized, for the output
        head). The final norm runs here, inside the depth's forward, so that under FSDP its
        weight is gathered with the depth's (a depth other than the last is resharded once its
        forward returns)."""
        joined = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)
        hidden = self.block(self.eh_proj(joined), rope, documents=documents)
        return hidden, self.norm(hidden)


def tokens_ahead(tokens: torch.Tensor, depth: int) -> torch.Tensor:
    """[batch, seq] ids -> the id ``depth`` places later at each position; the last ``depth``
    positions wrap around (their targets are ignored, and no earlier position attends to
    them)."""
    return torch.roll(tokens, -depth, dims=1)
