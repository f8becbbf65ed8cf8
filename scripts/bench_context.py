"""Context parallelism on this machine: per-rank activation memory and step time at long
sequence lengths for several cp degrees, and the share of the step spent gathering keys and
values.

Runs titanlite's Trainer on gloo processes (one process group per layout, one intra-op thread
per rank): a Llama of the debug model's width (--layers blocks), one sequence per step.
Per rank it measures, over one training step:

  activations   bytes autograd keeps for backward (every distinct storage packed by a
                saved-tensor hook during the step, the weights' own left out: all of them are
                alive when backward starts)
  peak RSS      the process's high-water mark (the model, optimizer and torch itself included)
  CPU s         the rank's CPU time for the step: its own work, independent of how many ranks
                share this machine's cores
  gather        time inside the all-gather of keys and values and its backward reduce-scatter
                (with --windows, also inside the windowed layers' all-to-all and its backward)
  received      bytes of keys and values (and their gradients) the rank received in those
                collectives, forward and backward

    python scripts/bench_context.py --seq-lens 8192 16384 32768 --cp 1 2 4
    python scripts/bench_context.py --seq-lens 4096 --cp 1 2 4 --windows 0 128

``--windows``: a sliding window of that many keys on every layer (0: full attention); a
windowed layer receives only the keys its windows reach (titanlite/parallel/context/window.py).

With more ranks than cores the ranks also wait for a core: wall time then overstates a step,
so the table's step-time ratio is per-rank CPU time against cp 1 (what a rank per core or
per GPU would see), and the wall time is printed beside it.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import sys
import time
from datetime import datetime, timezone

import torch
import torch.distributed as dist
from bench_pipeline import save_rows, spawn_rows

MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="*", default=[8192, 16384, 32768])
    parser.add_argument("--cp", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--warmup", type=int, default=0, help="unmeasured steps first")
    parser.add_argument("--windows", type=int, nargs="*", default=[0], help="0: no window")
    return parser.parse_args(argv)


def worker(rank: int, world: int, init_file: str, argv: list[str], warmup: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from titanlite.config import load_config
    from titanlite.trainer import Trainer

    gather_s, received = [0.0], [0]
    for name in ("all_gather_single", "reduce_scatter_single", "all_to_all_single"):
        original = getattr(dist, name)

        def timed(out, x, *a, _original=original, _name=name, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            start = time.perf_counter()
            try:
                return _original(out, x, *a, **k)
            finally:
                gather_s[0] += time.perf_counter() - start
                if _name == "all_to_all_single":  # (titanlite's windows send nothing to self)
                    received[0] += out.nbytes
                else:  # all but this rank's own part
                    received[0] += abs(out.nbytes - x.nbytes)

        setattr(dist, name, timed)
    saved: dict[int, int] = {}

    weights: set[int] = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    trainer = Trainer(load_config(argv))
    try:
        for part in trainer.model.parts:  # saved for backward too, but not activations
            weights.update(p.untyped_storage().data_ptr() for p in part.parameters())
        batches = iter(trainer.data.loader)
        for _ in range(warmup + 1):
            batch = [next(batches) for _ in range(trainer.accum_steps)]
            dist.barrier()
            saved.clear()
            gather_s[0], received[0] = 0.0, 0
            wall, cpu = time.perf_counter(), time.process_time()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                trainer.train_step(batch)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        result = torch.tensor([sum(saved.values()), peak, cpu, wall, gather_s[0], received[0]])
    finally:
        trainer.close()
    save_rows(result, rank, world, out)


def measure(world: int, argv: list[str], warmup: int) -> torch.Tensor:
    """Per rank: (activation bytes, peak RSS bytes, CPU s, wall s, gather s, received bytes)
    of one step."""
    return spawn_rows(worker, world, argv, warmup)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(
        f"# bench_context: {datetime.now(timezone.utc):%Y-%m-%d} {platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, llama debug width (dim 256, 8 "
        f"heads, 4 KV heads), {args.layers} blocks, 1 sequence per step, fp32, 1 thread per rank"
    )
    print(
        "\n| seq_len | window | cp | activations per rank, MiB | vs cp 1 | peak RSS per rank, "
        "MiB | CPU s per rank | vs cp 1 | wall s | gather share | received per rank, KiB |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for seq in args.seq_lens:
        for window in args.windows:
            base: torch.Tensor | None = None
            for cp in args.cp:
                layout = [
                    "--model.n_layers",
                    str(args.layers),
                    "--training.seq_len",
                    str(seq),
                    "--training.local_batch_size",
                    "1",
                    "--checkpoint.enable",
                    "false",
                    "--validation.enable",
                    "false",
                    "--metrics.log_freq",
                    "1000",
                    "--training.steps",
                    "1000",
                    "--parallelism.context_parallel_degree",
                    str(cp),
                    "--model.sliding_window",
                    str(window),
                ]
                rows = measure(cp, layout, args.warmup)
                worst = rows.max(dim=0).values  # the busiest rank of each figure
                base = worst if base is None else base
                print(
                    f"| {seq:,} | {window or '-'} | {cp} | {worst[0] / MIB:,.0f} | "
                    f"{worst[0] / base[0]:.2f} | {worst[1] / MIB:,.0f} | {worst[2]:.1f} | "
                    f"{worst[2] / base[2]:.2f} | {worst[3]:.1f} | "
                    f"{float((rows[:, 4] / rows[:, 3]).mean()):.1%} | {worst[5] / 1024:,.0f} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
