"""Context parallelism for the recurrent (linear-attention) layers: a state, not keys.

``context.py`` splits each sequence into 2 x cp chunks, rank r holding chunks r and
2 cp - 1 - r. A Gated DeltaNet layer's chunk needs from the chunks before it only two things:
the recurrent state S [heads, d_k, d_v] at its start, and the short convolution's inputs of
the kernel - 1 tokens before it. This module supplies both (``RecurrentSplit``, set on every
core whose ``recurrent`` is true); the layer runs this rank's two chunks as two rows.

The state: passing it along the chunk order would be exact but serial (chunk j waits for
j - 1's owner: 2 cp chunk-times per layer instead of 2). Instead every chunk runs at once
from an unknown start. The rule is linear in its initial state and acts on each value column
alike, so a chunk run from the identity in d_k extra value columns (zero values there) gives
its transition M [d_k, d_k] as the end state of those columns and their outputs as the
response to the start, beside the end state F and outputs of the real values from zero:

    end = M S + F,    outputs = outputs(zero start) + response @ S

One all-gather of every chunk's [M | F] (backward: a reduce-scatter of their gradients),
then each rank folds them in chunk order to the start of its own two chunks: exact, the same
arithmetic as one process up to the order of float sums. A document start resets the state
(the rule's ``resets``, from the whole sequence's document ids, so a chunk beginning a
document ignores the chunks before it). Costs: the chunk's rule runs with d_k + d_v value
columns instead of d_v, and each rank receives 2 cp x heads x d_k x (d_k + d_v) float32
numbers per sequence and layer, whatever the sequence length; gathering the layer's keys and
values instead would receive seq x (key + value channels), which is more as soon as a chunk
is longer than about heads x d_k x (d_k + d_v) x 4 / (channels x 2 bytes) tokens (docs/
models.md has the numbers). The convolution's lead-in is one small all-gather of each
chunk's last kernel - 1 inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.interfaces import AttentionCore, find
from titanlite.parallel.context.attention import ContextParallel, _GatherSequence


class RecurrentContext:
    """This rank's part of the cp group for recurrent cores (``RecurrentSplit``)."""

    def __init__(self, context: ContextParallel):
        self.context = context
        self.group, self.degree, self.rank = context.group, context.degree, context.rank
        self.mine = (self.rank, 2 * self.degree - 1 - self.rank)  # this rank's chunks, in order
        # Gathered pieces arrive rank by rank, (early, late) each: index of chunk j in them.
        self.chunk_order = [
            2 * j if j < self.degree else 2 * (2 * self.degree - 1 - j) + 1
            for j in range(2 * self.degree)
        ]
        self.received_bytes = 0
        """Bytes this rank received in forward all-gathers (the backward reduce-scatters
        send as many): what tests and docs compare with gathering keys and values."""
        self.kv_equivalent_bytes = 0
        """Bytes all-gathering the same layers' keys and values would have received."""

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        b, local, *rest = x.shape
        return x.reshape(b, 2, local // 2, *rest).transpose(0, 1).reshape(2 * b, local // 2, *rest)

    def unrows(self, x: torch.Tensor) -> torch.Tensor:
        rows, chunk, *rest = x.shape
        return (
            x.reshape(2, rows // 2, chunk, *rest)
            .transpose(0, 1)
            .reshape(rows // 2, 2 * chunk, *rest)
        )

    def _gather_chunks(self, pieces: torch.Tensor) -> torch.Tensor:
        """[2, ...] this rank's (early, late) pieces -> [2 cp, ...] every chunk's, in chunk
        order (autograd: the gradient of each piece comes back summed to its owner)."""
        self.received_bytes += (self.degree - 1) * pieces.numel() * pieces.element_size()
        gathered = _GatherSequence.apply(pieces, self.group)
        return gathered[self.chunk_order]

    def lead_in(
        self, inputs: list[torch.Tensor], n: int, documents: torch.Tensor | None
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        widths = [t.shape[-1] for t in inputs]
        x = torch.cat(inputs, -1)  # one gather for all of them
        rows, chunk, width = x.shape
        b, m = rows // 2, min(chunk, n)
        self.kv_equivalent_bytes += (
            (self.degree - 1) * rows * chunk * sum(widths[1:]) * x.element_size()
        )
        tails = self._gather_chunks(x[:, chunk - m :].reshape(2, b, m, width))
        # Every chunk's tail in sequence order, after n zeros for the tokens before the start:
        # chunk j's lead-in is the n entries from j x m (its predecessor's tail, or the whole
        # chunks before it when they are shorter than n).
        flat = F.pad(tails.transpose(0, 1).reshape(b, -1, width), (0, 0, n, 0))
        lead = torch.cat([flat[:, j * m : j * m + n] for j in self.mine])
        extended = torch.cat([lead, x], 1).split(widths, -1)
        if documents is None:
            return list(extended), None
        padded = F.pad(documents, (n, 0), value=-1)  # a document no token belongs to
        lead_documents = torch.cat([padded[:, j * chunk : (j + 1) * chunk + n] for j in self.mine])
        return list(extended), lead_documents

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
        rows, heads, chunk, dk = k.shape
        dv = v.shape[-1]
        resets = None
        if documents is not None:  # from the whole sequence: a chunk may begin a document
            starts = F.pad(documents[:, 1:] != documents[:, :-1], (1, 0), value=False)
            resets = self.rows(starts[:, self.context.positions(2 * chunk, starts.device)])
        # From the identity in d_k extra value columns: the transition M beside F.
        wide_v = torch.cat([v.new_zeros(rows, heads, chunk, dk), v], -1)
        eye = torch.eye(dk, dtype=v.dtype, device=v.device).expand(rows, heads, dk, dk)
        start = torch.cat([eye, v.new_zeros(rows, heads, dk, dv)], -1)
        out, end = core.scan(q, k, wide_v, g=g, beta=beta, resets=resets, initial_state=start)  # type: ignore[operator]
        ends = self._gather_chunks(end.reshape(2, rows // 2, heads, dk, dk + dv))
        state = end.new_zeros(rows // 2, heads, dk, dv)
        starts_of = {}
        for j in range(max(self.mine) + 1):
            starts_of[j] = state
            state = ends[j, ..., :dk] @ state + ends[j, ..., dk:]
        before = torch.cat([starts_of[j] for j in self.mine]).to(out.dtype)
        return out[..., dk:] + out[..., :dk] @ before


def apply_linear_cp(model: nn.Module, context: ContextParallel) -> RecurrentContext | None:
    """Point every recurrent core of ``model`` at a ``RecurrentContext`` over ``context``'s
    group; returns it (None when the model has no recurrent core)."""
    cores = [core for core in find(model, AttentionCore) if core.recurrent]
    if not cores:
        return None
    split = RecurrentContext(context)
    for core in cores:
        core.sequence_split = split
    return split
