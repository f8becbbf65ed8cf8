"""The attention registry: the attention core a family's block calls, by name.

A core (``titanlite.models.interfaces.AttentionCore``) is the math between the projections:
queries, keys and values in, the attended values out. A family's args name theirs
(``attention``); each block gets its core from ``for_layer(args, layer)``, which also reads
the attention options every decoder family has (``sliding_window``, ``window_pattern``,
``attention_sinks``: ``titanlite.models.decoder_spec.AttentionVariants``). Each core declares
its ``mask`` (causal, sliding window, sink, documents), which context parallelism and
document masking read instead of the class.

Adding a kind of attention: a module here with an ``AttentionCore`` subclass (set ``mask``,
implement ``attend``; for QK-clip, ``attend`` calls ``kernels.record_max_logits`` while
``record_max_logits`` is on) and one line in ``REGISTRY``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from titanlite.models.attention import fla_rule, flex
from titanlite.models.attention.causal import CausalAttention
from titanlite.models.attention.gated_delta import GatedDeltaAttention
from titanlite.models.attention.kernels import chunk_attention, document_attention
from titanlite.models.attention.latent import LatentAttention, LatentCore
from titanlite.models.attention.masked import MaskedAttention, banded_attention
from titanlite.models.interfaces import AttentionCore, AttentionLayer

logger = logging.getLogger(__name__)

REGISTRY: dict[str, type[AttentionCore]] = {
    "sdpa": CausalAttention,
    "mla": LatentCore,
    "gated_delta": GatedDeltaAttention,
    "masked": MaskedAttention,  # sliding window and/or sinks
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
    "MaskedAttention",
    "banded_attention",
    "build",
    "chunk_attention",
    "document_attention",
    "for_layer",
    "log_choice",
]


def build(name: str, **options: Any) -> AttentionCore:
    """A new attention core of the registered kind ``name`` (KeyError if unknown: the
    family's args name only registered kinds)."""
    return REGISTRY[name](**options)


def for_layer(args: Any, layer: int) -> AttentionCore:
    """The core of block ``layer``: the family's own (``args.attention``), or the masked
    core where that layer has a sliding window or the model has sinks."""
    window = args.layer_window(layer)
    if window is None and not args.attention_sinks:
        return build(args.attention)
    return build(
        "masked",
        window=window,
        sink_heads=args.n_heads if args.attention_sinks else 0,
        kernel=args.attention_kernel,
    )


def log_choice(cores: list[AttentionCore]) -> None:
    """Log which kernel the layers' attention runs on, when some layer has a window or sinks
    (FlexAttention on CUDA, the blocked explicit kernel elsewhere: ``flex.describe``) or is
    Gated DeltaNet (whose kernel is chosen per call: CUDA tensors and an importable
    flash-linear-attention); the line says what a run on this machine's device gets."""
    linear = [c for c in cores if isinstance(c, GatedDeltaAttention)]
    if linear:
        logger.info(
            "linear attention: %d of %d layers (Gated DeltaNet) run the delta rule with %s",
            len(linear),
            len(cores),
            fla_rule.describe(linear[0].kernel, cuda=torch.cuda.is_available()),
        )
    masked_cores = [c for c in cores if isinstance(c, MaskedAttention)]
    if not masked_cores:
        return
    masked = [c.mask for c in masked_cores]
    windowed = [m.window for m in masked if m.window is not None]
    what = ", ".join(
        part
        for part in (
            f"{len(windowed)} with a sliding window of {windowed[0]}" if windowed else "",
            f"{len(masked) - len(windowed)} full" if len(masked) > len(windowed) else "",
        )
        if part
    ) + (", with sinks" if masked[0].sink else "")
    rest = len(cores) - len(masked)
    logger.info(
        "attention: %d of %d layers (%s) run %s%s",
        len(masked),
        len(cores),
        what,
        flex.describe(masked_cores[0].kernel, cuda=torch.cuda.is_available()),
        f"; {rest} run causal SDPA" if rest else "",
    )
