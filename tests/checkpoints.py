"""A titanlite checkpoint folder written from a model in the test's own process."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch import nn

from titanlite.data.tokenizer import DEFAULT_TOKENIZER_PATH
from titanlite.interop.folders import quiet_single_process


def write_checkpoint(
    folder: Path,
    model: nn.Module,
    *,
    step: int,
    model_name: str | None = None,
) -> Path:
    """``folder`` as the trainer's final save writes it: DCP "model" state and titanlite.json
    naming the packaged tokenizer; ``model_name`` for a registered family (format 2), none for
    the llama default (format 1)."""
    with quiet_single_process():
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(folder))
    sidecar: dict[str, Any] = {"format": 1 if model_name is None else 2, "step": step}
    if model_name is not None:
        sidecar["model_name"] = model_name
    sidecar |= {
        "model_args": dataclasses.asdict(model.args),  # type: ignore[call-overload]
        "model_only": True,
        "tokenizer": str(DEFAULT_TOKENIZER_PATH),
    }
    (folder / "titanlite.json").write_text(json.dumps(sidecar))
    return folder
