"""Checks of a run's config, layout and input files that need no torch.

Used by the launcher's preflight (before any process starts), the dry run and the trainer
alike, so a typo or an impossible layout is the same one-line error wherever it is found.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from titanlite import converters, models
from titanlite.config import (
    ConfigError,
    Degrees,
    JobConfig,
    gradient_accumulation_steps,
    resolve_degrees,
)
from titanlite.config.batch_ramp import BatchRamp
from titanlite.config.layout import pipeline_plan
from titanlite.data.tokenizer import Tokenizer, load_tokenizer
from titanlite.data.tokens import is_token_folder
from titanlite.errors import Problems
from titanlite.models.spec import ModelSpec
from titanlite.paths import resolve_path


def model_overrides(cfg: JobConfig) -> dict[str, Any]:
    """The model.* shape fields the config sets (the families' fields; unset ones left out)."""
    return dict(sorted(cfg.model.overrides.items()))


def build_model_args(cfg: JobConfig, tokenizer_vocab: int) -> tuple[ModelSpec, Any]:
    """The family's spec and the args of this run's model; ConfigError naming the key."""
    m = cfg.model
    spec = models.get(m.name)
    vocab_size = m.vocab_size or tokenizer_vocab
    if vocab_size < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size {vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer_vocab})"
        )
    if m.flavor not in spec.flavors:
        raise ConfigError(
            f"model.flavor: {m.flavor!r} is not a {spec.name} flavor; valid: "
            f"{', '.join(spec.flavors)}"
        )
    try:
        args = spec.make_args(m.flavor, vocab_size, cfg.training.seq_len, model_overrides(cfg))
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None
    return spec, args


def check_pipeline(cfg: JobConfig, degrees: Degrees, args: Any, problems: Problems) -> None:
    """The pipeline split and schedule, and FSDP settings that give wrong results with it."""
    with problems.check():
        pipeline_plan(cfg.parallelism, degrees, args.n_layers, cfg.training.local_batch_size)
    p = cfg.parallelism
    if "ZeroBubble" in p.pipeline_parallel_schedule and p.fsdp_reshard_after_forward == "always":
        problems.add(
            f"parallelism.fsdp_reshard_after_forward always gives wrong gradients with the "
            f"{p.pipeline_parallel_schedule} schedule (torch 2.13); use default or never"
        )


def check_context(cfg: JobConfig, degrees: Degrees, problems: Problems) -> None:
    """What context parallelism needs: sequences that split into 2 chunks per cp rank, each
    rank's share split again by sequence parallelism; no pipeline stages (not built yet)."""
    cp, tp, seq = degrees.cp, degrees.tp, cfg.training.seq_len
    if seq % (2 * cp * tp):
        problems.add(
            f"training.seq_len {seq} is not divisible by 2 x context_parallel_degree x "
            f"tensor_parallel_degree = 2 x {cp} x {tp} = {2 * cp * tp}"
        )
    if degrees.pp > 1:
        problems.add(
            "parallelism: context parallelism does not combine with pipeline parallelism yet; "
            "set context_parallel_degree or pipeline_parallel_degree to 1"
        )


