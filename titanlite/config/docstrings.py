"""The docstrings written under dataclass fields (Python keeps none for them): what --help,
the config reference and the family-field listing show. Plain Python."""

from __future__ import annotations

import ast
import functools
import inspect


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass (what --help shows), those of
    the dataclasses it inherits from included."""
    docs: dict[str, str] = {}
    for base in cls.__bases__:
        if hasattr(base, "__dataclass_fields__"):
            docs.update(field_docs(base))
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
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
