"""Tokenize a titanlite config's training source once, into a folder of token shards.

    python scripts/pretokenize.py [CONFIG.toml] --out DIR [--shard-tokens N] \\
        [--section.key value ...]
    python scripts/pretokenize.py --verify DIR

The source (training.dataset / dataset_path / dataset_config / text_field), the tokenizer
(model.tokenizer_path) and the held-out fraction (validation.holdout_fraction) come from the
config and its overrides, exactly as for training. Both splits are written. Re-running the same
command finishes an interrupted job; --verify re-checks every shard's size and checksum.
"""

from __future__ import annotations

import logging
import sys

from titanlite.config import load_config
from titanlite.data import load_tokenizer
from titanlite.data.build import data_spec
from titanlite.data.tokens import DEFAULT_SHARD_TOKENS, pretokenize, verify
from titanlite.errors import EXIT_USER_ERROR, UserError
from titanlite.paths import resolve_path

USAGE = __doc__.split("\n\n")[1]


def _take(argv: list[str], flag: str) -> str | None:
    if flag not in argv:
        return None
    i = argv.index(flag)
    if i + 1 >= len(argv):
        raise UserError(f"{flag} needs a value")
    value = argv[i + 1]
    del argv[i : i + 2]
    return value


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        folder = _take(argv, "--verify")
        if folder is not None:
            print(verify(folder))
            return 0
        out = _take(argv, "--out")
        if out is None:
            raise UserError(f"--out DIR is required\n{USAGE}")
        shards = _take(argv, "--shard-tokens")
        try:
            shard_tokens = int(shards) if shards is not None else DEFAULT_SHARD_TOKENS
        except ValueError:
            raise UserError(f"--shard-tokens must be an integer, got {shards!r}") from None
        if argv and not argv[0].startswith("-"):  # the config file, as for run_train.sh
            argv = ["--job.config_file", argv[0], *argv[1:]]
        cfg = load_config(argv)
        tokenizer = load_tokenizer(resolve_path(cfg.model.tokenizer_path))
        meta = pretokenize(
            data_spec(cfg.training, cfg.validation), tokenizer, out, shard_tokens=shard_tokens
        )
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    splits = meta["splits"]
    print(
        f"{out}: train {splits['train']['tokens']:,} tokens in {len(splits['train']['shards'])} "
        f"shards, validation {splits['validation']['tokens']:,} tokens ({meta['dtype']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
