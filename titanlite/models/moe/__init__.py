"""The reusable mixture-of-experts layer: router options, grouped experts, balancing.

No torch.distributed: expert parallelism (``titanlite.parallel.expert``) and the trainer's
routing statistics (``titanlite.metrics.moe_tracker``) work through this layer's hooks.
"""

from titanlite.models.moe.experts import GroupedExperts, grouped_mm
from titanlite.models.moe.layer import MoE, Record

__all__ = ["GroupedExperts", "MoE", "Record", "grouped_mm"]
