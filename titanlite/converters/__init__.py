"""The model-converter registry: transformations that replace modules of a model (float8
linears, ...) at one point of the parallelize order.

``model.converters = [...]`` names them; ``titanlite.parallel.parallelize`` applies them, in
that order, to the whole model on the meta device, after it is built and before pipeline
stages are cut and TP, FSDP and the rest are applied (step 0 of its order), so every
parallelism sees the converted modules.

This module is plain Python: config validation and the launcher's preflight check names and
layouts from the registry without importing torch. Each entry names the module of its torch
side, which provides ``convert(model, spec, settings) -> int`` (the number of modules it
replaced; it logs what it did).

Adding a converter: that module, and one entry below with what it replaces and the layouts
it cannot take (``refuses``: a function of the resolved degrees and the config returning one
line per problem, checked before launch).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConverterEntry:
    """One converter of the registry."""

    module: str
    """Provides ``convert(model, spec, settings) -> int``."""
    replaces: str
    """Which modules it replaces, in words (logs, docs, --help)."""
    refuses: Callable[[Any, Any], list[str]] = field(default=lambda degrees, cfg: [])
    """(titanlite.config.layout.Degrees, JobConfig) -> one line per layout or setting it
    cannot take."""

    def implementation(self) -> ModuleType:
        return importlib.import_module(self.module)


REGISTRY: dict[str, ConverterEntry] = {}
"""Name -> entry. None is built in yet; the float8 converter is the first planned."""


def get(name: str) -> ConverterEntry:
    """The entry of ``name``; KeyError if unknown (config validation names the valid ones)."""
    return REGISTRY[name]


@dataclass
class Converter:
    """A converter as parallelize applies it: its entry's torch side, with its settings."""

    name: str
    entry: ConverterEntry
    settings: Any = None

    def convert(self, model: Any, spec: Any) -> int:
        replaced = self.entry.implementation().convert(model, spec, self.settings)
        logger.info(
            "converter %s replaced %d modules (%s)", self.name, replaced, self.entry.replaces
        )
        return replaced


def build(names: list[str], settings: Any = None) -> list[Converter]:
    """The converters ``model.converters`` names, in order."""
    return [Converter(name, get(name), settings) for name in names]
