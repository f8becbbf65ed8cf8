"""Loading a checkpoint into a run's states: which checkpoint a run starts from, the checks
made before any tensor is read (the model, the checksums, the tensors present), and the read.

Loading never unpickles arbitrary objects: plain state is JSON, and DCP's pickled metadata is
read with an allow-list (``safe_reader``). Tensors are stored by name with their global
shapes, so a checkpoint loads into any layout (DCP reshards).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from titanlite.checkpoint import formats, integrity
from titanlite.checkpoint.dcp_state import failure_cause, merge_state, tensors_in
from titanlite.checkpoint.folders import (
    complete_checkpoints,
    model_name,
    plain_states,
    read_sidecar,
)
from titanlite.checkpoint.safe_reader import SafeFileSystemReader
from titanlite.config.job_config import Checkpoint as CheckpointConfig
from titanlite.errors import UserError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelIdentity:
    """What a checkpoint must match to be loaded: the family and its args (as a dict)."""

    name: str
    args: dict[str, Any]


class DamagedCheckpoint(UserError):
    """A checkpoint whose files fail their checksums or that DCP cannot read."""


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


def will_load_weights(cfg: CheckpointConfig, folder: Path) -> bool:
    """Whether loading at start-up overwrites every weight (so initializing them is wasted)."""
    path = resume_path(cfg, folder)
    if path is not None:
        if read_sidecar(path).get("adapters_only"):  # the frozen base: loaded, or the seed's
            return bool(cfg.initial_load_path)
        return "model" not in cfg.exclude_from_loading
    return cfg.enable and bool(cfg.initial_load_path)


def base_fields(states: dict[str, Stateful], cfg: CheckpointConfig, model_only: bool) -> dict:
    """Sidecar fields of a checkpoint that holds only the trained weights of a model with
    frozen ones (LoRA): that it does, and the base they were loaded from (None: the seed's)."""
    model = states["model"]
    if model_only or not getattr(model, "frozen", False):
        return {}
    return {"adapters_only": True, "base": _resolved(cfg.initial_load_path), **model.adapters()}


def _resolved(path: str) -> str | None:
    return str(Path(path).resolve()) if path else None


def _load_base(
    states: dict[str, Stateful], cfg: CheckpointConfig, identity: ModelIdentity, folder: Path
) -> None:
    """The frozen weights of a model with trained adapters, from checkpoint.initial_load_path
    (a Hugging Face folder or a titanlite checkpoint): the weights only."""
    path = Path(cfg.initial_load_path)
    view = {"model": states["model"].base_view()}
    foreign = formats.recognized(path)
    if foreign is not None:
        reader = foreign.open_reader(path, identity.name, identity.args)
        _read(view, reader, ["model"], path=path, plain={})
    else:
        _load(view, path, ["model"], identity=identity, folder=folder)
    logger.info("frozen base weights from %s", path)


def load(
    states: dict[str, Stateful], cfg: CheckpointConfig, folder: Path, identity: ModelIdentity
) -> bool:
    """Resume ``states`` from the latest checkpoint in ``folder`` (or load initial_load_path);
    collective. True when training state (not just weights) was restored."""
    path = resume_path(cfg, folder)
    if path is not None:
        meta = read_sidecar(path)
        if meta.get("adapters_only"):
            if meta.get("base") != _resolved(cfg.initial_load_path):
                raise UserError(
                    f"checkpoint folder {str(path)!r} holds adapters trained on the base "
                    f"{meta.get('base')!r}; this run's checkpoint.initial_load_path is "
                    f"{cfg.initial_load_path!r} (set it to that base)"
                )
            if cfg.initial_load_path:
                _load_base(states, cfg, identity, folder)
        keys = [k for k in states if k not in cfg.exclude_from_loading]
        while True:
            try:
                _load(states, path, keys, identity=identity, folder=folder)
                break
            except DamagedCheckpoint as e:
                earlier = None if cfg.load_step >= 0 else _previous(path, folder)
                if not cfg.fallback_to_previous or earlier is None:
                    raise
                logger.warning(
                    "%s; loading %s instead (checkpoint.fallback_to_previous)", e, earlier.name
                )
                path = earlier
        logger.info("resumed from %s (step %d)", path, read_sidecar(path)["step"])
        return True
    if cfg.enable and cfg.initial_load_path:
        if getattr(states["model"], "frozen", False):  # a base to train adapters on
            _load_base(states, cfg, identity, folder)
            return False
        path = Path(cfg.initial_load_path)
        foreign = formats.recognized(path)
        if foreign is not None:  # a Hugging Face folder: the weights, read where they go
            reader = foreign.open_reader(path, identity.name, identity.args)
            _read(states, reader, ["model"], path=path, plain={})
            logger.info("initialized from %s (%s, weights only)", path, foreign.name)
            return False
        model_only = cfg.initial_load_model_only or read_sidecar(path).get("model_only")
        keys = ["model"] if model_only else list(states)
        _load(states, path, keys, identity=identity, folder=folder)
        logger.info("initialized from %s%s", path, " (weights only)" if model_only else "")
        return not model_only
    return False


def _load(
    states: dict[str, Stateful],
    path: Path,
    keys: list[str],
    *,
    identity: ModelIdentity,
    folder: Path,
) -> None:
    """Load the ``keys`` of ``states`` from the checkpoint at ``path`` (``folder``: the run's
    checkpoint folder, where an earlier checkpoint to suggest is looked for)."""
    meta = read_sidecar(path)
    _check_model(path, meta, identity)
    if meta.get("model_only", False):
        keys = [k for k in keys if k == "model"]
    _verify(path, meta, folder)
    _read(states, SafeFileSystemReader(str(path)), keys, path=path, plain=plain_states(meta))


def _read(
    states: dict[str, Stateful], reader: Any, keys: list[str], *, path: Path, plain: dict
) -> None:
    """Load the ``keys`` of ``states`` through a DCP ``reader`` of the folder ``path``
    (``plain``: the states' non-tensor parts, from the sidecar)."""
    try:
        saved = reader.read_metadata().state_dict_metadata  # refuse a bad one here
    except UserError:
        raise
    except Exception as e:  # unreadable, or refused: DCP would log a traceback
        raise UserError(f"checkpoint folder {str(path)!r}: unreadable .metadata ({e})") from None
    tensors: dict[str, Any] = {}
    for key in keys:
        template, missing = tensors_in(states[key].state_dict(), key, saved)
        if missing and not getattr(states[key], "partial_ok", False):
            raise UserError(
                f"checkpoint folder {str(path)!r} has no tensor {missing[0]!r}"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            )
        tensors[key] = template
    try:
        dcp.load(tensors, storage_reader=reader)
    except (Exception, CheckpointException) as e:  # a BaseException; the cause helps
        raise DamagedCheckpoint(
            f"checkpoint folder {str(path)!r} is unreadable: {failure_cause(e)}"
        ) from None
    for key in keys:
        try:
            states[key].load_state_dict(merge_state(tensors[key], plain.get(key)))
        except (KeyError, TypeError, ValueError, UserError) as e:
            raise UserError(
                f"checkpoint folder {str(path)!r}: its {key} state does not fit this run ({e})"
            ) from None


def _verify(path: Path, meta: dict[str, Any], folder: Path) -> None:
    """Check the shard files against their saved checksums before loading any of them, each
    rank a share; a damaged checkpoint is a one-line error naming a bad file and the previous
    complete checkpoint (collective: every rank calls it)."""
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
    earlier = [s for s, p in complete_checkpoints(folder) if s < step and p != path]
    hint = (
        f"; the previous complete checkpoint is step {earlier[-1]}: resume from it with "
        f"--checkpoint.load_step {earlier[-1]} (or always: checkpoint.fallback_to_previous)"
        if earlier and path.parent == folder
        else ""
    )
    raise DamagedCheckpoint(f"checkpoint folder {str(path)!r} is damaged: {found[0]}{hint}")


def _previous(path: Path, folder: Path) -> Path | None:
    """The newest complete training checkpoint in ``folder`` older than ``path``."""
    if path.parent != folder:
        return None
    step = int(read_sidecar(path).get("step", -1))
    earlier = [
        p
        for s, p in complete_checkpoints(folder)
        if s < step and not read_sidecar(p).get("model_only", False)
    ]
    return earlier[-1] if earlier else None


def _check_model(path: Path, meta: dict[str, Any], identity: ModelIdentity) -> None:
    """A checkpoint of another model is refused by name, before DCP sees it."""
    saved_name = model_name(meta)
    if saved_name != identity.name:
        raise UserError(
            f"checkpoint folder {str(path)!r} holds a {saved_name} model, this run trains "
            f"{identity.name}"
        )
    saved = meta.get("model_args", {})
    diffs = [
        f"{k}={saved.get(k)!r} (this run: {v!r})"
        for k, v in identity.args.items()
        if k != "max_seq_len" and saved.get(k) != v
    ]
    if diffs:
        raise UserError(
            f"checkpoint folder {str(path)!r} holds a different model: {', '.join(diffs)}"
        )
