"""titanlite checkpoints in one process, without training: load a model (generation,
export), write a model-only checkpoint (import). Works without a process group."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from titanlite import models
from titanlite.checkpoint.dcp_state import failure_cause
from titanlite.checkpoint.folders import SIDECAR, model_name, read_sidecar, write_sidecar
from titanlite.checkpoint.safe_reader import SafeFileSystemReader
from titanlite.data.tokenizer import Tokenizer, load_tokenizer
from titanlite.errors import UserError
from titanlite.interop.folders import atomic_folder, check_output_folder, quiet_single_process
from titanlite.models.spec import ModelSpec

logger = logging.getLogger(__name__)

_CHECKPOINT_FILES = re.compile(
    r"^(\.metadata|.*\.distcp|titanlite\.json|tokenizer\.model|tokenizer\.json|tokenizer_config\.json)$"
)


@dataclasses.dataclass
class CheckpointModel:
    model: nn.Module
    spec: ModelSpec
    args: Any
    meta: dict[str, Any]


def spec_and_args(meta: Mapping[str, Any], where: str) -> tuple[ModelSpec, Any]:
    """The family and args a sidecar (or export marker) records; UserError if unusable."""
    name = model_name(dict(meta))
    if name not in models.REGISTRY:
        raise UserError(f"{where}: unknown model family {name!r}")
    spec = models.get(name)
    try:
        return spec, spec.args_from_dict(meta["model_args"])
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{where}: {SIDECAR} has no usable model_args ({e})") from None


def checkpoint_tokenizer(
    meta: Mapping[str, Any],
    override: str | os.PathLike[str] | None,
    vocab_size: int,
    folder: str | os.PathLike[str] | None = None,
) -> Tokenizer:
    """The tokenizer given on the command line, else the one titanlite.json names (a file
    inside the checkpoint ``folder``, or, for older checkpoints, a path of its own); a
    UserError when neither is usable or it has more tokens than the model."""
    path = override or meta.get("tokenizer")
    if not path:
        raise UserError("the checkpoint names no tokenizer: pass --tokenizer PATH")
    if override is None and folder is not None and (Path(folder) / path).is_file():
        path = Path(folder) / path
    if override is None and not Path(path).exists():
        raise UserError(
            f"tokenizer {str(path)!r} named by the checkpoint is not found from "
            f"{os.getcwd()!r}: pass --tokenizer PATH"
        )
    tokenizer = load_tokenizer(path)
    if tokenizer.vocab_size > vocab_size:
        raise UserError(
            f"tokenizer {str(path)!r} has {tokenizer.vocab_size} tokens, the model {vocab_size}"
        )
    return tokenizer


def load_checkpoint_model(path: str | os.PathLike[str], ema: bool = False) -> CheckpointModel:
    """The model (float32, CPU, eval mode) of a titanlite checkpoint folder, with its spec,
    args and titanlite.json; with ``ema`` its parameters are the checkpoint's average of the
    weights (training.ema_decay) instead of the weights. Optimizer and other training state
    in the folder are not read. UserError for incomplete or unusable folders."""
    path = Path(path)
    meta = read_sidecar(path)
    spec, args = spec_and_args(meta, str(path))
    # Built untied (to_empty would untie anyway) and tied again below once both are loaded.
    with torch.device("meta"):
        model = spec.build(dataclasses.replace(args, tie_embeddings=False))
    model.to_empty(device="cpu")
    spec.init_buffers(model)
    try:
        saved = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as e:  # unreadable, or refused: not one of DCP's own metadata classes
        raise UserError(f"checkpoint folder {str(path)!r}: unreadable .metadata ({e})") from None
    tied_name, owner_name = spec.tied_weights
    if ema and not any(key.startswith("ema.") for key in saved):
        raise UserError(
            f"checkpoint folder {str(path)!r} holds no average of the weights (its run had no "
            "training.ema_decay)"
        )
    params = {name for name, _ in model.named_parameters()}
    state: dict[str, dict[str, torch.Tensor]] = {"model": {}, "ema": {}}
    for name, tensor in model.state_dict().items():
        key = "ema" if ema and name in params else "model"  # buffers are the model's
        info = saved.get(f"{key}.{name}")
        if info is None:
            if name == tied_name and args.tie_embeddings:
                continue  # tied: the embedding is the output projection
            raise UserError(f"checkpoint folder {str(path)!r} has no tensor {key}.{name}")
        size = tuple(getattr(info, "size", ()))
        if size != tuple(tensor.shape):
            raise UserError(
                f"checkpoint folder {str(path)!r}: {key}.{name} has shape {list(size)}, "
                f"model_args in {SIDECAR} give {list(tensor.shape)}"
            )
        state[key][name] = tensor
    with quiet_single_process():
        try:
            wanted = {key: tensors for key, tensors in state.items() if tensors}
            dcp.load(wanted, storage_reader=SafeFileSystemReader(str(path)))
        except (Exception, CheckpointException) as e:  # a BaseException: a damaged shard's
            first = failure_cause(e)  # the first line of what broke
            first = (first.split("] ", 1)[-1] if first.startswith("[") else first).split(". ")[0]
            raise UserError(f"checkpoint folder {str(path)!r} is unreadable: {first}") from None
    if args.tie_embeddings:
        output, embedding = model.get_parameter(tied_name), model.get_parameter(owner_name)
        if tied_name in state["ema" if ema else "model"] and not torch.equal(output, embedding):
            # Trained untied despite the flag: keep both so the function is unchanged.
            logger.warning("%s: tied model with distinct output weights; loading untied", path)
            args = dataclasses.replace(args, tie_embeddings=False)
        else:
            model.get_submodule(tied_name.rpartition(".")[0]).weight = embedding
    model.args = args
    model.eval()
    logger.info("loaded %s (step %s)", path, meta.get("step"))
    return CheckpointModel(model, spec, args, meta)


def save_model_checkpoint(
    state: Mapping[str, torch.Tensor],
    spec: ModelSpec,
    args: Any,
    out: str | os.PathLike[str],
    *,
    tokenizer: Tokenizer | None = None,
    source: str = "",
) -> Path:
    """Write a model-only titanlite checkpoint (DCP "model" + titanlite.json) to ``out``,
    atomically; a tokenizer given is copied in (tokenizer.model, or tokenizer.json and its
    tokenizer_config.json) and named by titanlite.json."""
    out = Path(out)
    check_output_folder(out, _CHECKPOINT_FILES, SIDECAR, key="source")
    with atomic_folder(out) as tmp:
        with quiet_single_process():
            dcp.save({"model": dict(state)}, storage_writer=FileSystemWriter(str(tmp)))
        tokenizer_path = None
        if tokenizer is not None:
            tokenizer_path = tokenizer.copy_files(tmp).name  # relative: the folder can move
        write_sidecar(
            tmp,
            {
                "step": 0,
                "model_only": True,
                "model_name": spec.name,
                "model_args": dataclasses.asdict(args),
                "tokenizer": tokenizer_path,
                "time": time.time(),
                "source": source,
            },
        )
    return out
