"""Checkpoints that never lose work: sharded DCP saves, atomic completion, exact resume.

On disk, under job.dump_folder/checkpoint.folder:

    step-N/            a complete checkpoint
      .metadata, *.distcp   torch.distributed.checkpoint: every tensor, sharded as trained
      titanlite.json   everything else (plain JSON): step, tokens seen, model shape, LR
                       schedule, data-loader position, RNG, optimizer hyper-parameters
    step-N.partial/    a save in progress (or killed); never loaded, removed on the next save

A save writes step-N.partial and renames it to step-N only once every rank's shards and
the metadata are on disk, so a kill at any moment leaves the previous checkpoint as the
latest. Old checkpoints are deleted only after a newer one is complete.

Tensors are stored by parameter name with their global shapes, so a checkpoint loads into
any layout (DCP reshards). Loading never unpickles arbitrary objects: the non-tensor state
is JSON, and DCP's pickled metadata file is read with an allow-list of its own classes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import re
import shutil
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titanlite.config import JobConfig
from titanlite.errors import UserError

logger = logging.getLogger(__name__)

FORMAT = 1
SIDECAR = "titanlite.json"
STEP_DIR = re.compile(r"^step-(\d+)$")
# Exit status after saving on SIGTERM/SIGUSR1 (EX_TEMPFAIL: "try again later"); SLURM
# scripts requeue the job on it.
EXIT_PREEMPTED = 75


# --------------------------------------------------------------------------- safe reading
_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib._local", "PosixPath"),  # where the class lives on Python 3.13+
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's .metadata but refuses any class outside DCP's own metadata types."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            (module, name) in _ALLOWED_GLOBALS
            or module == "torch.distributed.checkpoint.metadata"
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        )
        if not allowed:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = Path(self.path) / ".metadata"
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        # DCP torch.load(weights_only=False)s the data of "bytes" entries; titanlite saves
        # only tensors, so any such entry is a crafted checkpoint.
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                raise pickle.UnpicklingError(f"refusing to load pickled object {fqn!r}")
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# --------------------------------------------------------------------------- folders
def is_complete(path: Path) -> bool:
    return (path / ".metadata").is_file() and (path / SIDECAR).is_file()


def complete_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint in folder, oldest first."""
    if not folder.is_dir():
        return []
    found = []
    for child in folder.iterdir():
        match = STEP_DIR.match(child.name)
        if match and child.is_dir():
            if is_complete(child):
                found.append((int(match.group(1)), child))
            else:
                logger.warning("ignoring %s: not a complete checkpoint", child)
    return sorted(found)


def read_sidecar(path: Path) -> dict[str, Any]:
    """The checkpoint's titanlite.json, or a UserError naming the folder."""
    if not path.is_dir():
        raise UserError(f"checkpoint folder {str(path)!r} does not exist")
    if not is_complete(path):
        raise UserError(
            f"checkpoint folder {str(path)!r} is not a complete titanlite checkpoint "
            f"(needs .metadata and {SIDECAR})"
        )
    try:
        meta = json.loads((path / SIDECAR).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"checkpoint folder {str(path)!r}: {SIDECAR} is unreadable ({e})") from None
    found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
    if found != FORMAT:
        raise UserError(
            f"checkpoint folder {str(path)!r}: unknown format {found!r} "
            f"(this titanlite reads format {FORMAT})"
        )
    return meta


# --------------------------------------------------------------------------- checkpointer
@dataclasses.dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0


