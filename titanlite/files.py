"""Files a reader never sees half-written: write beside the target, then rename over it.

rename(2) within one folder is atomic, so a reader (or the next run, after a crash) finds the
old content or the new, never a mix. Every writer of a file that something reads back (token
shards, checksums, caches, plots, tokenizers, configs, export folders) goes through here.

Plain Python, no torch: the launcher's preflight and the scripts import it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path


def temp_sibling(path: Path, tag: str = "tmp") -> Path:
    """A fresh hidden name beside ``path``, ending in ``.{tag}``. The random part keeps two
    writers apart even when they share a process id (ranks on different nodes writing one
    shared folder)."""
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.{tag}")


def fsync(path: Path) -> None:
    """Flush a file's data, or a folder's entries (after a rename in it), to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], *, durable: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` for the block to create, as a file or a folder.
    When the block succeeds, it replaces ``path`` in one rename; when it raises, it is
    removed and ``path`` is left as it was. ``durable`` fsyncs the file before the rename,
    for files whose loss after a crash would void other work (a shard, a checksum)."""
    target = Path(path)
    tmp = temp_sibling(target)
    try:
        yield tmp
        if durable:
            fsync(tmp)
        _replace(tmp, target)
    except BaseException:
        _remove(tmp)
        raise


def atomic_write(path: str | os.PathLike[str], data: bytes | str, *, durable: bool = False) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` through ``atomic_path``."""
    with atomic_path(path) as tmp, open(tmp, "xb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        if durable:  # here, while the file is open, rather than reopening it
            f.flush()
            os.fsync(f.fileno())


def _replace(tmp: Path, target: Path) -> None:
    if not (tmp.is_dir() and target.exists()):
        os.replace(tmp, target)
        return
    # rename(2) replaces only an empty folder: the old one steps aside for the moment of the
    # swap and comes back if the swap fails.
    old = temp_sibling(target, "old")
    os.replace(target, old)
    try:
        os.replace(tmp, target)
    except BaseException:
        os.replace(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _remove(path: Path) -> None:
    """Remove a failed write's leftover; a failure here must not hide the error that failed it."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
