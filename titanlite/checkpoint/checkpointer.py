"""Checkpoints that never lose work: sharded DCP saves, atomic completion, exact resume.

The Checkpointer takes the registry of Stateful objects (``states.build_states``) and knows
nothing else about training. A save writes step-N.partial and renames it to step-N only once
every rank's shards and the sidecar are on disk, so a kill at any moment leaves the previous
checkpoint as the latest. Old checkpoints are deleted only after a newer one is complete.

Tensors are stored by name with their global shapes, so a checkpoint loads into any layout
(DCP reshards). Loading never unpickles arbitrary objects: plain state is JSON, and DCP's
pickled metadata is read with an allow-list (``safe_reader``).
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from titanlite.checkpoint import integrity
from titanlite.checkpoint.folders import (
    STEP_DIR,
    complete_checkpoints,
    fsync_dir,
    is_complete,
    model_name,
    plain_states,
    read_sidecar,
    write_sidecar,
)
from titanlite.checkpoint.integrity import ChecksummingWriter
from titanlite.checkpoint.safe_reader import SafeFileSystemReader
from titanlite.config.job_config import Checkpoint as CheckpointConfig
from titanlite.dtypes import DTYPES
from titanlite.errors import UserError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelIdentity:
    """What a checkpoint must match to be loaded: the family and its args (as a dict)."""

    name: str
    args: dict[str, Any]


def resume_path(cfg: CheckpointConfig, folder: Path) -> Path | None:
    """The checkpoint a run with this config resumes from (None: a fresh start)."""
    if not cfg.enable:
        return None
    # A model-only export has no training state to continue from.
    found = [
        (step, path)
        for step, path in complete_checkpoints(folder)
        if not read_sidecar(path).get("model_only", False)
    ]
    if cfg.load_step >= 0:
        for step, path in found:
            if step == cfg.load_step:
                return path
        raise UserError(
            f"checkpoint.load_step {cfg.load_step}: no complete checkpoint "
            f"{folder / f'step-{cfg.load_step}'}"
        )
    return found[-1][1] if found else None


class DamagedCheckpoint(UserError):
    """A checkpoint whose files fail their checksums or that DCP cannot read."""


DELETING = ".deleting"
"""Suffix of a checkpoint being removed by retention: renamed first (so it is no longer a
step-N folder and can never be loaded), then deleted in the background."""

STALE = ".stale"
"""Suffix of the step-N folder a save of the same step replaces (after a load_step rewind),
renamed aside for the moment between the two renames that swap the new one in."""


def will_load_weights(cfg: CheckpointConfig, folder: Path) -> bool:
    """Whether loading at start-up overwrites every weight (so initializing them is wasted)."""
    if resume_path(cfg, folder) is not None:
        return "model" not in cfg.exclude_from_loading
    return cfg.enable and bool(cfg.initial_load_path)


class Checkpointer:
    def __init__(
        self,
        states: dict[str, Stateful],
        cfg: CheckpointConfig,
        folder: Path,
        identity: ModelIdentity,
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
        # Rank 0 deletes retired checkpoints on a thread of its own (a 405B checkpoint is
        # hundreds of files on a shared filesystem); leftovers of a killed run go first.
        self._deleter: ThreadPoolExecutor | None = None
        if is_main and folder.is_dir():
            self._clean_up_leftovers()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # no rank looks for checkpoints before rank 0 put a step-N back

    def _clean_up_leftovers(self) -> None:
        """Rank 0, at start-up: what a killed run left. A step-N.stale (a save killed while
        swapping a new step-N in) goes back to step-N when that is missing (the kill came
        between the two renames: the stale folder is the only complete copy), and is deleted
        when step-N is complete; step-N.deleting folders are deleted."""
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
            fsync_dir(self.folder)
        for doomed in sorted(self.folder.glob(f"step-*{DELETING}")):
            self._delete(doomed)

    # ------------------------------------------------------------------ loading
    def load(self) -> bool:
        """Resume from this run's latest checkpoint (or load initial_load_path). True when
        training state (not just weights) was restored."""
        path = resume_path(self.cfg, self.folder)
        if path is not None:
            keys = [k for k in self.states if k not in self.cfg.exclude_from_loading]
            while True:
                try:
                    self._load(path, keys)
                    break
                except DamagedCheckpoint as e:
                    earlier = self._previous(path)
                    if not self.cfg.fallback_to_previous or earlier is None:
                        raise
                    logger.warning(
                        "%s; loading %s instead (checkpoint.fallback_to_previous)", e, earlier.name
                    )
                    path = earlier
            logger.info("resumed from %s (step %d)", path, read_sidecar(path)["step"])
            return True
        if self.cfg.enable and self.cfg.initial_load_path:
            path = Path(self.cfg.initial_load_path)
            model_only = self.cfg.initial_load_model_only or read_sidecar(path).get("model_only")
            self._load(path, ["model"] if model_only else list(self.states))
            logger.info("initialized from %s%s", path, " (weights only)" if model_only else "")
            return not model_only
        return False

    def _load(self, path: Path, keys: list[str]) -> None:
        meta = read_sidecar(path)
        self._check_model(path, meta)
        if meta.get("model_only", False):
            keys = [k for k in keys if k == "model"]
        self._verify(path, meta)
        reader = SafeFileSystemReader(str(path))
        try:
            saved = reader.read_metadata().state_dict_metadata  # refuse a bad one here
        except Exception as e:  # unreadable, or refused: DCP would log a traceback
            raise UserError(
                f"checkpoint folder {str(path)!r}: unreadable .metadata ({e})"
            ) from None
        plain = plain_states(meta)
        tensors: dict[str, Any] = {}
        for key in keys:
            template, missing = _tensors_in(self.states[key].state_dict(), key, saved)
            if missing and not getattr(self.states[key], "partial_ok", False):
                raise UserError(
                    f"checkpoint folder {str(path)!r} has no tensor {missing[0]!r}"
                    + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                )
            tensors[key] = template
        try:
            dcp.load(tensors, storage_reader=reader)
        except (Exception, CheckpointException) as e:  # a BaseException; the cause helps
            raise DamagedCheckpoint(
                f"checkpoint folder {str(path)!r} is unreadable: {_cause(e)}"
            ) from None
        for key in keys:
            try:
                self.states[key].load_state_dict(_merge(tensors[key], plain.get(key)))
            except (KeyError, TypeError, ValueError, UserError) as e:
                raise UserError(
                    f"checkpoint folder {str(path)!r}: its {key} state does not fit this run ({e})"
                ) from None

    def _verify(self, path: Path, meta: dict[str, Any]) -> None:
        """Check the shard files against their saved checksums before loading any of them,
        each rank a share; a damaged checkpoint is a one-line error naming a bad file and
        the previous complete checkpoint (collective: every rank calls it)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        step = int(meta.get("step", -1))
        found = integrity.problems(path, meta.get("checksum_ranks"), rank, world)[:1]
        if world > 1:
            group = dist.new_group(backend="gloo")  # objects over the CPU, whatever the device
            everyone: list[list[str]] = [[] for _ in range(world)]
            dist.all_gather_object(everyone, found, group=group)
            dist.destroy_process_group(group)
            found = [p for part in everyone for p in part]
        if not found:
            return
        earlier = [s for s, p in complete_checkpoints(self.folder) if s < step and p != path]
        hint = (
            f"; the previous complete checkpoint is step {earlier[-1]}: resume from it with "
            f"--checkpoint.load_step {earlier[-1]} (or always: checkpoint.fallback_to_previous)"
            if earlier and path.parent == self.folder
            else ""
        )
        raise DamagedCheckpoint(f"checkpoint folder {str(path)!r} is damaged: {found[0]}{hint}")

    def _previous(self, path: Path) -> Path | None:
        """The newest complete training checkpoint of this run older than ``path``."""
        if path.parent != self.folder or self.cfg.load_step >= 0:
            return None
        step = int(read_sidecar(path).get("step", -1))
        earlier = [
            p for s, p in complete_checkpoints(self.folder)
            if s < step and not read_sidecar(p).get("model_only", False)
        ]  # fmt: skip
        return earlier[-1] if earlier else None

    def _check_model(self, path: Path, meta: dict[str, Any]) -> None:
        """A checkpoint of another model is refused by name, before DCP sees it."""
        saved_name = model_name(meta)
        if saved_name != self.identity.name:
            raise UserError(
                f"checkpoint folder {str(path)!r} holds a {saved_name} model, this run trains "
                f"{self.identity.name}"
            )
        saved = meta.get("model_args", {})
        diffs = [
            f"{k}={saved.get(k)!r} (this run: {v!r})"
            for k, v in self.identity.args.items()
            if k != "max_seq_len" and saved.get(k) != v
        ]
        if diffs:
            raise UserError(
                f"checkpoint folder {str(path)!r} holds a different model: {', '.join(diffs)}"
            )

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
        writer = ChecksummingWriter(str(partial))
        if self.cfg.async_mode == "async" and not force_sync:
            future = dcp.async_save(tensors, storage_writer=writer, process_group=self._async_group)
            self._pending = (future, partial, final, sidecar, start)
            logger.info(
                "checkpoint: step %d staged in %.2f s, writing in the background",
                step, time.perf_counter() - start,
            )  # fmt: skip
        else:
            try:
                dcp.save(tensors, storage_writer=writer)
            except (Exception, CheckpointException) as e:  # a BaseException; see _write_failed
                raise self._write_failed(partial, e) from None
            if force_sync:  # a preemption save: complete before the process exits
                self._finish(partial, final, sidecar, start)
            else:
                self._finish_in_background(partial, final, sidecar, start)

    def _snapshot(self, step: int, model_only: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        """(tensors for DCP, sidecar fields): each state split into its tensor and plain parts."""
        keys = ["model"] if model_only else list(self.states)
        tensors: dict[str, Any] = {}
        plain: dict[str, Any] = {}
        for key in keys:
            tensors[key], rest = _split(self.states[key].state_dict())
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

    def _write_failed(self, partial: Path, error: BaseException) -> UserError:
        """The one-line error for a save that failed (every rank gets DCP's exception): the
        cause (a full disk said plainly), and that the previous checkpoint is intact. Rank 0
        removes the partial folder, which is never loaded, to give the space back."""
        done = complete_checkpoints(self.folder)
        needed = sum(f.stat().st_size for f in done[-1][1].iterdir()) if done else 0
        try:
            free = shutil.disk_usage(partial.parent).free
        except OSError:
            free = -1
        cause = _cause(error)
        if "No space left" in cause or (needed and 0 <= free < needed):
            cause = f"no space left on the device ({free / 2**20:.0f} MiB free"
            cause += f", a checkpoint takes about {needed / 2**20:.0f} MiB)" if needed else ")"
            cause += "; free some space or lower checkpoint.keep_latest_k"
        if self.is_main:
            shutil.rmtree(partial, ignore_errors=True)
        intact = (f"the previous checkpoint, step {done[-1][0]}, is intact: run the same command "
                  "to resume from it" if done else "no earlier checkpoint exists")  # fmt: skip
        name = partial.name.removesuffix(".partial")
        return UserError(f"checkpoint {name} could not be written: {cause}; {intact}")

    def _finish(self, partial: Path, final: Path, sidecar: dict[str, Any], start: float) -> None:
        """Rank 0 marks the checkpoint complete once DCP returned: all shards and the
        metadata are written by then. A kill before the rename leaves step-N.partial (never
        loaded); one between the two renames of a swap leaves step-N.stale, which the next
        start-up puts back (``_clean_up_leftovers``)."""
        if not self.is_main:
            return
        if self.write_files is not None:
            sidecar = {**sidecar, **self.write_files(partial)}
        write_sidecar(partial, sidecar)
        if final.exists():  # an abandoned run's step-N (after a load_step rewind)
            stale = final.with_name(final.name + STALE)
            shutil.rmtree(stale, ignore_errors=True)
            os.replace(final, stale)
            os.replace(partial, final)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            os.replace(partial, final)
        fsync_dir(final.parent)
        self._apply_retention()
        logger.info("checkpoint: saved %s in %.2f s", final, time.perf_counter() - start)

    def _apply_retention(self) -> None:
        """Retire all but the newest keep_latest_k checkpoints: each is renamed at once (it
        stops being a checkpoint before any of its files goes), then deleted in the background."""
        keep = self.cfg.keep_latest_k
        if keep <= 0:
            return
        retired = complete_checkpoints(self.folder)[:-keep]
        for _, path in retired:
            doomed = path.with_name(path.name + DELETING)
            shutil.rmtree(doomed, ignore_errors=True)
            os.replace(path, doomed)
            logger.info("checkpoint: removing %s (keep_latest_k=%d)", path, keep)
        if retired:
            fsync_dir(self.folder)
        for _, path in retired:
            self._delete(path.with_name(path.name + DELETING))

    def _delete(self, doomed: Path) -> None:
        if self._deleter is None:
            self._deleter = ThreadPoolExecutor(1, thread_name_prefix="titanlite-retention")
        self._deleter.submit(shutil.rmtree, doomed, True)

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
            for pool in (self._finisher, self._deleter):
                if pool is not None:
                    pool.shutdown(wait=True)
            self._finisher = self._deleter = None


def _split(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensor leaves, every other leaf) of a nested dict, each keeping the nesting."""
    tensors: dict[str, Any] = {}
    plain: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            t, p = _split(v)
            if t:
                tensors[k] = t
            if p:
                plain[k] = p
        elif isinstance(v, torch.Tensor):
            tensors[k] = v
        else:
            plain[k] = v
    return tensors, plain


def _merge(tensors: dict[str, Any], plain: dict[str, Any] | None) -> dict[str, Any]:
    out = dict(plain or {})
    for k, v in tensors.items():
        out[k] = _merge(v, out.get(k)) if isinstance(v, dict) else v
    return out


def _tensors_in(state: dict[str, Any], prefix: str, saved: dict[str, Any]) -> tuple[dict, list]:
    """The tensor part of ``state`` that the checkpoint holds (DCP names nested keys with
    dots), and the names of the tensors it lacks."""
    tensors, _ = _split(state)
    missing: list[str] = []

    def keep(tree: dict[str, Any], path: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in tree.items():
            name = f"{path}.{k}"
            if isinstance(v, dict):
                sub = keep(v, name)
                if sub:
                    out[k] = sub
            elif name in saved:
                size = getattr(saved[name], "size", None)
                if _is_blob(v) and size is not None and tuple(size) != tuple(v.shape):
                    v = torch.empty(size, dtype=torch.uint8)  # a byte blob: the saved length
                out[k] = v
            else:
                missing.append(name)
        return out

    return keep(tensors, prefix), missing


def _is_blob(value: Any) -> bool:
    """A 1-D uint8 tensor: serialized bytes (a rank's own data position, RNG state) whose
    length may differ between the saving and the loading run."""
    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1


def _cause(e: BaseException) -> str:
    """First line of the error behind a DCP failure (CheckpointException holds one per rank)."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
