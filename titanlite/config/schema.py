"""What the JobConfig schema says of itself: its sections, each field's type and the docstring
under it, and names derived from its values. The parser, the checks, --help and the config
reference all read the schema through these.

Plain Python: no torch (the launcher's preflight parses configs).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import os
import types
import typing
from typing import Any, Literal

from titanlite.config.job_config import DatasetEntry, JobConfig


def sections() -> dict[str, type]:
    """Section name -> dataclass, in declaration order."""
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)}


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass (what --help shows)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for stmt, nxt in zip(body, [*body[1:], None], strict=True):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


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
