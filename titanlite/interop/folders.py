"""Writing output folders safely: atomic replacement, never over a user's own data."""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from titanlite.errors import UserError
from titanlite.files import atomic_path


def check_output_folder(out: Path, allowed: re.Pattern[str], marker: str, key: str) -> None:
    """UserError unless out is missing, empty, or an earlier output of ours: nothing but
    files we write, and a marker JSON file holding ``key``. User data (a training
    checkpoint, a hand-made HF folder) is never replaced."""
    if not out.exists():
        return
    if not out.is_dir():
        raise UserError(f"output {str(out)!r} exists and is not a folder")
    names = sorted(p.name for p in out.iterdir())
    if not names:
        return
    foreign = [n for n in names if not allowed.match(n)]
    try:
        ours = key in json.loads((out / marker).read_text())
    except (OSError, ValueError, TypeError):
        ours = False
    if foreign or not ours:
        reason = f"holds {', '.join(foreign[:3])}" if foreign else f"{marker} is not ours"
        raise UserError(
            f"output folder {str(out)!r} is not empty and not an earlier conversion "
            f"({reason}); choose a new or empty folder"
        )


@contextmanager
def atomic_folder(out: Path) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it replaces ``out`` in one rename."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        tmp.mkdir()
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        for file in tmp.iterdir():  # some writers create private (0600) files
            file.chmod(0o666 & ~umask)


@contextmanager
def quiet_single_process() -> Iterator[None]:
    # DCP warns that it assumes one process when no process group exists: that is the intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* single process")
        yield


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise UserError(f"{str(path)!r} does not exist")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{str(path)!r} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise UserError(f"{str(path)!r} does not hold a JSON object")
    return data


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
