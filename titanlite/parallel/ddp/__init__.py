"""titanlite's own data-parallel engine (the PyTorch DDP paper's algorithm); docs/ddp.md walks
through it. Use it from here::

    from titanlite.parallel.ddp import BucketedDDP, bf16_compress_hook

The modules: the ``nn.Module`` a user holds (``engine``: ``BucketedDDP``), the reducer that
fills buckets and launches their all-reduces during backward (``reducer``), the per-bucket
communication hooks (``comm_hooks``), and the engine's stateless pieces: where gradients live
(``buckets``: parameter collection, bucket assignment and allocation), one synchronised
iteration's bookkeeping and the autograd-graph walk for unused parameters (``iteration``),
and the collectives outside backward (``collectives``: the construction-time parameter check
and broadcast, the after-backward all-reduce that other parallelisms use too).

May import: torch and torch.distributed only; nothing else of titanlite.
"""

from titanlite.parallel.ddp.comm_hooks import (
    CommHook,
    GradBucket,
    allreduce_hook,
    bf16_compress_hook,
)
from titanlite.parallel.ddp.engine import BucketedDDP
from titanlite.parallel.ddp.iteration import IterationStats

__all__ = [
    "BucketedDDP",
    "CommHook",
    "GradBucket",
    "IterationStats",
    "allreduce_hook",
    "bf16_compress_hook",
]
