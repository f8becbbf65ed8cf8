"""Pipeline parallelism on this machine: each schedule's measured idle ("bubble") fraction per
rank against its theoretical one, step time relative to the same model without PP, and the
per-rank model-state memory at several pipeline degrees.

Runs titanlite's Trainer on gloo processes (one process group per layout), a Llama of
--layers blocks with the debug model's width, --microbatches micro-batches of one sequence per
step. A rank's busy time is the time spent inside its stages' forward and backward calls
(timed around torch.distributed.pipelining's per-micro-batch stage methods); the bubble is
1 - busy / step time, the median over the measured steps, then the mean over ranks.

    python scripts/bench_pipeline.py --pp 4 --microbatches 8 --steps 6

On a machine with fewer cores than ranks the ranks also wait for a core, which the bubble
figure includes: compare schedules with each other in one run, and read the absolute values
against the theory with that in mind.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SCHEDULES = [
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
]
STAGE_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def theoretical_bubble(schedule: str, pp: int, microbatches: int) -> str:
    """Idle fraction with equal stage times: (p - 1) / (v m + p - 1) with v stages per rank;
    the zero-bubble schedules fill it with weight-gradient work (ideal timings: ~0)."""
    if "ZeroBubble" in schedule:
        return "~0"
    v = 1 if schedule in ("GPipe", "1F1B") else 2
    return f"{(pp - 1) / (v * microbatches + pp - 1):.3f}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=4, help="pipeline degree of the bubble table")
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches per step")
    parser.add_argument("--layers", type=int, default=8, help="transformer blocks")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6, help="measured steps (after 2 warm-up)")
    parser.add_argument("--memory-degrees", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--schedules", nargs="*", default=SCHEDULES)
    return parser.parse_args(argv)


def worker(rank: int, world: int, init_file: str, argv: list[str], steps: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from torch.distributed.pipelining import stage as stage_module

    from titanlite.config import load_config
    from titanlite.trainer import Trainer

    busy = [0.0]
    for name in STAGE_METHODS:
        original = getattr(stage_module._PipelineStageBase, name)

        def timed(self, *a, _original=original, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            start = time.perf_counter()
            try:
                return _original(self, *a, **k)
            finally:
                busy[0] += time.perf_counter() - start

        setattr(stage_module._PipelineStageBase, name, timed)
    trainer = Trainer(load_config(argv))
    try:
        batches = iter(trainer.data.loader)
        step_s, bubbles = [], []
        for step in range(steps + 2):
            batch = [next(batches) for _ in range(trainer.accum_steps)]
            dist.barrier()
            busy[0], start = 0.0, time.perf_counter()
            trainer.train_step(batch)
            elapsed = time.perf_counter() - start
            if step >= 2:
                step_s.append(elapsed)
                bubbles.append(1 - busy[0] / elapsed)
        state = sum(trainer.model_state.values()) if trainer.model_state else 0
        result = torch.tensor([statistics.median(step_s), statistics.median(bubbles), state])
    finally:
        trainer.close()
    save_rows(result, rank, world, out)


def save_rows(result: torch.Tensor, rank: int, world: int, out: str) -> None:
    """Every rank's result row, gathered and saved by rank 0; then the group ends."""
    gathered = [torch.zeros(result.numel(), dtype=torch.float64) for _ in range(world)]
    dist.all_gather(gathered, result.double())
    if rank == 0:
        torch.save(torch.stack(gathered), out)
    dist.destroy_process_group()


def spawn_rows(worker, world: int, argv: list[str], extra: int) -> torch.Tensor:  # noqa: ANN001
    """Run ``worker(rank, world, init_file, argv, extra, out)`` on ``world`` gloo processes
    (their dump folder a temporary one); the rows they saved with ``save_rows``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        argv = [*argv, "--job.dump_folder", os.path.join(tmp, "run")]
        mp.spawn(worker, args=(world, os.path.join(tmp, "init"), argv, extra, out), nprocs=world)
        return torch.load(out)


def measure(world: int, argv: list[str], steps: int) -> torch.Tensor:
    """Per rank: (median step seconds, median bubble fraction, model-state bytes)."""
    return spawn_rows(worker, world, argv, steps)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common = [
        "--model.n_layers",
        str(args.layers),
        "--training.seq_len",
        str(args.seq_len),
        "--training.local_batch_size",
        str(args.microbatches),
        "--checkpoint.enable",
        "false",
        "--validation.enable",
        "false",
        "--metrics.log_freq",
        "1000",
        "--training.steps",
        "1000",
    ]
    print(
        f"# bench_pipeline: {datetime.now(timezone.utc):%Y-%m-%d} {platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, llama debug width, {args.layers} "
        f"blocks, seq {args.seq_len}, {args.microbatches} micro-batches of 1 sequence per step"
    )
    base = measure(1, common, args.steps)
    base_step = float(base[0, 0])
    print(f"\nno PP (1 process): {base_step * 1e3:.0f} ms per step\n")
    print(
        f"| schedule (pp={args.pp}) | bubble measured (mean over ranks) | theoretical | "
        "step time vs no PP |"
    )
    print("|---|---:|---:|---:|")
    for schedule in args.schedules:
        pp_args = ["--parallelism.pipeline_parallel_degree", str(args.pp)]
        pp_args += ["--parallelism.pipeline_parallel_schedule", schedule]
        rows = measure(args.pp, [*common, *pp_args], args.steps)
        step = float(rows[:, 0].max())
        print(
            f"| {schedule} | {float(rows[:, 1].mean()):.3f} | "
            f"{theoretical_bubble(schedule, args.pp, args.microbatches)} | "
            f"{step / base_step:.2f}x |",
            flush=True,
        )
    print("\n| pipeline degree | model state per rank (largest), MiB |\n|---:|---:|")
    for pp in args.memory_degrees:
        pp_args = ["--parallelism.pipeline_parallel_degree", str(pp)] if pp > 1 else []
        rows = measure(pp, [*common, *pp_args], 1)
        print(f"| {pp} | {float(rows[:, 2].max()) / 2**20:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
