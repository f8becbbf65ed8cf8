"""Checks a run's config, layout and input files before any process starts.

    python -m titanlite.preflight --job.config_file CONFIG.toml [--section.key value ...]

run_train.sh calls this first, with the world size it is about to launch in WORLD_SIZE, so
that a typo or an impossible layout is one line and exit status 2 instead of a crash in
every rank. The checks themselves live in titanlite.checks (the trainer runs them again).
A dry run (--job.dry_run) is done here, in this one process, and nothing is launched.
A dump folder held by a live run (titanlite.runtime.run_lock) is refused here too, before anything
starts; the trainer takes the lock itself, for its whole life. With
TITANLITE_DUMP_FOLDER_FILE set, a run that may go ahead writes its dump folder (absolute)
into that file: run_train.sh keeps torchrun's per-rank logs there.
"""

from __future__ import annotations

import os
import sys

from titanlite.checks import check
from titanlite.config import load_config
from titanlite.errors import (
    EXIT_INTERRUPTED,
    EXIT_NO_LAUNCH,
    EXIT_OK,
    EXIT_USER_ERROR,
    UserError,
    error_lines,
)
from titanlite.ft.settings import group_folder
from titanlite.runtime import run_lock


def main(argv: list[str] | None = None) -> int:
    """0: go ahead; 2: bad input or a busy dump folder; EXIT_NO_LAUNCH: a dry run was done,
    nothing to launch; EXIT_INTERRUPTED: Ctrl-C, nothing launched."""
    argv = sys.argv[1:] if argv is None else argv
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = load_config(argv)
        tokenizer = check(cfg, world_size)
        if cfg.job.dry_run:
            from titanlite.dry_run import dry_run  # imports torch: only for a dry run

            vocab = tokenizer.vocab_size if tokenizer else 0
            sys.stdout.write(dry_run(cfg, world_size, vocab) + "\n")
            return EXIT_NO_LAUNCH
        # (a replica group's run holds its own folder: replica-<id>)
        run_lock.check_free(group_folder(cfg.fault_tolerance, cfg.job.dump_folder))
        # run_train.sh asks where the run writes, to give torchrun's per-rank logs a home there.
        answer = os.environ.get("TITANLITE_DUMP_FOLDER_FILE")
        if answer:
            with open(answer, "w") as f:
                f.write(os.path.abspath(cfg.job.dump_folder))
    except UserError as e:
        sys.stderr.writelines(line + "\n" for line in error_lines(e))
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        sys.stderr.write("titanlite: interrupted (Ctrl-C) before the run started; nothing ran\n")
        return EXIT_INTERRUPTED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
