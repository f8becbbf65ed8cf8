"""Checkpoint folders on disk, and the JSON sidecar every titanlite checkpoint carries.

    step-N/            a complete checkpoint
      .metadata, *.distcp   torch.distributed.checkpoint: every tensor, sharded as trained
      titanlite.json   the sidecar: format, step, the model's family and args, and the
                       plain (non-tensor) state of each Stateful under "states"
    step-N.partial/    a save in progress (or killed); never loaded, removed on the next save

Plain Python: no torch.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from titanlite.errors import UserError

logger = logging.getLogger(__name__)

FORMAT = 2
"""Format 2 keeps plain state under "states" and RNG per rank in the tensors; format 1
(titanlite 0.1) is still read."""
READABLE_FORMATS = (1, 2)
SIDECAR = "titanlite.json"
STEP_DIR = re.compile(r"^step-(\d+)$")
DEFAULT_MODEL = "llama3"
"""The family of a sidecar that names none (format 1 knew only Llama)."""


def is_complete(path: Path) -> bool:
    return (path / ".metadata").is_file() and (path / SIDECAR).is_file()


def complete_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint in folder, oldest first."""
    if not folder.is_dir():
        return []
    found = []
    for child in folder.iterdir():
        match = STEP_DIR.match(child.name)
        if match and child.is_dir():
            if is_complete(child):
                found.append((int(match.group(1)), child))
            else:
                logger.warning("ignoring %s: not a complete checkpoint", child)
    return sorted(found)


def read_sidecar(path: Path) -> dict[str, Any]:
    """The checkpoint's titanlite.json, or a UserError naming the folder."""
    if not path.is_dir():
        raise UserError(f"checkpoint folder {str(path)!r} does not exist")
    if not is_complete(path):
        raise UserError(
            f"checkpoint folder {str(path)!r} is not a complete titanlite checkpoint "
            f"(needs .metadata and {SIDECAR})"
        )
    try:
        meta = json.loads((path / SIDECAR).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"checkpoint folder {str(path)!r}: {SIDECAR} is unreadable ({e})") from None
    found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
    if found not in READABLE_FORMATS:
        raise UserError(
            f"checkpoint folder {str(path)!r}: unknown format {found!r} "
            f"(this titanlite reads formats {', '.join(map(str, READABLE_FORMATS))})"
        )
    return meta


def plain_states(meta: dict[str, Any]) -> dict[str, Any]:
    """The non-tensor state of each Stateful, by key, from a sidecar of any readable format."""
    if meta["format"] == 1:
        return {k: meta[k] for k in ("lr_scheduler", "dataloader", "train_state") if k in meta}
    return meta.get("states", {})


def model_name(meta: dict[str, Any]) -> str:
    return meta.get("model_name", DEFAULT_MODEL)


def write_sidecar(folder: Path, fields: dict[str, Any]) -> None:
    """Write folder/titanlite.json with this format, durably (the file marks the checkpoint
    complete, so it must not be half-written when the rename makes it visible)."""
    path = folder / SIDECAR
    with open(path, "w") as f:
        json.dump({"format": FORMAT, **fields}, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
