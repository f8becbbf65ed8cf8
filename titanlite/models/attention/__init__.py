"""The attention registry: the attention core a family's block calls, by name.

A core (``titanlite.models.interfaces.AttentionCore``) is the math between the projections:
queries, keys and values in, the attended values out. A family's args name theirs
(``attention``); the block builds it with ``build(name)``. Each core declares its ``mask``
(causal, sliding window, sink, documents), which context parallelism and document masking
read instead of the class.

Adding a kind of attention: a module here with an ``AttentionCore`` subclass (set ``mask``,
implement ``attend``; for QK-clip, ``attend`` calls ``kernels.record_max_logits`` while
``record_max_logits`` is on) and one line in ``REGISTRY``.
"""

from __future__ import annotations

from titanlite.models.attention.causal import CausalAttention
from titanlite.models.attention.gated_delta import GatedDeltaAttention
from titanlite.models.attention.kernels import chunk_attention, document_attention
from titanlite.models.attention.latent import LatentAttention, LatentCore
from titanlite.models.interfaces import AttentionCore, AttentionLayer

REGISTRY: dict[str, type[AttentionCore]] = {
    "sdpa": CausalAttention,
    "mla": LatentCore,
    "gated_delta": GatedDeltaAttention,
}
LAYERS: dict[str, type[AttentionLayer]] = {"mla": LatentAttention}
"""Kinds whose projections differ from the shared decoder's q/k/v/o (``decoder.Attention``):
the block builds this layer (from the family's args) instead, and it builds its core."""

__all__ = [
    "LAYERS",
    "REGISTRY",
    "AttentionCore",
    "CausalAttention",
    "LatentAttention",
    "LatentCore",
    "GatedDeltaAttention",
    "build",
    "chunk_attention",
    "document_attention",
]


def build(name: str) -> AttentionCore:
    """A new attention core of the registered kind ``name`` (KeyError if unknown: the
    family's args name only registered kinds)."""
    return REGISTRY[name]()
