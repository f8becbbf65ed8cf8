"""Silent-data-corruption scenarios for tests/test_health_sdc.py, run on every rank of a
tests/pool.py pool: a tiny Llama trained a few real steps by titanlite's own Trainer (the
layout's own assembly, optimizer and DDP/FSDP/TP), then its replicas compared by
``titanlite.health.fingerprints.ReplicaCheck``, clean and after one bit of one rank's
parameter or optimizer state is flipped."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from train_scenarios import DEBUG_CONFIG

from titanlite.config import load_config
from titanlite.health.fingerprints import ReplicaCheck, SilentCorruption
from titanlite.trainer import Trainer

TINY = [
    "--model.dim",
    "64",
    "--model.n_layers",
    "2",
    "--model.n_heads",
    "4",
    "--model.n_kv_heads",
    "4",
    "--model.multiple_of",
    "32",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--training.steps",
    "3",
    "--lr_scheduler.warmup_steps",
    "1",
    "--metrics.log_freq",
    "1",
    "--validation.enable",
    "false",
    "--checkpoint.enable",
    "false",
]
"""Three real steps of a 2-layer Llama of width 64: every optimizer state exists and the
replicas have applied the same updates."""


def flip_bit(tensor: torch.Tensor, bit: int) -> None:
    """Flip one bit of the first element this rank holds of ``tensor`` (a float32 parameter
    or optimizer state; a DTensor's local shard), in place: what a bad memory cell does."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    with torch.no_grad():
        bits = local.view(torch.int32).view(-1)
        bits[0] ^= 1 << bit


def _target(trainer: Trainer, tensor: str, state: str | None) -> torch.Tensor:
    params = {n: p for part in trainer.model.parts for n, p in part.named_parameters()}
    param = params[tensor]
    if state is None:
        return param
    return next(o.state[param][state] for o in trainer.optimizers if param in o.state)


def replicas_after_training(
    rank: int, world: int, argv: list[str], flips: list[dict[str, Any]]
) -> dict[str, Any]:
    """Train TINY with ARGV, then check the replicas: clean, then once per flip (a bit of
    ``flip["tensor"]``, or of its optimizer state ``flip["state"]``, flipped on rank
    ``flip["rank"]`` before the check and flipped back after). Returns this rank's view:
    ``compared`` (the clean check's count), ``plan`` (group ranks -> names compared) and per
    flip the error's line, ranks and tensors (None where no SilentCorruption was raised)."""
    cfg = load_config(["--job.config_file", DEBUG_CONFIG, *TINY, *argv])
    trainer = Trainer(cfg)
    try:
        trainer.train()
        d = trainer.dims.degrees
        replicated = d.dp_shard == 1 and d.dp_replicate * d.cp > 1  # as the trainer decides
        check = ReplicaCheck.of(
            trainer.model.parts,
            trainer.optimizers,
            replica_group=trainer.dims.replica_group() if replicated else None,
            rank=rank,
        )
        step = trainer.state.step
        result: dict[str, Any] = {"compared": check.check(step), "plan": check.plan()}
        result["flips"] = []
        for flip in flips:
            target = None  # (a pipeline stage holds some tensors only)
            bit = flip.get("bit", 0)  # the lowest mantissa bit: the smallest change there is
            if rank == flip["rank"]:
                target = _target(trainer, flip["tensor"], flip.get("state"))
                flip_bit(target, bit)
            try:
                check.check(step)
                result["flips"].append(None)
            except SilentCorruption as e:
                result["flips"].append({"line": str(e), "ranks": e.ranks, "tensors": e.tensors})
            if target is not None:
                flip_bit(target, bit)
        result["clean_again"] = check.check(step) == result["compared"]
        return result
    finally:
        trainer.close()
