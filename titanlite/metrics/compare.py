"""How runs are compared for parity (scripts/loss_compare.py, tests). Plain Python: the
comparison script starts without importing torch."""

from __future__ import annotations

import math


def relative_difference(a: float, b: float) -> float:
    """|a - b| relative to the larger magnitude; 0 when equal, inf when one is non-finite."""
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b))
