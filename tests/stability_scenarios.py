"""Pool scenarios for tests/test_stability.py: titanlite's Trainer with a z-loss measured
against the logits, and with spikes injected into the gradients at chosen steps."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from train_scenarios import DEBUG_CONFIG, logits_of, read_run

from titanlite.config import load_config
from titanlite.data.batches import IGNORE_INDEX
from titanlite.trainer import Trainer


def z_loss_by_hand(rank: int, world: int, argv: list[str]) -> dict[str, Any] | None:
    """One process: the z-loss of the first step computed directly from the initial model's
    logits of its batches (float64), then the run itself; rank 0 returns both."""
    cfg = load_config(["--job.config_file", DEBUG_CONFIG, *argv])
    trainer = Trainer(cfg)
    try:
        first = [next(trainer.train_iter) for _ in range(trainer.accum_steps)]
        squares, count = 0.0, 0
        with torch.no_grad():
            for inputs, labels in first:
                logits = logits_of(trainer, trainer.model(inputs))
                lse = torch.logsumexp(logits.double(), dim=-1)
                targets = labels != IGNORE_INDEX
                squares += float(lse[targets].square().sum())
                count += int(targets.sum())
        trainer.train_iter = itertools.chain(first, trainer.train_iter)
        trainer.train()
    finally:
        trainer.close()
    direct = cfg.training.z_loss_weight * squares / count
    return {"direct": direct, **read_run(Path(cfg.job.dump_folder))} if rank == 0 else None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def train_with_spikes(
    rank: int, world: int, argv: list[str], *, spikes: dict[int, str], watch: list[int]
) -> dict[str, Any]:
    """Train with a spike injected into the gradients at the steps of ``spikes``: "scale"
    multiplies every rank's gradients by 1000, "nan" puts a NaN into one element of rank 0's
    (only). For each step of ``watch``, whether this rank's parameters, optimizer state and
    average of the weights (if any) came out of the step bit-identical. Every rank returns
    that, its schedule's and optimizer's step counts; rank 0 also what the run wrote
    (read_run) and the whole average at the end."""
    cfg = load_config(["--job.config_file", DEBUG_CONFIG, *argv])
    trainer = Trainer(cfg)
    finish = trainer.model.finish_gradients

    def finish_and_inject() -> None:
        finish()
        kind = spikes.get(trainer.state.step)
        grads = [_local(p.grad) for p in trainer.params if p.grad is not None]
        if kind == "scale":
            torch._foreach_mul_(grads, 1000.0)
        elif kind == "nan" and rank == 0:
            grads[0].view(-1)[0] = float("nan")

    def snapshot() -> list[torch.Tensor]:
        params = [_local(p).detach().clone() for p in trainer.params]
        state = [
            _local(v).clone()
            for o in trainer.optimizers
            for s in o.state.values()
            for v in s.values()
            if torch.is_tensor(v)
        ]
        average = list(trainer.ema.average.values()) if trainer.ema is not None else []
        return params + state + [_local(a).clone() for a in average]

    unchanged: dict[int, bool] = {}
    take_step = trainer.train_step

    def train_step(batches: list, log: bool = True) -> Any:
        step = trainer.state.step
        before = snapshot() if step in watch else None
        out = take_step(batches, log)
        if before is not None:
            after = snapshot()
            pairs = zip(before, after, strict=True)  # the optimizer state existed before
            unchanged[step] = all(torch.equal(a, b) for a, b in pairs)
        return out

    # ParallelModel is frozen: the injection replaces the method of this one instance.
    object.__setattr__(trainer.model, "finish_gradients", finish_and_inject)
    trainer.train_step = train_step
    try:
        trainer.train()
        adam_steps = {
            int(s["step"]) for o in trainer.optimizers for s in o.state.values() if "step" in s
        }
        result: dict[str, Any] = {
            "unchanged": unchanged,
            "schedule_steps": trainer.lr_schedulers[0].last_epoch,
            "optimizer_steps": sorted(adam_steps),
        }
        if trainer.ema is not None:  # gathered on every rank (a collective)
            average = {name: _full(a) for name, a in trainer.ema.average.items()}
    finally:
        trainer.close()
    if rank == 0:
        result.update(read_run(Path(cfg.job.dump_folder)))
        if trainer.ema is not None:
            result["average"] = average
    return result


def train_with_weight_snapshots(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    """Train with training.ema_decay, keeping the whole weights before the first step and
    after every step. Every rank returns whether it kept the average sharded as the
    weights; rank 0 also the snapshots, the whole average at the end and the dump folder."""
    cfg = load_config(["--job.config_file", DEBUG_CONFIG, *argv])
    trainer = Trainer(cfg)
    ema = trainer.ema
    assert ema is not None, "training.ema_decay is not set"

    def whole() -> dict[str, torch.Tensor]:
        return {name: _full(p.detach()).clone() for name, p in ema.params.items()}

    snapshots = [whole()]
    take_step = trainer.train_step

    def train_step(batches: list, log: bool = True) -> Any:
        out = take_step(batches, log)
        snapshots.append(whole())
        return out

    trainer.train_step = train_step
    try:
        trainer.train()
        average = {name: _full(a).clone() for name, a in ema.average.items()}
        sharded = all(
            type(a) is type(p) and getattr(a, "placements", None) == getattr(p, "placements", None)
            for a, p in zip(ema.average.values(), ema.params.values(), strict=True)
        )
    finally:
        trainer.close()
    if rank != 0:
        return {"sharded": sharded}
    return {
        "snapshots": snapshots,
        "average": average,
        "sharded": sharded,
        "folder": cfg.job.dump_folder,
    }
