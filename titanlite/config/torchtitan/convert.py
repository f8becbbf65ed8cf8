"""TorchTitan v0.2.x TOML configs: recognize them and convert them to titanlite configs.

titanlite's schema was modeled on TorchTitan's, so most keys carry over unchanged. ``mapping()``
says, as data, where every TorchTitan key goes; ``convert`` applies it and reports each key
titanlite ignores (``dropped``) or cannot honour (``blocking``: the run must not start). No
torch here: the config parser and scripts/convert_torchtitan_config.py both use it.
"""

from __future__ import annotations

import functools
import json
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from titanlite.config import catalog
from titanlite.config.job_config import JobConfig, Training
from titanlite.config.schema import field_types, sections
from titanlite.config.torchtitan.rule import ANY, Rule
from titanlite.config.torchtitan.rules import (
    ATTENTION_SUFFIXES,
    STATE_NAMES,
    TORCHTITAN_DEFAULTS,
    mapping,
)


@dataclass
class Note:
    key: str
    value: Any
    advice: str

    def line(self) -> str:
        shown = "(unset)" if self.value is None else _show(self.value)
        return f"{self.key} = {shown}: {self.advice}"


@dataclass
class Conversion:
    config: dict[str, dict[str, Any]] = field(default_factory=dict)
    mapped: list[tuple[str, str]] = field(default_factory=list)
    dropped: list[Note] = field(default_factory=list)
    blocking: list[Note] = field(default_factory=list)

    def report_lines(self) -> list[str]:
        return [f"blocking: {n.line()}" for n in self.blocking] + [n.line() for n in self.dropped]

    def put(self, source: str, target: str, value: Any) -> None:
        section, _, name = target.partition(".")
        self.config.setdefault(section, {})[name] = value
        self.mapped.append((source, target))


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (bool, str, list)) else repr(value)


@functools.cache
def _titanlite_types() -> dict[str, Any]:
    """'section.key' -> type of every titanlite key, in schema order (the optimizer's name is
    one of the registry's, in any case)."""
    types_: dict[str, Any] = {}
    for section, cls in sections().items():
        types_.update({f"{section}.{k}": tp for k, tp in field_types(cls).items()})
    types_["optimizer.name"] = Literal[tuple(catalog.current().optimizers)]
    return types_


