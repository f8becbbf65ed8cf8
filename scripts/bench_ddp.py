"""Benchmark titanlite's BucketedDDP against torch DDP and naive gradient averaging.

Spawns one process group per world size (gloo; CPU unless --device cuda) and measures the
per-step time (forward + backward + gradient communication, median over the measured steps,
slowest rank per step) of each method on a transformer-like MLP stack:

  floor      no communication at all
  titanlite  titanlite.parallel.ddp.BucketedDDP, swept over --bucket-caps (MiB)
  torch      torch.nn.parallel.DistributedDataParallel at the same caps
  per-param  after backward, one async all-reduce per parameter gradient, then wait
  flat       after backward, concatenate all gradients into one all-reduce

Methods are interleaved step by step (the starting method rotates every step), so slow
periods of a shared machine hit every method alike. Prints a markdown table.

    python scripts/bench_ddp.py --world-sizes 2 4 --steps 10
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from titanlite.parallel.ddp import BucketedDDP


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def build_model(dim: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(dim) for _ in range(depth)], nn.LayerNorm(dim))


def per_param_allreduce(model: nn.Module, world: int) -> None:
    works = [dist.all_reduce(p.grad, async_op=True) for p in model.parameters()]
    for work in works:
        work.wait()
    for p in model.parameters():
        p.grad.div_(world)


def flat_allreduce(model: nn.Module, world: int) -> None:
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(world)
    for g, piece in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(piece.view_as(g))


def worker(rank: int, world: int, init_file: str, args: argparse.Namespace, out: dict) -> None:
    torch.set_num_threads(args.threads)
    device = torch.device(f"cuda:{rank}") if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)

    # name -> (model to zero and call, hook run after backward or None)
    methods: dict[str, tuple[nn.Module, Callable[[], None] | None]] = {}
    methods["floor"] = (build_model(args.dim, args.depth).to(device), None)
    for cap in args.bucket_caps:
        ours = BucketedDDP(
            build_model(args.dim, args.depth).to(device),
            bucket_cap_mb=cap,
            first_bucket_cap_mb=min(1.0, cap),
        )
        methods[f"titanlite@{cap:g}"] = (ours, None)
        # At 25 MiB torch runs its defaults (bucket_cap_mb=None: 25 MiB and a 1 MiB first
        # bucket), the same layout as titanlite's defaults; with an explicit cap torch sizes
        # the first bucket at the cap too.
        theirs = DistributedDataParallel(
            build_model(args.dim, args.depth).to(device),
            device_ids=[rank] if device.type == "cuda" else None,
            bucket_cap_mb=None if cap == 25.0 else cap,
            gradient_as_bucket_view=True,
        )
        methods[f"torch@{cap:g}"] = (theirs, None)
    naive = build_model(args.dim, args.depth).to(device)
    methods["per-param"] = (naive, lambda m=naive: per_param_allreduce(m, world))
    flat = build_model(args.dim, args.depth).to(device)
    methods["flat"] = (flat, lambda m=flat: flat_allreduce(m, world))

    x = torch.randn(args.batch, args.dim, generator=torch.Generator().manual_seed(rank))
    x = x.to(device)
    names = list(methods)
    times: dict[str, list[float]] = {name: [] for name in names}
    for step in range(args.warmup + args.steps):
        start = step % len(names)
        for name in names[start:] + names[:start]:
            model, after_backward = methods[name]
            model.zero_grad(set_to_none=True)
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(x).square().mean().backward()
            if after_backward is not None:
                after_backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            if step >= args.warmup:
                times[name].append(elapsed)

    # Slowest rank per step: a step is as slow as its slowest participant.
    table = torch.tensor([times[name] for name in names], dtype=torch.float64, device=device)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    if rank == 0:
        nparams = sum(p.numel() for p in methods["floor"][0].parameters())
        steps_ms = {
            n: [1e3 * t for t in row.tolist()] for n, row in zip(names, table.cpu(), strict=True)
        }
        out[world] = {"params": nparams, "steps_ms": steps_ms}
    dist.barrier()
    dist.destroy_process_group()


def format_table(results: dict, caps: list[float]) -> str:
    """One row per method; ratios compare with torch DDP at the same bucket cap.

    "paired" is the median over steps of (this method / torch DDP) measured in the same
    round, which cancels most of the noise a shared machine adds to both.
    """
    lines = [
        "| ranks | method | bucket MiB | median ms/step | min ms/step | vs torch DDP "
        "| paired vs torch DDP | vs floor | overhead over floor ms | overhead vs torch DDP's |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for world, result in sorted(results.items()):
        steps = result["steps_ms"]
        med = {name: statistics.median(times) for name, times in steps.items()}
        floor = med["floor"]
        rows = [("floor", "floor (no communication)", "-", None)]
        for cap in caps:
            rows.append(
                (f"titanlite@{cap:g}", "titanlite BucketedDDP", f"{cap:g}", f"torch@{cap:g}")
            )
            rows.append((f"torch@{cap:g}", "torch DDP", f"{cap:g}", None))
        rows += [
            ("per-param", "per-param all-reduce after backward", "-", "torch@25"),
            ("flat", "one flat all-reduce after backward", "-", "torch@25"),
        ]
        for key, label, cap_text, versus in rows:
            t = med[key]
            ratio = paired = overhead_ratio = "-"
            if versus in med:
                ratio = f"{t / med[versus]:.3f}"
                pairs = [a / b for a, b in zip(steps[key], steps[versus], strict=True)]
                paired = f"{statistics.median(pairs):.3f}"
                if med[versus] > floor:
                    overhead_ratio = f"{(t - floor) / (med[versus] - floor):.2f}"
            lines.append(
                f"| {world} | {label} | {cap_text} | {t:.1f} | {min(steps[key]):.1f} | {ratio} "
                f"| {paired} | {t / floor:.3f} | {t - floor:.1f} | {overhead_ratio} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=15, help="measured steps per method")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps (incl. rebuild)")
    parser.add_argument("--dim", type=int, default=768, help="model width")
    parser.add_argument("--depth", type=int, default=5, help="number of MLP blocks")
    parser.add_argument("--batch", type=int, default=16, help="rows per rank per step")
    parser.add_argument("--bucket-caps", type=float, nargs="+", default=[1.0, 5.0, 25.0, 100.0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()

    manager = mp.Manager()
    out = manager.dict()
    for world in args.world_sizes:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(worker, args=(world, os.path.join(tmp, "init"), args, out), nprocs=world)
    results = dict(out)
    nparams = next(iter(results.values()))["params"]
    print(f"# bench_ddp {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"command: python scripts/bench_ddp.py {' '.join(sys.argv[1:])}")
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
        f"torch {torch.__version__}, backend {'nccl' if args.device == 'cuda' else 'gloo'}, "
        f"{args.threads} thread(s) per rank"
    )
    print(
        f"model: {args.depth} MLP blocks of width {args.dim} ({nparams / 1e6:.1f}M parameters, "
        f"fp32), {args.batch} rows per rank; "
        f"{args.steps} measured steps after {args.warmup} warmup\n"
    )
    print(format_table(results, args.bucket_caps))


if __name__ == "__main__":
    main()
