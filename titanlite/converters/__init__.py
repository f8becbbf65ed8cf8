"""The model-converter registry: transformations that replace modules of a model (float8
linears, ...) at one point of the parallelize order.

``model.converters = [...]`` names them; ``titanlite.parallel.parallelize`` applies them, in
that order, to the whole model on the meta device, after it is built and before pipeline
stages are cut and TP, FSDP and the rest are applied (step 0 of its order), so every
parallelism sees the converted modules.

This module is plain Python: config validation and the launcher's preflight check names and
layouts from the registry without importing torch. Each entry names the module of its torch
side, which provides ``convert(model, spec, settings) -> int`` (the number of modules it
replaced; it logs what it did) and may provide ``after_optimizer_step(parts, settings)``
(run after every optimizer step; float8 precomputes its FSDP scales there). ``settings`` is
the entry's config section (``section``), e.g. [float8].

Adding a converter: that module, and one entry below with what it replaces and the layouts
it cannot take (``refuses``: a function of the planned run returning one line per problem,
checked before launch).

May import: ``config``, ``errors``; its torch sides also ``models.spec`` and
``models.interfaces``.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from titanlite.config.catalog import Section
from titanlite.config.planned import Rule
from titanlite.converters import float8_settings, lora_settings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConverterEntry:
    """One converter of the registry."""

    module: str
    """Provides ``convert(model, spec, settings) -> int``."""
    replaces: str
    """Which modules it replaces, in words (logs, docs, --help)."""
    refuses: Rule | None = None
    """What it cannot take of the planned run (the layout's degrees, other settings): one
    line each, checked before launch (``titanlite.config.planned``)."""
    section: Section | None = None
    """Its own settings ([float8]), if any: passed to its functions as ``settings``."""

    def implementation(self) -> ModuleType:
        return importlib.import_module(self.module)


REGISTRY: dict[str, ConverterEntry] = {
    "float8": ConverterEntry(
        module="titanlite.converters.float8",
        replaces="nn.Linear -> torchao Float8Linear, but the output projection and routers",
        refuses=float8_settings.refuses,
        section=float8_settings.SECTION,
    ),
    "lora": ConverterEntry(
        module="titanlite.converters.lora",
        replaces="chosen nn.Linear -> LoraLinear (frozen weight + trained low-rank update)",
        refuses=lora_settings.refuses,
        section=lora_settings.SECTION,
    ),
}
"""Name -> entry."""


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

    def attach(self, parts: list[Any], optimizers: list[Any]) -> None:
        """Run the torch side's ``after_optimizer_step(parts, settings)``, if it has one, after
        every optimizer step (a step that is skipped runs none)."""
        hook = getattr(self.entry.implementation(), "after_optimizer_step", None)
        if hook is None:
            return
        for part, optimizer in zip(parts, optimizers, strict=True):
            optimizer.register_step_post_hook(lambda *_, part=part: hook([part], self.settings))


def build(names: list[str], cfg: Any = None) -> list[Converter]:
    """The converters ``model.converters`` names, in order, each with its config section."""
    entries = [(name, get(name)) for name in names]
    return [
        Converter(name, e, getattr(cfg, e.section.name) if cfg is not None and e.section else None)
        for name, e in entries
    ]
