"""Checkpoints that never lose work: sharded DCP saves, atomic completion, exact resume.

The Checkpointer takes the registry of Stateful objects (``states.build_states``) and knows
nothing else about training. A save writes step-N.partial and renames it to step-N only once
every rank's shards and the sidecar are on disk, so a kill at any moment leaves the previous
checkpoint as the latest. Old checkpoints are deleted only after a newer one is complete.

This module saves and holds the state of a save in flight; ``loading`` loads, and
``lifecycle`` renames and deletes the step-N folders.
"""

from __future__ import annotations

import copy
import logging
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from titanlite.checkpoint import formats, loading
from titanlite.checkpoint.dcp_state import failure_cause, lost_collective, split_state
from titanlite.checkpoint.folders import complete_checkpoints, write_sidecar
from titanlite.checkpoint.integrity import ChecksummingWriter
from titanlite.checkpoint.lifecycle import StepFolders
from titanlite.checkpoint.loading import (
    DamagedCheckpoint,
    ModelIdentity,
    resume_path,
    will_load_weights,
)
from titanlite.config.job_config import Checkpoint as CheckpointConfig
from titanlite.dtypes import DTYPES
from titanlite.errors import UserError

# The loading names are imported from here too (the trainer, the tests): one face for a run.
__all__ = ["Checkpointer", "DamagedCheckpoint", "ModelIdentity", "resume_path", "will_load_weights"]

logger = logging.getLogger(__name__)

HF_FOLDER = "hf"
"""Where a checkpoint holds its Hugging Face folder (checkpoint.last_save_in_hf, save_format)."""


