"""TOML + command-line parsing into a JobConfig, with errors that name the key.

Precedence is CLI > TOML > defaults. The CLI takes ``--section.key value``,
``--section.key=value`` and, for booleans, a bare ``--section.key`` meaning true.

Every problem found (unknown keys, bad values, failed checks) is collected and raised as one
ConfigError holding a line per problem, so a user fixes a config in one round, not one per typo.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import importlib.util
import inspect
import json
import logging
import math
import os
import sys
import types
import typing
from typing import Any, Literal

from titanlite.checkpoint.keys import STATE_KEYS
from titanlite.config import torchtitan
from titanlite.config.job_config import ConfigError, DatasetEntry, JobConfig
from titanlite.errors import Problems

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

logger = logging.getLogger(__name__)

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_NONE = {"none", "null"}


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


def _split_optional(tp: Any) -> tuple[Any, bool]:
    """(inner type, whether None is allowed) for ``X | None``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def type_name(tp: Any) -> str:
    inner, optional = _split_optional(tp)
    if typing.get_origin(inner) is Literal:
        name = "|".join(str(c) for c in typing.get_args(inner))
    elif typing.get_origin(inner) is list:
        name = f"list[{typing.get_args(inner)[0].__name__}]"
    else:
        name = inner.__name__
    return f"{name} (optional)" if optional else name


def _coerce(value: Any, tp: Any, key: str, from_cli: bool) -> Any:
    """Convert/check one value against a field type; errors name the key."""
    inner, optional = _split_optional(tp)
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
    if typing.get_origin(inner) is list and typing.get_args(inner)[0] is DatasetEntry:
        return _dataset_entries(value, key, from_cli)
    if typing.get_origin(inner) is list:
        if from_cli and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        raise bad("a list of strings")
    raise TypeError(f"unsupported config type {tp!r} for {key}")  # a schema bug, not user input


def _dataset_entries(value: Any, key: str, from_cli: bool) -> list[DatasetEntry]:
    """[[training.datasets]] tables, or PATH[:WEIGHT],... on the command line."""
    if from_cli and isinstance(value, str):
        tables = []
        for item in (v.strip() for v in value.split(",")):
            path, sep, weight = item.rpartition(":")
            if not sep or not path:
                path, weight = item, "1"
            try:
                tables.append({"path": path, "weight": float(weight)})
            except ValueError:
                tables.append({"path": item})
        value = [t for t in tables if t["path"]]
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ConfigError(f"{key}: expected [[{key}]] tables (path, weight, name), got {value!r}")
    hints = field_types(DatasetEntry)
    entries = []
    for i, table in enumerate(value):
        where = f"{key}[{i}]"
        unknown = sorted(set(table) - set(hints))
        if unknown:
            raise _unknown(f"key in {where}:", unknown[0], list(hints))
        if "path" not in table:
            raise ConfigError(f"{where}: path is required")
        fields = {
            name: _coerce(v, hints[name], f"{where}.{name}", False) for name, v in table.items()
        }
        entries.append(DatasetEntry(**fields))
    return entries


def dataset_name(entry: DatasetEntry) -> str:
    """A mixture entry's name: as given, else its folder's name."""
    return entry.name or os.path.basename(os.path.normpath(entry.path))


def _unknown(kind: str, name: str, known: list[str]) -> ConfigError:
    hint = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    suggestion = f" (did you mean {hint[0]!r}?)" if hint else f"; valid: {', '.join(known)}"
    return ConfigError(f"unknown {kind} {name!r}{suggestion}")


def _all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in sections().items() for f in dataclasses.fields(cls)]


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
        elif tp is None or _split_optional(tp)[0] is bool:
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
    config_file = overrides.get("job.config_file")
    if isinstance(config_file, str) and config_file:
        data = read_toml(config_file)  # nothing else can be checked without it
        if torchtitan.looks_like_torchtitan(data):
            data = from_torchtitan(data, config_file)
        with problems.check():
            apply_toml(cfg, data, config_file)
    for key, raw in overrides.items():
        section, name, tp = _lookup(key)
        with problems.check():
            setattr(getattr(cfg, section), name, _coerce(raw, tp, f"--{key}", from_cli=True))
    # A key that failed above keeps its default, which is valid: no problem is reported twice.
    with problems.check():
        validate(cfg)
    problems.raise_if_any(ConfigError)
    return cfg


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


