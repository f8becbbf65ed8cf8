"""The reusable mixture-of-experts layer: router options, grouped experts, balancing.

The router options (``options``: ``RouterOptions``, ``GroupLimitedRouting``) are plain
Python, which the families' args dataclasses inherit; the layer and the experts (which need
torch) are imported on first use, so that the model registry imports without torch.

No torch.distributed: expert parallelism (``titanlite.parallel.expert``) and the trainer's
routing statistics (``titanlite.metrics.moe_tracker``) work through this layer's hooks.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from titanlite.models.moe.options import GroupLimitedRouting, RouterOptions

if TYPE_CHECKING:
    from titanlite.models.moe.experts import GroupedExperts, grouped_mm
    from titanlite.models.moe.layer import MoE, Record

_TORCH_SIDE = {  # name -> the module it lives in (imported on first use: it needs torch)
    "GroupedExperts": "experts",
    "grouped_mm": "experts",
    "MoE": "layer",
    "Record": "layer",
}

__all__ = ["GroupLimitedRouting", "GroupedExperts", "MoE", "Record", "RouterOptions", "grouped_mm"]


def __getattr__(name: str) -> Any:
    if name in _TORCH_SIDE:
        return getattr(importlib.import_module(f"titanlite.models.moe.{_TORCH_SIDE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
