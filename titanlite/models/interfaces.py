"""The interfaces the parallel layer (and optimizers that work per head) see of a model,
besides its spec.

``titanlite.parallel`` never imports a model class: it finds the attention cores and the
routed experts of any family through these two base classes, and talks to them only through
the hooks documented here. A family's modules subclass them (the attention registry's entries
subclass ``AttentionCore``; ``titanlite.models.moe.GroupedExperts`` subclasses
``RoutedExperts``).

Hooks are plain attributes a parallelism sets once, after the model is built on the meta
device; the model calls through them and knows nothing of process groups:

- ``AttentionCore.sequence_split``: context parallelism. An object whose
  ``attention(core, q, k, v, documents)`` returns this rank's attention output when the local
  sequence is this rank's share of a longer one. It gathers keys and values and calls back
  ``core.attend`` with the chunks this rank holds (with a ``mask.window``, once per chunk
  with only the keys its window reaches, positions counted from the first of them). A core
  with ``recurrent = True`` (linear attention) gets a ``RecurrentSplit`` instead: its layer
  runs this rank's chunks as rows and the split supplies what each chunk needs from the ones
  before it (a state, a few tokens).
- ``RoutedExperts.dispatch``: expert parallelism. ``dispatch(rows, counts, experts)`` moves
  rows (sorted by global expert, ``counts`` per expert) to the ranks holding their experts,
  runs ``experts(rows, local_counts)`` there and brings the outputs back.
- ``sequence_shards`` on a module that routes its own tokens (a mixture of experts declares
  the attribute, None by default): an object with ``degree`` and ``sum(tensor)`` (an
  all-reduce over the ranks holding the other shards of the same sequences), for statistics
  that are per whole sequence. Tensor parallelism sets it on the modules its plan runs as
  ``local_tokens`` (the tp ranks); context parallelism on every module that has the
  attribute (the cp x tp ranks).
- ``AttentionCore.record_max_logits``: QK-clip (``titanlite.optim.qk_clip``). While true,
  each training forward folds the largest logit per query head it computed into the core's
  ``max_logits``; the optimizer reduces them over ranks and resets them.

Optimizers that work per head (Muon's per-head blocks, QK-clip) find the attention layers
through a third base class, ``AttentionLayer`` (the shared decoder's ``Attention``), and their
projections through its ``heads()``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from titanlite.models.spec import InitRule


@dataclass(frozen=True)
class Mask:
    """Which keys a query may see, as data: context parallelism and document masking read
    this, not the class of the attention core."""

    causal: bool = True
    """A query sees keys at or before its own position."""
    window: int | None = None
    """Sliding window: a query sees at most this many keys ending at its own (None = all).
    A windowed core uses positions only relatively: context parallelism hands it each chunk
    with just the keys its window reaches, positions counted from the first of them."""
    sink: bool = False
    """A learned logit per head joins every softmax row (attends to nothing)."""
    documents: bool = True
    """Honours document ids: block-causal within the documents of a packed window."""


class SequenceSplit(Protocol):
    """What context parallelism sets as ``AttentionCore.sequence_split``."""

    def attention(
        self,
        core: AttentionCore,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        documents: torch.Tensor | None,
    ) -> torch.Tensor: ...


class RecurrentSplit(Protocol):
    """What context parallelism sets as ``sequence_split`` on a recurrent core. This rank's
    tokens [b, local, ...] are chunks of the sequence; ``rows`` makes each chunk a row
    [rows, chunk, ...] and ``unrows`` undoes it."""

    def rows(self, x: torch.Tensor) -> torch.Tensor: ...

    def unrows(self, x: torch.Tensor) -> torch.Tensor: ...

    def lead_in(
        self, inputs: list[torch.Tensor], n: int, documents: torch.Tensor | None
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Rows [rows, chunk, channels] -> the same rows led by the ``n`` tokens before each
        chunk (zeros before the sequence), and the documents of those n + chunk tokens."""
        ...

    def recurrence(
        self,
        core: AttentionCore,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        g: torch.Tensor,
        beta: torch.Tensor,
        documents: torch.Tensor | None,
    ) -> torch.Tensor:
        """The rows' outputs of ``core.scan`` run from the state each chunk starts in."""
        ...


