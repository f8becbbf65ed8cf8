"""LoRA adapters merged into their weights, for an export: the frozen base (the Hugging Face
folder or titanlite checkpoint the run loaded, as its checkpoint's titanlite.json records)
plus, for every adapted linear, (alpha / rank) B A added to its weight."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from titanlite.checkpoint.safe_reader import SafeFileSystemReader
from titanlite.errors import UserError
from titanlite.interop.folders import quiet_single_process
from titanlite.models.spec import ModelSpec

ADAPTERS = ("lora_a", "lora_b")


def merged(state: Mapping[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """``state`` (whole tensors by model name) with each ``P.lora_a``/``P.lora_b`` pair
    folded into ``P.weight`` as W + scale B A (in float64, rounded back once), adapters out."""
    out = {k: v for k, v in state.items() if k.rpartition(".")[2] not in ADAPTERS}
    for name, a in state.items():
        if name.endswith(".lora_a"):
            prefix = name[: -len("lora_a")]
            weight, b = state[prefix + "weight"], state[prefix + "lora_b"]
            update = (b.double() @ a.double()) * scale
            out[prefix + "weight"] = (weight.double() + update).to(weight.dtype)
    return out


def read_adapters(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The adapters of a titanlite checkpoint folder, whole, by model name."""
    saved = SafeFileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    names = [k for k in saved if k.startswith("model.") and k.rpartition(".")[2] in ADAPTERS]
    if not names:
        raise UserError(f"checkpoint folder {str(checkpoint)!r} holds no LoRA adapters")
    tensors = {k.removeprefix("model."): torch.empty(tuple(saved[k].size)) for k in names}
    with quiet_single_process():
        dcp.load({"model": tensors}, storage_reader=SafeFileSystemReader(str(checkpoint)))
    return tensors


def merged_model(checkpoint: Path, meta: Mapping[str, Any]) -> tuple[dict, ModelSpec, Any]:
    """(merged state dict, spec, args) of an adapters-only checkpoint; UserError when its base
    is unrecorded (a seed-initialized base) or gone."""
    from titanlite.interop.checkpoint_model import load_checkpoint_model
    from titanlite.interop.hf import load_hf
    from titanlite.interop.source import is_hf_folder

    base, scale = meta.get("base"), meta.get("adapter_scale")
    if not base or scale is None:
        raise UserError(
            f"checkpoint folder {str(checkpoint)!r}: its adapters were trained on a base that "
            "was not loaded from a folder (no checkpoint.initial_load_path); nothing to merge into"
        )
    if not Path(base).exists():
        raise UserError(f"checkpoint folder {str(checkpoint)!r}: its base {base!r} is gone")
    if is_hf_folder(base):
        state, spec, args = load_hf(base)
    else:
        loaded = load_checkpoint_model(base)
        state, spec, args = loaded.model.state_dict(), loaded.spec, loaded.args
    adapters = read_adapters(checkpoint)
    missing = sorted({k.rpartition(".")[0] + ".weight" for k in adapters} - set(state))
    if missing:
        raise UserError(f"base {base!r} has no weight {missing[0]} for the adapters")
    return merged({**state, **adapters}, float(scale)), spec, args
