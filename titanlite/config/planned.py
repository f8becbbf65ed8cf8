"""What the checks before a run know of it (``PlannedRun``), and the shape of a rule that
checks one feature against the rest (``Rule``). Plain Python.

A cross-feature rule (Muon's per-head blocks need per-head projections; a document mask needs
a tokenizer with BOS or EOS; expert parallelism needs experts) lives with the feature that
has it, as a short function ``(PlannedRun) -> list[str]``: one line per problem. The
launcher's preflight, the dry run and the trainer run every rule through
``titanlite.checks.check``; the rules of registry entries are declared on the entry
(``refuses``), the others listed in ``titanlite.components.RUN_RULES``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from titanlite.config.job_config import JobConfig
from titanlite.config.layout import Degrees


@dataclass(frozen=True)
class PlannedRun:
    """A run as far as it is known before it starts."""

    cfg: JobConfig
    world_size: int
    degrees: Degrees | None = None
    """The layout's degrees (None: the layout itself is wrong, already reported)."""
    spec: Any = None
    """The family's ModelSpec (None with ``args``)."""
    args: Any = None
    """This run's model args (None: no vocabulary size known, or the shape is wrong)."""
    tokenizer: Any = None
    """The tokenizer (None in a dry run given model.vocab_size and no tokenizer file)."""


Rule = Callable[[PlannedRun], list[str]]
"""One feature's checks of a planned run: a line per problem, empty when all is well."""