class SequenceShards(Protocol):
    """What tensor or context parallelism sets as ``sequence_shards``."""

    degree: int

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the ranks holding the other shards (in place)."""
        ...


class AttentionCore(nn.Module):
    """The attention math a block calls on [batch, heads, seq, head_dim] queries, keys and
    values (keys may have fewer heads: grouped-query attention); no parameters of its own
    unless the mask needs them (a sink per head).

    Subclasses are the attention registry's entries (``titanlite.models.attention``): they
    set ``mask`` and implement ``attend``.
    """

    mask: Mask = Mask()
    recurrent: bool = False
    """Keys summarized in a state carried along the sequence (linear attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.sequence_split: SequenceSplit | RecurrentSplit | None = None
        self.record_max_logits = False
        """Fold each training forward's largest pre-softmax logit per local query head into
        ``max_logits`` (``attend`` computes them only while this is on)."""
        self.max_logits: torch.Tensor | None = None
        """[local query heads]: the largest logit recorded since the owner last reset it."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``documents`` [batch, seq]: each token's document number within its window."""
        if self.sequence_split is not None:
            return self.sequence_split.attention(self, q, k, v, documents=documents)
        return self.attend(q, k, v, [(0, q.shape[2])], documents=documents)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        chunks: Sequence[tuple[int, int]],
        *,
        documents: torch.Tensor | None = None,
        masked: bool = False,
    ) -> torch.Tensor:
        """Attention of queries ``q`` [b, h, local, d] that hold the sequence's ``chunks``
        ((first position, length), in local order) over keys and values [b, h_kv, seq, d] in
        sequence order; ``documents`` [b, seq] for the whole sequence. ``masked`` forces a
        mask-based kernel where a mask-free one exists (tests compare the two)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Heads:
    """An attention layer's projections, cut into heads: each head owns ``head_dim`` rows of
    ``query`` ([heads * head_dim, dim]), ``key`` and ``value`` ([kv_heads * head_dim, dim];
    key head g serves query heads g * heads / kv_heads onward) and ``head_dim`` columns of
    ``output`` ([dim, heads * head_dim]). The weights are the parameters as stored (DTensors
    under FSDP or TP: shapes are global)."""

    head_dim: int
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    output: torch.Tensor


class AttentionLayer(nn.Module):
    """A block's attention: projections around an ``AttentionCore`` (``core``); ``layer_id``
    is the index of its block in the whole model (the same in every pipeline stage)."""

    core: AttentionCore
    layer_id: int = 0

    def heads(self) -> Heads:
        raise NotImplementedError


class RoutedExperts(nn.Module):
    """A mixture-of-experts layer's experts: ``forward(rows, counts)`` maps rows sorted by
    expert (``counts[e]`` rows for expert e) to their outputs, in the same order."""

    num_experts: int

    def __init__(self) -> None:
        super().__init__()
        self.dispatch: (
            Callable[[torch.Tensor, torch.Tensor, Callable[..., torch.Tensor]], torch.Tensor] | None
        ) = None


class LowRankLinear(nn.Linear):
    """A linear whose output adds a trained low-rank update, ``x A^T B^T`` times ``scale``
    (LoRA, ``titanlite.converters.lora``): its own parameters ``lora_a`` [rank, in] and
    ``lora_b`` [out, rank] beside the (usually frozen) ``weight``.

    Tensor parallelism splits the factors to match the weight: a column-wise weight (outputs
    split) keeps A whole and splits B's rows; a row-wise weight (inputs split) splits A's
    columns and keeps B whole, so each rank's update is its share of the whole one.
    Initialization takes ``adapter_init`` (A random, B zero: the update starts at zero), even
    when a checkpoint is about to overwrite the other weights."""

    adapter_init: dict[str, InitRule]
    """Parameter name (``lora_a``, ``lora_b``) -> how it starts."""


def find(model: nn.Module, kind: type[Any]) -> list[Any]:
    """The modules of ``model`` that implement an interface, in module order."""
    return [m for m in model.modules() if isinstance(m, kind)]
