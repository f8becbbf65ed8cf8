"""Process group, device, threads and seeds; small reductions used for logging.

Works the same under torchrun (RANK/WORLD_SIZE/... in the environment) and as a plain
single process (a one-rank group over an in-memory store), so there is one code path.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_info() -> tuple[int, int, int, int]:
    """(rank, world_size, local_rank, local_world_size) as torchrun sets them."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return rank, world, local_rank, local_world


def init(seed: int, timeout_s: float | None = None) -> DistInfo:
    """The process group (``timeout_s``: collective timeout during start-up, every group)."""
    rank, world, local_rank, local_world = env_info()
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        # CPU tensors (e.g. loader state) can still be reduced over gloo.
        backend = "cuda:nccl,cpu:gloo"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        join_group(
            backend,
            rank,
            world,
            device_id=_device_id(device),
            timeout=timedelta(seconds=timeout_s) if timeout_s else None,
        )
    if timeout_s:
        from titanlite.runtime.heartbeat import set_timeouts

        set_timeouts(timeout_s)  # also for the groups made later (the mesh's)
    torch.manual_seed(seed)
    info = DistInfo(rank, world, local_rank, local_world, device)
    logger.info(
        "world size %d (%d per node), device %s, backend %s, %d threads per rank",
        world,
        local_world,
        device,
        backend,
        torch.get_num_threads(),
    )
    return info


def join_group(backend: str, rank: int, world: int, **options: object) -> None:
    """The default process group: torchrun's rendezvous (MASTER_ADDR and the rest in the
    environment; ``options`` go to ``init_process_group``), or for a plain ``python -m ...``
    a group of one, nothing to rendezvous with (a store in memory)."""
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, rank=rank, world_size=world, **options)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def _device_id(device: torch.device) -> torch.device | None:
    return device if device.type == "cuda" else None


def world_size() -> int:
    """Ranks in the default group (1 before it exists)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(value: torch.Tensor, op: dist.ReduceOp, group=None) -> torch.Tensor:  # noqa: ANN001
    """All-reduce a copy (the input is left alone) and return it."""
    out = value.detach().clone()
    dist.all_reduce(out, op=op, group=group)
    return out


def setup_logging() -> None:
    """Rank-prefixed log lines; rank 0 logs INFO, the others only warnings."""
    rank = int(os.environ.get("RANK", "0"))
    level = logging.INFO if rank == 0 else logging.WARNING
    # torchrun's --tee already prefixes every line with the rank.
    prefix = "" if "TORCHELASTIC_RUN_ID" in os.environ else f"[rank{rank}] "
    logging.basicConfig(
        level=level,
        format=f"{prefix}%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
