"""[model]: the family, flavor and tokenizer, and the shape fields the families let a config
override (``model.dim``, ``model.num_experts``, ...), found in the families' args through the
component catalog, so that a family adds its keys in its own folder. Plain Python."""

from __future__ import annotations

import functools
import typing
from dataclasses import dataclass, field
from typing import Any

from titanlite.config import catalog
from titanlite.config.docstrings import field_docs

FROM_CHECKPOINT = "from_checkpoint"
"""model.name and model.flavor meaning "what checkpoint.initial_load_path holds": the family and
shape of that checkpoint or Hugging Face folder. A config that leaves model.name and
model.flavor unset while it names an initial_load_path means it too."""


@dataclass
class Model:
    """[model]: the fixed keys below, and the shape fields of the families (``model.dim``,
    ``model.num_experts``, ...): any field a registered family lets a config override (its
    spec's ``overrides``; --help lists them) is read and written as a key of this section,
    and held in ``overrides``. A family adds such keys in its own folder, not here."""

    name: str = "llama3"
    """Model family, one of the registry's (docs/models.md; --help lists them), or
    "from_checkpoint": the family of checkpoint.initial_load_path (the default when a config names
    an initial_load_path and no model.name)."""
    flavor: str = "debugmodel"
    """Size preset of the family (--help lists each family's), or "from_checkpoint": the shape of
    checkpoint.initial_load_path (the default when a config names an initial_load_path and no
    model.flavor)."""
    tokenizer_path: str = "titanlite/assets/tokenizer.model"
    """Tokenizer: a sentencepiece .model, a Hugging Face tokenizer.json, or a folder holding either
    (e.g. a downloaded model folder); the vocabulary size follows it. Unset while
    checkpoint.initial_load_path holds a tokenizer: that one."""
    vocab_size: int | None = None
    """Embedding rows (unset = the tokenizer's vocabulary size; if set, at least that). Lets a dry
    run go without a tokenizer file."""
    converters: list[str] = field(default_factory=list)
    """Model converters applied in this order before parallelization (titanlite.converters; --help
    lists them)."""
    overrides: dict[str, Any] = field(default_factory=dict, metadata={"key": False})
    """The family fields this config sets (read and written as model.FIELD)."""

    def __getattr__(self, name: str) -> Any:
        # Only for names that are not attributes: the families' fields, None when unset.
        if name != "overrides" and not name.startswith("__") and name in family_fields():
            return self.__dict__.get("overrides", {}).get(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dataclass_fields__ or name not in family_fields():
            object.__setattr__(self, name, value)
        elif value is None:
            self.overrides.pop(name, None)
        else:
            self.overrides[name] = value


@dataclass(frozen=True)
class FamilyField:
    """A shape field families let a config override: its type, what it means, who has it."""

    type: Any
    doc: str
    families: tuple[str, ...]


def family_fields() -> dict[str, FamilyField]:
    """model.FIELD keys from the model registry: every field some family overrides, in the
    order the families list them (its type made optional: unset keeps the flavor's)."""
    return _family_fields()


@functools.cache
def _family_fields() -> dict[str, FamilyField]:
    found: dict[str, FamilyField] = {}
    for name, spec in catalog.current().families.items():
        hints, docs = typing.get_type_hints(spec.args_cls), field_docs(spec.args_cls)
        for key in spec.overrides:
            if key in found:
                old = found[key]
                found[key] = FamilyField(
                    old.type, old.doc or docs.get(key, ""), (*old.families, name)
                )
            else:
                found[key] = FamilyField(hints[key] | None, docs.get(key, ""), (name,))
    return found
