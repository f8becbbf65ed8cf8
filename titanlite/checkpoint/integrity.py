"""Checksums of a checkpoint's shard files: written by the rank that wrote each file, checked
before a load (each rank a share of the files) and by scripts/verify_checkpoint.py.

Each rank writes ``__RANK.sha256.json`` beside its ``*.distcp`` files: name -> [size, sha256].
Nothing of it passes through rank 0, so no file grows with the world size. A checkpoint saved
before checksums existed has no such files; it is loaded unchecked.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from titanlite.files import atomic_write

SUFFIX = ".sha256.json"
_CHUNK = 1 << 22


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


class ChecksummingWriter(FileSystemWriter):
    """DCP's file writer that also records the size and sha256 of every file this rank wrote
    (runs where the writing does: in the background for an asynchronous save)."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        results = future.wait()
        names = sorted({r.storage_data.relative_path for r in results})
        folder = Path(self.path)
        sums = {n: [(folder / n).stat().st_size, file_digest(folder / n)] for n in names}
        rank = dist.get_rank() if dist.is_initialized() else 0
        out = folder / f"__{rank}{SUFFIX}"
        # Durable like the shards: a crash must not void a good save.
        atomic_write(out, json.dumps(sums, sort_keys=True), durable=True)
        return future


def _read(path: Path) -> dict[str, tuple[int, str]] | str:
    """One rank's record, or what is wrong with it."""
    try:
        return {n: (int(size), str(d)) for n, (size, d) in json.loads(path.read_text()).items()}
    except (OSError, ValueError, TypeError) as e:
        return f"{path.name}: unreadable checksum file ({e})"


def recorded(folder: Path) -> dict[str, tuple[int, str]]:
    """Every shard file's recorded (size, sha256), from all ranks' checksum files."""
    sums: dict[str, tuple[int, str]] = {}
    for path in sorted(folder.glob(f"__*{SUFFIX}")):
        record = _read(path)
        if isinstance(record, dict):
            sums.update(record)
    return sums


def _check(folder: Path, name: str, size: int, digest: str) -> str | None:
    path = folder / name
    try:
        if not path.is_file():
            return f"{name}: missing"
        found = path.stat().st_size
        if found != size:
            return f"{name}: truncated or grown ({found:,} bytes, saved {size:,})"
        if file_digest(path) != digest:
            return f"{name}: checksum mismatch (the file changed after it was saved)"
    except OSError as e:  # an I/O error is a finding too, never an exception on one rank
        return f"{name}: unreadable ({e.strerror or e})"
    return None


def problems(folder: Path, saved_ranks: int | None, rank: int = 0, world: int = 1) -> list[str]:
    """What is wrong with this rank's share of the shard files: those of the saving ranks
    r, r + world, ... (so each rank reads world-independent amounts of records). With
    ``saved_ranks`` None (the count was not recorded: verify_checkpoint.py on any folder, or a
    checkpoint from before checksums) every checksum file present is checked, by rank 0."""
    if saved_ranks is None:
        paths = sorted(folder.glob(f"__*{SUFFIX}")) if rank == 0 else []
    else:
        paths = [folder / f"__{r}{SUFFIX}" for r in range(rank, saved_ranks, world)]
    found: list[str] = []
    for path in paths:
        if not path.is_file():
            found.append(f"{path.name}: missing (the rank's checksums)")
            continue
        record = _read(path)
        if isinstance(record, str):
            found.append(record)
            continue
        for name, (size, digest) in sorted(record.items()):
            problem = _check(folder, name, size, digest)
            if problem:
                found.append(problem)
    return found