def validate(cfg: JobConfig) -> None:
    """Checks that need no knowledge of the world size; one ConfigError listing every failure."""
    problems = Problems()

    def require(ok: bool, key: str, what: str) -> None:
        if not ok:
            value = getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1])
            problems.add(f"{key}: {what}, got {value!r}")

    t, o, s, m, v = cfg.training, cfg.optimizer, cfg.lr_scheduler, cfg.metrics, cfg.validation
    require(t.steps >= 1, "training.steps", "must be at least 1")
    require(t.seq_len >= 1, "training.seq_len", "must be at least 1")
    require(t.local_batch_size >= 1, "training.local_batch_size", "must be at least 1")
    require(
        t.global_batch_size == -1 or t.global_batch_size >= 1,
        "training.global_batch_size",
        "must be -1 or at least 1",
    )
    require(0 <= t.seed < 2**32, "training.seed", "must be in [0, 2**32)")
    require(t.max_norm >= 0, "training.max_norm", "must be >= 0 (0 disables clipping)")
    for i, entry in enumerate(t.datasets):
        if not entry.weight > 0:
            problems.add(f"training.datasets[{i}].weight: must be > 0, got {entry.weight!r}")
        if not entry.path:
            problems.add(f"training.datasets[{i}].path: must not be empty")
    names = [dataset_name(e) for e in t.datasets]
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.add(f"training.datasets: two entries are named {name!r}; give each a name")
    require(o.lr > 0, "optimizer.lr", "must be > 0")
    require(o.eps > 0, "optimizer.eps", "must be > 0")
    require(o.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0")
    require(0 <= o.beta1 < 1, "optimizer.beta1", "must be in [0, 1)")
    require(0 <= o.beta2 < 1, "optimizer.beta2", "must be in [0, 1)")
    require(s.warmup_steps >= 0, "lr_scheduler.warmup_steps", "must be >= 0")
    require(
        s.decay_ratio is None or 0 <= s.decay_ratio <= 1,
        "lr_scheduler.decay_ratio",
        "must be between 0 and 1",
    )
    require(0 <= s.min_lr_factor <= 1, "lr_scheduler.min_lr_factor", "must be between 0 and 1")
    require(m.log_freq >= 1, "metrics.log_freq", "must be at least 1")
    require(v.freq >= 1, "validation.freq", "must be at least 1")
    require(v.steps == -1 or v.steps >= 1, "validation.steps", "must be -1 or at least 1")
    require(0 <= v.holdout_fraction < 1, "validation.holdout_fraction", "must be in [0, 1)")
    require(
        not v.enable or v.holdout_fraction > 0,
        "validation.holdout_fraction",
        "must be > 0 when validation.enable is true",
    )
    require(
        cfg.model.vocab_size is None or cfg.model.vocab_size >= 1,
        "model.vocab_size",
        "must be at least 1 (or unset to follow the tokenizer)",
    )
    p = cfg.parallelism
    require(
        p.data_parallel_replicate_degree >= 1,
        "parallelism.data_parallel_replicate_degree",
        "must be at least 1",
    )
    require(
        p.data_parallel_shard_degree == -1 or p.data_parallel_shard_degree >= 1,
        "parallelism.data_parallel_shard_degree",
        "must be -1 (the rest of the world) or at least 1",
    )
    require(
        p.tensor_parallel_degree >= 1, "parallelism.tensor_parallel_degree", "must be at least 1"
    )
    require(p.ddp_bucket_cap_mb > 0, "parallelism.ddp_bucket_cap_mb", "must be > 0")
    require(cfg.comm.init_timeout_seconds > 0, "comm.init_timeout_seconds", "must be > 0")
    require(cfg.comm.timeout_seconds > 0, "comm.timeout_seconds", "must be > 0")
    c = cfg.checkpoint
    require(c.interval >= 1, "checkpoint.interval", "must be at least 1")
    require(c.interval_minutes >= 0, "checkpoint.interval_minutes", "must be >= 0 (0 = off)")
    require(c.keep_latest_k >= 0, "checkpoint.keep_latest_k", "must be >= 0 (0 keeps all)")
    require(c.load_step == -1 or c.load_step >= 0, "checkpoint.load_step", "must be -1 or >= 0")
    require(
        set(c.exclude_from_loading) <= set(STATE_KEYS),
        "checkpoint.exclude_from_loading",
        f"must name only {', '.join(STATE_KEYS)}",
    )
    ac = cfg.activation_checkpoint
    option = ac.selective_ac_option
    require(
        ac.mode != "selective" or option == "op" or (option.isdigit() and int(option) >= 1),
        "activation_checkpoint.selective_ac_option",
        'must be "op" or a positive integer',
    )
    require(cfg.profiling.profile_freq >= 2, "profiling.profile_freq", "must be at least 2")
    j = cfg.job
    require(j.dry_run_init_rank >= -1, "job.dry_run_init_rank", "must be -1 or a rank (>= 0)")
    require(
        j.dry_run_init_rank == -1 or j.dry_run,
        "job.dry_run_init_rank",
        "needs --job.dry_run (it initializes one rank's shards instead of training)",
    )
    if m.enable_tensorboard and importlib.util.find_spec("tensorboard") is None:
        problems.add(
            "metrics.enable_tensorboard needs the tensorboard package, which is not installed: "
            "pip install 'titanlite[tensorboard]' (or tensorboard)"
        )
    problems.raise_if_any(ConfigError)


def to_toml(cfg: JobConfig) -> str:
    """The fully resolved config as TOML (unset optional overrides are left as comments)."""
    lines: list[str] = []
    for section in sections():
        lines.append(f"[{section}]")
        obj = getattr(cfg, section)
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if value is None:
                lines.append(f"# {f.name} = (unset)")
            else:
                lines.append(f"{f.name} = {toml_value(value)}")
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
        items = ", ".join(f"{f.name} = {toml_value(getattr(value, f.name))}"
                          for f in dataclasses.fields(value))  # fmt: skip
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
        for f in dataclasses.fields(cls):
            default = getattr(defaults, f.name)
            shown = "unset" if default is None else toml_value(default)
            lines.append(f"  --{section}.{f.name}  ({type_name(types_[f.name])}, default {shown})")
            lines.append(f"      {docs.get(f.name, '')}")
    return "\n".join(lines)
