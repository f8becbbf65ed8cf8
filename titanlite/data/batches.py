"""What every loader hands out: (inputs, labels) LongTensors [local_batch_size, seq_len], the
labels the inputs shifted by one, IGNORE_INDEX where a position has no target."""

from __future__ import annotations

import torch

IGNORE_INDEX = -100
"""Label of padded positions (only in the last batch of a validation pass)."""


def padded_chunk(
    tokens: torch.Tensor, chunk: int, window: int, *, pad_id: int, rows: slice
) -> tuple[torch.Tensor, torch.Tensor]:
    """The last tokens of a validation pass cut into one global chunk of ``chunk`` windows, the
    partial last window and the missing windows padded (labels IGNORE_INDEX) so that all ranks
    get a full batch; ``rows`` are this rank's."""
    inputs = torch.full((chunk, window - 1), pad_id, dtype=torch.int64)
    labels = torch.full((chunk, window - 1), IGNORE_INDEX, dtype=torch.int64)
    for row, start in enumerate(range(0, tokens.numel() - 1, window)):
        piece = tokens[start : start + window]
        inputs[row, : piece.numel() - 1] = piece[:-1]
        labels[row, : piece.numel() - 1] = piece[1:]
    return inputs[rows].clone(), labels[rows].clone()
