"""What the JobConfig schema says of itself: its sections, each field's type and the docstring
under it, and names derived from its values. The parser, the checks, --help and the config
reference all read the schema through these.

Plain Python: no torch (the launcher's preflight parses configs).
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from typing import Any, Literal

from titanlite.config import catalog, docstrings
from titanlite.config.job_config import DatasetEntry, JobConfig
from titanlite.config.model_section import Model, family_fields


def sections() -> dict[str, type]:
    """Section name -> dataclass, in the order --help and config.toml list them: titanlite's
    own in declaration order, each followed by the components' sections that name it as
    ``after`` (then those following them); a component naming no known section comes last."""
    hints = typing.get_type_hints(JobConfig)
    own = {
        f.name: hints[f.name]
        for f in dataclasses.fields(JobConfig)
        if f.metadata.get("section", True)  # not ``components``: their holder
    }
    components = catalog.current().sections
    ordered: dict[str, type] = {}

    def emit(name: str, cls: type) -> None:
        ordered[name] = cls
        for s in components:
            if s.after == name and s.name not in ordered:
                emit(s.name, s.settings)

    for name, cls in own.items():
        emit(name, cls)
    for s in components:
        if s.name not in ordered:
            emit(s.name, s.settings)
    return ordered


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each key of a section (for [model], the families' fields too:
    their own docstrings, with the families that have them)."""
    docs = dict(docstrings.field_docs(cls))
    if cls is Model:
        for name, f in family_fields().items():
            docs[name] = f"{f.doc} ({', '.join(f.families)})".lstrip()
    return docs


def field_types(cls: type) -> dict[str, Any]:
    """Key -> type of a section's keys (for [model], the families' fields too)."""
    hints = typing.get_type_hints(cls)
    if cls is not Model:
        return hints
    own = {f.name for f in dataclasses.fields(cls) if f.metadata.get("key", True)}
    return {
        **{k: v for k, v in hints.items() if k in own},
        **{name: f.type for name, f in family_fields().items()},
    }


def keys(cls: type) -> list[str]:
    """A section's keys in order: its fields (not the internal ones), and for [model] the
    families' fields after them."""
    own = [f.name for f in dataclasses.fields(cls) if f.metadata.get("key", True)]
    return own + list(family_fields()) if cls is Model else own


def split_optional(tp: Any) -> tuple[Any, bool]:
    """(inner type, whether None is allowed) for ``X | None``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def type_name(tp: Any) -> str:
    inner, optional = split_optional(tp)
    if typing.get_origin(inner) is Literal:
        name = "|".join(str(c) for c in typing.get_args(inner))
    elif typing.get_origin(inner) is list:
        name = f"list[{typing.get_args(inner)[0].__name__}]"
    else:
        name = inner.__name__
    return f"{name} (optional)" if optional else name


def dataset_name(entry: DatasetEntry) -> str:
    """A mixture entry's name: as given, else its folder's name."""
    return entry.name or os.path.basename(os.path.normpath(entry.path))
