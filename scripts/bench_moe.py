"""Mixture of experts on this machine: step time of the qwen3_moe (or, --family deepseek_v3,
the DeepSeek-V3) debug model at several expert-parallel degrees, its tokens/s against a dense
model of the same active size, and the share of the step spent in expert parallelism's
dispatch and combine.

Runs titanlite's Trainer on --world gloo processes (one process group per layout, one
intra-op thread per rank), fp32, the same global batch for every layout: dp_shard = world
(FSDP) and the expert-parallel degree borrowed from it (at ep 1 FSDP alone shards the
experts, and each rank computes every expert on its own tokens). The dense baseline is qwen3
debugmodel with the feed-forward width (top_k x moe_hidden_dim, plus the router's share rounded
in) that gives it about the MoE's active parameter count, on the same layout; for deepseek_v3
it is the DeepSeek-V3 debug model itself with every block dense (the same latent attention) at
the width that gives it the MoE's active parameters. Per rank, median over the measured steps:

  step          wall time of Trainer.train_step; the table shows the slowest rank's, and
                tokens/s is the global batch's tokens over it
  CPU           the rank's own CPU time for the step (all its threads): its work, whatever
                the core count; tokens / the busiest rank's CPU time is the throughput with
                a core per rank
  dispatch/     time inside torch.distributed.all_to_all_single, wrapped by this script: the
  combine       integer counts exchange, and the token rows' all-to-alls (dispatch and
                combine, forward and backward), as a share of the step's wall time, and all
                of them as a share of its CPU time (mean over ranks)

    python scripts/bench_moe.py --ep 1 2 4 --world 4 --seq-len 128 --local-batch 2
    python scripts/bench_moe.py --family deepseek_v3 --ep 1 2 --world 2

With more ranks than cores the ranks also wait for a core, and a collective waits for the
slowest rank: the all-to-all time includes that wait, so read the share as an upper bound.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import torch
import torch.distributed as dist
from bench_pipeline import save_rows, spawn_rows

# One row per rank: medians over the measured steps, then the model's parameter counts.
FIELDS = ("step_s", "cpu_s", "counts_s", "a2a_s", "a2a_cpu_s", "calls", "params", "active")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--family",
        choices=("qwen3_moe", "deepseek_v3"),
        default="qwen3_moe",
        help="the MoE debug model, against a dense one of its active size",
    )
    parser.add_argument("--ep", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--world", type=int, default=4, help="ranks = dp_shard for every layout")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--local-batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    parser.add_argument("--steps", type=int, default=6, help="measured steps")
    parser.add_argument("--json", help="also write the rows to this file")
    return parser.parse_args(argv)


def worker(
    rank: int, world: int, init_file: str, argv: list[str], counts: tuple[int, int], out: str
) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from titanlite.config import load_config
    from titanlite.trainer import Trainer

    # Every all-to-all of expert_parallel goes through this function: the counts exchange
    # directly, the token rows through torch.distributed.nn's autograd wrapper (both ways).
    spent = {"counts": 0.0, "a2a": 0.0, "a2a_cpu": 0.0, "calls": 0}
    original = dist.all_to_all_single

    def timed(output, input, *a, **k):  # noqa: A002, ANN001, ANN002, ANN003, ANN202
        start, cpu = time.perf_counter(), time.process_time()
        try:
            return original(output, input, *a, **k)
        finally:
            kind = "a2a" if input.is_floating_point() else "counts"
            spent[kind] += time.perf_counter() - start
            spent["a2a_cpu"] += time.process_time() - cpu
            spent["calls"] += 1

    dist.all_to_all_single = timed
    warmup, steps = counts
    trainer = Trainer(load_config(argv))
    try:
        batches = iter(trainer.data.loader)
        measured: list[tuple[float, ...]] = []
        for step in range(warmup + steps):
            batch = [next(batches) for _ in range(trainer.accum_steps)]
            dist.barrier()
            spent.update(counts=0.0, a2a=0.0, a2a_cpu=0.0, calls=0)
            wall, cpu = time.perf_counter(), time.process_time()
            trainer.train_step(batch)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if step >= warmup:
                measured.append((wall, cpu, *spent.values()))
        medians = [statistics.median(column) for column in zip(*measured, strict=True)]
        result = torch.tensor([*medians, trainer.num_params, trainer.active_params])
    finally:
        trainer.close()
    save_rows(result, rank, world, out)


def measure(world: int, argv: list[str], warmup: int, steps: int) -> torch.Tensor:
    """Per rank, the FIELDS (medians over the measured steps, then the model's counts)."""
    return spawn_rows(worker, world, argv, (warmup, steps))


def dense_width() -> tuple[int, str]:
    """The dense qwen3 feed-forward width whose per-layer parameters equal the MoE's active
    ones: top_k experts of 3 x dim x moe_hidden_dim plus the dim x num_experts router."""
    from titanlite.models.qwen3_moe.args import FLAVORS

    moe = FLAVORS["debugmodel"]
    active_ffn = moe.top_k * 3 * moe.dim * moe.moe_hidden_dim + moe.dim * moe.num_experts
    width = round(active_ffn / (3 * moe.dim))
    shape = (
        f"dim {moe.dim}, {moe.n_layers} layers, {moe.num_experts} experts, top-{moe.top_k}, "
        f"expert width {moe.moe_hidden_dim}"
    )
    return width, shape


def deepseek_dense_width() -> tuple[int, str]:
    """The deepseek_v3 debug model made dense (every block a SwiGLU: first_k_dense = n_layers,
    the same latent attention) with the width that gives it the MoE's active parameters: the
    dense first blocks' widths plus, per MoE block, the top_k and shared experts' and the
    router's (weights and routing bias), spread evenly over the blocks."""
    from titanlite.models.deepseek_v3.args import FLAVORS

    moe = FLAVORS["debugmodel"]
    experts = (moe.top_k + moe.shared_experts) * 3 * moe.dim * moe.moe_hidden_dim
    active_moe_ffn = experts + moe.dim * moe.num_experts + moe.num_experts
    ffn = moe.first_k_dense * 3 * moe.dim * moe.dense_hidden_dim
    ffn += (moe.n_layers - moe.first_k_dense) * active_moe_ffn
    width = round(ffn / (moe.n_layers * 3 * moe.dim))
    shape = (
        f"dim {moe.dim}, {moe.n_layers} layers ({moe.first_k_dense} dense of width "
        f"{moe.dense_hidden_dim}), {moe.num_experts} experts in {moe.n_groups} groups, "
        f"top-{moe.top_k} + {moe.shared_experts} shared, expert width {moe.moe_hidden_dim}, "
        "latent attention"
    )
    return width, shape


def families(family: str, eps: list[int]) -> tuple[str, list[tuple[str, list[str]]]]:
    """The shape line and the (name, argv) layouts: the dense baseline first, then the MoE
    model at each expert-parallel degree."""
    if family == "deepseek_v3":
        from titanlite.models.deepseek_v3.args import FLAVORS

        width, shape = deepseek_dense_width()
        blocks = str(FLAVORS["debugmodel"].n_layers)
        dense = ["--model.first_k_dense", blocks, "--model.dense_hidden_dim", str(width)]
        layouts = [(f"deepseek_v3 dense (width {width})", ["--model.name", "deepseek_v3", *dense])]
        line = f"# deepseek_v3 debugmodel: {shape}; dense: the same, all blocks width {width}"
    else:
        width, shape = dense_width()
        layouts = [
            (
                f"qwen3 dense (hidden {width})",
                ["--model.name", "qwen3", "--model.hidden_dim", str(width)],
            )
        ]
        line = f"# qwen3_moe debugmodel: {shape}; dense: qwen3 debugmodel, hidden_dim {width}"
    layouts += [
        (
            f"{family} ep {ep}",
            ["--model.name", family, "--parallelism.expert_parallel_degree", str(ep)],
        )
        for ep in eps
    ]
    return line, layouts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common = [
        "--training.seq_len",
        str(args.seq_len),
        "--training.local_batch_size",
        str(args.local_batch),
        "--parallelism.data_parallel_shard_degree",
        str(args.world),
        "--checkpoint.enable",
        "false",
        "--validation.enable",
        "false",
        "--metrics.log_freq",
        "1000",
        "--training.steps",
        "1000",
    ]
    tokens = args.world * args.local_batch * args.seq_len
    cores = os.cpu_count() or 1
    print(
        f"# bench_moe: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC {platform.machine()}, "
        f"{cores} cores, torch {torch.__version__}, gloo, fp32, 1 thread per rank; "
        f"{args.world} ranks = dp_shard {args.world}, global batch {args.world} x "
        f"{args.local_batch} x {args.seq_len} = {tokens:,} tokens; {args.warmup} warm-up + "
        f"{args.steps} measured steps (median)"
    )
    if args.world > cores:
        print(f"# {args.world} ranks share {cores} cores: wall time includes waiting for a core")
    line, layouts = families(args.family, args.ep)
    print(line)
    print(
        "\n| model | params | active | step ms (wall, slowest rank) | tokens/s (wall) | "
        "vs dense | CPU ms per step (busiest rank) | tokens/s (1 core per rank) | vs dense | "
        "dispatch/combine, % of wall: counts + rows | % of CPU | all-to-alls per step |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    results: list[dict] = []
    for name, extra in layouts:
        rows = measure(args.world, [*common, *extra], args.warmup, args.steps)
        per_rank = [dict(zip(FIELDS, map(float, r), strict=True)) for r in rows]
        step, cpu = max(r["step_s"] for r in per_rank), max(r["cpu_s"] for r in per_rank)
        row = {
            "model": name,
            "params": int(per_rank[0]["params"]),
            "active_params": int(per_rank[0]["active"]),
            "step_s": step,
            "tokens_per_s": tokens / step,
            "cpu_s": cpu,
            "tokens_per_cpu_s": tokens / cpu,
            "counts_share": statistics.mean(r["counts_s"] / r["step_s"] for r in per_rank),
            "a2a_share": statistics.mean(r["a2a_s"] / r["step_s"] for r in per_rank),
            "a2a_cpu_share": statistics.mean(r["a2a_cpu_s"] / r["cpu_s"] for r in per_rank),
            "a2a_calls": int(per_rank[0]["calls"]),
            "per_rank": per_rank,
        }
        results.append(row)
        dense = results[0]
        print(
            f"| {name} | {row['params']:,} | {row['active_params']:,} | {step * 1e3:,.0f} | "
            f"{row['tokens_per_s']:,.0f} | {row['tokens_per_s'] / dense['tokens_per_s']:.2f}x | "
            f"{cpu * 1e3:,.0f} | {row['tokens_per_cpu_s']:,.0f} | "
            f"{row['tokens_per_cpu_s'] / dense['tokens_per_cpu_s']:.2f}x | "
            f"{row['counts_share']:.1%} + {row['a2a_share']:.1%} | {row['a2a_cpu_share']:.1%} | "
            f"{row['a2a_calls']} |",
            flush=True,
        )
    dense_params, moe_active = results[0]["params"], results[-1]["active_params"]
    print(
        f"\nactive parameters per token: MoE {moe_active:,}, dense {dense_params:,} "
        f"({dense_params / moe_active - 1:+.2%})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
