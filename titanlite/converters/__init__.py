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
it cannot take (``refuses``: a function of the resolved degrees and the config returning one
line per problem, checked before launch).
"""

from __future__ import annotations

import importlib
import importlib.util
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
    section: str = ""
    """The JobConfig section holding its settings ("" = none); passed to its functions."""

    def implementation(self) -> ModuleType:
        return importlib.import_module(self.module)


def _float8_refuses(degrees: Any, cfg: Any) -> list[str]:
    """What the float8 converter cannot take (torch-free: torchao is only looked for)."""
    f = cfg.float8
    lines = []
    if importlib.util.find_spec("torchao") is None:
        lines.append("needs torchao, which is not installed: pip install 'titanlite[float8]'")
    if f.enable_fsdp_float8_all_gather and f.recipe != "tensorwise":
        lines.append(
            f'float8.enable_fsdp_float8_all_gather needs float8.recipe = "tensorwise" (the '
            f"{f.recipe} recipe scales each row, which a weight's shard does not hold)"
        )
    if f.precompute_float8_dynamic_scale_for_fsdp and not f.enable_fsdp_float8_all_gather:
        lines.append(
            "float8.precompute_float8_dynamic_scale_for_fsdp needs "
            "float8.enable_fsdp_float8_all_gather = true"
        )
    if f.experts and f.recipe != "rowwise":
        lines.append("float8.experts: the grouped matmuls have the rowwise recipe only")
    return lines


REGISTRY: dict[str, ConverterEntry] = {
    "float8": ConverterEntry(
        module="titanlite.converters.float8",
        replaces="nn.Linear -> torchao Float8Linear, but the output projection and routers",
        refuses=_float8_refuses,
        section="float8",
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
        Converter(name, e, getattr(cfg, e.section) if cfg is not None and e.section else None)
        for name, e in entries
    ]
