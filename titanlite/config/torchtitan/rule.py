"""How one TorchTitan key carries over to titanlite (``Rule``). No torch here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ANY = None
"""``Rule.inert`` value meaning that no value of the key changes a titanlite run."""


@dataclass(frozen=True)
class Rule:
    target: str = ""
    """The titanlite key the value goes to ("" = none)."""
    note: str = ""
    """What the key does in titanlite, or what to do instead (docs table and report)."""
    inert: tuple[Any, ...] | None = ANY
    """Without a target: values accepted silently (ANY = all); any other value is a Note."""
    blocks: bool = False
    """A value titanlite cannot honour blocks the run (else it is dropped with a note)."""
    values: tuple[tuple[Any, Any], ...] = ()
    """Value renames (TorchTitan value, titanlite value)."""
    special: bool = False
    """Handled by its own code in ``convert`` (the note says how)."""


def same(*keys: str) -> dict[str, Rule]:
    return {key: Rule(key) for key in keys}
