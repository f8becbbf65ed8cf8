"""titanlite.files: a file or folder is replaced whole or not at all, and nothing is left over."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from titanlite.files import atomic_path, atomic_write


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("durable", [False, True])
def test_atomic_write_replaces_the_file_with_ordinary_permissions(
    tmp_path: Path, durable: bool
) -> None:
    path = tmp_path / "out.json"
    path.write_text("old")
    atomic_write(path, "new ✓", durable=durable)
    assert path.read_text(encoding="utf-8") == "new ✓"
    atomic_write(path, b"\x00bytes", durable=durable)
    assert path.read_bytes() == b"\x00bytes"
    assert names(tmp_path) == ["out.json"]  # no temporary file left
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # not a private temp file's 0600


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "out.png"
    path.write_bytes(b"an earlier plot")
    with pytest.raises(ValueError, match="refused"), atomic_path(path, durable=True) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".out.png.")
        tmp.write_bytes(b"half")
        raise ValueError("refused")
    assert path.read_bytes() == b"an earlier plot"
    assert names(tmp_path) == ["out.png"]


def test_a_folder_replaces_an_existing_folder_or_leaves_it_on_failure(tmp_path: Path) -> None:
    out = tmp_path / "export"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), atomic_path(out) as tmp:
        tmp.mkdir()
        (tmp / "new.txt").write_text("new")
        raise RuntimeError("a conversion failed half-way")
    assert names(out) == ["old.txt"] and names(tmp_path) == ["export"]
    with atomic_path(out) as tmp:
        tmp.mkdir()
        (tmp / "new.txt").write_text("new")
    assert names(out) == ["new.txt"] and names(tmp_path) == ["export"]
