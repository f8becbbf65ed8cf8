"""[eval]: which downstream tasks are scored during training, and how often. Plain Python."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from titanlite.config.catalog import Section
from titanlite.config.planned import PlannedRun
from titanlite.errors import Problems
from titanlite.paths import resolve_path


@dataclass
class EvalSettings:
    """[eval]: downstream multiple-choice tasks scored during training (docs/evaluation.md)."""

    enable: bool = False
    """Score the tasks periodically (and after the last step)."""
    freq: int = 50
    """Every this many steps."""
    tasks: list[str] = field(default_factory=lambda: ["sotu_word_order"])
    """Built-in tasks (sotu_word_order, sotu_next_sentence) or JSONL task files
    (docs/evaluation.md has the format)."""
    limit: int = 100
    """Questions scored per task (0 = all)."""
    batch_size: int = 16
    """Rows (one per question and choice) per forward pass."""


SECTION = Section("eval", EvalSettings, after="validation")


def check_tasks(run: PlannedRun) -> list[str]:
    """[eval]'s numbers, and every task file read and checked: before the run writes anything
    into its folder (a bad file once replaced an earlier run's config.toml and run.json)."""
    from titanlite.downstream import builtin
    from titanlite.downstream.tasks import read_task

    e = run.cfg.eval
    if not e.enable:
        return []
    problems = Problems()
    for key, value, least in (
        ("freq", e.freq, 1),
        ("batch_size", e.batch_size, 1),
        ("limit", e.limit, 0),
    ):
        if value < least:
            problems.add(f"eval.{key}: must be at least {least}, got {value}")
    for name in e.tasks:
        if name not in builtin.NAMES:
            with problems.check():
                read_task(Path(resolve_path(name)))
    return problems.lines