class Checkpointer:
    def __init__(
        self,
        states: dict[str, Stateful],
        cfg: CheckpointConfig,
        folder: Path,
        identity: ModelIdentity,
        *,
        sidecar_fields: dict[str, Any],
        is_main: bool,
        write_files: Callable[[Path], dict[str, Any]] | None = None,
    ):
        self.states = states
        self.cfg = cfg
        self.folder = folder
        self.identity = identity
        self.sidecar_fields = sidecar_fields
        self.is_main = is_main
        # Rank 0 writes these files into every checkpoint (the tokenizer, so a checkpoint is
        # self-contained); the fields it returns join the sidecar.
        self.write_files = write_files
        self._pending: tuple[Future, Path, Path, dict[str, Any], float] | None = None
        # Rank 0's finishing of a save (sidecar, tokenizer, rename, retention) on a thread of
        # its own, so training goes on meanwhile; joined before the next save and at the end.
        self._finisher: ThreadPoolExecutor | None = None
        self._finishing: Future | None = None
        # Background saves talk over their own group so they never interleave with the
        # training step's collectives.
        self._async_group = dist.new_group(backend="gloo") if cfg.async_mode == "async" else None
        self._step_folders = StepFolders(folder)
        if is_main and folder.is_dir():  # what a killed run left, before anyone looks
            self._step_folders.clean_up_leftovers()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # no rank looks for checkpoints before rank 0 put a step-N back

    def load(self) -> bool:
        """Resume from this run's latest checkpoint (or load initial_load_path). True when
        training state (not just weights) was restored."""
        return loading.load(self.states, self.cfg, self.folder, self.identity)

    # ------------------------------------------------------------------ saving
    def should_save(self, step: int, last: bool) -> bool:
        return self.cfg.enable and (last or step % self.cfg.interval == 0)

    def save(self, step: int, last: bool = False, force_sync: bool = False) -> None:
        """Save this step (collective: every rank calls it). Without ``force_sync`` it may
        return before the checkpoint is complete: rank 0 finishes it in the background (and,
        with async_mode, every rank writes it there); ``wait`` or ``close`` complete it."""
        self.wait()  # one save in flight at a time; finishes the previous one
        final = self.folder / f"step-{step}"
        partial = self.folder / f"step-{step}.partial"
        if self.is_main:
            if partial.exists():
                shutil.rmtree(partial)  # left by a killed save
            partial.mkdir(parents=True)
        dist.barrier()
        start = time.perf_counter()
        model_only = last and self.cfg.last_save_model_only
        tensors, sidecar = self._snapshot(step, model_only)
        if (last and self.cfg.last_save_in_hf) or self.cfg.save_format == "dcp+hf":
            self._write_hf(partial / HF_FOLDER)
        writer = ChecksummingWriter(str(partial))
        if self.cfg.async_mode == "async" and not force_sync:
            future = dcp.async_save(tensors, storage_writer=writer, process_group=self._async_group)
            self._pending = (future, partial, final, sidecar, start)
            logger.info(
                "checkpoint: step %d staged in %.2f s, writing in the background",
                step,
                time.perf_counter() - start,
            )
        else:
            try:
                dcp.save(tensors, storage_writer=writer)
            except (Exception, CheckpointException) as e:  # a BaseException; see _write_failed
                raise self._write_failed(partial, e) from None
            if force_sync:  # a preemption save: complete before the process exits
                self._finish(partial, final, sidecar, start)
            else:
                self._finish_in_background(partial, final, sidecar, start)

    def _write_hf(self, folder: Path) -> None:
        """The model as a Hugging Face folder inside the checkpoint (every rank writes its
        part; the checkpoint's rename makes it visible with the rest)."""
        if self.is_main:
            folder.mkdir()
        dist.barrier()
        formats.FORMATS[formats.HUGGING_FACE].write(
            self.states["model"].state_dict(),
            folder,
            model_name=self.identity.name,
            model_args=self.identity.args,
            tokenizer=self.sidecar_fields.get("tokenizer_source"),
            dtype=DTYPES[self.cfg.export_dtype],
        )

    def _snapshot(self, step: int, model_only: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        """(tensors for DCP, sidecar fields): each state split into its tensor and plain parts."""
        keys = ["model"] if model_only else list(self.states)
        tensors: dict[str, Any] = {}
        plain: dict[str, Any] = {}
        for key in keys:
            tensors[key], rest = split_state(self.states[key].state_dict())
            if rest:
                plain[key] = rest
        if model_only:
            dtype = DTYPES[self.cfg.export_dtype]
            tensors["model"] = {k: v.to(dtype) for k, v in tensors["model"].items()}
        sidecar = {
            "step": step,
            "model_only": model_only,
            "model_name": self.identity.name,
            "model_args": self.identity.args,
            **self.sidecar_fields,
            **loading.base_fields(self.states, self.cfg, model_only),
            "checksum_ranks": dist.get_world_size(),  # __0 .. __N-1.sha256.json (integrity)
            "time": time.time(),
            "states": copy.deepcopy(plain),  # written later, while training changes the states
        }
        return tensors, sidecar

    def poll(self) -> None:
        """Take the next step of a save in flight if it is ready, without waiting (cheap; call
        every step): a background write that is done is handed to rank 0's finishing, and a
        finishing that failed raises here."""
        if self._finishing is not None and self._finishing.done():
            self._join_finishing()
        if self._pending is not None and self._pending[0].done():
            self._collect_write(background=True)

    def wait(self) -> None:
        """Complete the save in flight, if any: its write, then rank 0's finishing."""
        self._join_finishing()
        if self._pending is not None:
            self._collect_write(background=False)

    def _collect_write(self, background: bool) -> None:
        future, partial, final, sidecar, start = self._pending
        self._pending = None
        try:
            future.result()
        except (Exception, CheckpointException) as e:
            raise self._write_failed(partial, e) from None
        if background:
            self._finish_in_background(partial, final, sidecar, start)
        else:
            self._finish(partial, final, sidecar, start)

    def _finish_in_background(self, *args: Any) -> None:
        """``_finish`` on rank 0's finishing thread (one at a time: the previous is joined)."""
        if not self.is_main:
            return
        self._join_finishing()
        if self._finisher is None:
            self._finisher = ThreadPoolExecutor(1, thread_name_prefix="titanlite-finish")
        self._finishing = self._finisher.submit(self._finish, *args)

    def _join_finishing(self) -> None:
        """Wait for rank 0's finishing in flight; its error, if it failed, is raised here."""
        finishing, self._finishing = self._finishing, None
        if finishing is not None:
            finishing.result()

    def _write_failed(self, partial: Path, error: BaseException) -> BaseException:
        """The one-line error for a save that failed (every rank gets DCP's exception): the
        cause (a full disk said plainly), and that the previous checkpoint is intact. Rank 0
        removes the partial folder, which is never loaded, to give the space back. A rank lost
        during the save is not the checkpoint's failure: its collective's error is returned, for
        the trainer to name the lost rank (the partial folder stays, replaced by the next save)."""
        lost = lost_collective(error)
        if lost is not None:
            return lost
        done = complete_checkpoints(self.folder)
        needed = sum(f.stat().st_size for f in done[-1][1].iterdir()) if done else 0
        try:
            free = shutil.disk_usage(partial.parent).free
        except OSError:
            free = -1
        cause = failure_cause(error)
        if "No space left" in cause or (needed and 0 <= free < needed):
            cause = f"no space left on the device ({free / 2**20:.0f} MiB free"
            cause += f", a checkpoint takes about {needed / 2**20:.0f} MiB)" if needed else ")"
            cause += "; free some space or lower checkpoint.keep_latest_k"
        if self.is_main:
            shutil.rmtree(partial, ignore_errors=True)
        intact = (
            f"the previous checkpoint, step {done[-1][0]}, is intact: run the same command "
            "to resume from it"
            if done
            else "no earlier checkpoint exists"
        )
        name = partial.name.removesuffix(".partial")
        return UserError(f"checkpoint {name} could not be written: {cause}; {intact}")

    def _finish(self, partial: Path, final: Path, sidecar: dict[str, Any], start: float) -> None:
        """Rank 0 marks the checkpoint complete once DCP returned: all shards and the
        metadata are written by then (``StepFolders.commit``: what a kill leaves)."""
        if not self.is_main:
            return
        if self.write_files is not None:
            sidecar = {**sidecar, **self.write_files(partial)}
        write_sidecar(partial, sidecar)
        self._step_folders.commit(partial, final)
        self._step_folders.retire(self.cfg.keep_latest_k)
        logger.info("checkpoint: saved %s in %.2f s", final, time.perf_counter() - start)

    def close(self, abandon: bool = False) -> None:
        """Finish the save in flight and the background deletions. ``abandon`` (a rank is
        lost): do not wait for a write, which would wait for that rank; rank 0's finishing
        needs no other rank and still completes (its failure is logged, not raised, so that
        the error that ended the run is the one reported)."""
        try:
            if not abandon:
                self.wait()
            else:
                try:
                    self._join_finishing()
                except Exception as e:
                    logger.error("checkpoint: finishing the last save failed: %s", e)
        finally:
            if self._finisher is not None:
                self._finisher.shutdown(wait=True)
                self._finisher = None
            self._step_folders.close()
