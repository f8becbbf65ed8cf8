"""Muon's per-rank cost at scale, by arithmetic (a dry run: nothing is allocated).

For Llama 3 8B and 70B (titanlite's flavors) and a world of N ranks, the Newton-Schulz FLOPs
and the bytes each rank sends and receives per step for Muon's orthogonalization, with the
owners titanlite's Orthogonalizer picks (the least loaded of the ranks holding a matrix,
largest matrix first) and the busiest rank reported (it sets the step):

  FSDP over N ranks (the "sharded" plan): the owner gathers S (N-1)/N and scatters as much;
  every other rank sends and receives S/N of each matrix.
  FSDP x TP 8 (the "gathered" plan, 70B's shipped layout): the same, in two hops (along tp to
  the rank in line with the owner, then along dp), so those relays also move their row's
  8 S/N.

    python scripts/bench_muon.py [--ns-steps 5] [--bytes-per-element 4]

``--time FLAVOR`` measures instead: the optimizer step alone (AdamW, then Muon with its
default groups) of a Llama 3 flavor on this machine's CPU, random gradients, one process or,
under torchrun with gloo, FSDP over the ranks (each block a unit, as titanlite shards); the
median wall and CPU time per step of the busiest rank over ``--steps`` after 2 warm-up steps:

    python scripts/bench_muon.py --time bench
    torchrun --nproc-per-node 4 scripts/bench_muon.py --time bench
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass

import torch

from titanlite import models
from titanlite.config import load_config
from titanlite.optim import resolve_groups
from titanlite.optim.orthogonalize import newton_schulz_flops


@dataclass(frozen=True)
class Cost:
    flops: float
    """Newton-Schulz FLOPs of the busiest rank."""
    sent: float
    """Bytes the busiest rank sends."""
    received: float
    """Bytes the busiest rank receives."""


def hidden_matrices(flavor: str) -> list[tuple[int, int]]:
    """The shapes Muon's default rules take in a Llama 3 flavor, in parameter order (the
    model built on the meta device)."""
    spec = models.get("llama3")
    with torch.device("meta"):
        model = spec.build(spec.make_args(flavor, 128256, 8192, {}))
    cfg = load_config(["--optimizer.name", "muon"])
    muon = [g for g in resolve_groups(model, cfg.optimizer) if g.optimizer == "muon"]
    return [tuple(p.shape) for g in muon for p in g.params]  # type: ignore[misc]


def per_rank_cost(
    shapes: list[tuple[int, int]], world: int, *, steps: int, element: int, tp: int
) -> Cost:
    """The busiest rank's cost, owners picked as the Orthogonalizer picks them (the least
    loaded holder, largest matrix first). ``tp`` 1: FSDP over ``world`` (the "sharded" plan: one
    gather and one scatter over the ranks). ``tp`` > 1: FSDP x TP on a (world / tp) x tp mesh
    (the "gathered" plan: the gather hops along tp to the ranks in line with the owner, then
    along dp to the owner; the scatter back the same way)."""
    flops, moved = [0.0] * world, [0.0] * world  # each rank sends as much as it receives
    by_size = sorted(shapes, key=lambda shape: -newton_schulz_flops(shape))  # stable
    for out, inp in by_size:
        owner = min(range(world), key=lambda r: (flops[r], r))
        size = out * inp * element
        piece = size / world
        flops[owner] += steps * newton_schulz_flops((out, inp))
        for r in range(world):
            if r == owner:
                moved[r] += size - piece
            elif tp > 1 and r % tp == owner % tp:  # relays its tp row to the owner
                moved[r] += (tp - 1) * piece + tp * piece
            else:
                moved[r] += piece
    busiest = max(range(world), key=lambda r: (flops[r], moved[r]))
    return Cost(flops[busiest], moved[busiest], moved[busiest])


def time_steps(flavor: str, steps: int) -> None:
    """Median seconds (wall, CPU) of AdamW's and Muon's optimizer step; rank 0 prints."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from titanlite.optim import build_optimizer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    spec = models.get("llama3")
    results = {}
    for name in ("adamw", "muon"):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = spec.build(spec.make_args(flavor, 2048, 512, {}))
        if world > 1:
            mesh = init_device_mesh("cpu", (world,))
            for block in model.layers.values():
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02)
        cfg = load_config(["--optimizer.name", name])
        optimizer, _ = build_optimizer(
            model, cfg.optimizer, torch.device("cpu"), sections=cfg.components
        )
        walls, cpus = [], []
        for _ in range(steps + 2):
            for p in model.parameters():
                p.grad = torch.randn_like(p) * 1e-3
            if world > 1:
                dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            optimizer.step()
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
        stats = torch.tensor([statistics.median(walls[2:]), statistics.median(cpus[2:])])
        if world > 1:
            dist.all_reduce(stats, dist.ReduceOp.MAX)
        results[name] = stats.tolist()
    if world == 1 or dist.get_rank() == 0:
        n = sum(p.numel() for p in model.parameters())
        for name, (wall, cpu) in results.items():
            print(
                f"{flavor} ({n:,} params), {world} rank(s): {name} step "
                f"{wall * 1e3:.1f} ms wall, {cpu * 1e3:.1f} ms CPU (busiest rank, median)"
            )
    if world > 1:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ns-steps", type=int, default=5)
    parser.add_argument("--bytes-per-element", type=int, default=4)
    parser.add_argument("--time", metavar="FLAVOR", help="measure the optimizer step instead")
    parser.add_argument("--steps", type=int, default=10)
    a = parser.parse_args()
    if a.time:
        time_steps(a.time, a.steps)
        return
    print(
        "| model | layout | ranks | matrices | NS TFLOP per rank | GiB sent / received per rank |"
    )
    print("|---|---|---|---|---|---|")
    for flavor, layouts in (("8B", [("FSDP", 1)]), ("70B", [("FSDP", 1), ("FSDP x TP 8", 8)])):
        shapes = hidden_matrices(flavor)
        for layout, tp in layouts:
            for world in (8, 64, 512, 2048):
                c = per_rank_cost(
                    shapes,
                    world,
                    steps=a.ns_steps,
                    element=a.bytes_per_element,
                    tp=tp,
                )
                print(
                    f"| {flavor} | {layout} | {world:,} | {len(shapes)} | {c.flops / 1e12:.2f} "
                    f"| {c.sent / 2**30:.2f} / {c.received / 2**30:.2f} |"
                )


if __name__ == "__main__":
    main()
