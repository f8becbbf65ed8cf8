"""Building blocks the families share: RMSNorm, RoPE, the SwiGLU feed-forward."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def outside_graphs(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compiler.disable(fn)`` (eager, a graph break inside compiled code), with the
    disabled wrapper made on the first call from compiled code rather than at import.

    ``torch.compiler.disable`` imports ``torch._dynamo`` where it decorates: about half a second
    of CPU in every process that imports the models. Training pays it anyway (torch.optim's
    ``Optimizer`` imports it); dry runs, conversions and evaluation scripts need not.
    Eager calls go straight to ``fn``. Traced by ``torch.compile``, the wrapper makes the
    disabled function once (``torch.compiler.disable`` is itself a graph break) and calls it,
    so ``fn`` runs eagerly there, as under the decorator."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return _disabled(fn)(*args, **kwargs)
        return fn(*args, **kwargs)

    return call


_DISABLED: dict[Callable[..., Any], Callable[..., Any]] = {}


def _disabled(fn: Callable[..., Any]) -> Callable[..., Any]:
    if fn not in _DISABLED:
        _DISABLED[fn] = torch.compiler.disable(fn)
    return _DISABLED[fn]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 whatever the activation dtype, as Llama does.
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """cos and sin of every (position, frequency) pair: shape [max_seq_len, head_dim/2, 2]
    (YaRN's stretched table: ``titanlite.models.yarn.yarn_tables``)."""
    # Always computed on the CPU (then moved): arange on the meta device would import torch's
    # compiler stack (seconds) just to build a model whose buffers are filled in later anyway.
    cpu = torch.device("cpu")
    freqs = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=cpu) / head_dim)
    )
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64, device=cpu), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1).float()


def _table_for(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The rows of a RoPE table that x [batch, seq, heads, head_dim] needs, with a heads axis:
    [seq, 1, head_dim/2, 2] from the whole table (positions 0, 1, ...), or [batch, seq, 1,
    head_dim/2, 2] from a table already indexed by per-sequence positions."""
    if table.dim() == 3:
        table = table[: x.shape[1]]
    return table.float().unsqueeze(-3)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x0, x1) of x [batch, seq, heads, head_dim], as Meta's Llama."""
    table = _table_for(x, table)
    if torch.compiler.is_compiling():
        # Written out in real numbers, inductor fuses the rotation into one kernel; it has no
        # complex kernels and would call back into eager code for a complex product.
        pairs = x.float().unflatten(-1, (-1, 2))
        cos, sin = table[..., 0], table[..., 1]
        x0, x1 = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
        return rotated.flatten(-2).type_as(x)
    # Eager: as complex numbers (x0 + i x1) * (cos + i sin), one kernel each way; faster on a
    # CPU than the four products above (and bitwise equal to them; docs/performance.md).
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    rotation = torch.view_as_complex(table.contiguous())
    return torch.view_as_real(pairs * rotation).flatten(-2).type_as(x)


def apply_rope_halves(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate (x_i, x_{i + head_dim/2}) pairs of x [batch, seq, heads, head_dim], as Hugging
    Face's rotate_half (Qwen3 checkpoints are trained this way)."""
    table = _table_for(x, table)
    cos, sin = table[..., 0], table[..., 1]
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    return rotated.type_as(x)


ROPE_STYLES = {"interleaved": apply_rope, "halves": apply_rope_halves}


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x), the dense feed-forward and a MoE's shared experts."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def count_params(model: nn.Module) -> int:
    """Unique parameters (tied weights once), by their global shapes."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
