"""assemble_model(): the one way a run's model is built (the trainer, the dry run, tools).

The family's spec (model.name) and the model's args (flavor, vocabulary, model.* overrides)
-> the model built on the meta device (counted there: nothing is allocated) -> the model
converters -> ``parallelize``, every parallelism in its fixed order
(``titanlite.parallel.parallelize``), which on a device ends by allocating and initializing
only this rank's shards. What the caller gets is an ``AssembledModel``: the ParallelModel and
what was decided on the way.

``build_model_args`` is also one of the checks the launcher's preflight runs before any
process starts, without torch (``titanlite.checks``): this module imports torch and the
parallelisms only when a model is assembled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from titanlite import converters, models
from titanlite.config import ConfigError, JobConfig
from titanlite.config.model_section import FROM_CHECKPOINT
from titanlite.models.spec import ModelSpec

if TYPE_CHECKING:
    import torch

    from titanlite.converters import Converter
    from titanlite.parallel.dims import ParallelDims
    from titanlite.parallel.parallel_model import DocumentStructure, ParallelModel


def model_overrides(cfg: JobConfig) -> dict[str, Any]:
    """The model.* shape fields the config sets (the families' fields; unset ones left out)."""
    return dict(sorted(cfg.model.overrides.items()))


def build_model_args(cfg: JobConfig, tokenizer_vocab: int) -> tuple[ModelSpec, Any]:
    """The family's spec and the args of this run's model; ConfigError naming the key.

    With checkpoint.initial_load_path, a model.flavor of "from_checkpoint" takes the family
    and shape from that folder (``titanlite.interop.source``); a named flavor must describe
    the same model, every difference listed in one line."""
    m = cfg.model
    source = None
    if cfg.checkpoint.enable and cfg.checkpoint.initial_load_path:
        from titanlite.interop import source as sources

        source = sources.describe(cfg.checkpoint.initial_load_path)
    if m.flavor == FROM_CHECKPOINT and source is not None:
        spec, args = _args_of_source(cfg, source)
    else:
        spec = models.get(source.family if m.name == FROM_CHECKPOINT and source else m.name)
        if m.flavor not in spec.flavors:
            raise ConfigError(
                f"model.flavor: {m.flavor!r} is not a {spec.name} flavor; valid: "
                f"{', '.join(spec.flavors)}, {FROM_CHECKPOINT}"
            )
        vocab_size = m.vocab_size or tokenizer_vocab
        try:
            args = spec.make_args(m.flavor, vocab_size, cfg.training.seq_len, model_overrides(cfg))
        except ValueError as e:
            raise ConfigError(f"model: {e}") from None
    if source is not None:
        found = sources.differences(source, spec.name, args)
        if found:
            raise ConfigError(
                f"model: checkpoint.initial_load_path {str(source.path)!r} holds a different "
                f"model: {', '.join(found)} (leave model.name, model.flavor and the shape "
                "keys unset to train the model it holds)"
            )
    if args.vocab_size < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size {args.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer_vocab})"
        )
    return spec, args


def _args_of_source(cfg: JobConfig, source: Any) -> tuple[ModelSpec, Any]:
    """The source's family and args, with this run's sequence length and model.* keys."""
    m = cfg.model
    if m.name not in (FROM_CHECKPOINT, source.family):
        raise ConfigError(
            f"model.name: checkpoint.initial_load_path {str(source.path)!r} holds a "
            f"{source.family} model (this run: {m.name}); leave model.name unset"
        )
    spec = models.get(source.family)
    changes = {k: v for k, v in model_overrides(cfg).items() if v is not None}
    foreign = sorted(set(changes) - set(spec.overrides))
    if foreign:
        raise ConfigError(f"model: {', '.join(foreign)} does not apply to {spec.name}")
    if m.vocab_size:
        changes["vocab_size"] = m.vocab_size
    try:
        args = dataclasses.replace(source.args, max_seq_len=cfg.training.seq_len, **changes)
        args.check()
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None
    return spec, args


@dataclass(frozen=True)
class AssembledModel:
    """A run's model, assembled (``assemble_model``)."""

    spec: ModelSpec
    """The family's spec: how the rest of titanlite addresses the model."""
    args: Any
    """The model's args (the family's dataclass: flavor, vocabulary, overrides applied)."""
    model: ParallelModel
    """The parallelized model: what training, validation and evaluation run."""
    num_params: int
    """Parameters of the whole model (tied weights once), by their global shapes."""
    active_params: int
    """Parameters one token runs through (fewer than ``num_params`` for a mixture of experts)."""
    converters: tuple[Converter, ...]
    """The model converters applied (model.converters): the trainer attaches them to the
    optimizers once those exist (``Converter.attach``)."""
    mup: Any = None
    """μP's plan ([mup], titanlite.mup.parametrize.Plan), or None: the optimizer's groups
    take its learning-rate factors."""


def assemble_model(
    cfg: JobConfig,
    *,
    tokenizer_vocab: int,
    dims: ParallelDims,
    device: torch.device | None,
    documents: DocumentStructure | None = None,
    init_weights: bool = True,
) -> AssembledModel:
    """This rank's model for the run ``cfg`` describes, parallelized over ``dims``.

    ``tokenizer_vocab``: the tokenizer's vocabulary (model.vocab_size may be larger; 0 in a
    dry run given only model.vocab_size). ``device`` None (a dry run) leaves the model on the
    meta device, with neither data-parallel wrappers nor a pipeline schedule. ``documents``:
    attention block-causal within documents (training.document_mask). ``init_weights`` False
    allocates without initializing, when a checkpoint is about to overwrite every weight.
    ConfigError for a model the config cannot build.
    """
    import torch

    from titanlite.models.layers import count_params
    from titanlite.mup.parametrize import install as install_mup
    from titanlite.mup.parametrize import plan as mup_plan
    from titanlite.mup.parametrize import scale_init
    from titanlite.parallel.parallelize import parallelize
    from titanlite.training.loss import TrainingLoss

    spec, args = build_model_args(cfg, tokenizer_vocab)
    with torch.device("meta"):
        model = spec.build(args)
    # μP: the plan from the family's shapes; its factors once the model is parallelized.
    mup = mup_plan(spec, args, cfg.mup.base_dim, cfg.mup.base_head_dim) if cfg.mup.enable else None
    num_params = count_params(model)
    active = spec.active_params(args, num_params) if spec.active_params else num_params
    applied = tuple(converters.build(cfg.model.converters, cfg))
    parallel = parallelize(
        model,
        spec,
        args,
        dims,
        parallelism=cfg.parallelism,
        training=cfg.training,
        activation_checkpoint=cfg.activation_checkpoint,
        compile=cfg.compile,
        device=device,
        # (+ z, MTP; fused with the projection under training.fused_loss): loss.py
        loss_sum=TrainingLoss.of(cfg.training, args),
        converters=applied,
        init_weights=init_weights,
        documents=documents,
    )
    if mup is not None:  # on the modules as they run (a deferred head, FSDP, TP)
        for part in parallel.parts:
            install_mup(part, mup)
        if init_weights and device is not None:
            scale_init(parallel.parts, mup)
    return AssembledModel(spec, args, parallel, num_params, active, applied, mup)
