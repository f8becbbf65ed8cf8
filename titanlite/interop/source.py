"""What a run's ``checkpoint.initial_load_path`` holds: a titanlite checkpoint (step-N) or a
Hugging Face folder (config.json and safetensors), and the model in it (family and args).

A run that names no model shape takes it from here (``titanlite.assembly.build_model_args``);
one that names a shape is compared with it, every difference in one line. Reading a titanlite
checkpoint's description needs no torch; an HF folder's goes through its family's adapter.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titanlite.checkpoint.folders import SIDECAR, model_name, read_sidecar
from titanlite.errors import UserError

IGNORED_FIELDS = ("max_seq_len",)
"""Args a run may set apart from its source's: the sequence length it trains at (RoPE
tables are computed, not loaded)."""


@dataclass(frozen=True)
class Source:
    path: Path
    kind: str
    """"titanlite" (a step-N checkpoint) or "hf" (a Hugging Face folder)."""
    family: str
    args: Any
    """The family's args dataclass, as the folder describes the model."""


def is_hf_folder(path: str | Path) -> bool:
    """A folder with a config.json and no titanlite sidecar (an export keeps its marker)."""
    path = Path(path)
    return (path / "config.json").is_file() and not (path / SIDECAR).is_file()


def describe(path: str | Path) -> Source:
    """The model an initial_load_path holds; UserError for a missing or unusable folder."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(
            f"checkpoint.initial_load_path {str(path)!r} does not exist (a titanlite step-N "
            "folder or a Hugging Face folder with config.json)"
        )
    if is_hf_folder(path):
        from titanlite.interop.hf import read_hf_model  # the adapters import torch

        spec, args, _ = read_hf_model(path)
        return Source(path, "hf", spec.name, args)
    meta = read_sidecar(path)
    from titanlite.interop.checkpoint_model import spec_and_args

    spec, args = spec_and_args(meta, str(path))
    return Source(path, "titanlite", model_name(meta), args)


def differences(source: Source, family: str, args: Any) -> list[str]:
    """'key=source value (this run: value)' for each way a run's model is not the source's."""
    if family != source.family:
        return [f"a {source.family} model (this run: {family})"]
    theirs, ours = dataclasses.asdict(source.args), dataclasses.asdict(args)
    return [
        f"{key}={theirs.get(key)!r} (this run: {value!r})"
        for key, value in ours.items()
        if key not in IGNORED_FIELDS and theirs.get(key) != value
    ]
