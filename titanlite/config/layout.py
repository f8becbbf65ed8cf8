"""Parallel degrees and batch arithmetic: pure functions of the config and the world size.

Kept free of torch so the launcher can reject an impossible layout before any process
starts. The mesh has five named dimensions, outermost first: pp (pipeline stages),
dp_replicate (replicas), dp_shard (FSDP shards), cp (context parallel) and tp (tensor
parallel); ep (expert parallel) is a view that borrows ranks from dp_shard x cp x tp.
Today's config sets dp_replicate, dp_shard and tp; pp, cp and ep stay 1 until their
parallelisms exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.config.job_config import ConfigError, JobConfig

MESH_DIMS: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Degrees:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in (*MESH_DIMS, "ep"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallelism: the {name} degree must be at least 1")
        borrowed = self.dp_shard * self.cp * self.tp
        if borrowed % self.ep:
            raise ConfigError(
                f"parallelism: the expert-parallel degree {self.ep} must divide "
                f"dp_shard x cp x tp = {borrowed}"
            )

    def of(self, dim: str) -> int:
        return getattr(self, dim)

    @property
    def world_size(self) -> int:
        size = 1
        for dim in MESH_DIMS:
            size *= self.of(dim)
        return size

    @property
    def dp(self) -> int:
        """Ranks that see different data (the batch dimensions)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        """Ranks that shard parameters (context-parallel ranks shard them too)."""
        return self.dp_shard * self.cp

    @property
    def loss(self) -> int:
        """Ranks whose losses and token counts are summed: batch x context."""
        return self.dp * self.cp

    def describe(self) -> str:
        shown = [f"{d}={self.of(d)}" for d in MESH_DIMS if self.of(d) > 1 or d == "dp_shard"]
        return " x ".join(shown)


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
    degrees = Degrees(dp_replicate=rep, dp_shard=shard, tp=tp)
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
