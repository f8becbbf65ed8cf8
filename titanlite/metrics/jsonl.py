"""Reading a run's metrics.jsonl: the one reader, for the scripts and the tests.

The trainer appends one JSON record per line: a training step's record has no "kind";
others say theirs ("validation", "resume", ...). A resumed run appends to the same file: it
logs a "resume" record at its checkpoint's step N, then logs steps N+1, ... again. So:

- records after a resume at step N with a step above N belong to the history the resume
  abandoned, and are dropped (those steps are undone, whether or not they are logged again);
- of a step logged more than once, the latest record wins (it is the run that continues).

Plain Python, no torch: the comparison and plotting scripts start without it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FILE_NAME = "metrics.jsonl"
TRAIN = "train"
"""The kind of a training step's record (logged without a "kind")."""
VALIDATION = "validation"
RESUME = "resume"


class MetricsFileError(Exception):
    """A metrics file that cannot be read; the message is one line naming it."""


@dataclass(frozen=True)
class Malformed:
    """A line that is not a metrics record (one cut short by a crash, say)."""

    line: int
    reason: str


@dataclass(frozen=True)
class MetricsRecords:
    """The records of one metrics.jsonl, by kind, then by step (in the order first logged)."""

    path: Path
    by_kind: dict[str, dict[int, dict[str, Any]]]
    malformed: list[Malformed] = field(default_factory=list)

    def kind(self, name: str) -> dict[int, dict[str, Any]]:
        return self.by_kind.get(name, {})

    @property
    def train(self) -> dict[int, dict[str, Any]]:
        return self.kind(TRAIN)

    @property
    def validation(self) -> dict[int, dict[str, Any]]:
        return self.kind(VALIDATION)


def find_metrics_file(run: str | os.PathLike[str]) -> Path:
    """The metrics file of a run folder, or the file itself when given one."""
    path = Path(run)
    if not path.exists():
        raise MetricsFileError(f"{path}: no such file or directory")
    if path.is_dir():
        path = path / FILE_NAME
        if not path.is_file():
            raise MetricsFileError(f"{path.parent}: no {FILE_NAME} in this folder")
    return path


def read_metrics(path: str | os.PathLike[str]) -> MetricsRecords:
    """Every record of a metrics file by kind and step, by the rules of the module docstring.
    Malformed lines are listed, not raised: whether one is fatal is the caller's choice."""
    path = Path(path)
    by_kind: dict[str, dict[int, dict[str, Any]]] = {}
    malformed: list[Malformed] = []
    try:
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                record = _parse(line)
                if isinstance(record, str):
                    malformed.append(Malformed(number, record))
                    continue
                kind = TRAIN if record.get("kind") is None else record["kind"]
                step = record["step"]
                if kind == RESUME:
                    for steps in by_kind.values():
                        for undone in [s for s in steps if s > step]:
                            del steps[undone]
                by_kind.setdefault(kind, {})[step] = record
    except UnicodeDecodeError:
        raise MetricsFileError(f"{path}: not a text file") from None
    except OSError as e:
        raise MetricsFileError(f"{path}: cannot read ({e.strerror or e})") from None
    return MetricsRecords(path, by_kind, malformed)


def _parse(line: str) -> dict[str, Any] | str:
    """The record on a line, or why it is not one."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        return f"malformed JSON ({e.msg})"
    step = record.get("step") if isinstance(record, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
        return "not a metrics record (needs an integer 'step')"
    if record.get("kind") is not None and not isinstance(record["kind"], str):
        return "not a metrics record ('kind' must be a string)"
    return record
