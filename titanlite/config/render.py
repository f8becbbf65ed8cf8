"""The config as text: the resolved config as TOML (a run's config.toml, the TorchTitan
converter's output) and the --help listing of every option.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from titanlite.config import catalog
from titanlite.config.job_config import JobConfig
from titanlite.config.schema import field_docs, field_types, keys, sections, type_name


def to_toml(cfg: JobConfig) -> str:
    """The fully resolved config as TOML (unset optional overrides are left as comments)."""
    lines: list[str] = []
    for section in sections():
        lines.append(f"[{section}]")
        obj = getattr(cfg, section)
        for key in keys(type(obj)):
            value = getattr(obj, key)
            if value is None:
                lines.append(f"# {key} = (unset)")
            else:
                lines.append(f"{key} = {toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        # JSON's string escapes are all valid TOML; TOML also forbids a raw DEL.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if dataclasses.is_dataclass(value):  # an inline table, e.g. one of training.datasets
        items = ", ".join(
            f"{f.name} = {toml_value(getattr(value, f.name))}"
            for f in dataclasses.fields(value)
            if getattr(value, f.name) is not None
        )
        return "{" + items + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def help_text() -> str:
    lines = [
        "usage: ./run_train.sh [CONFIG.toml] [--section.key value | --section.key=value ...]",
        "",
        "Precedence: command line > TOML file > defaults. Options:",
    ]
    for section, cls in sections().items():
        lines.append(f"\n[{section}]")
        docs = field_docs(cls)
        types_ = field_types(cls)
        defaults = cls()
        for key in keys(cls):
            default = getattr(defaults, key)
            shown = "unset" if default is None else toml_value(default)
            lines.append(f"  --{section}.{key}  ({type_name(types_[key])}, default {shown})")
            lines.append(f"      {docs.get(key, '')}")
            lines.extend(f"      {line}" for line in registry_choices(f"{section}.{key}"))
    return "\n".join(lines)


def registry_choices(key: str) -> list[str]:
    """What the registries offer for ``key`` (model families and flavors, optimizers,
    converters): --help and the config reference list them from the code, so adding an entry
    documents it."""
    known = catalog.current()
    if key == "model.name":
        return [f"one of: {', '.join(known.families)}"]
    if key == "model.flavor":
        return [f"{name}: {', '.join(spec.flavors)}" for name, spec in known.families.items()]
    if key == "optimizer.name":
        return [f"one of: {', '.join(known.optimizers)}"]
    if key == "model.converters":
        listed = [f"{name} ({entry.replaces})" for name, entry in known.converters.items()]
        return [f"available: {', '.join(listed) or 'none yet'}"]
    return []
