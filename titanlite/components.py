"""The components titanlite is made of, composed into the config.

``titanlite.config`` imports no component; this module, at the root, reads the registries
(model families, optimizers, converters), the sections their entries and the features
declare, and what the config checks against (checkpoint state names, TorchTitan's flavors),
and installs them as the config's ``Catalog``. ``titanlite/__init__.py`` imports it, so any
use of titanlite has it in place. Plain Python: no torch.

Adding a component with settings: its dataclass and ``Section`` in a torch-free module of its
own folder, named by its registry entry (``section=``) or, for a feature without a registry,
listed in ``FEATURE_SECTIONS`` below; its checks against the rest of a planned run likewise
(the entry's ``refuses``, or a line in ``RUN_RULES``).
"""

from __future__ import annotations

from titanlite import converters, models, optim
from titanlite.checkpoint import formats
from titanlite.checkpoint.keys import STATE_KEYS
from titanlite.config import catalog
from titanlite.config.planned import Rule
from titanlite.data import rules as data_rules
from titanlite.downstream import settings as eval_settings
from titanlite.ft import settings as ft_settings
from titanlite.health import settings as health_settings
from titanlite.interop.source import is_hf_folder
from titanlite.models import torchtitan as torchtitan_models
from titanlite.mup import settings as mup_settings
from titanlite.parallel import rules as parallel_rules

FEATURE_SECTIONS = (
    eval_settings.SECTION,
    health_settings.SECTION,
    ft_settings.SECTION,
    mup_settings.SECTION,
)
"""Sections of features that no registry lists: [eval] (downstream tasks), [health],
[fault_tolerance], [mup]."""

RUN_RULES: tuple[Rule, ...] = (
    *parallel_rules.RULES,
    *data_rules.RULES,
    eval_settings.check_tasks,
    ft_settings.rules,
)
"""The cross-feature rules of features without a registry entry, run before every run
(``titanlite.checks.check``); registry entries declare theirs as ``refuses``."""


def declared_sections() -> tuple[catalog.Section, ...]:
    """The sections of the registries' entries (as registered now) and of the features."""
    entries = [*optim.REGISTRY.values(), *converters.REGISTRY.values()]
    return (*(e.section for e in entries if e.section is not None), *FEATURE_SECTIONS)


def build_catalog() -> catalog.Catalog:
    return catalog.Catalog(
        declared=declared_sections,
        families=models.REGISTRY,
        optimizers=optim.REGISTRY,
        converters=converters.REGISTRY,
        flavor_aliases={
            alias: (spec.name, flavor)
            for spec in models.REGISTRY.values()
            for alias, flavor in spec.also_named.items()
        },
        torchtitan_flavors=torchtitan_models.FLAVORS,
        torchtitan_yarn_from=torchtitan_models.TT_YARN_FROM,
        state_keys=STATE_KEYS,
    )


CATALOG = build_catalog()
catalog.install(CATALOG)

formats.register(
    formats.Format(
        formats.HUGGING_FACE,
        recognizes=is_hf_folder,
        reader="titanlite.interop.hf_reader:open_reader",
        writer="titanlite.interop.hf_writer:write_hf",
    )
)
"""checkpoint.initial_load_path may be a Hugging Face folder, and a save may also write one
(checkpoint.last_save_in_hf): interop's format, handed to the checkpoint room from here."""
