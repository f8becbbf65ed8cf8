"""YaRN: RoPE stretched past the sequence length a model was pretrained at (Peng et al., 2023),
as DeepSeek-V3 and Kimi K2 ship it.

Each rotary frequency is blended between itself (high frequencies, many turns within the
original context: kept, "extrapolated") and itself divided by ``factor`` (low frequencies:
"interpolated"), with a linear ramp between dimensions ``low`` and ``high``, the ones that
turn ``beta_fast`` and ``beta_slow`` times over the original context. The longer context also
sharpens attention by ``mscale(factor, m) = 0.1 m ln(factor) + 1``: the cos/sin tables carry
``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` and the softmax scale carries
``mscale(factor, mscale_all_dim)^2`` (DeepSeek's split; with both m = 1 the tables stay unit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class YaRN:
    factor: float
    original_seq_len: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0
    truncate: bool = True  # the ramp's ends rounded outwards to whole dimensions (gpt-oss: no)

    def table_scale(self) -> float:
        """What the cos and sin tables are multiplied by."""
        return mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)

    def softmax_scale(self) -> float:
        """What the attention's 1/sqrt(head_dim) is multiplied by."""
        return mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0


def mscale(factor: float, m: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _turning_dim(turns: float, dim: int, theta: float, seq_len: int) -> float:
    """The (fractional) rotary dimension whose frequency turns ``turns`` times in ``seq_len``."""
    return dim * math.log(seq_len / (turns * 2 * math.pi)) / (2 * math.log(theta))


def yarn_tables(head_dim: int, max_seq_len: int, theta: float, yarn: YaRN) -> torch.Tensor:
    """cos and sin of every (position, frequency) pair under YaRN: [max_seq_len, head_dim/2, 2]
    (the layout of ``titanlite.models.layers.rope_tables``)."""
    cpu = torch.device("cpu")  # as rope_tables: never on the meta device
    base = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=cpu) / head_dim)
    kept, stretched = 1.0 / base, 1.0 / (yarn.factor * base)
    low = _turning_dim(yarn.beta_fast, head_dim, theta, yarn.original_seq_len)
    high = _turning_dim(yarn.beta_slow, head_dim, theta, yarn.original_seq_len)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    span = (high - low) or 1e-3  # one dimension: a step, not a division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64, device=cpu) - low) / span).clamp(0, 1)
    freqs = stretched * ramp + kept * (1 - ramp)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64, device=cpu), freqs)
    table = torch.stack([angles.cos(), angles.sin()], dim=-1) * yarn.table_scale()
    return table.float()
