"""TorchTitan's keys of checkpointing, activation checkpointing, compile, metrics, profiling,
validation, debug, comm, fault tolerance and the float8 sections: where each goes in
titanlite. No torch here."""

from __future__ import annotations

from titanlite.config.torchtitan.rule import Rule, same


def run_rules() -> dict[str, Rule]:
    """Key -> Rule, in the order of TorchTitan's sections."""
    return {
        **same(
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
            "checkpoint.initial_load_path",
            note=(
                "with initial_load_in_hf = true: the Hugging Face folder, loaded as is; else a "
                "TorchTitan checkpoint, which does not load in titanlite: export it to a "
                "Hugging Face folder and load that"
            ),
            special=True,
        ),
        "checkpoint.initial_load_in_hf": Rule(
            note="initial_load_path is a Hugging Face folder (titanlite recognizes one by itself)",
            special=True,
        ),
        "checkpoint.initial_load_in_hf_quantized": Rule(
            note=(
                "titanlite trains from float32 weights: it dequantizes FP8-block and MXFP4 "
                "Hugging Face weights on the way in (initial_load_in_hf alone)"
            ),
            inert=(False,),
            blocks=True,
        ),
        "checkpoint.last_save_in_hf": Rule("checkpoint.last_save_in_hf"),
        "checkpoint.enable_first_step_checkpoint": Rule(
            note="use checkpoint.interval = 1 for a quick check", inert=(False,)
        ),
        "checkpoint.create_seed_checkpoint": Rule(
            note=(
                "titanlite initializes sharded models directly and needs no seed "
                "checkpoint; remove it"
            ),
            inert=(False,),
            blocks=True,
        ),
        "checkpoint.load_only": Rule(
            note=(
                "titanlite saves checkpoints while it trains (set checkpoint.enable "
                "= false to save none)"
            ),
            inert=(False,),
        ),
        "checkpoint.enable_ft_dataloader_checkpoints": Rule(note="only used with fault tolerance"),
        "activation_checkpoint.mode": Rule(
            "activation_checkpoint.mode", "memory_budget is not in titanlite: use selective or full"
        ),
        "activation_checkpoint.selective_ac_option": Rule(
            "activation_checkpoint.selective_ac_option"
        ),
        "activation_checkpoint.*": Rule(
            note="TorchTitan's fine-tuning of activation checkpointing; none in titanlite"
        ),
        "compile.enable": Rule("compile.enable", "titanlite compiles each transformer block"),
        "compile.components": Rule(
            note="titanlite compiles the model's blocks, not the loss", special=True
        ),
        "compile.backend": Rule(note="titanlite compiles with inductor", inert=("inductor",)),
        **same(*(f"metrics.{k}" for k in ("log_freq", "enable_tensorboard", "enable_wandb"))),
        "metrics.save_tb_folder": Rule("metrics.tensorboard_folder"),
        "metrics.disable_color_printing": Rule(note="console formatting"),
        "metrics.save_for_all_ranks": Rule(
            note="titanlite logs metrics from one rank", inert=(False,)
        ),
        **same(
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
        **same("validation.enable", "validation.freq", "validation.steps"),
        "validation.dataset": Rule(
            note=(
                "with validation.enable: titanlite validates on documents held "
                "out of the training data (validation.holdout_fraction)"
            ),
            special=True,
        ),
        "validation.dataset_path": Rule(
            note=(
                "with validation.enable: titanlite validates on documents held "
                "out of the training data (validation.holdout_fraction)"
            ),
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
            note=(
                "titanlite has no forced load balancing (its MoE models balance "
                "by aux loss or routing bias)"
            )
        ),
        "comm.mode": Rule(
            "job.dry_run",
            '"fake_backend" -> job.dry_run = true; "local_tensor" blocks',
            special=True,
        ),
        **same("comm.init_timeout_seconds"),
        "comm.train_timeout_seconds": Rule("comm.timeout_seconds"),
        "comm.*": Rule(note="flight recorder settings; none in titanlite"),
        "memory_estimation.enable": Rule(
            note="job.dry_run = true reports each rank's parameter, gradient and optimizer GiB",
            inert=(False,),
        ),
        "memory_estimation.*": Rule(note="only used with memory estimation"),
        **same(
            *(
                f"fault_tolerance.{key}"
                for key in (
                    "enable",
                    "replica_id",
                    "group_size",
                    "min_replica_size",
                    "process_group",
                    "process_group_timeout_ms",
                    "semi_sync_method",
                    "sync_steps",
                    "num_fragments",
                    "fragment_sync_delay",
                    "fragment_update_alpha",
                    "should_quantize",
                )
            )
        ),
        "fault_tolerance.module_fqns_per_model_fragment": Rule(
            note="titanlite cuts the fragments itself: consecutive blocks, equal in bytes"
        ),
        "fault_tolerance.*": Rule(
            note="TorchTitan's fault-tolerance settings titanlite has none of"
        ),
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
                note="with model.converters naming float8 (TorchTitan's "
                f"{'older ' if section == 'float8' else ''}section)",
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
