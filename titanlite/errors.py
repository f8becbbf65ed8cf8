"""Errors a user can cause, and every exit status titanlite's commands use, in one table.

Anything raised as a ``UserError`` is reported by the entry points as one line on stderr
with exit status 2, never as a traceback: the message must name the offending key, file
or value and, where possible, what would be valid.
"""


class UserError(Exception):
    """A problem with the user's input that they can fix; the message is shown as is."""


EXIT_OK = 0
EXIT_USER_ERROR = 2
"""Bad input: a config, layout, file or checkpoint problem (one line on stderr)."""
EXIT_DIVERGED = 3
"""The loss or the gradient norm became non-finite."""
EXIT_PREEMPTED = 75
"""Stopped by SIGTERM/SIGUSR1 after saving a checkpoint (EX_TEMPFAIL: "try again later");
the same command resumes, and SLURM scripts requeue the job on it."""
EXIT_NO_LAUNCH = 100
"""Internal, preflight -> run_train.sh: a dry run was done and there is nothing to launch."""
