"""DiLoCo and Streaming DiLoCo written out in one process (tests/test_ft_diloco.py): the
algorithm the replica groups must follow, step by step, to compare them against.

One titanlite Trainer (one process, no fault tolerance) plays every group in turn: before a
group's inner step its parameters, optimizer state and schedule are put into the model, after
it they are taken out again; each group reads its own share of the data, as a replica group
does (the loader of data-parallel rank g of G). Every ``sync_steps / F`` steps one fragment is
synchronized: ``delay`` steps before, its pseudo-gradient (global parameters minus the group's)
is averaged over the groups; at the sync the outer optimizer, SGD with Nesterov momentum
written here (with torch's operations in SGD's order, so that rounding matches too), moves
the global parameters, and each group's fragment becomes ``global + alpha * (own - global)``
(torch.lerp).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from train_scenarios import DEBUG_CONFIG

from titanlite.config import load_config
from titanlite.data.build import build_training_data
from titanlite.ft.diloco import fragments_of
from titanlite.trainer import Trainer


def simulate(
    rank: int,
    world: int,
    argv: list[str],
    *,
    groups: int,
    sync_steps: int,
    fragments: int,
    delay: int,
    alpha: float,
    outer_lr: float,
    outer_momentum: float,
) -> dict[str, Any]:
    """Every group's loss at every step and its parameters at the end (by name)."""
    cfg = load_config(["--job.config_file", DEBUG_CONFIG, *argv])
    trainer = Trainer(cfg)
    try:
        model = trainer.model.parts[0]
        optimizer, schedule = trainer.optimizers[0], trainer.lr_schedulers[0]
        params = dict(model.named_parameters())
        names = [[n for n, _ in f] for f in fragments_of(model, fragments)]
        data = [
            build_training_data(
                trainer.tokenizer, cfg.training, cfg.validation, dp_rank=g, dp_world_size=groups
            ).loader
            for g in range(groups)
        ]
        batches = [iter(loader) for loader in data]

        def weights() -> dict[str, torch.Tensor]:
            return {n: p.detach().clone() for n, p in params.items()}

        start = {
            "params": weights(),
            "optimizer": copy.deepcopy(optimizer.state_dict()),
            "schedule": copy.deepcopy(schedule.state_dict()),
        }
        state = [copy.deepcopy(start) for _ in range(groups)]
        global_ = weights()
        momentum = {n: torch.zeros_like(p) for n, p in global_.items()}
        period, local, syncs = sync_steps // fragments, 0, 0
        pending: tuple[int, dict[str, torch.Tensor]] | None = None
        losses: list[list[float]] = [[] for _ in range(groups)]
        for step in range(1, cfg.training.steps + 1):
            for g in range(groups):  # group g's inner step
                with torch.no_grad():
                    for n, p in params.items():
                        p.copy_(state[g]["params"][n])
                optimizer.load_state_dict(copy.deepcopy(state[g]["optimizer"]))
                schedule.load_state_dict(copy.deepcopy(state[g]["schedule"]))
                trainer.state.step = step
                loss, _, _ = trainer.train_step(trainer.ramp.take(step, batches[g], data[g]))
                losses[g].append(float(loss.mean()[0]))
                state[g] = {
                    "params": weights(),
                    "optimizer": copy.deepcopy(optimizer.state_dict()),
                    "schedule": copy.deepcopy(schedule.state_dict()),
                }
            local += 1
            if local == period - delay:  # this fragment's pseudo-gradients, averaged
                fragment = syncs % fragments
                pending = (
                    fragment,
                    {
                        n: sum(global_[n] - state[g]["params"][n] for g in range(groups)) / groups
                        for n in names[fragment]
                    },
                )
            if local == period:  # the outer step, then each group's merge
                assert pending is not None
                fragment, average = pending
                for n in names[fragment]:
                    grad = average[n]
                    if outer_momentum > 0:  # b = m b + d; d = d + m b (Nesterov)
                        momentum[n] = momentum[n].mul(outer_momentum).add(grad)
                        grad = grad.add(momentum[n], alpha=outer_momentum)
                    global_[n] = global_[n].add(grad, alpha=-outer_lr)
                    for g in range(groups):  # global + alpha (own - global)
                        own = state[g]["params"][n]
                        state[g]["params"][n] = torch.lerp(global_[n], own, alpha)
                pending, local, syncs = None, 0, syncs + 1
        return {"losses": losses, "params": [s["params"] for s in state]}
    finally:
        trainer.close()
