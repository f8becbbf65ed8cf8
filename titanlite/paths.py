"""Where a path in a config points (plain Python: the launcher's preflight imports it)."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def resolve_path(path: str) -> str:
    """A relative path as given when it exists, else relative to the titanlite checkout (so
    the shipped tokenizer is found from any working directory)."""
    if not path or os.path.isabs(path) or os.path.exists(path):
        return path
    candidate = REPO_ROOT / path
    return str(candidate) if candidate.exists() else path