class Checkpointer:
    """Saves and restores model, optimizer, LR schedule, data position, RNG and train state."""

    def __init__(
        self,
        cfg: JobConfig,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler,
        dataloader: Any,
        train_state: TrainState,
        model_args: Any,
        is_main: bool,
    ):
        self.cfg = cfg.checkpoint
        self.full_cfg = cfg
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.dataloader = dataloader
        self.train_state = train_state
        self.model_args = dataclasses.asdict(model_args)
        self.is_main = is_main
        self.folder = Path(cfg.job.dump_folder) / self.cfg.folder
        self._pending: tuple[Future, Path, Path, dict[str, Any], float] | None = None
        # Background saves talk over their own group so they never interleave with the
        # training step's collectives.
        self._async_group = (
            dist.new_group(backend="gloo") if self.cfg.async_mode == "async" else None
        )

    # ------------------------------------------------------------------ loading
    def load(self) -> bool:
        """Resume from this run's latest checkpoint (or load initial_load_path). True when
        training state (not just weights) was restored."""
        if not self.cfg.enable:
            return False
        path = self._resume_path()
        if path is not None:
            self._load(path, model_only=False, exclude=set(self.cfg.exclude_from_loading))
            logger.info("resumed from %s (step %d)", path, self.train_state.step)
            return True
        if self.cfg.initial_load_path:
            path = Path(self.cfg.initial_load_path)
            model_only = self.cfg.initial_load_model_only
            self._load(path, model_only=model_only, exclude=set())
            logger.info("initialized from %s%s", path, " (weights only)" if model_only else "")
            return not model_only
        return False

    def _resume_path(self) -> Path | None:
        # A model-only export has no training state to continue from.
        found = [
            (step, path)
            for step, path in complete_checkpoints(self.folder)
            if not read_sidecar(path).get("model_only", False)
        ]
        if self.cfg.load_step >= 0:
            for step, path in found:
                if step == self.cfg.load_step:
                    return path
            raise UserError(
                f"checkpoint.load_step {self.cfg.load_step}: no complete checkpoint "
                f"{self.folder / f'step-{self.cfg.load_step}'}"
            )
        return found[-1][1] if found else None

    def _load(self, path: Path, model_only: bool, exclude: set[str]) -> None:
        meta = read_sidecar(path)
        self._check_model(path, meta)
        model_only = model_only or meta.get("model_only", False)
        load_optimizer = not model_only and "optimizer" not in exclude
        if load_optimizer:
            _init_optimizer_state(self.model, self.optimizer)
        tensors: dict[str, Any] = {}
        if "model" not in exclude:
            tensors["model"] = get_model_state_dict(self.model)
        if load_optimizer:
            # Hyper-parameters (param_groups) come from this run's config, not the checkpoint,
            # so a resume with another --optimizer.lr or weight decay takes effect.
            current = get_optimizer_state_dict(self.model, self.optimizer)
            tensors["optimizer"] = {"state": current["state"]}
        reader = SafeFileSystemReader(str(path))
        try:
            reader.read_metadata()  # refuse a bad .metadata here: DCP would log a traceback
            dcp.load(tensors, storage_reader=reader)
        except (Exception, CheckpointException) as e:  # a BaseException; the cause helps
            raise UserError(f"checkpoint folder {str(path)!r} is unreadable: {_cause(e)}") from None
        if "model" in tensors:
            set_model_state_dict(self.model, tensors["model"])
        if load_optimizer:
            set_optimizer_state_dict(
                self.model,
                self.optimizer,
                {"state": tensors["optimizer"]["state"], "param_groups": current["param_groups"]},
            )
        if model_only:
            return
        try:
            self._load_plain_state(meta, exclude)
        except UserError as e:
            raise UserError(f"checkpoint folder {str(path)!r}: {e}") from None

    def _load_plain_state(self, meta: dict[str, Any], exclude: set[str]) -> None:
        if "lr_scheduler" not in exclude:
            self._load_lr_scheduler(meta["lr_scheduler"])
        if "dataloader" not in exclude:
            self.dataloader.load_state_dict(meta["dataloader"])
        if "train_state" not in exclude:
            self.train_state.step = int(meta["train_state"]["step"])
            self.train_state.tokens_seen = int(meta["train_state"]["tokens_seen"])
        torch.set_rng_state(torch.tensor(meta["rng"], dtype=torch.uint8))

    def _load_lr_scheduler(self, state: dict[str, Any]) -> None:
        """The schedule's position from the checkpoint; its peak LR from this run's config.

        torch's scheduler state also restores the old base LRs; keeping the configured ones
        makes `--optimizer.lr` on a resume take effect (and changes nothing when unchanged).
        """
        base_lrs = list(self.lr_scheduler.base_lrs)
        self.lr_scheduler.load_state_dict(state)
        self.lr_scheduler.base_lrs = base_lrs
        epoch = self.lr_scheduler.last_epoch
        for group, base, factor in zip(
            self.optimizer.param_groups, base_lrs, self.lr_scheduler.lr_lambdas, strict=True
        ):
            group["lr"] = base * factor(epoch)
        self.lr_scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def _check_model(self, path: Path, meta: dict[str, Any]) -> None:
        """A checkpoint of another model shape is refused by name, before DCP sees it."""
        saved = meta.get("model_args", {})
        diffs = [
            f"{k}={saved.get(k)!r} (this run: {v!r})"
            for k, v in self.model_args.items()
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
        """Save this step (collective: every rank calls it)."""
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
        tensors, sidecar = self._state(model_only)
        writer = FileSystemWriter(str(partial))
        if self.cfg.async_mode == "async" and not force_sync:
            future = dcp.async_save(tensors, storage_writer=writer, process_group=self._async_group)
            self._pending = (future, partial, final, sidecar, start)
            logger.info(
                "checkpoint: step %d staged in %.2f s, writing in the background",
                step, time.perf_counter() - start,
            )  # fmt: skip
        else:
            dcp.save(tensors, storage_writer=writer)
            self._finish(partial, final, sidecar, start)

    def poll(self) -> None:
        """Complete a background save if it has finished (cheap; call every step)."""
        if self._pending is not None and self._pending[0].done():
            self.wait()

    def wait(self) -> None:
        if self._pending is None:
            return
        future, partial, final, sidecar, start = self._pending
        self._pending = None
        future.result()
        self._finish(partial, final, sidecar, start)

    def _finish(self, partial: Path, final: Path, sidecar: dict[str, Any], start: float) -> None:
        """Rank 0 marks the checkpoint complete once DCP returned: all shards and the
        metadata are written by then."""
        if self.is_main:
            _write_json(partial / SIDECAR, sidecar)
            if final.exists():  # an abandoned run's step-N (after a load_step rewind)
                stale = final.with_name(final.name + ".stale")
                shutil.rmtree(stale, ignore_errors=True)
                os.replace(final, stale)
                os.replace(partial, final)
                shutil.rmtree(stale, ignore_errors=True)
            else:
                os.replace(partial, final)
            _fsync_dir(final.parent)
            self._apply_retention()
            logger.info("checkpoint: saved %s in %.2f s", final, time.perf_counter() - start)

    def _state(self, model_only: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        model_sd = get_model_state_dict(self.model)
        sidecar: dict[str, Any] = {
            "format": FORMAT,
            "step": self.train_state.step,
            "model_only": model_only,
            "model_args": self.model_args,
            "tokenizer": self.full_cfg.model.tokenizer_path,
            "time": time.time(),
        }
        if model_only:
            dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.cfg.export_dtype]
            return {"model": {k: v.to(dtype) for k, v in model_sd.items()}}, sidecar
        optim_sd = get_optimizer_state_dict(
            self.model, self.optimizer, options=StateDictOptions(flatten_optimizer_state_dict=False)
        )
        sidecar.update(
            train_state=dataclasses.asdict(self.train_state),
            lr_scheduler=self.lr_scheduler.state_dict(),
            dataloader=self.dataloader.state_dict(),
            rng=torch.get_rng_state().tolist(),
        )
        return {"model": model_sd, "optimizer": {"state": optim_sd["state"]}}, sidecar

    def _apply_retention(self) -> None:
        keep = self.cfg.keep_latest_k
        if keep <= 0:
            return
        for _, path in complete_checkpoints(self.folder)[:-keep]:
            shutil.rmtree(path, ignore_errors=True)
            logger.info("checkpoint: removed %s (keep_latest_k=%d)", path, keep)

    def close(self) -> None:
        self.wait()


def _init_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors (lazy in torch) so DCP can load into them:
    one step with zero gradients and a zero learning rate changes no weight."""
    if optimizer.state:
        return
    saved_lrs = [g["lr"] for g in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, saved_lrs, strict=True):
        group["lr"] = lr


def _cause(e: BaseException) -> str:
    """First line of the error behind a DCP failure (CheckpointException holds one per rank)."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
