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
from titanlite.models.llama import FLAVORS, ModelArgs, model_args

REPO_ROOT = Path(__file__).resolve().parent.parent
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


def build_model_args(cfg: JobConfig, vocab_size: int) -> ModelArgs:
    m = cfg.model
    if m.flavor not in FLAVORS:
        raise ConfigError(
            f"model.flavor: {m.flavor!r} is not a flavor; valid: {', '.join(FLAVORS)}"
        )
    overrides = {k: getattr(m, k) for k in MODEL_OVERRIDES}
    try:
        return model_args(m.flavor, vocab_size, cfg.training.seq_len, **overrides)
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None


def check(cfg: JobConfig, world_size: int) -> Tokenizer:
    """Raise a UserError for anything about this run that is wrong before it starts;
    returns the (valid) tokenizer."""
    degrees = resolve_degrees(cfg, world_size)
    gradient_accumulation_steps(cfg, degrees)
    tokenizer = Tokenizer(resolve_path(cfg.model.tokenizer_path))
    args = build_model_args(cfg, tokenizer.vocab_size)
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
    argv = sys.argv[1:] if argv is None else argv
    try:
        check(load_config(argv), int(os.environ.get("WORLD_SIZE", "1")))
    except UserError as e:
        sys.stderr.write(f"titanlite: error: {e}\n")
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
