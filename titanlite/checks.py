"""Checks of a run's config, layout and input files that need no torch.

Used by the launcher's preflight (before any process starts), the dry run and the trainer
alike, so a typo or an impossible layout is the same one-line error wherever it is found.
This module resolves the layout, the tokenizer and the model's shape into a
``PlannedRun``; the rules of each feature against the rest live with the feature
(``titanlite.config.planned``): the registry entries' ``refuses`` (the optimizers and
converters the run names) and ``titanlite.components.RUN_RULES``.
"""

from __future__ import annotations

import os

from titanlite import components, converters, optim
from titanlite.assembly import build_model_args
from titanlite.config import ConfigError, JobConfig, gradient_accumulation_steps, resolve_degrees
from titanlite.config.batch_ramp import BatchRamp
from titanlite.config.planned import PlannedRun, Rule
from titanlite.data.tokenizer import Tokenizer, load_tokenizer
from titanlite.errors import Problems
from titanlite.paths import resolve_path


def check(cfg: JobConfig, world_size: int) -> Tokenizer | None:
    """Raise a UserError for anything about this run that is wrong before it starts (every
    independent problem at once); returns the (valid) tokenizer, or None in a dry run given
    model.vocab_size and no tokenizer file."""
    problems = Problems()
    run = plan(cfg, world_size, problems)
    for prefix, rule in [("", r) for r in components.RUN_RULES] + entry_rules(cfg):
        for line in rule(run):
            problems.add(prefix + line)
    rank = cfg.job.dry_run_init_rank
    if rank >= world_size:
        problems.add(
            f"job.dry_run_init_rank {rank} is not a rank of this layout (world size {world_size})"
        )
    problems.raise_if_any(ConfigError)
    return run.tokenizer


def plan(cfg: JobConfig, world_size: int, problems: Problems) -> PlannedRun:
    """What is known of the run before it starts; what cannot be resolved is a problem and
    stays None (rules that need it skip)."""
    degrees = spec = args = tokenizer = None
    with problems.check():
        degrees = resolve_degrees(cfg, world_size)
        gradient_accumulation_steps(cfg, degrees)
        BatchRamp.of(cfg, degrees)
    tokenizer_path = resolve_path(cfg.model.tokenizer_path)
    vocab_size = cfg.model.vocab_size
    if not (cfg.job.dry_run and cfg.model.vocab_size and not os.path.exists(tokenizer_path)):
        # (a dry run given model.vocab_size needs no tokenizer file)
        with problems.check():
            tokenizer = load_tokenizer(tokenizer_path)
            vocab_size = tokenizer.vocab_size
    if vocab_size:
        with problems.check():
            spec, args = build_model_args(cfg, vocab_size)
    return PlannedRun(cfg, world_size, degrees, spec, args, tokenizer)


def entry_rules(cfg: JobConfig) -> list[tuple[str, Rule]]:
    """The registry entries' rules, each with the prefix of its lines: every optimizer's
    (each checks its own settings, whichever optimizer the run names) and those of the
    converters the run names."""
    found: list[tuple[str, Rule]] = [
        ("", entry.refuses) for entry in optim.REGISTRY.values() if entry.refuses is not None
    ]
    for name in cfg.model.converters:
        entry = converters.REGISTRY.get(name)
        if entry is not None and entry.refuses is not None:
            found.append((f"model.converters: {name}: ", entry.refuses))
    return found
