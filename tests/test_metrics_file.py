"""titanlite.metrics.jsonl: a resumed run's metrics.jsonl read as the run that continued."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from titanlite.metrics.jsonl import MetricsFileError, find_metrics_file, read_metrics


def write(path: Path, records: list[dict | str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_resume_drops_undone_steps_of_every_kind_and_the_latest_record_wins(
    tmp_path: Path,
) -> None:
    records: list[dict | str] = [{"step": s, "loss": 10.0 - s} for s in range(1, 9)]
    records.append({"step": 6, "kind": "validation", "val_loss": 9.0})
    records.append({"step": 8, "kind": "validation", "val_loss": 8.0})
    records.append({"step": 4, "kind": "resume"})  # steps 5-8 are undone
    records += [{"step": s, "loss": 1.0 - s / 10} for s in range(5, 7)]
    records.append({"step": 6, "kind": "validation", "val_loss": 0.5})
    records.append({"step": 6, "loss": 0.25})  # logged twice without a resume: the last wins
    records.append("")  # blank lines are nothing
    found = read_metrics(write(tmp_path / "metrics.jsonl", records))
    assert {s: r["loss"] for s, r in found.train.items()} == {
        1: 9.0,
        2: 8.0,
        3: 7.0,
        4: 6.0,
        5: 0.5,
        6: 0.25,
    }
    assert {s: r["val_loss"] for s, r in found.validation.items()} == {6: 0.5}
    assert list(found.kind("resume")) == [4]
    assert found.kind("startup") == {} and found.malformed == []


def test_malformed_lines_are_listed_with_their_numbers_and_skipped(tmp_path: Path) -> None:
    good = {"step": 1, "loss": 2.0}
    lines = [good, '{"step": 2, "lo', "[1, 2]", {"step": True}, {"step": 3, "kind": 7}, good]
    found = read_metrics(write(tmp_path / "metrics.jsonl", lines))
    assert [(m.line, m.reason.split(" (")[0]) for m in found.malformed] == [
        (2, "malformed JSON"),
        (3, "not a metrics record"),
        (4, "not a metrics record"),
        (5, "not a metrics record"),
    ]
    assert found.train == {1: good}


def test_a_run_is_its_folder_or_its_file_and_bad_ones_are_one_line(tmp_path: Path) -> None:
    path = write(tmp_path / "metrics.jsonl", [{"step": 1}])
    assert find_metrics_file(tmp_path) == path == find_metrics_file(path)
    with pytest.raises(MetricsFileError, match="no such file or directory"):
        find_metrics_file(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MetricsFileError, match="no metrics.jsonl in this folder"):
        find_metrics_file(tmp_path / "empty")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(MetricsFileError, match="not a text file"):
        read_metrics(binary)


def test_importing_the_helpers_does_not_import_torch() -> None:
    """The scripts that read metrics and the launcher's preflight start without torch."""
    code = "import sys, titanlite.files, titanlite.metrics.jsonl; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.split() == ["False"], out.stderr
