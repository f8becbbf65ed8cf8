"""LoRA scenarios (tests/pool.py): train with the real Trainer on every rank and hand back
the losses and the whole weights (gathered from any layout), for test_lora.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from train_scenarios import DEBUG_CONFIG, read_run

from titanlite.config import load_config
from titanlite.trainer import Trainer


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def train_lora(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    """Train; return (on every rank) the records rank 0 wrote, the whole weights before and
    after training by name (every stage's, merged over the pipeline ranks), which parameters
    were trainable, and how many tensors the optimizers hold state for."""
    import torch.distributed as dist

    cfg = load_config(["--job.config_file", DEBUG_CONFIG, *argv])
    trainer = Trainer(cfg)
    parts = trainer.model.parts
    before = {n: _whole(p) for part in parts for n, p in part.named_parameters()}
    trainable = sorted(n for part in parts for n, p in part.named_parameters() if p.requires_grad)
    try:
        trainer.train()
    finally:
        trainer.close()
    after = {n: _whole(p) for part in parts for n, p in part.named_parameters()}
    held = {id(p) for o in trainer.optimizers for p in o.state}
    own = {id(p) for part in parts for p in part.parameters() if p.requires_grad}
    states = (len(held), len(own), held == own)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (before, after, trainable, states))
    merged: dict[str, Any] = {"before": {}, "after": {}, "trainable": set(), "states": []}
    for b, a, t, s in gathered:
        merged["before"].update(b)
        merged["after"].update(a)
        merged["trainable"].update(t)
        merged["states"].append(s)
    run = read_run(Path(cfg.job.dump_folder)) if rank == 0 else None
    return {**merged, "run": run}


def tp_factors(rank: int, world: int) -> dict[str, Any]:
    """A column-wise then a row-wise LoRA linear split over ``world`` ranks (as an MLP's up
    and down projections): their factors' placements, and the largest relative differences of the
    output and of the adapters' gradients from the same modules unsplit."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from titanlite.converters.lora import LoraLinear
    from titanlite.parallel.tensor import Colwise, Rowwise

    torch.manual_seed(0)

    def pair() -> nn.Sequential:
        torch.manual_seed(0)
        up = LoraLinear(8, 12, bias=False, rank=4, alpha=8.0, dropout=0.0)
        down = LoraLinear(12, 8, bias=False, rank=4, alpha=8.0, dropout=0.0)
        for p in (*up.parameters(), *down.parameters()):
            nn.init.normal_(p)  # B nonzero too, so the update counts in the output
        return nn.Sequential(up, down)

    x = torch.randn(2, 5, 8)
    whole, split = pair(), pair()
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(split, mesh, {"0": Colwise(), "1": Rowwise()})
    y_whole, y_split = whole(x), split(x)
    y_whole.square().sum().backward()
    y_split.square().sum().backward()
    out = {"output": float((y_whole - y_split).abs().max() / y_whole.abs().max())}
    for i, module in enumerate(split):
        for name in ("lora_a", "lora_b"):
            p = getattr(module, name)
            expected = getattr(whole[i], name).grad
            g = (p.grad.full_tensor() - expected).abs().max() / expected.abs().max()
            out[f"{i}.{name}"] = (str(p.placements[0]), float(g))
    return out
