"""Parallel degrees and batch arithmetic: pure functions of the config and the world size.

Kept free of torch so the launcher can reject an impossible layout before any process
starts. The mesh has five named dimensions, outermost first: pp (pipeline stages),
dp_replicate (replicas), dp_shard (FSDP shards), cp (context parallel) and tp (tensor
parallel); ep (expert parallel) borrows its ranks from dp_shard (the inner ep of them;
placed inside cp when cp > 1, see ``titanlite.parallel.dims``). ``pipeline_plan`` splits the
blocks into pipeline stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from titanlite.config.job_config import ConfigError, JobConfig, Parallelism

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
        if self.dp_shard % self.ep:
            raise ConfigError(
                f"parallelism.expert_parallel_degree {self.ep} must divide "
                f"data_parallel_shard_degree {self.dp_shard} (expert parallelism borrows its ranks)"
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
        return " x ".join(shown) + (f" (ep={self.ep} within dp_shard)" if self.ep > 1 else "")


def resolve_degrees(cfg: JobConfig, world_size: int) -> Degrees:
    """Fill in data_parallel_shard_degree=-1 and check the product equals the world size."""
    p = cfg.parallelism
    given = {  # in mesh order; pp and cp are named only when they are used
        "pipeline_parallel_degree": p.pipeline_parallel_degree,
        "data_parallel_replicate_degree": p.data_parallel_replicate_degree,
        "data_parallel_shard_degree": p.data_parallel_shard_degree,
        "context_parallel_degree": p.context_parallel_degree,
        "tensor_parallel_degree": p.tensor_parallel_degree,
    }
    optional = ("pipeline_parallel_degree", "context_parallel_degree")
    for key in optional:
        if given[key] < 1:
            raise ConfigError(f"parallelism.{key} must be at least 1, not {given[key]}")
    shown = {k: v for k, v in given.items() if v > 1 or k not in optional}
    shard = given["data_parallel_shard_degree"]
    if shard == -1:
        others = {k: v for k, v in shown.items() if k != "data_parallel_shard_degree"}
        product = math.prod(others.values())
        if world_size % product:
            raise ConfigError(
                f"parallelism: world size {world_size} is not divisible by "
                f"{' x '.join(others)} = {' x '.join(map(str, others.values()))}"
            )
        shard = shown["data_parallel_shard_degree"] = world_size // product
    degrees = Degrees(
        dp_replicate=given["data_parallel_replicate_degree"],
        dp_shard=shard,
        tp=given["tensor_parallel_degree"],
        pp=given["pipeline_parallel_degree"],
        cp=given["context_parallel_degree"],
        ep=p.expert_parallel_degree,
    )
    if degrees.world_size != world_size:
        raise ConfigError(
            f"parallelism: {' x '.join(shown)} = {' x '.join(map(str, shown.values()))} = "
            f"{degrees.world_size}, but the world size is {world_size}"
        )
    return degrees


# Schedules that run several stages per rank: "loop" places stage s on rank s % pp, "v" gives
# rank r stages r and 2 pp - 1 - r (the V shape, so the first and last stage share a rank).
MULTI_STAGE: dict[str, Literal["loop", "v"]] = {
    "Interleaved1F1B": "loop",
    "LoopedBFS": "loop",
    "InterleavedZeroBubble": "loop",
    "ZBVZeroBubble": "v",
}


@dataclass(frozen=True)
class PipelinePlan:
    """Which blocks each pipeline stage holds and which stages each pp rank runs."""

    schedule: str
    pp: int
    stage_blocks: tuple[tuple[int, ...], ...]
    """Block indices of each stage, in order (stage 0 also holds the embedding, the last
    stage the final norm, the output projection and the loss)."""
    microbatches: int
    """Pipeline micro-batches per local batch."""

    @property
    def n_stages(self) -> int:
        return len(self.stage_blocks)

    @property
    def style(self) -> Literal["single", "loop", "v"]:
        return MULTI_STAGE.get(self.schedule, "single")

    def stage_rank(self, stage: int) -> int:
        """The pp rank that runs ``stage``."""
        if self.style == "v" and stage >= self.pp:
            return 2 * self.pp - 1 - stage
        return stage % self.pp

    def rank_stages(self, pp_rank: int) -> list[int]:
        """The stage indices pp rank ``pp_rank`` runs, in increasing order."""
        if self.style == "v":
            return [pp_rank, 2 * self.pp - 1 - pp_rank]
        return list(range(pp_rank, self.n_stages, self.pp))

    def in_flight(self, pp_rank: int) -> int:
        """Peak number of (micro-batch, stage) activation sets ``pp_rank`` keeps for backward,
        with equal stage times: GPipe all micro-batches; 1F1B min(m, p - r); LoopedBFS every
        micro-batch of every local stage; the interleaved ones Megatron's warm-up count
        (v - 1) p + 2 (p - r - 1) + 1; the V schedule about 2 p (the ZB-V paper: as 1F1B's p
        micro-batches of a whole rank's layers, in chunks of half the size)."""
        m, p, v, r = self.microbatches, self.pp, self.n_stages // self.pp, pp_rank
        if self.schedule == "GPipe":
            return m
        if self.schedule == "1F1B":
            return min(m, p - r)
        if self.schedule == "LoopedBFS":
            return v * m
        if self.schedule == "ZBVZeroBubble":
            return min(2 * m, 2 * p)
        return min(v * m, (v - 1) * p + 2 * (p - r - 1) + 1)

    def describe(self) -> str:
        runs: list[list[int]] = []  # [blocks, how many consecutive stages have that many]
        for blocks in self.stage_blocks:
            if runs and runs[-1][0] == len(blocks):
                runs[-1][1] += 1
            else:
                runs.append([len(blocks), 1])
        sizes = ", ".join(f"{k} x {n}" if k > 1 else str(n) for n, k in runs)
        return (
            f"{self.schedule}, {self.n_stages} stages ({sizes} blocks), "
            f"{self.microbatches} micro-batches"
        )


def pipeline_plan(
    p: Parallelism, degrees: Degrees, n_layers: int, local_batch_size: int
) -> PipelinePlan | None:
    """The pipeline split of ``n_layers`` blocks (None without pipeline parallelism) with
    micro-batches cut from ``local_batch_size`` sequences; a ConfigError naming the key for a
    split or schedule that cannot work."""
    pp = degrees.pp
    if pp == 1:
        return None
    schedule, style = p.pipeline_parallel_schedule, MULTI_STAGE.get(p.pipeline_parallel_schedule)
    first_less, last_less = (
        p.pipeline_parallel_first_stage_less_layers,
        p.pipeline_parallel_last_stage_less_layers,
    )
    slots = n_layers + first_less + last_less  # as if the first and last had full stages
    per_stage = p.pipeline_parallel_layers_per_stage
    if per_stage is None:
        n_stages = pp * (2 if style else 1)
    elif slots % per_stage:
        raise ConfigError(
            f"parallelism.pipeline_parallel_layers_per_stage {per_stage} does not divide the "
            f"{n_layers} blocks + first/last_stage_less_layers {first_less} + {last_less}"
        )
    else:
        n_stages = slots // per_stage
    if n_stages % pp:
        raise ConfigError(
            f"parallelism: {n_stages} pipeline stages do not divide evenly over "
            f"pipeline_parallel_degree {pp} ranks"
        )
    per_rank = n_stages // pp
    if style and per_rank < 2:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule {schedule} runs several stages per rank, "
            f"but the split gives {per_rank} (use fewer pipeline_parallel_layers_per_stage, or "
            "GPipe / 1F1B)"
        )
    if style == "v" and per_rank != 2:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule {schedule} needs exactly 2 stages per rank, "
            f"but the split gives {per_rank}"
        )
    if not style and per_rank != 1:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule {schedule} runs one stage per rank, but the "
            f"split gives {per_rank} (use Interleaved1F1B, LoopedBFS or InterleavedZeroBubble)"
        )
    base, extra = divmod(slots, n_stages)
    sizes = [base + (1 if i < extra else 0) for i in range(n_stages)]
    sizes[0] -= first_less
    sizes[-1] -= last_less
    if min(sizes) < 0 or min(sizes[1:-1], default=1) < 1:  # only the ends may hold no block
        raise ConfigError(
            f"parallelism: {n_layers} blocks cannot fill {n_stages} pipeline stages with "
            f"first/last_stage_less_layers {first_less}/{last_less}"
        )
    bounds = [sum(sizes[:i]) for i in range(n_stages + 1)]
    blocks = tuple(tuple(range(bounds[i], bounds[i + 1])) for i in range(n_stages))
    size = p.pipeline_parallel_microbatch_size
    if size < 1 or local_batch_size % size:
        raise ConfigError(
            f"parallelism.pipeline_parallel_microbatch_size {size} does not divide "
            f"training.local_batch_size {local_batch_size}"
        )
    microbatches = local_batch_size // size
    if schedule in ("1F1B",) and microbatches < n_stages:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule {schedule} needs at least as many "
            f"micro-batches as stages ({n_stages}); training.local_batch_size / "
            f"pipeline_parallel_microbatch_size = {microbatches}"
        )
    rounds = max(1, microbatches // pp)
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble") and (
        microbatches % rounds
    ):
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule {schedule} needs the micro-batches "
            f"({microbatches}) to be a multiple of {rounds} (their number over the "
            f"pipeline_parallel_degree {pp}, rounded down)"
        )
    return PipelinePlan(schedule, pp, blocks, microbatches)


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
