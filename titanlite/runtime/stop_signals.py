"""The signals that ask a trainer process to stop, recorded from its first moments.

SIGTERM and SIGUSR1 (preemption) and SIGINT (Ctrl-C) each ask the run to stop at the next
step boundary; ``titanlite.runtime.stop_vote`` makes every rank stop at the same step. This module
is torch-free so that ``titanlite.train`` installs it before importing torch: a Ctrl-C during
those seconds must become the same orderly stop, not a KeyboardInterrupt traceback.

A second Ctrl-C stops at once, without saving. Who delivers it decides how:

- Started directly (run_train.sh with one process execs the trainer): the terminal sends
  SIGINT to the trainer itself. The first one restores SIGINT's default action, so the
  second ends the process in the kernel at once, whatever the main thread is blocked in (a
  collective, a checkpoint write): exactly as safe for the checkpoints as SIGKILL.
- Through run_train.sh's torchrun path (``PIDS_ENV`` set): the trainers run in sessions of
  their own (torchrun starts them so) and get no terminal signal. run_train.sh relays Ctrl-C
  to the pids the trainers list in that file once their handlers are in place, so one
  pressed during start-up still arrives, and ends them with SIGKILL on the second. SLURM
  signals every process of a job step, so there a trainer can get one interrupt twice
  (directly and relayed): in this mode every SIGINT only asks for the stop.

A trainer must not outlive its launcher: under torchrun the kernel kills it when torchrun
dies (a parent-death signal), and when run_train.sh (``LAUNCHER_ENV``) is gone the trainer
stops as if Ctrl-C had been pressed.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time

logger = logging.getLogger(__name__)

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PIDS_ENV = "TITANLITE_INTERRUPT_PIDS"
"""File the trainers append their pid to, for run_train.sh to relay Ctrl-C (torchrun path)."""
LAUNCHER_ENV = "TITANLITE_LAUNCHER_PID"
"""run_train.sh's pid on its torchrun path: the trainers stop when it is gone."""
LAUNCHER_POLL_S = 1.0

_preempt: int | None = None  # the first preemption signal, None while there is none
_interrupted = False  # Ctrl-C (or the launcher is gone)
_process_set_up = False  # the pid registered, the launcher watched: once per process


def install() -> None:
    """Handle the stop signals in this process (call from the main thread). A signal already
    recorded is kept when the handlers in place are this module's (train.py installs them
    before the Trainer's vote does); otherwise this starts afresh."""
    global _preempt, _interrupted
    if signal.getsignal(signal.SIGTERM) is not _on_preempt:
        _preempt, _interrupted = None, False
    # SIGINT first: whoever sees the preemption handlers in place (the tests read SigCgt)
    # may count on Ctrl-C's being handled too.
    if not (_interrupted and not relayed()):  # else SIGINT's default is armed: keep it so
        signal.signal(signal.SIGINT, _on_interrupt)
    for sig in PREEMPT_SIGNALS:
        signal.signal(sig, _on_preempt)
    _set_up_process()


def relayed() -> bool:
    """Whether run_train.sh relays Ctrl-C to this trainer (its torchrun path)."""
    return bool(os.environ.get(PIDS_ENV))


def interrupted() -> bool:
    return _interrupted


def preempt_signal() -> int | None:
    return _preempt


def _on_preempt(signum: int, frame: object) -> None:
    global _preempt
    if _preempt is None:
        _preempt = signum


def _on_interrupt(signum: int, frame: object) -> None:
    global _interrupted
    if _interrupted:
        return
    _interrupted = True
    if not relayed():  # run_train.sh says it itself on its torchrun path
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # the second Ctrl-C ends the process
        logger.warning(
            "Ctrl-C: stopping at the end of this step (saving it when checkpoints are on); "
            "Ctrl-C again stops at once without saving"
        )


def _set_up_process() -> None:
    global _process_set_up
    if _process_set_up:
        return
    _process_set_up = True
    if "TORCHELASTIC_RUN_ID" in os.environ:
        _die_with_parent()
    pids = os.environ.get(PIDS_ENV)
    if pids:
        try:  # only now: a relayed SIGINT before the handler would be lost (ignored)
            with open(pids, "a") as f:
                f.write(f"{os.getpid()}\n")
        except OSError as e:
            logger.warning("Ctrl-C cannot be relayed to this trainer: %s: %s", pids, e)
    launcher = os.environ.get(LAUNCHER_ENV, "")
    if launcher.isdigit() and int(launcher) != os.getpid():
        threading.Thread(
            target=_watch_launcher, args=(int(launcher),), name="titanlite-launcher", daemon=True
        ).start()


def _die_with_parent() -> None:
    """torchrun starts each trainer in a session of its own: if torchrun is killed, nothing
    else would end the trainers. Linux kills this process when its parent dies."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # torchrun died before the request took effect
        os._exit(1)


def _watch_launcher(pid: int) -> None:
    global _interrupted
    while True:
        time.sleep(LAUNCHER_POLL_S)
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):  # gone (or its pid now another user's)
            break
    logger.warning("the launcher (run_train.sh, pid %d) is gone: stopping as on Ctrl-C", pid)
    _interrupted = True
