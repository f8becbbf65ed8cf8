"""A titanlite checkpoint written out as a Hugging Face folder: the one export that
``scripts/convert_to_hf.py`` and ``scripts/eval_harness.py`` (through a temporary folder) share."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from titanlite.checkpoint.folders import read_sidecar
from titanlite.errors import UserError
from titanlite.interop.checkpoint_model import checkpoint_tokenizer, load_checkpoint_model
from titanlite.interop.hf import save_hf
from titanlite.interop.lora_merge import merged_model


@dataclass(frozen=True)
class Export:
    files: list[str]  # the names written into the folder
    step: int | None  # the checkpoint's training step


def export_checkpoint(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = 5 * 10**9,
    ema: bool = False,
    tokenizer: str | os.PathLike[str] | None = None,
    merge_lora: bool = False,
) -> Export:
    """Write the model of the titanlite checkpoint folder ``checkpoint`` (with ``ema``, its
    average of the weights) and its tokenizer (or ``tokenizer``) as a Hugging Face folder
    ``out`` (missing, empty or an earlier export). A checkpoint of LoRA adapters alone needs
    ``merge_lora``: they are merged into the base model the run loaded
    (``titanlite.interop.lora_merge``). UserError for unusable input."""
    meta = read_sidecar(Path(checkpoint))
    if meta.get("adapters_only") and not merge_lora:
        raise UserError(
            f"checkpoint folder {str(checkpoint)!r} holds LoRA adapters only: pass --merge-lora "
            "to merge them into their base model"
        )
    if merge_lora and not meta.get("adapters_only"):
        raise UserError(f"--merge-lora: checkpoint folder {str(checkpoint)!r} has no adapters")
    if merge_lora:
        state, spec, args = merged_model(Path(checkpoint), meta)
    else:
        loaded = load_checkpoint_model(checkpoint, ema=ema)
        state, spec, args, meta = loaded.model.state_dict(), loaded.spec, loaded.args, loaded.meta
    step = meta.get("step")
    source = {"source": str(Path(checkpoint).resolve()), "step": step}
    if ema:
        source["weights"] = "ema"
    files = save_hf(
        state,
        spec,
        args,
        out,
        tokenizer=checkpoint_tokenizer(meta, tokenizer, args.vocab_size, checkpoint),
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        source=source,
    )
    return Export(files, step)
