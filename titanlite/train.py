"""The training entry point: parse, build the Trainer, run, map errors to exit statuses.

    python -m titanlite.train --job.config_file CONFIG.toml [--section.key value ...]

Normally started by ./run_train.sh through torchrun; a plain single process works too.
Exit statuses are those of titanlite.errors: 0 done, 2 bad input (a line per problem on
stderr), 3 the loss became non-finite, 4 a rank was lost (a collective failed or timed out),
75 stopped by SIGTERM/SIGUSR1 after saving a checkpoint (run the same command to resume),
130 stopped by Ctrl-C (the first saves the step it stopped at, a second stops at once; the
same command resumes).

Only torch-free modules are imported before the signal handlers are in place: importing torch
takes seconds, and a Ctrl-C meanwhile must be the same orderly stop as later.
"""

from __future__ import annotations

import sys

try:
    import contextlib
    import gc
    import logging
    import os
    import signal
    from collections.abc import Iterator

    from titanlite.errors import (
        EXIT_COMM_FAILURE,
        EXIT_DIVERGED,
        EXIT_INTERRUPTED,
        EXIT_OK,
        EXIT_PREEMPTED,
        EXIT_USER_ERROR,
        Interrupted,
        Preempted,
        SilentCorruption,
        TrainingDiverged,
        UserError,
        error_lines,
        resume_line,
    )
    from titanlite.runtime import run_lock, stop_signals
except KeyboardInterrupt:  # Ctrl-C before main() can install the handlers: the same line
    if __name__ != "__main__":
        raise
    from titanlite.errors import EXIT_INTERRUPTED, Interrupted, resume_line

    stop = Interrupted.at("during start-up", saved=False)  # which step is not known yet
    sys.stderr.write(resume_line(stop) + "\n")
    raise SystemExit(EXIT_INTERRUPTED) from None

logger = logging.getLogger("titanlite.train")

# Started as the program (python -m titanlite.train: run_train.sh, torchrun), this process owns
# its garbage collector; imported (tests call main() in long-lived worker processes), the module
# leaves the collector alone.
OWNS_PROCESS = __name__ == "__main__"


@contextlib.contextmanager
def imports_uncollected() -> Iterator[None]:
    """Heavy imports (torch, the trainer's modules) with the cyclic garbage collector paused,
    and what they made frozen out of every later collection. They make almost no garbage, but
    the collections they trigger walk the growing heap again and again: about 0.6 s of a
    trainer's 2.5 s of import CPU on the 2-core machine (the later imports' included, which
    then skip the frozen objects)."""
    if not OWNS_PROCESS:
        yield
        return
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def report_error(error: Exception, status: int) -> int:
    """A line per problem on stderr; also "STATUS<TAB>line" each to TITANLITE_ERROR_FILE so the
    launcher can repeat them after torchrun's report and exit with the same status."""
    lines = error_lines(error)
    sys.stderr.writelines(line + "\n" for line in lines)
    return record_status(lines, status)


def record_status(lines: list[str], status: int) -> int:
    """Append "STATUS<TAB>line" to TITANLITE_ERROR_FILE: torchrun only says that a rank failed,
    so this is how ./run_train.sh (and through it a SLURM job) learns the trainer's status."""
    path = os.environ.get("TITANLITE_ERROR_FILE")
    if path:
        with contextlib.suppress(OSError), open(path, "a") as f:
            f.writelines(f"{status}\t{line}\n" for line in lines)
    return status


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    stop_signals.install()  # first: the imports below take seconds (torch)
    from titanlite.config import help_text, parse_cli

    try:
        want_help, _ = parse_cli(argv)
    except UserError as e:
        return report_error(e, EXIT_USER_ERROR)
    if want_help:  # from the config and the registries alone: no torch to import
        sys.stdout.write(help_text() + "\n")
        return EXIT_OK
    return run(argv)


def run(argv: list[str]) -> int:
    """Load the config and train (or dry-run); an exit status of titanlite.errors."""
    from titanlite.config import load_config

    with imports_uncollected():
        from titanlite.runtime import distributed
        from titanlite.runtime.heartbeat import CommFailure, failure_message, is_comm_failure

    distributed.setup_logging()
    trainer = None
    lost = False  # a rank is gone: nothing collective may run any more
    try:
        cfg = load_config(argv)
        if cfg.job.dry_run:  # the report alone, as ./run_train.sh gives it: never a Trainer
            from titanlite.checks import check
            from titanlite.dry_run import dry_run

            world = int(os.environ.get("WORLD_SIZE", "1"))
            tokenizer = check(cfg, world)
            sys.stdout.write(dry_run(cfg, world, tokenizer.vocab_size if tokenizer else 0) + "\n")
            return EXIT_OK
        with imports_uncollected():
            from titanlite.trainer import Trainer

        trainer = Trainer(cfg)
        trainer.train()
        done, trainer = trainer, None
        done.close()  # inside the try: finishing the last (async) save can still fail
        return EXIT_OK
    except UserError as e:
        return report_error(e, EXIT_USER_ERROR)
    except TrainingDiverged as e:
        return report_error(e, EXIT_DIVERGED)
    except (CommFailure, SilentCorruption) as e:  # a rank lost, or one computing wrongly
        lost = True
        return report_error(e, EXIT_COMM_FAILURE)
    except Interrupted as e:
        line = resume_line(e)
        sys.stderr.write(line + "\n")  # the user pressed Ctrl-C: the answer goes to the terminal
        return record_status([line], EXIT_INTERRUPTED)
    except Preempted as e:
        logger.warning("%s; exiting with status %d so the job can be requeued", e, EXIT_PREEMPTED)
        # Not an error, but the launcher must see 75 (torchrun itself exits 1).
        return record_status([resume_line(e)], EXIT_PREEMPTED)
    except RuntimeError as e:  # last: the stops and TrainingDiverged are RuntimeErrors too
        if not (is_comm_failure(e) and distributed.world_size() > 1):
            raise
        lost = True
        return report_error(CommFailure(failure_message(e)), EXIT_COMM_FAILURE)
    finally:
        if trainer is not None:  # already failing: a second error would hide the first
            with contextlib.suppress(UserError):
                trainer.close(abandon=lost)
        run_lock.release_held()  # also when the Trainer failed to start
        if not lost:  # tearing down groups with a dead peer can hang (NCCL)
            distributed.shutdown()
        # Done (or failed): SIGTERM means "exit now" again, as torchrun means it when it stops
        # the other ranks after a failure; the save-and-stop handler would only make it wait
        # for its SIGKILL (about 30 s).
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


if __name__ == "__main__":
    status = main()
    # Everything is closed and flushed: the interpreter's last full collection, over every object
    # torch and the libraries made, would only cost time (about 1 s of CPU per process; 3 to 5 s
    # from "training finished" to the launcher's exit for 4 ranks on 2 cores). Frozen objects are
    # left out of it; those freed by reference counting still are, as before.
    gc.freeze()
    sys.exit(status)
