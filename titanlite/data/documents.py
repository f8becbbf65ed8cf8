"""The documents of packed windows: where each starts, each token's position within its own,
and training.document_mask's description of them for the model (block-causal attention,
RoPE positions restarting at each document)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def document_ids(tokens: torch.Tensor, bos_id: int, eos_id: int) -> torch.Tensor:
    """[batch, seq] ids -> [batch, seq] document numbers within each window (0, 1, ...): a
    document starts at each BOS token, or, for a tokenizer without BOS, after each EOS."""
    if bos_id >= 0:
        starts = tokens == bos_id
    else:
        starts = torch.zeros_like(tokens, dtype=torch.bool)
        starts[:, 1:] = tokens[:, :-1] == eos_id
    return starts.long().cumsum(1)


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """[batch, seq] document numbers -> each token's position within its document."""
    index = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    new = torch.ones_like(documents, dtype=torch.bool)
    new[:, 1:] = documents[:, 1:] != documents[:, :-1]
    starts = torch.cummax(torch.where(new, index, 0), dim=1).values
    return index - starts


@dataclass(frozen=True)
class DocumentMask:
    """training.document_mask: attention stays within the documents of a packed window, found
    by the tokenizer's BOS (or, without one, after its EOS); ``reset_positions`` restarts RoPE
    positions at each document."""

    bos_id: int
    eos_id: int
    reset_positions: bool = False

    @classmethod
    def of(cls, training: Any, tokenizer: Any) -> DocumentMask | None:
        """training.document_mask's mask over ``tokenizer``'s BOS and EOS, or None."""
        if not training.document_mask:
            return None
        return cls(tokenizer.bos_id, tokenizer.eos_id, training.document_positions)

    def ids(self, tokens: torch.Tensor) -> torch.Tensor:
        return document_ids(tokens, self.bos_id, self.eos_id)

    def positions(self, documents: torch.Tensor) -> torch.Tensor:
        return document_positions(documents)
