"""A run's sharded model written as a Hugging Face folder of its family, each rank writing
its own part (checkpoint.last_save_in_hf, checkpoint.save_format = "dcp+hf").

The model's tensors are cut in groups (a block's tensors; those outside the blocks), and each
group has one owner among the ranks that hold it (under pipeline parallelism, only that
stage's ranks): the group's tensors are gathered whole to its holders one tensor at a time
(``full_tensor``), the owner converts them through the family's adapter and keeps them, the
others drop them at once. Owners are spread over the ranks, so every rank writes a
safetensors file of about 1/world of the model, and none ever holds the whole model. Rank 0
then writes the index, config.json and the tokenizer.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titanlite import models
from titanlite.data.tokenizer import load_tokenizer
from titanlite.interop.folders import write_json
from titanlite.interop.hf import EXPORT_MARKER, special_ids, tokenizer_files
from titanlite.interop.hf_reader import layer_of
from titanlite.paths import resolve_path

logger = logging.getLogger(__name__)


def write_hf(
    state: dict[str, Any],
    folder: Path,
    *,
    model_name: str,
    model_args: dict[str, Any],
    tokenizer: str | None,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Write the model ``state`` (this rank's DTensors or whole tensors, by titanlite name)
    as an HF folder ``folder``; collective: every rank calls it."""
    spec = models.get(model_name)
    args = spec.args_cls(**model_args)
    adapter = spec.hf_adapter()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    group = dist.new_group(backend="gloo") if world > 1 else None  # objects over the CPU
    held = _gather(sorted(state), group, world)
    holders: dict[str, tuple[int, ...]] = defaultdict(tuple)
    for r, names in enumerate(held):
        for name in names:
            holders[name] += (r,)
    groups: dict[tuple[int, tuple[int, ...]], list[str]] = defaultdict(list)
    for name in sorted(holders):
        groups[(layer_of(name), holders[name])].append(name)
    owner = {key: key[1][(key[0] + 1) % len(key[1])] for key in groups}
    writers = sorted(set(owner.values()))
    mine: dict[str, torch.Tensor] = {}
    for key, names in sorted(groups.items()):
        if rank not in key[1]:
            continue
        whole = {}
        for name in names:
            tensor = state[name].detach()
            tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if owner[key] == rank:
                whole[name] = tensor.cpu()
        if whole:
            mine |= adapter.to_hf_state_dict(whole, args, dtype)
    file = _file_name(writers.index(rank), len(writers)) if rank in writers else None
    if file is not None:
        from safetensors.torch import save_file

        save_file(mine, str(folder / file), metadata={"format": "pt"})
    written = _gather((file, sorted(mine), {n: t.nbytes for n, t in mine.items()}), group, world)
    if rank == 0:
        _write_small_files(folder, written, spec=spec, args=args, tokenizer=tokenizer, dtype=dtype)
    if group is not None:
        dist.barrier(group=group)  # the folder is complete on every rank's return
        dist.destroy_process_group(group)
    logger.info("wrote %s as a Hugging Face folder (%d files)", folder, len(writers))


def _file_name(index: int, count: int) -> str:
    return (
        "model.safetensors" if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"
    )


def _gather(value: Any, group: Any, world: int) -> list[Any]:
    if world == 1:
        return [value]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, value, group=group)
    return everyone


def _write_small_files(
    folder: Path, written: list[Any], *, spec: Any, args: Any, tokenizer: str | None, dtype: Any
) -> None:
    """The index (when several files), config.json, the tokenizer and the export marker."""
    files = [entry for entry in written if entry[0] is not None]
    if len(files) > 1:
        weight_map = {name: file for file, names, _ in files for name in names}
        total = sum(size for _, _, sizes in files for size in sizes.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        write_json(folder / "model.safetensors.index.json", index)
    loaded = load_tokenizer(resolve_path(tokenizer)) if tokenizer else None
    adapter = spec.hf_adapter()
    write_json(folder / "config.json", adapter.to_hf_config(args, special_ids(loaded), dtype))
    if loaded is not None:
        loaded.copy_files(folder)
        for name, content in tokenizer_files(loaded, args.max_seq_len).items():
            write_json(folder / name, content)
    marker = {"format": 1, "model_name": spec.name, "model_args": dataclasses.asdict(args)}
    write_json(folder / EXPORT_MARKER, marker)
