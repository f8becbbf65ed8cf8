"""Checksums of a checkpoint's shard files: written by the rank that wrote each file, checked
before a load (each rank a share of the files) and by scripts/verify_checkpoint.py.

Each rank writes ``__RANK.sha256.json`` beside its ``*.distcp`` files: name -> [size, sha256].
Nothing of it passes through rank 0, so no file grows with the world size. A checkpoint saved
before checksums existed has no such files; it is loaded unchecked.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

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
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(sums, sort_keys=True))
        os.replace(tmp, out)
        return future


def recorded(folder: Path) -> dict[str, tuple[int, str]]:
    """Every shard file's recorded (size, sha256), from all ranks' checksum files."""
    sums: dict[str, tuple[int, str]] = {}
    for path in sorted(folder.glob(f"__*{SUFFIX}")):
        try:
            for name, (size, digest) in json.loads(path.read_text()).items():
                sums[name] = (int(size), str(digest))
        except (OSError, ValueError, TypeError) as e:
            sums[f"<{path.name}>"] = (-1, f"unreadable checksum file ({e})")
    return sums


def problems(folder: Path, rank: int = 0, world: int = 1) -> list[str]:
    """What is wrong with this rank's share of the shard files (every file when world is 1):
    missing, of another size, or another checksum; a shard without a checksum."""
    sums = recorded(folder)
    if not sums:
        return []  # saved before checksums existed
    found: list[str] = []
    shards = sorted(set(sums) | {p.name for p in folder.glob("*.distcp")})
    for i, name in enumerate(shards):
        if i % world != rank:
            continue
        if name.startswith("<"):
            found.append(f"{name[1:-1]}: {sums[name][1]}")
            continue
        path = folder / name
        if name not in sums:
            found.append(f"{name}: no checksum recorded for it")
        elif not path.is_file():
            found.append(f"{name}: missing")
        elif path.stat().st_size != sums[name][0]:
            found.append(
                f"{name}: truncated or grown ({path.stat().st_size:,} bytes, saved "
                f"{sums[name][0]:,})"
            )
        elif file_digest(path) != sums[name][1]:
            found.append(f"{name}: checksum mismatch (the file changed after it was saved)")
    return found
