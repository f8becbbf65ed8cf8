"""Scenarios that train with titanlite's real Trainer on every rank of a worker pool
(tests/pool.py): the same code path as ./run_train.sh after the launcher, without paying a
process start-up per run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from titanlite.config import load_config
from titanlite.trainer import Trainer

REPO = Path(__file__).resolve().parent.parent
DEBUG_CONFIG = str(REPO / "train_configs" / "debug_model.toml")


def read_run(folder: Path) -> dict[str, Any]:
    """metrics.jsonl records (in order) and run.json of a run folder."""
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return {
        "records": [json.loads(line) for line in lines],
        "info": json.loads((folder / "run.json").read_text()),
    }


def main(rank: int, world: int, argv: list[str]) -> int:
    """`python -m titanlite.train ARGV` in this rank: the exit status (its output goes to the
    pool's captured output). It ends by destroying the default group, so the pool restarts."""
    from titanlite.train import main as train_main

    return train_main(argv)


def train(rank: int, world: int, argv: list[str]) -> dict[str, Any] | None:
    """Train as `./run_train.sh train_configs/debug_model.toml ARGV` would (later arguments
    win); rank 0 returns what the run wrote (read_run), the others None."""
    cfg = load_config(["--job.config_file", DEBUG_CONFIG, *argv])
    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    return read_run(Path(cfg.job.dump_folder)) if rank == 0 else None


def initial_weights(rank: int, world: int, argv: list[str]) -> dict[str, torch.Tensor] | None:
    """The full (gathered) initial parameters of the configured layout, on rank 0."""
    cfg = load_config(["--job.config_file", DEBUG_CONFIG, "--checkpoint.enable=false", *argv])
    trainer = Trainer(cfg)
    try:
        weights = {}
        for part in trainer.model.parts:
            for name, p in part.named_parameters():
                full = p.full_tensor() if hasattr(p, "full_tensor") else p
                weights[name.replace("_checkpoint_wrapped_module.", "")] = full.detach().clone()
    finally:
        trainer.close()
    return weights if rank == 0 else None


def rng_after_resume(rank: int, world: int, argv: list[str]) -> list[float]:
    """Build a Trainer that resumes from the run's checkpoint (without training further)
    and draw from the global generator: what the restored per-rank RNG state gives."""
    cfg = load_config(["--job.config_file", DEBUG_CONFIG, *argv])
    torch.manual_seed(1234 + rank)  # anything but the restored state
    trainer = Trainer(cfg)
    try:
        assert trainer.state.step > 0, "nothing was resumed"
        return torch.rand(3).tolist()
    finally:
        trainer.close()


def train_with_rank_seeds(rank: int, world: int, argv: list[str]) -> list[float]:
    """Train with a different global-generator state on each rank, then draw from it: the
    numbers that follow the state the last checkpoint saved (nothing draws after it)."""
    cfg = load_config(["--job.config_file", DEBUG_CONFIG, *argv])
    trainer = Trainer(cfg)
    try:
        torch.manual_seed(100 + rank)
        trainer.train()
        return torch.rand(3).tolist()
    finally:
        trainer.close()


def validate_twice(rank: int, world: int, argv: list[str]) -> list[dict] | None:
    """Two validation passes on the initial weights; rank 0 returns both records."""
    cfg = load_config(["--job.config_file", DEBUG_CONFIG, "--checkpoint.enable=false", *argv])
    trainer = Trainer(cfg)
    try:
        trainer.validate()
        trainer.validate()
    finally:
        trainer.close()
    if rank != 0:
        return None
    lines = (Path(cfg.job.dump_folder) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == "validation"]
