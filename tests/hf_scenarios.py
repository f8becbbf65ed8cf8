"""Scenarios of runs that start from a Hugging Face folder (tests/test_hf_start.py), on every
rank of a worker pool (tests/pool.py), with the real Trainer: the config names no model, so
family, shape and tokenizer come from checkpoint.initial_load_path."""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Any

from train_scenarios import read_run

from titanlite.config import load_config
from titanlite.trainer import Trainer

CONFIG = """\
[job]
dump_folder = "{dump}"
[optimizer]
name = "AdamW"
lr = 1e-3
[training]
steps = {steps}
local_batch_size = {local}
global_batch_size = 4
seq_len = 32
dataset = "sotu"
[checkpoint]
interval = 1
[validation]
enable = false
[metrics]
log_freq = 1
"""


def config_file(folder: Path, *, steps: int = 2, local: int = 2) -> Path:
    """A config that names no model (and no tokenizer): ``folder``/config.toml."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.toml"
    path.write_text(CONFIG.format(dump=folder / "run", steps=steps, local=local))
    return path


def train(rank: int, world: int, argv: list[str]) -> dict[str, Any] | None:
    """Train with ARGV (which names --job.config_file); rank 0 returns what the run wrote."""
    cfg = load_config(argv)
    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    return read_run(Path(cfg.job.dump_folder)) if rank == 0 else None


def load_peak(rank: int, world: int, argv: list[str]) -> dict[str, float]:
    """Set a run up (which loads initial_load_path into this rank's shards) and return this
    process's peak resident memory (MiB) before and after: the load's cost is the rise."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    trainer = Trainer(load_config(argv))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    trainer.close()
    return {"before": before, "after": after}
