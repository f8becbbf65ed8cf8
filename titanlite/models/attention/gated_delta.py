"""The "gated_delta" core: Gated DeltaNet's linear attention (the gated delta rule).

Queries and keys are L2-normalized per head and queries scaled by 1/sqrt(key head size);
each query/key head serves ``value heads / key heads`` consecutive value heads. The state
restarts at every document start when document ids are given (``Mask.documents``). The
rule itself is ``delta_rule.chunk_gated_delta_rule``: plain PyTorch, any device; on CUDA,
flash-linear-attention's kernel instead when that package is installed (``fla_rule``). Under context
parallelism (``sequence_split``, a ``RecurrentSplit``) the core's rows are this rank's chunks
and the split supplies the state before each (``titanlite.parallel.context.recurrent``).
"""

from __future__ import annotations

import torch

from titanlite.models.attention import fla_rule
from titanlite.models.attention.delta_rule import chunk_gated_delta_rule, document_starts
from titanlite.models.interfaces import AttentionCore, Mask


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dimension (the published layer's epsilon)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


class GatedDeltaAttention(AttentionCore):
    mask = Mask(causal=True)  # keys are summarized in a state; documents restart it
    recurrent = True  # context parallelism passes a state between ranks, not keys

    def __init__(self) -> None:
        super().__init__()
        self.chunk_size = 64
        """Tokens per chunk of the delta rule (the block sets its args' chunk_size)."""
        self.kernel = "auto"
        """"auto": flash-linear-attention's kernel on CUDA when it imports; "torch": never."""

    def forward(  # type: ignore[override]  # a recurrent core also takes decays and steps
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: torch.Tensor | None = None,
        *,
        g: torch.Tensor,
        beta: torch.Tensor,
    ) -> torch.Tensor:
        """q, k [b, key heads, seq, d_k], v [b, value heads, seq, d_v], log-decays g and
        step sizes beta [b, value heads, seq] -> outputs [b, value heads, seq, d_v]."""
        group = v.shape[1] // k.shape[1]
        q = l2_normalize(q.float()) * q.shape[-1] ** -0.5
        k = l2_normalize(k.float())
        if group > 1:
            q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
        if self.sequence_split is not None:
            split = self.sequence_split
            return split.recurrence(self, q, k, v, g=g, beta=beta, documents=documents)  # type: ignore[attr-defined]
        resets = None if documents is None else document_starts(documents)
        out, _ = self.scan(q, k, v, g=g, beta=beta, resets=resets)
        return out

    def scan(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        g: torch.Tensor,
        beta: torch.Tensor,
        resets: torch.Tensor | None = None,
        initial_state: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rule over normalized, head-matched q, k, v from ``initial_state`` (zero if
        None): outputs and the final state (``chunk_gated_delta_rule``, or the same through
        ``fla_rule.run`` where ``fla_rule.choose`` picks flash-linear-attention's kernel)."""
        op = fla_rule.choose(self.kernel, q.device)
        if op is not None:
            return fla_rule.run(
                op, q, k, v, g=g, beta=beta, resets=resets, initial_state=initial_state
            )
        return chunk_gated_delta_rule(
            q,
            k,
            v,
            g=g,
            beta=beta,
            chunk_size=self.chunk_size,
            resets=resets,
            initial_state=initial_state,
        )