def check(cfg: JobConfig, world_size: int) -> Tokenizer | None:
    """Raise a UserError for anything about this run that is wrong before it starts (every
    independent problem at once); returns the (valid) tokenizer, or None in a dry run given
    model.vocab_size and no tokenizer file."""
    problems = Problems()
    degrees = None
    with problems.check():
        degrees = resolve_degrees(cfg, world_size)
        gradient_accumulation_steps(cfg, degrees)
        BatchRamp.of(cfg, degrees)
    tokenizer_path = resolve_path(cfg.model.tokenizer_path)
    tokenizer = None
    vocab_size = cfg.model.vocab_size
    if not (cfg.job.dry_run and cfg.model.vocab_size and not os.path.exists(tokenizer_path)):
        # (a dry run given model.vocab_size needs no tokenizer file)
        with problems.check():
            tokenizer = load_tokenizer(tokenizer_path)
            vocab_size = tokenizer.vocab_size
    if vocab_size:
        with problems.check():
            spec, args = build_model_args(cfg, vocab_size)
            tp = degrees.tp if degrees else 1
            for key, value in spec.tp_divisible(args).items():
                if value % tp:
                    problems.add(
                        f"parallelism.tensor_parallel_degree {tp} does not divide model.{key} "
                        f"{value}"
                    )
            if degrees and degrees.pp > 1:
                check_pipeline(cfg, degrees, args, problems)
            per_head = cfg.muon.qk_clip_threshold is not None or cfg.muon.block == "head"
            if per_head and getattr(args, "attention", None) in attention_layers():
                problems.add(
                    f"muon: {spec.name}'s latent attention has no per-head query, key and value "
                    'matrices, which muon.block = "head" and muon.qk_clip_threshold need; use '
                    'block "full" and leave qk_clip_threshold unset'
                )
            elif cfg.muon.qk_clip_threshold is not None and getattr(args, "qk_norm", False):
                problems.add(
                    f"muon.qk_clip_threshold: {spec.name} normalizes each head's queries and "
                    "keys (qk-norm), which undoes QK-clip's scaling of wq and wk; leave it unset"
                )
            if degrees and spec.experts:
                if degrees.ep > 1 and args.num_experts % degrees.ep:
                    problems.add(
                        f"parallelism.expert_parallel_degree {degrees.ep} does not divide "
                        f"model.num_experts {args.num_experts}"
                    )
            elif degrees and degrees.ep > 1:
                problems.add(
                    f"parallelism.expert_parallel_degree {degrees.ep}: {cfg.model.name} has no "
                    "experts (a mixture-of-experts model such as qwen3_moe has); set it to 1"
                )
    if degrees and degrees.cp > 1:
        check_context(cfg, degrees, problems)
    elif degrees and cfg.training.seq_len % degrees.tp:
        problems.add(
            f"parallelism.tensor_parallel_degree {degrees.tp} does not divide training.seq_len "
            f"{cfg.training.seq_len} (sequence parallelism splits the sequence)"
        )
    for name in cfg.model.converters:  # the layouts each converter cannot take
        if degrees and name in converters.REGISTRY:
            for line in converters.get(name).refuses(degrees, cfg):
                problems.add(f"model.converters: {name}: {line}")
    if cfg.eval.enable:
        check_eval(cfg, problems)
    t = cfg.training
    if t.document_positions and not t.document_mask:
        problems.add("training.document_positions needs training.document_mask = true")
    if t.document_mask and degrees and degrees.pp > 1:
        problems.add(
            "training.document_mask does not combine with pipeline parallelism yet; set "
            "parallelism.pipeline_parallel_degree to 1"
        )
    if t.document_mask and cfg.compile.enable:
        problems.add(
            "training.document_mask does not combine with compile.enable yet (blocks compile "
            "as whole graphs, and the split by document depends on the data)"
        )
    if t.document_mask and tokenizer is not None and tokenizer.bos_id < 0 and tokenizer.eos_id < 0:
        problems.add(
            "training.document_mask: the tokenizer has neither a BOS nor an EOS token to find "
            "document boundaries by"
        )
    path = resolve_path(cfg.training.dataset_path)
    # A dry run reads no data: a cluster recipe's shared folder need not exist where it runs.
    if path and not os.path.exists(path) and not cfg.training.datasets and not cfg.job.dry_run:
        problems.add(f"training.dataset_path: {path!r} does not exist")
    for i, entry in enumerate(cfg.training.datasets):
        folder = resolve_path(entry.path)
        if not os.path.isdir(folder):
            problems.add(f"training.datasets[{i}].path: {folder!r} is not a folder")
        elif not is_token_folder(folder):
            problems.add(
                f"training.datasets[{i}].path: {folder!r} is not a pre-tokenized folder "
                "(make one with scripts/pretokenize.py)"
            )
    rank = cfg.job.dry_run_init_rank
    if rank >= world_size:
        problems.add(
            f"job.dry_run_init_rank {rank} is not a rank of this layout (world size {world_size})"
        )
    problems.raise_if_any(ConfigError)
    return tokenizer


def check_eval(cfg: JobConfig, problems: Problems) -> None:
    """[eval]'s numbers, and every task file read and checked: before the run writes anything
    into its folder (a bad file once replaced an earlier run's config.toml and run.json)."""
    from titanlite.downstream import builtin
    from titanlite.downstream.tasks import read_task

    e = cfg.eval
    for key, value, least in (
        ("freq", e.freq, 1),
        ("batch_size", e.batch_size, 1),
        ("limit", e.limit, 0),
    ):
        if value < least:
            problems.add(f"eval.{key}: must be at least {least}, got {value}")
    for name in e.tasks:
        if name not in builtin.NAMES:
            with problems.check():
                read_task(Path(resolve_path(name)))


def attention_layers() -> tuple[str, ...]:
    """The attention kinds with projections of their own (no per-head q/k/v), imported only
    when asked: the registry imports torch, which the launcher's preflight does without."""
    from titanlite.models.attention import LAYERS

    return tuple(LAYERS)
