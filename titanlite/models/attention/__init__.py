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
from titanlite.models.interfaces import AttentionCore

REGISTRY: dict[str, type[AttentionCore]] = {
    "sdpa": CausalAttention,
    "gated_delta": GatedDeltaAttention,
}

__all__ = [
    "REGISTRY",
    "AttentionCore",
    "CausalAttention",
    "GatedDeltaAttention",
    "build",
    "chunk_attention",
    "document_attention",
]


def build(name: str) -> AttentionCore:
    """A new attention core of the registered kind ``name`` (KeyError if unknown: the
    family's args name only registered kinds)."""
    return REGISTRY[name]()