def _fits(value: Any, tp: Any) -> bool:
    """Whether a TOML value is valid for a titanlite field type (ints do for floats)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is Literal:
        return value in args or str(value).lower() in args
    if typing.get_origin(tp) is list:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if args:  # X | None
        return _fits(value, args[0])
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, tp) and (tp is bool or not isinstance(value, bool))


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def rule_for(key: str) -> Rule | None:
    """The rule for a TorchTitan key: its own entry, else the longest "prefix*" covering it."""
    rules = mapping()
    if key in rules:
        return rules[key]
    prefixes = [k[:-1] for k in rules if k.endswith("*") and key.startswith(k[:-1])]
    return rules[max(prefixes, key=len) + "*"] if prefixes else None


def looks_like_torchtitan(data: dict[str, Any]) -> bool:
    """True when a parsed TOML file is a TorchTitan config.

    The rule: the file names a key that TorchTitan's schema has (a ``mapping()`` entry) and
    titanlite's does not (e.g. model.hf_assets_path, job.print_config, metrics.save_tb_folder,
    parallelism.pipeline_parallel_degree, any [quantize]/[comm]/[debug]/... key), or sets
    training.dataset to TorchTitan's "c4_test"/"c4_validation". A titanlite config never does:
    titanlite rejects such keys, and keys neither schema knows (typos) do not count. Keys
    titanlite gains later stop being markers by themselves.
    """
    known = _titanlite_types()
    flat = _flatten(data)
    if flat.get("training.dataset") in ("c4_test", "c4_validation"):
        return True
    return any(k not in known and rule_for(k) is not None for k in flat)


def convert(data: dict[str, Any]) -> Conversion:
    """Map a TorchTitan v0.2.x config (parsed TOML) to a titanlite config dict."""
    conv, types_ = Conversion(), _titanlite_types()
    given = _flatten(data)
    flat = {**{k: v for k, v in TORCHTITAN_DEFAULTS.items() if k not in given}, **given}

    def note(key: str, advice: str, blocks: bool = False) -> None:
        (conv.blocking if blocks else conv.dropped).append(Note(key, flat.get(key), advice))

    for key, value in list(flat.items()):
        rule = rule_for(key)
        if rule is None:
            note(key, "not a TorchTitan v0.2 key; ignored")
        elif rule.special:
            if rule.target and types_[rule.target] is str and not isinstance(value, str):
                note(key, "expected a string", True)
                del flat[key]
        elif rule.target:
            if isinstance(value, str):
                value = dict(rule.values).get(value, value)
            if isinstance(value, int) and types_[rule.target] is str:
                value = str(value)  # e.g. selective_ac_option = 2
            if _fits(value, types_[rule.target]):
                conv.put(key, rule.target, value)
            else:
                section, _, name = rule.target.partition(".")
                default = _show(getattr(getattr(JobConfig(), section), name))
                fate = ": " if rule.blocks else f"; left at titanlite's default {default}. "
                note(key, f"not a value of {rule.target}{fate}{rule.note}".strip(". "), rule.blocks)
        elif rule.inert is not ANY and value not in rule.inert:
            note(key, rule.note, rule.blocks)

    # model: family, flavor (with TorchTitan's shape) and tokenizer
    name = str(flat.get("model.name", "llama3"))
    flavor = str(flat.get("model.flavor", "debugmodel"))
    base = next((flavor[: -len(s)] for s in ATTENTION_SUFFIXES if flavor.endswith(s)), flavor)
    tokenizer = flat.get("model.tokenizer_path") or flat.get("model.hf_assets_path")
    known = catalog.current()
    flavors, families = known.torchtitan_flavors, ", ".join(known.families)
    if name not in {n for n, _ in flavors}:
        models = ", ".join(dict.fromkeys(n for n, _ in flavors))
        note(
            "model.name",
            f"not a TorchTitan model that titanlite converts ({models}); titanlite's families "
            f"are {families}",
            True,
        )
    elif (name, base) not in flavors:
        same = ", ".join(f for n, f in flavors if n == name)
        note(
            "model.flavor",
            f"not a TorchTitan {name} flavor that titanlite converts; use {same} (titanlite's "
            f"families are {families})",
            True,
        )
    else:
        family, titanlite_flavor, overrides = flavors[name, base]
        conv.put("model.name", "model.name", family)
        conv.put("model.flavor", "model.flavor", titanlite_flavor)
        for key, value in overrides.items():
            if key != "vocab_size" or tokenizer:
                conv.put("model.flavor", f"model.{key}", value)
        yarn_from = known.torchtitan_yarn_from
        if family == "deepseek_v3" and int(flat.get("training.seq_len", 2048)) > yarn_from:
            conv.put("model.flavor", "model.rope_factor", 40.0)
        if base != flavor:
            kind = ATTENTION_SUFFIXES[flavor[len(base) :]]
            note(
                "model.flavor",
                f'titanlite has no {kind} attention: trains "{base}" with causal attention '
                "across packed documents",
            )
    if tokenizer:
        source = next(k for k in ("model.tokenizer_path", "model.hf_assets_path") if flat.get(k))
        conv.put(source, "model.tokenizer_path", tokenizer)
    else:
        note(
            "model.hf_assets_path",
            (
                "TorchTitan's default tests/assets/tokenizer is not in titanlite; "
                "using titanlite's default model.tokenizer_path (set it to a "
                "tokenizer.json or its folder)"
            ),
        )

    # data: TorchTitan's named datasets become titanlite sources
    dataset, path = flat.get("training.dataset", "c4_test"), flat.get("training.dataset_path")
    if path:
        conv.put("training.dataset_path", "training.dataset_path", path)
    if dataset in ("c4", "c4_validation"):
        conv.put("training.dataset", "training.dataset", "allenai/c4")
        conv.put("training.dataset", "training.dataset_config", "en")
        if dataset == "c4_validation":
            note("training.dataset", "titanlite streams allenai/c4's train split")
    elif dataset == "c4_test" and not path:
        conv.put("training.dataset", "training.dataset", "sotu")
        note(
            "training.dataset",
            (
                "TorchTitan's 2K-document C4 sample is not in titanlite; training "
                "on the built-in sotu corpus (set training.dataset_path to a "
                "copy of tests/assets/c4_test to keep the data)"
            ),
        )
    elif dataset != "c4_test":
        advice = "a TorchTitan custom dataset: titanlite reads training.dataset_path as plain files"
        if not path:
            advice = (
                "not a TorchTitan built-in dataset; set training.dataset to a "
                "Hugging Face Hub id or training.dataset_path to local files"
            )
        note("training.dataset", advice, not path)
    if flat.get("validation.enable"):  # titanlite validates on held-out training documents
        for key in ("validation.dataset", "validation.dataset_path"):
            if key in flat:
                note(key, mapping()[key].note)
        for name in ("local_batch_size", "seq_len"):
            default = getattr(Training(), name)  # the same in TorchTitan
            if flat.get(f"validation.{name}", default) != flat.get(f"training.{name}", default):
                note(f"validation.{name}", mapping()[f"validation.{name}"].note)

    # the other special keys
    total = flat.get("lr_scheduler.total_steps")
    if total is not None and total != flat.get("training.steps", 10000):
        note("lr_scheduler.total_steps", mapping()["lr_scheduler.total_steps"].note, True)
    names = flat.get("checkpoint.exclude_from_loading", [])
    names = [n.strip() for n in names.split(",") if n.strip()] if isinstance(names, str) else names
    if names:
        known = [n for n in names if n in STATE_NAMES]
        conv.put("checkpoint.exclude_from_loading", "checkpoint.exclude_from_loading", known)
        if len(known) < len(names):
            note(
                "checkpoint.exclude_from_loading",
                f"only {', '.join(STATE_NAMES)} are loaded state; the rest is ignored",
            )
    _convert_initial_load(flat, conv, note)
    components = flat.get("compile.components", [])
    components = components if isinstance(components, list) else [components]
    if flat.get("compile.enable") and any(c != "model" for c in components):
        note("compile.components", mapping()["compile.components"].note)
    _convert_converters(flat, conv, note)
    mode = flat.get("comm.mode", "default")
    if mode == "fake_backend":
        conv.put("comm.mode", "job.dry_run", True)
    elif mode != "default":
        note(
            "comm.mode",
            (
                "titanlite has no local-tensor simulation; run on CPU ranks (gloo) "
                "or use job.dry_run = true"
            ),
            True,
        )

    ordered: dict[str, dict[str, Any]] = {}  # sections and keys in titanlite's schema order
    for key in types_:
        section, _, name = key.partition(".")
        if name in conv.config.get(section, {}):
            ordered.setdefault(section, {})[name] = conv.config[section][name]
    conv.config = ordered
    return conv


def _convert_converters(flat: dict[str, Any], conv: Conversion, note: Any) -> None:
    """model.converters and the float8 sections: titanlite's float8 converter with TorchTitan's
    float8 settings (its defaults where the file leaves them: tensorwise, nothing filtered by
    name, no size filter), MX formats blocked."""
    names = flat.get("model.converters", [])
    names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
    linear = {"float8", "quantize.linear.float8"} & set(names)
    experts = "quantize.grouped_mm.float8" in names
    others = [
        n
        for n in names
        if n not in ("float8", "quantize.linear.float8", "quantize.grouped_mm.float8")
    ]
    if others:
        note(
            "model.converters",
            f"titanlite has float8 training only (no {', '.join(others)}); remove them",
            True,
        )
    if not (linear or experts):
        return
    conv.put("model.converters", "model.converters", ["float8"])
    section = "float8" if "float8" in linear else "quantize.linear.float8"
    for key in (
        "enable_fsdp_float8_all_gather",
        "precompute_float8_dynamic_scale_for_fsdp",
        "emulate",
    ):
        if f"{section}.{key}" in flat:
            conv.put(f"{section}.{key}", f"float8.{key}", bool(flat[f"{section}.{key}"]))
    recipe = flat.get(f"{section}.recipe_name") or "tensorwise"
    if recipe not in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        note(
            f"{section}.recipe_name",
            "not a float8 recipe titanlite has (tensorwise, rowwise, rowwise_with_gw_hp)",
            True,
        )
    conv.put(f"{section}.recipe_name", "float8.recipe", recipe)
    fqns = flat.get(f"{section}.filter_fqns", [])
    fqns = (
        [f.strip() for f in fqns.split(",") if f.strip()] if isinstance(fqns, str) else list(fqns)
    )
    conv.put(f"{section}.filter_fqns", "float8.auto_filter_small", "auto_filter_small_kn" in fqns)
    conv.put(
        f"{section}.filter_fqns",
        "float8.filter_fqns",
        [f for f in fqns if f != "auto_filter_small_kn"],
    )
    if experts:
        conv.put("quantize.grouped_mm.float8.fqns", "float8.experts", True)
        if recipe != "rowwise":
            conv.put("quantize.grouped_mm.float8.fqns", "float8.recipe", "rowwise")
            note(
                f"{section}.recipe_name",
                "titanlite's float8 experts take the rowwise recipe, for the linears too",
            )


def _convert_initial_load(flat: dict[str, Any], conv: Conversion, note: Any) -> None:
    """initial_load_path carries over when it is a Hugging Face folder (initial_load_in_hf);
    a TorchTitan (DCP) checkpoint does not load in titanlite."""
    path = flat.get("checkpoint.initial_load_path") or ""
    in_hf = bool(flat.get("checkpoint.initial_load_in_hf", False))
    if path and in_hf:
        conv.put("checkpoint.initial_load_path", "checkpoint.initial_load_path", path)
    elif path:
        note(
            "checkpoint.initial_load_path",
            "a TorchTitan checkpoint does not load in titanlite: export it to a Hugging Face "
            "folder, set checkpoint.initial_load_path to it and initial_load_in_hf = true",
            True,
        )


def mapping_table_markdown() -> str:
    """The "TorchTitan v0.2 configs" section of docs/config.md."""
    lines = [
        "## TorchTitan v0.2 configs",
        "",
        "A TorchTitan v0.2.x TOML file runs as is (`./run_train.sh their.toml`: converted in"
        " memory, each ignored key logged as a warning), or becomes a titanlite config with"
        " `python scripts/convert_torchtitan_config.py IN.toml OUT.toml`. Either way every key"
        " titanlite ignores is reported, and settings titanlite cannot honour stop it with one"
        " line each. Keys left unset take TorchTitan's defaults where they differ from"
        " titanlite's (below). Where each TorchTitan key goes (`*` stands for any ending):",
        "",
        "| TorchTitan key | titanlite key | note |",
        "|---|---|---|",
    ]
    for key, rule in mapping().items():
        note = rule.note
        if not rule.target and not rule.special:
            fate = "blocks the run" if rule.blocks else "is reported and ignored"
            if rule.inert is ANY:
                note = f"ignored: {note}"
            elif rule.inert:
                ok = ", ".join(f"`{_show(v)}`" for v in rule.inert)
                note = f"no effect at {ok}; another value {fate}: {note}"
            else:
                note = f"any value {fate}: {note}"
        if key in TORCHTITAN_DEFAULTS:
            note = (
                f"{note} (unset: TorchTitan's default `{_show(TORCHTITAN_DEFAULTS[key])}`)".strip()
            )
        target = f"`{rule.target}`" if rule.target else "—"
        lines.append(f"| `{key}` | {target} | {note.replace('|', '/')} |")
    return "\n".join(lines) + "\n"
