"""The experts of a mixture-of-experts layer: SwiGLUs run as grouped matrix multiplies over
the token rows sorted by expert (``torch.nn.functional.grouped_mm`` where it runs, a padded
batched matmul elsewhere), never as a Python loop over experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.interfaces import RoutedExperts

_FAST: dict[tuple[str, torch.dtype], bool] = {}
"""(device type, dtype) -> whether torch's grouped_mm ran there (tried once)."""


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` [N, in] sorted by group, group g (``counts[g]`` rows) times ``w[g]``
    [in, out]: [N, out]. No host synchronization on the fast path."""
    if x.is_meta:  # a shape probe (the dry run): one matmul keeps what a grouped one keeps
        return x @ w[0]
    key = (x.device.type, x.dtype)
    aligned = all((t.shape[-1] * t.element_size()) % 16 == 0 for t in (x, w))
    if aligned and _FAST.get(key, True) and hasattr(F, "grouped_mm"):
        try:
            out = F.grouped_mm(x, w, offs=torch.cumsum(counts, 0, dtype=torch.int32))
            _FAST[key] = True
            return out
        except (RuntimeError, NotImplementedError):  # not for this device or dtype
            _FAST[key] = False
    return _padded_bmm(x, w, counts)


def _padded_bmm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The same as one batched matmul over groups padded to the largest (one host read)."""
    groups = w.shape[0]
    starts = torch.cumsum(counts, 0) - counts
    group = torch.repeat_interleave(torch.arange(groups, device=x.device), counts)
    row = torch.arange(x.shape[0], device=x.device) - starts[group]
    padded = x.new_zeros(groups, int(counts.max()) if x.shape[0] else 0, x.shape[1])
    padded[group, row] = x
    return torch.bmm(padded, w)[group, row]


class GroupedExperts(RoutedExperts):
    """``num_experts`` SwiGLUs as three [experts, in, out] weights (w1 gate, w3 up, w2 down),
    with, given ``bias``, a bias per expert on each (b1, b3 [experts, hidden], b2 [experts,
    dim]). Given ``clamp`` (alpha, limit), the activation is gpt-oss's clamped form:
    gate clamped above and up on both sides at the limit, then (up + 1) * gate *
    sigmoid(alpha * gate).

    Under expert parallelism the weights are DTensors split by expert and ``dispatch`` (set by
    ``titanlite.parallel.expert``) moves the rows to the ranks holding their experts."""

    def __init__(
        self,
        num_experts: int,
        dim: int,
        hidden_dim: int,
        *,
        bias: bool = False,
        clamp: tuple[float, float] | None = None,
    ):
        super().__init__()
        self.num_experts, self.clamp = num_experts, clamp
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        if bias:
            self.b1 = nn.Parameter(torch.empty(num_experts, hidden_dim))
            self.b3 = nn.Parameter(torch.empty(num_experts, hidden_dim))
            self.b2 = nn.Parameter(torch.empty(num_experts, dim))
        else:
            self.b1 = self.b3 = self.b2 = None

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        def local(w: torch.Tensor | None) -> torch.Tensor | None:
            return w.to_local() if hasattr(w, "to_local") else w

        w1, w3, w2, b1, b3, b2 = map(local, (self.w1, self.w3, self.w2, self.b1, self.b3, self.b2))

        def swiglu(rows: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
            gate, up = grouped_mm(rows, w1, sizes), grouped_mm(rows, w3, sizes)
            if b1 is not None:  # each row's expert's bias
                expert = torch.repeat_interleave(
                    torch.arange(sizes.numel(), device=rows.device),
                    sizes,
                    output_size=rows.shape[0],
                )
                gate, up = gate + b1[expert], up + b3[expert]
            if self.clamp is None:
                hidden = F.silu(gate) * up
            else:
                alpha, limit = self.clamp
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
                hidden = (up + 1) * gate * torch.sigmoid(alpha * gate)
            out = grouped_mm(hidden, w2, sizes)
            return out if b2 is None else out + b2[expert]

        if self.dispatch is None:
            return swiglu(x, counts)
        return self.dispatch(x, counts, swiglu)
