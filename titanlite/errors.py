"""Errors a user can cause, and every exit status titanlite's commands use, in one table.

Anything raised as a ``UserError`` is reported by the entry points as one line on stderr
with exit status 2, never as a traceback: the message must name the offending key, file
or value and, where possible, what would be valid.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class UserError(Exception):
    """A problem with the user's input that they can fix; the message is shown as is.

    One error may carry several problems (``UserError("a", "b")``), each a line of its own, so
    that a config with three mistakes is reported once with all three.
    """

    def __init__(self, *problems: str) -> None:
        super().__init__("\n".join(problems))
        self.problems = list(problems)


def error_lines(error: Exception, program: str = "titanlite") -> list[str]:
    """The lines an entry point prints for ``error``: one per problem, each naming the program."""
    return [f"{program}: error: {problem}" for problem in str(error).split("\n") if problem]


class Problems:
    """Collects UserErrors from independent checks so that all of them are reported at once.

    ``with problems.check(): ...`` records a UserError raised inside the block and goes on;
    ``problems.raise_if_any(ErrorType)`` raises one error holding every problem recorded.
    """

    def __init__(self) -> None:
        self.lines: list[str] = []

    @contextlib.contextmanager
    def check(self) -> Iterator[None]:
        try:
            yield
        except UserError as e:
            self.lines.extend(line for line in str(e).split("\n") if line)

    def add(self, line: str) -> None:
        self.lines.append(line)

    def raise_if_any(self, kind: type[UserError] = UserError) -> None:
        if self.lines:
            raise kind(*self.lines)


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm became non-finite (EXIT_DIVERGED)."""


class SilentCorruption(RuntimeError):
    """Replicas that must hold identical bytes differ: a rank computed or stored wrong numbers
    (EXIT_COMM_FAILURE, as a lost rank: the same command resumes from the last checkpoint,
    which nothing of the bad rank reached)."""


class Preempted(RuntimeError):
    """Stopped on a signal, after saving when checkpoints are on (EXIT_PREEMPTED); the same
    command resumes."""


class Interrupted(RuntimeError):
    """Stopped on Ctrl-C (SIGINT), after saving when checkpoints are on (EXIT_INTERRUPTED); the
    same command resumes."""

    @classmethod
    def at(cls, where: str, saved: bool) -> Interrupted:
        """Stopped ``where`` ("at step 7", "during start-up, before step 1"), ``saved`` or not."""
        return cls(
            f"interrupted (Ctrl-C) {where}; "
            f"{'checkpoint saved' if saved else 'nothing new to save'}"
        )


def resume_line(stop: Exception) -> str:
    """The last line of a run a signal stopped (Interrupted, Preempted)."""
    return f"titanlite: {stop}; run the same command to resume"


EXIT_OK = 0
EXIT_USER_ERROR = 2
"""Bad input: a config, layout, file or checkpoint problem (one line on stderr)."""
EXIT_DIVERGED = 3
"""The loss or the gradient norm became non-finite."""
EXIT_COMM_FAILURE = 4
"""A collective failed or timed out (comm.timeout_seconds): a rank was lost; one line names it.
Also a hang the health watchdog diagnosed, and replicas found to differ (silent corruption).
The checkpoint on disk is untouched; the same command resumes from the latest complete one."""
EXIT_PREEMPTED = 75
"""Stopped by SIGTERM/SIGUSR1 after saving a checkpoint (EX_TEMPFAIL: "try again later");
the same command resumes, and SLURM scripts requeue the job on it."""
EXIT_INTERRUPTED = 130
"""Stopped by Ctrl-C (SIGINT; 128 + 2, what shells report for it): after saving the step it
stopped at on the first Ctrl-C, at once and without saving on the second. The same command
resumes; SLURM scripts do not requeue on it."""
EXIT_NO_LAUNCH = 100
"""Internal, preflight -> run_train.sh: a dry run was done and there is nothing to launch."""
