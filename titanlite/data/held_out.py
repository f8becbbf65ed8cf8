"""A text stream's validation batches, kept on disk so that a restarted run does not rescan.

Finding the held-out documents of a text stream means reading the whole corpus. The trainer
keeps the first validation pass's batches in memory, and also in one file per data-parallel
rank in the run's dump folder; a run started again in that folder (a resume) reads them back
when the file's key matches: a hash of everything that determines them (the DataSpec, the
tokenizer's fingerprint, the rank, the data-parallel degree, validation.steps, and the size and
modification time of a local source's files). Any other file is ignored and later replaced. A
Hub dataset is known by its name and config only: a changed Hub dataset keeps its old batches
until the file is deleted (a local folder given as training.dataset is known by its files).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict
from pathlib import Path

import torch

from titanlite.data.sources import local_files, sotu_files
from titanlite.data.spec import DataSpec
from titanlite.files import atomic_path

logger = logging.getLogger(__name__)

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def batches_key(spec: DataSpec, tokenizer: str, *, dp_rank: int, dp: int, steps: int) -> str:
    """The key of rank ``dp_rank``'s batches (``tokenizer``: its fingerprint)."""
    if spec.dataset_path:
        files = local_files(spec.dataset_path)[1]
    elif spec.dataset == "sotu":
        files = sotu_files()
    else:  # a local folder given as the dataset is known by its files, a Hub id by its name
        folder = Path(spec.dataset).expanduser()
        files = sorted(p for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []
    identity = {
        "spec": asdict(spec),
        "tokenizer": tokenizer,
        "dp_rank": dp_rank,
        "dp": dp,
        "steps": steps,
        "files": [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files],
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def load(path: Path, key: str) -> Batches | None:
    """The batches saved at ``path`` under ``key``; None when absent, other or unreadable."""
    if not path.is_file():
        return None
    try:
        saved = torch.load(path, weights_only=True)
        if saved["key"] != key:
            logger.info("validation: %s holds other batches (another run's data)", path)
            return None
        return [(inputs, labels) for inputs, labels in saved["batches"]]
    except Exception as exc:  # noqa: BLE001 (a damaged cache is only a cache)
        logger.warning("validation: ignoring %s (%s)", path, " ".join(str(exc).split())[:200])
        return None


def save(path: Path, key: str, batches: Batches) -> None:
    """Write ``batches`` atomically (to a temporary file, then renamed; the ranks of one dp rank
    write the same file, each through its own temporary); a failure only warns."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path, durable=True) as tmp:
            torch.save({"key": key, "batches": [list(b) for b in batches]}, tmp)
    except OSError as exc:
        logger.warning("validation: could not keep the batches in %s (%s)", path, exc)
