"""Autoregressive sampling from a titanlite Transformer.

The model has no KV cache, so every new token recomputes the whole context (at most
``max_seq_len`` tokens: older ones are dropped from the left). That costs O(n^2) per token,
which is fine for checking what a checkpoint learned, not for serving.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

logger = logging.getLogger(__name__)


def next_token(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> int:
    """One token id from the logits [vocab] of the last position: the argmax when
    temperature is 0, else a sample of softmax(logits / temperature) restricted to the
    top_k most likely tokens (all when top_k is None)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.numel():
        kth_largest = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: Sequence[int],
    max_new_tokens: int,
    max_seq_len: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The ids that follow ``prompt`` (not including it), at most ``max_new_tokens``.

    Generation stops early at ``eos_id``, which is not returned. Sampling draws from
    ``generator`` (on the model's device), so a seeded generator gives reproducible text.
    """
    if not prompt:
        raise ValueError("the prompt must hold at least one token (e.g. BOS)")
    device = next(model.parameters()).device
    ids = list(prompt)
    if len(ids) > max_seq_len:
        logger.warning("prompt of %d tokens: only the last %d are seen", len(ids), max_seq_len)
    new: list[int] = []
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-max_seq_len:]], dtype=torch.long, device=device)
        logits = model(context)[0, -1]
        token = next_token(logits, temperature, top_k, generator)
        if token == eos_id:
            break
        ids.append(token)
        new.append(token)
    return new
