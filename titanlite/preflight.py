"""Checks a run's config, layout and input files before any process starts.

    python -m titanlite.preflight --job.config_file CONFIG.toml [--section.key value ...]

run_train.sh calls this first, with the world size it is about to launch in WORLD_SIZE, so
that a typo or an impossible layout is one line and exit status 2 instead of a crash in
every rank. The trainer runs the same checks again (they are cheap).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from titanlite.config import (
    ConfigError,
    JobConfig,
    gradient_accumulation_steps,
    load_config,
    resolve_degrees,
)
from titanlite.data.tokenizer import Tokenizer
from titanlite.errors import EXIT_USER_ERROR, UserError
from titanlite.models.args import FLAVORS, ModelArgs, model_args

REPO_ROOT = Path(__file__).resolve().parent.parent
# Tells run_train.sh that preflight did all there was to do (a dry run): launch nothing.
EXIT_NO_LAUNCH = 100
MODEL_OVERRIDES = (
    "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim_multiplier", "multiple_of",
    "rope_theta", "norm_eps", "tie_embeddings",
)  # fmt: skip


def resolve_path(path: str) -> str:
    """A relative path as given when it exists, else relative to the titanlite checkout (so
    the shipped tokenizer is found from any working directory)."""
    if not path or os.path.isabs(path) or os.path.exists(path):
        return path
    candidate = REPO_ROOT / path
    return str(candidate) if candidate.exists() else path


def build_model_args(cfg: JobConfig, tokenizer_vocab: int) -> ModelArgs:
    m = cfg.model
    vocab_size = m.vocab_size or tokenizer_vocab
    if vocab_size < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size {vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer_vocab})"
        )
    if m.flavor not in FLAVORS:
        raise ConfigError(
            f"model.flavor: {m.flavor!r} is not a flavor; valid: {', '.join(FLAVORS)}"
        )
    overrides = {k: getattr(m, k) for k in MODEL_OVERRIDES}
    try:
        return model_args(m.flavor, vocab_size, cfg.training.seq_len, **overrides)
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None


def check(cfg: JobConfig, world_size: int) -> Tokenizer | None:
    """Raise a UserError for anything about this run that is wrong before it starts;
    returns the (valid) tokenizer, or None in a dry run given model.vocab_size and no
    tokenizer file."""
    degrees = resolve_degrees(cfg, world_size)
    gradient_accumulation_steps(cfg, degrees)
    tokenizer_path = resolve_path(cfg.model.tokenizer_path)
    if cfg.job.dry_run and cfg.model.vocab_size and not os.path.exists(tokenizer_path):
        tokenizer = None  # a dry run needs only the vocabulary size
    else:
        tokenizer = Tokenizer(tokenizer_path)
    args = build_model_args(cfg, tokenizer.vocab_size if tokenizer else cfg.model.vocab_size)
    tp = degrees.tp
    for key, value in (("n_heads", args.n_heads), ("n_kv_heads", args.kv_heads)):
        if value % tp:
            raise ConfigError(
                f"parallelism.tensor_parallel_degree {tp} does not divide model.{key} {value}"
            )
    if cfg.training.seq_len % tp:
        raise ConfigError(
            f"parallelism.tensor_parallel_degree {tp} does not divide training.seq_len "
            f"{cfg.training.seq_len} (sequence parallelism splits the sequence)"
        )
    path = resolve_path(cfg.training.dataset_path)
    if path and not os.path.exists(path):
        raise ConfigError(f"training.dataset_path: {path!r} does not exist")
    return tokenizer


def main(argv: list[str] | None = None) -> int:
    """0: go ahead; 2: bad input; EXIT_NO_LAUNCH: a dry run was done, nothing to launch."""
    argv = sys.argv[1:] if argv is None else argv
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = load_config(argv)
        tokenizer = check(cfg, world_size)
        if cfg.job.dry_run:
            from titanlite.dry_run import dry_run

            vocab = tokenizer.vocab_size if tokenizer else 0
            sys.stdout.write(dry_run(cfg, world_size, vocab) + "\n")
            return EXIT_NO_LAUNCH
    except UserError as e:
        sys.stderr.write(f"titanlite: error: {e}\n")
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
