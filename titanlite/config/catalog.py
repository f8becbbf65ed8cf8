"""What the components offer the config, handed in from above: their settings sections, the
names their registries know, their checks of a parsed config, and family data.

``titanlite.config`` imports no component (models, optimizers, converters, checkpoints, ...):
the dependency runs the other way. ``titanlite.components`` collects the registries into one
``Catalog`` and installs it when the package is first imported; the parser, the checks,
--help and the TorchTitan import read it through ``current()``.

A component with settings declares a ``Section`` (its dataclass lives next to its code, in a
torch-free module); the registry entry that owns it lists it, and ``JobConfig`` holds an
instance under the section's name (``cfg.muon``, ``cfg.float8``). Plain Python.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Section:
    """One component's settings: ``[name]`` in a config file, ``--name.key`` on the command
    line, ``cfg.name`` in code."""

    name: str
    settings: type
    """A dataclass: each field a key, with its type, default and the docstring under it."""
    after: str
    """The section it is listed after in --help and a run's config.toml."""
    check: Callable[[Any, Any], None] | None = None
    """(JobConfig, Problems) -> None: adds one line per bad value of the parsed config that
    needs no world size (the layout's checks come later, with the degrees)."""


@dataclass(frozen=True)
class Catalog:
    """Everything the config needs to know of the components. The registries are read live
    (an entry registered later, a plug-in's, shows up with its section and names)."""

    declared: Callable[[], tuple[Section, ...]] = tuple
    """() -> the components' sections, in the order the registries list them."""
    families: Mapping[str, Any] = field(default_factory=dict)
    """Family name -> its ModelSpec (read: ``flavors``, ``args_cls``, ``overrides``)."""
    optimizers: Mapping[str, Any] = field(default_factory=dict)
    """Registry name (lower case) -> optimizer entry."""
    converters: Mapping[str, Any] = field(default_factory=dict)
    """Registry name -> converter entry (read: ``replaces``)."""
    flavor_aliases: Mapping[tuple[str, str], tuple[str, str]] = field(default_factory=dict)
    """(model.name, model.flavor) as users write them -> the family and flavor that build it."""
    torchtitan_flavors: Mapping[tuple[str, str], tuple[str, str, Mapping[str, Any]]] = field(
        default_factory=dict
    )
    """(TorchTitan model.name, flavor) -> (family, flavor, overrides reproducing its model)."""
    torchtitan_yarn_from: int = 0
    """TorchTitan's DeepSeek-V3 stretches RoPE only for training.seq_len above this."""
    state_keys: tuple[str, ...] = ()
    """What a checkpoint holds, by name (checkpoint.exclude_from_loading may list them)."""

    @property
    def sections(self) -> tuple[Section, ...]:
        """The components' sections; a ValueError when two declare the same name."""
        found = self.declared()
        names = [s.name for s in found]
        if len(set(names)) != len(names):
            raise ValueError(f"two components declare the same section: {sorted(names)}")
        return found

    def section(self, name: str) -> Section | None:
        return next((s for s in self.sections if s.name == name), None)


_installed: Catalog | None = None


def install(catalog: Catalog) -> None:
    """Make ``catalog`` the one the config reads (titanlite.components does it on import)."""
    global _installed
    catalog.sections  # noqa: B018 - two components declaring one section fail here, at import
    _installed = catalog


def current() -> Catalog:
    if _installed is None:  # only if titanlite/__init__.py was bypassed
        raise RuntimeError("no component catalog installed: import titanlite first")
    return _installed
