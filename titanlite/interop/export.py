"""A titanlite checkpoint written out as a Hugging Face folder: the one export that
``scripts/convert_to_hf.py`` and ``scripts/eval_harness.py`` (through a temporary folder) share."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from titanlite.interop.checkpoint_model import checkpoint_tokenizer, load_checkpoint_model
from titanlite.interop.hf import save_hf


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
) -> Export:
    """Write the model of the titanlite checkpoint folder ``checkpoint`` (with ``ema``, its
    average of the weights) and its tokenizer (or ``tokenizer``) as a Hugging Face folder
    ``out`` (missing, empty or an earlier export). UserError for unusable input."""
    loaded = load_checkpoint_model(checkpoint, ema=ema)
    step = loaded.meta.get("step")
    vocab = loaded.args.vocab_size
    source = {"source": str(Path(checkpoint).resolve()), "step": step}
    if ema:
        source["weights"] = "ema"
    files = save_hf(
        loaded.model.state_dict(),
        loaded.spec,
        loaded.args,
        out,
        tokenizer=checkpoint_tokenizer(loaded.meta, tokenizer, vocab, checkpoint),
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        source=source,
    )
    return Export(files, step)
