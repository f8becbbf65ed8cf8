"""TOML + command-line parsing into a JobConfig, with errors that name the key.

Precedence is CLI > TOML > defaults. The CLI takes ``--section.key value``,
``--section.key=value`` and, for booleans, a bare ``--section.key`` meaning true.

Every problem found (unknown keys, bad values, failed checks) is collected and raised as one
ConfigError holding a line per problem, so a user fixes a config in one round, not one per typo.
What the schema says of itself is ``schema``'s, the checks after parsing ``constraints``'s, and
writing a config out (TOML, --help) ``render``'s.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import sys
import typing
from typing import Any, Literal

from titanlite.config import catalog, torchtitan
from titanlite.config.constraints import validate
from titanlite.config.job_config import ConfigError, DatasetEntry, JobConfig
from titanlite.config.model_section import FROM_CHECKPOINT
from titanlite.config.render import help_text, to_toml, toml_value
from titanlite.config.schema import (
    dataset_name,
    field_docs,
    field_types,
    keys,
    sections,
    split_optional,
    type_name,
)
from titanlite.errors import Problems

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

# The public names, with those of schema, constraints and render: config/__init__, the scripts
# and the tests import them from here, as they did before those modules were split out.
__all__ = [
    "apply_toml",
    "dataset_name",
    "field_docs",
    "field_types",
    "help_text",
    "load_config",
    "parse_cli",
    "read_toml",
    "sections",
    "to_toml",
    "toml_value",
    "tomllib",
    "type_name",
    "validate",
]

logger = logging.getLogger(__name__)

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_NONE = {"none", "null"}


def _coerce(value: Any, tp: Any, key: str, from_cli: bool) -> Any:
    """Convert/check one value against a field type; errors name the key."""
    inner, optional = split_optional(tp)
    if from_cli and optional and isinstance(value, str) and value.lower() in _NONE:
        return None

    def bad(expected: str) -> ConfigError:
        return ConfigError(f"{key}: expected {expected}, got {value!r}")

    if typing.get_origin(inner) is Literal:
        choices = typing.get_args(inner)
        if value not in choices:
            hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            extra = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ConfigError(
                f"{key}: {value!r} is not one of {', '.join(map(repr, choices))}{extra}"
            )
        return value
    if inner is bool:
        if isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise bad("true or false")
    if inner is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise bad("an integer")
    if inner is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            result = float(value)
        elif from_cli and isinstance(value, str):
            try:
                result = float(value)
            except ValueError:
                raise bad("a number") from None
        else:
            raise bad("a number")
        if not math.isfinite(result):
            raise bad("a finite number")
        return result
    if inner is str:
        if isinstance(value, str):
            return value
        raise bad("a string")
    if typing.get_origin(inner) is list and dataclasses.is_dataclass(typing.get_args(inner)[0]):
        return _tables(value, key, from_cli, typing.get_args(inner)[0])
    if typing.get_origin(inner) is list:
        if from_cli and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        raise bad("a list of strings")
    raise TypeError(f"unsupported config type {tp!r} for {key}")  # a schema bug, not user input


def _tables(value: Any, key: str, from_cli: bool, cls: type) -> list[Any]:
    """[[key]] tables of ``cls`` (DatasetEntry, ParamGroupRule, ...). On the command line:
    training.datasets as PATH[:WEIGHT],...; other lists as a TOML inline array of tables,
    e.g. --optimizer.param_groups '[{params = "*norm*", weight_decay = 0.0}, {params = "*"}]'."""
    hints = field_types(cls)
    required = [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if from_cli and isinstance(value, str):
        value = _datasets_from_cli(value) if cls is DatasetEntry else _inline_tables(value, key)
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ConfigError(f"{key}: expected [[{key}]] tables ({', '.join(hints)}), got {value!r}")
    entries = []
    for i, table in enumerate(value):
        where = f"{key}[{i}]"
        unknown = sorted(set(table) - set(hints))
        if unknown:
            raise _unknown(f"key in {where}:", unknown[0], list(hints))
        for name in required:
            if name not in table:
                raise ConfigError(f"{where}: {name} is required")
        fields = {
            name: _coerce(v, hints[name], f"{where}.{name}", False) for name, v in table.items()
        }
        entries.append(cls(**fields))
    return entries


def _datasets_from_cli(value: str) -> list[dict[str, Any]]:
    tables = []
    for item in (v.strip() for v in value.split(",")):
        path, sep, weight = item.rpartition(":")
        if not sep or not path:
            path, weight = item, "1"
        try:
            tables.append({"path": path, "weight": float(weight)})
        except ValueError:
            tables.append({"path": item})
    return [t for t in tables if t["path"]]


def _inline_tables(value: str, key: str) -> Any:
    try:
        return tomllib.loads(f"value = {value}")["value"]
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(
            f"{key}: expected a TOML array of inline tables like '[{{params = \"*\"}}]' ({e})"
        ) from None


def _unknown(kind: str, name: str, known: list[str]) -> ConfigError:
    hint = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    suggestion = f" (did you mean {hint[0]!r}?)" if hint else f"; valid: {', '.join(known)}"
    return ConfigError(f"unknown {kind} {name!r}{suggestion}")


def _all_keys() -> list[str]:
    return [f"{s}.{key}" for s, cls in sections().items() for key in keys(cls)]


def _lookup(key: str) -> tuple[str, str, Any]:
    """'section.field' -> (section, field, type), or a ConfigError with a suggestion."""
    section, _, name = key.partition(".")
    secs = sections()
    if section not in secs or not name:
        raise _unknown("option", f"--{key}", [f"--{k}" for k in _all_keys()])
    types_ = field_types(secs[section])
    if name not in types_:
        raise _unknown("option", f"--{key}", [f"--{k}" for k in _all_keys()])
    return section, name, types_[name]


def _is_option(token: str) -> bool:
    return token.startswith("--") or token == "-h"


def parse_cli(argv: list[str]) -> tuple[bool, dict[str, str | bool]]:
    """(help requested, {'section.key': raw value}) from command-line tokens."""
    problems = Problems()
    result = _parse_cli(argv, problems)
    problems.raise_if_any(ConfigError)
    return result


def _parse_cli(argv: list[str], problems: Problems) -> tuple[bool, dict[str, str | bool]]:
    """parse_cli, recording each bad option in ``problems`` and going on with the rest."""
    overrides: dict[str, str | bool] = {}
    i = 0
    want_help = False
    while i < len(argv):
        token = argv[i]
        i += 1
        if token in ("-h", "--help"):
            want_help = True
            continue
        if not token.startswith("--"):
            problems.add(f"unexpected argument {token!r}; options look like --section.key value")
            continue
        key, eq, raw = token[2:].partition("=")
        try:
            _, _, tp = _lookup(key)
        except ConfigError as e:
            problems.add(str(e))
            tp = None  # still step over its value, so that the value is not read as an option
        if eq:
            value: str | bool = raw
        elif i < len(argv) and not _is_option(argv[i]):
            value = argv[i]
            i += 1
        elif tp is None or split_optional(tp)[0] is bool:
            value = True
        else:
            # A value that starts with "--" must use the --section.key=value form.
            problems.add(f"--{key}: missing value")
            continue
        if tp is not None:
            overrides[key] = value
    return want_help, overrides


def read_toml(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} not found")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path!r} is not valid TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path!r} cannot be read: {e}") from None


def load_config(argv: list[str]) -> JobConfig:
    """Build the JobConfig from CLI tokens (which may name --job.config_file); a ConfigError
    listing every problem of the file and the command line together."""
    problems = Problems()
    _, overrides = _parse_cli(argv, problems)
    cfg = JobConfig()
    given = set(overrides)  # the keys this config sets (the file's added below)
    config_file = overrides.get("job.config_file")
    if isinstance(config_file, str) and config_file:
        data = read_toml(config_file)  # nothing else can be checked without it
        if torchtitan.looks_like_torchtitan(data):
            data = from_torchtitan(data, config_file)
        given |= {
            f"{section}.{name}"
            for section, table in data.items()
            if isinstance(table, dict)
            for name in table
        }
        with problems.check():
            apply_toml(cfg, data, config_file)
    for key, raw in overrides.items():
        section, name, tp = _lookup(key)
        with problems.check():
            setattr(getattr(cfg, section), name, _coerce(raw, tp, f"--{key}", from_cli=True))
    # A key that failed above keeps its default, which is valid: no problem is reported twice.
    _model_from_checkpoint(cfg, given)
    with problems.check():
        _flavor_family(cfg)
        validate(cfg)
    problems.raise_if_any(ConfigError)
    return cfg


def _model_from_checkpoint(cfg: JobConfig, given: set[str]) -> None:
    """A run starting from checkpoint.initial_load_path takes what the config leaves unset of
    the model from there: the family and shape (model.name and model.flavor become
    "from_checkpoint", resolved with the model's args: ``titanlite.assembly``) and the
    tokenizer, when the folder holds one."""
    source = cfg.checkpoint.initial_load_path
    if not (cfg.checkpoint.enable and source):
        return
    if "model.flavor" not in given:
        cfg.model.flavor = FROM_CHECKPOINT
        if "model.name" not in given:
            cfg.model.name = FROM_CHECKPOINT
    holds_tokenizer = any(
        os.path.isfile(os.path.join(source, name)) for name in ("tokenizer.json", "tokenizer.model")
    )
    if "model.tokenizer_path" not in given and holds_tokenizer:
        cfg.model.tokenizer_path = source


def _flavor_family(cfg: JobConfig) -> None:
    """Point a (family, flavor) that another family builds at that family (logged)."""
    moved = catalog.current().flavor_aliases.get((cfg.model.name, cfg.model.flavor))
    if moved:
        logger.info(
            "model %s %s is the %s family's %s flavor", cfg.model.name, cfg.model.flavor, *moved
        )
        cfg.model.name, cfg.model.flavor = moved


def from_torchtitan(data: dict[str, Any], source: str) -> dict[str, Any]:
    """A TorchTitan v0.2 file run as is: its titanlite equivalent, each ignored key logged as
    a warning; a ConfigError listing what titanlite cannot honour when anything blocks."""
    conversion = torchtitan.convert(data)
    if conversion.blocking:
        raise ConfigError(
            f"{source} is a TorchTitan config with settings titanlite cannot honour "
            "(change them, or see scripts/convert_torchtitan_config.py):",
            *(f"{source}: {note.line()}" for note in conversion.blocking),
        )
    logger.warning(
        "%s is a TorchTitan v0.2 config: running its titanlite equivalent "
        "(scripts/convert_torchtitan_config.py writes it out)%s",
        source,
        "; ignored:" if conversion.dropped else "",
    )
    for note in conversion.dropped:
        logger.warning("  %s", note.line())
    return conversion.config


def apply_toml(cfg: JobConfig, data: dict[str, Any], source: str) -> None:
    """Set every key of a parsed TOML file; one ConfigError naming all unknown keys and bad
    values (the good ones are applied either way)."""
    secs = sections()
    problems = Problems()
    for section, table in data.items():
        if section not in secs:
            problems.add(
                str(_unknown(f"section in {source}:", f"[{section}]", [f"[{s}]" for s in secs]))
            )
            continue
        if not isinstance(table, dict):
            problems.add(f"{source}: {section} must be a [section] table")
            continue
        types_ = field_types(secs[section])
        for name, value in table.items():
            if name not in types_:
                problems.add(str(_unknown(f"key in {source} [{section}]:", name, list(types_))))
                continue
            with problems.check():
                coerced = _coerce(value, types_[name], f"{section}.{name}", from_cli=False)
                setattr(getattr(cfg, section), name, coerced)
    problems.raise_if_any(ConfigError)
