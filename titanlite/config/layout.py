"""Parallel degrees and batch arithmetic: pure functions of the config and the world size.

Kept free of torch so the launcher can reject an impossible layout before any process
starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.config.job_config import ConfigError, JobConfig


@dataclass(frozen=True)
class Degrees:
    dp_replicate: int
    dp_shard: int
    tp: int

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Ranks that see different data (the batch dimensions)."""
        return self.dp_replicate * self.dp_shard


def resolve_degrees(cfg: JobConfig, world_size: int) -> Degrees:
    """Fill in data_parallel_shard_degree=-1 and check the product equals the world size."""
    p = cfg.parallelism
    rep, shard, tp = (
        p.data_parallel_replicate_degree,
        p.data_parallel_shard_degree,
        p.tensor_parallel_degree,
    )
    if shard == -1:
        if world_size % (rep * tp):
            raise ConfigError(
                f"parallelism: world size {world_size} is not divisible by "
                f"data_parallel_replicate_degree x tensor_parallel_degree = {rep} x {tp}"
            )
        shard = world_size // (rep * tp)
    degrees = Degrees(rep, shard, tp)
    if degrees.world_size != world_size:
        raise ConfigError(
            f"parallelism: data_parallel_replicate_degree x data_parallel_shard_degree x "
            f"tensor_parallel_degree = {rep} x {shard} x {tp} = {degrees.world_size}, "
            f"but the world size is {world_size}"
        )
    return degrees


def gradient_accumulation_steps(cfg: JobConfig, degrees: Degrees) -> int:
    """Micro-batches per optimizer step on each rank."""
    t = cfg.training
    per_micro = t.local_batch_size * degrees.dp
    if t.global_batch_size == -1:
        return 1
    if t.global_batch_size % per_micro:
        raise ConfigError(
            f"training.global_batch_size {t.global_batch_size} is not a multiple of "
            f"local_batch_size x data-parallel degree = {t.local_batch_size} x {degrees.dp} "
            f"= {per_micro}"
        )
    return t.global_batch_size // per_micro


def global_batch_size(cfg: JobConfig, degrees: Degrees) -> int:
    return cfg.training.local_batch_size * degrees.dp * gradient_accumulation_steps(cfg, degrees)
