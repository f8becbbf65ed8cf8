"""The renames and deletions of a run's step-N folders, done by rank 0 alone.

A finished save is renamed from step-N.partial to step-N (swapping out an abandoned run's
step-N through step-N.stale); all but the newest keep_latest_k checkpoints are retired (renamed
to step-N.deleting at once, deleted in the background); at start-up, what a killed run left
is put back or removed. Each rename is made durable before the next step relies on it.

Plain Python: no torch.
"""

from __future__ import annotations

import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from titanlite.checkpoint.folders import STEP_DIR, complete_checkpoints, is_complete
from titanlite.files import fsync

logger = logging.getLogger(__name__)

DELETING = ".deleting"
"""Suffix of a checkpoint being removed by retention: renamed first (so it is no longer a
step-N folder and can never be loaded), then deleted in the background."""

STALE = ".stale"
"""Suffix of the step-N folder a save of the same step replaces (after a load_step rewind),
renamed aside for the moment between the two renames that swap the new one in."""


class StepFolders:
    """The step-N folders of one run's checkpoint folder, as rank 0 changes them."""

    def __init__(self, folder: Path):
        self.folder = folder
        # Retired checkpoints are deleted on a thread of its own (a 405B checkpoint is
        # hundreds of files on a shared filesystem).
        self._deleter: ThreadPoolExecutor | None = None

    def clean_up_leftovers(self) -> None:
        """At start-up: what a killed run left. A step-N.stale (a save killed while swapping a
        new step-N in) goes back to step-N when that is missing (the kill came between the two
        renames: the stale folder is the only complete copy), and is deleted when step-N is
        complete; step-N.deleting folders are deleted."""
        renamed = False
        for stale in sorted(self.folder.glob(f"step-*{STALE}")):
            final = stale.with_name(stale.name.removesuffix(STALE))
            if not (STEP_DIR.match(final.name) and stale.is_dir()):
                continue
            if not final.exists() and is_complete(stale):
                os.replace(stale, final)
                logger.warning("checkpoint: %s put back as %s (a save was killed)", stale, final)
            elif is_complete(final) or not is_complete(stale):
                doomed = stale.with_name(stale.name + DELETING)
                shutil.rmtree(doomed, ignore_errors=True)
                os.replace(stale, doomed)
            else:  # the only complete copy, beside a damaged step-N: for a person to decide
                logger.warning("checkpoint: leaving %s (%s is not complete)", stale, final)
                continue
            renamed = True
        if renamed:
            fsync(self.folder)
        for doomed in sorted(self.folder.glob(f"step-*{DELETING}")):
            self._delete(doomed)

    def commit(self, partial: Path, final: Path) -> None:
        """Make the complete save in ``partial`` the checkpoint ``final``. A kill before the
        rename leaves step-N.partial (never loaded); one between the two renames of a swap
        leaves step-N.stale, which ``clean_up_leftovers`` puts back."""
        if final.exists():  # an abandoned run's step-N (after a load_step rewind)
            stale = final.with_name(final.name + STALE)
            shutil.rmtree(stale, ignore_errors=True)
            os.replace(final, stale)
            os.replace(partial, final)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            os.replace(partial, final)
        fsync(final.parent)
        # Any other step-M.partial is a save killed before (one save is in flight at a time).
        # A later save of M would replace it, but a run may never save M again (a replica
        # group that healed past M, a timed save): retired as an old checkpoint is.
        leftovers = [p for p in self.folder.glob("step-*.partial") if p.is_dir()]
        for path in leftovers:
            doomed = path.with_name(path.name + DELETING)
            shutil.rmtree(doomed, ignore_errors=True)
            os.replace(path, doomed)
            logger.info("checkpoint: removing %s (a save that was killed)", path)
        if leftovers:
            fsync(self.folder)
        for path in leftovers:
            self._delete(path.with_name(path.name + DELETING))

    def retire(self, keep: int) -> None:
        """Retire all but the newest ``keep`` checkpoints (0 keeps all): each is renamed at once
        (it stops being a checkpoint before any of its files goes), then deleted in the
        background."""
        if keep <= 0:
            return
        retired = complete_checkpoints(self.folder)[:-keep]
        for _, path in retired:
            doomed = path.with_name(path.name + DELETING)
            shutil.rmtree(doomed, ignore_errors=True)
            os.replace(path, doomed)
            logger.info("checkpoint: removing %s (keep_latest_k=%d)", path, keep)
        if retired:
            fsync(self.folder)
        for _, path in retired:
            self._delete(path.with_name(path.name + DELETING))

    def _delete(self, doomed: Path) -> None:
        if self._deleter is None:
            self._deleter = ThreadPoolExecutor(1, thread_name_prefix="titanlite-retention")
        self._deleter.submit(shutil.rmtree, doomed, True)

    def close(self) -> None:
        """Wait for the background deletions."""
        if self._deleter is not None:
            self._deleter.shutdown(wait=True)
            self._deleter = None
