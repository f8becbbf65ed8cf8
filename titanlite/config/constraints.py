"""The checks of a parsed JobConfig that need no knowledge of the world size (those that do
are ``layout``'s): every failure is collected into one ConfigError.
"""

from __future__ import annotations

import difflib
import importlib.util

from titanlite.config import catalog
from titanlite.config.batch_ramp import parse_schedule
from titanlite.config.job_config import ConfigError, JobConfig
from titanlite.config.model_section import FROM_CHECKPOINT
from titanlite.config.schema import dataset_name
from titanlite.errors import Problems

SPIKE_VALUES = ("loss", "grad_norm")
"""What training.skip_spikes may watch: the step's global loss and gradient norm."""


def validate(cfg: JobConfig) -> None:
    """Checks that need no knowledge of the world size; one ConfigError listing every failure."""
    problems = Problems()
    check_registered(cfg, problems)

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
    try:
        parse_schedule(t.batch_size_schedule)
    except ValueError as e:
        problems.add(f"training.batch_size_schedule: {e}")
    try:
        for _, length in parse_schedule(t.seq_len_schedule, "SEQ_LEN"):
            if length > t.seq_len:
                raise ValueError(f"seq_len {length} is above training.seq_len {t.seq_len}")
    except ValueError as e:
        problems.add(f"training.seq_len_schedule: {e}")
    require(t.z_loss_weight >= 0, "training.z_loss_weight", "must be >= 0 (0 = off)")
    require(t.fused_loss_chunk >= 1, "training.fused_loss_chunk", "must be at least 1")
    require(t.fused_loss_tokens >= 0, "training.fused_loss_tokens", "must be 0 (automatic) or more")
    require(
        set(t.skip_spikes) <= set(SPIKE_VALUES),
        "training.skip_spikes",
        f"must name only {', '.join(SPIKE_VALUES)}",
    )
    require(0 <= t.ema_decay < 1, "training.ema_decay", "must be in [0, 1) (0 = off)")
    require(t.spike_window >= 2, "training.spike_window", "must be at least 2")
    require(t.spike_sigmas > 0, "training.spike_sigmas", "must be > 0")
    require(
        t.max_skipped >= 0, "training.max_skipped", "must be >= 0 (0 = stop at a non-finite loss)"
    )
    require(
        not t.skip_spikes or t.max_skipped >= 1,
        "training.max_skipped",
        "must be at least 1 with training.skip_spikes (the skipped steps allowed in a row)",
    )
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
    state_keys = catalog.current().state_keys
    require(
        set(c.exclude_from_loading) <= set(state_keys),
        "checkpoint.exclude_from_loading",
        f"must name only {', '.join(state_keys)}",
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
    for section in catalog.current().sections:  # each component checks its own settings
        if section.check is not None:
            section.check(cfg, problems)
    if m.enable_tensorboard and importlib.util.find_spec("tensorboard") is None:
        problems.add(
            "metrics.enable_tensorboard needs the tensorboard package, which is not installed: "
            "pip install 'titanlite[tensorboard]' (or tensorboard)"
        )
    problems.raise_if_any(ConfigError)


def _did_you_mean(key: str, value: str, known: list[str]) -> str:
    if not known:
        return f"{key}: {value!r} is unknown (titanlite has none yet)"
    hint = difflib.get_close_matches(value, known, n=1, cutoff=0.6)
    also = f" (did you mean {hint[0]!r}?)" if hint else ""
    return f"{key}: {value!r} is not one of {', '.join(known)}{also}"


def check_registered(cfg: JobConfig, problems: Problems) -> None:
    """Names the registries must know: the model family, the optimizers, the converters."""
    known = catalog.current()
    if cfg.model.name not in known.families and cfg.model.name != FROM_CHECKPOINT:
        problems.add(_did_you_mean("model.name", cfg.model.name, list(known.families)))
    source = cfg.checkpoint.initial_load_path if cfg.checkpoint.enable else ""
    for key in ("name", "flavor"):
        if getattr(cfg.model, key) == FROM_CHECKPOINT and not source:
            problems.add(
                f'model.{key}: "{FROM_CHECKPOINT}" takes the model of '
                "checkpoint.initial_load_path, and none is set (or checkpoint.enable is false)"
            )
    names = [("optimizer.name", cfg.optimizer.name)]
    for i, rule in enumerate(cfg.optimizer.param_groups):
        where = f"optimizer.param_groups[{i}]"
        if rule.optimizer:
            names.append((f"{where}.optimizer", rule.optimizer))
        if not rule.lr_scale > 0:
            problems.add(f"{where}.lr_scale: must be > 0, got {rule.lr_scale!r}")
        if rule.weight_decay is not None and rule.weight_decay < 0:
            problems.add(f"{where}.weight_decay: must be >= 0, got {rule.weight_decay!r}")
        if not rule.params.strip(" ,"):
            problems.add(f"{where}.params: must name at least one pattern")
    for key, name in names:
        if name.lower() not in known.optimizers:
            problems.add(_did_you_mean(key, name, list(known.optimizers)))
    for i, name in enumerate(cfg.model.converters):
        if name not in known.converters:
            problems.add(_did_you_mean(f"model.converters[{i}]", name, list(known.converters)))
