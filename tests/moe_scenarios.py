"""Pool scenarios for mixture-of-experts layers (workers import only this module)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from titanlite.models.moe import GroupedExperts
from titanlite.parallel.expert import expert_parallel


def dispatch_matches_local_experts(rank: int, world: int, experts: int = 8) -> dict[str, float]:
    """Each rank routes its own token slots (uneven counts, some experts with none); the
    expert-parallel dispatch over ``world`` ranks, each holding experts / world of them, must
    give the same outputs and input gradients as every expert held locally, and each local
    expert's weight gradient must be the sum of every rank's local one."""
    dim, hidden = 8, 12
    torch.manual_seed(0)  # the same weights everywhere
    full = GroupedExperts(experts, dim, hidden)
    for w in full.parameters():
        torch.nn.init.normal_(w, std=0.3)
    torch.manual_seed(100 + rank)  # this rank's tokens and routing
    n = 20 + 7 * rank
    chosen = torch.randint(0, experts, (n,))
    chosen[chosen == 1] = 2  # expert 1 gets no rows anywhere
    counts = torch.bincount(chosen, minlength=experts)
    x = torch.randn(n, dim).index_select(0, torch.argsort(chosen, stable=True))
    probe = torch.randn(n, dim)

    x_ref = x.clone().requires_grad_(True)
    (full(x_ref, counts) * probe).sum().backward()

    per = experts // world
    mine = GroupedExperts(per, dim, hidden)
    with torch.no_grad():
        for name, w in mine.named_parameters():
            w.copy_(getattr(full, name)[rank * per : (rank + 1) * per])
    x_ep = x.clone().requires_grad_(True)
    out = expert_parallel(x_ep, counts, mine, group=dist.group.WORLD, degree=world)
    (out * probe).sum().backward()

    worst = {"out": 0.0, "x_grad": 0.0, "w_grad": 0.0}
    with torch.no_grad():
        worst["out"] = (out - full(x, counts)).abs().max().item()
        worst["x_grad"] = (x_ep.grad - x_ref.grad).abs().max().item()
        for name, w in mine.named_parameters():
            total = getattr(full, name).grad.clone()
            dist.all_reduce(total)
            diff = (w.grad - total[rank * per : (rank + 1) * per]).abs().max().item()
            worst["w_grad"] = max(worst["w_grad"], diff)
    return worst
