"""A Hugging Face folder read straight into a run's sharded model, each rank reading only what
it holds: a DCP ``StorageReader`` whose metadata names the run's tensors.

torch.distributed.checkpoint plans the load as for a titanlite checkpoint (any layout: FSDP,
TP, PP, EP, CP; DCP computes each rank's boxes of each tensor) and asks this reader for those
boxes. The family's adapter (``models/<family>/hf.py``) says how HF tensors become
titanlite's; run once on meta tensors (no data) it shows which titanlite tensors are an HF
tensor renamed (most of them: returned as the very same object). Those are read as lazy
slices (``safe_open(...).get_slice``): a rank reads exactly its box from the file. The others
(tensors an adapter computes: Llama's RoPE row permutation, stacked experts, fused
projections, dequantized FP8 and MXFP4 weights) are computed one layer at a time: the
adapter runs again with that layer's inputs read whole and every other input on meta, and
the rank keeps its boxes of the results. So a rank holds its share of the model plus at
most one layer's computed tensors, never the whole model.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from titanlite import models
from titanlite.errors import UserError
from titanlite.interop import fp8, mxfp4
from titanlite.interop.hf import read_hf_model, safetensors_files

logger = logging.getLogger(__name__)

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
PREFIX = "model"
"""The state key the run's model weights load under (``checkpoint.keys``)."""


def open_reader(path: Path, model_name: str, model_args: dict[str, Any]) -> HFReader:
    """The reader of the HF folder ``path`` for a run training ``model_name`` with
    ``model_args`` (its args as a dict: the folder's, with the run's sequence length)."""
    spec = models.get(model_name)
    _, _, config = read_hf_model(path)
    return HFReader(Path(path), spec, spec.args_cls(**model_args), config)


class HFReader(StorageReader):
    def __init__(self, path: Path, spec: Any, args: Any, config: dict[str, Any]):
        super().__init__()
        self.path, self.args, self.config = path, args, config
        self.adapter = spec.hf_adapter()
        self.files: dict[str, Path] = {}  # HF name -> its file
        self.metas: dict[str, torch.Tensor] = {}  # HF name -> a meta tensor of its shape
        for file in safetensors_files(path):
            with _opened(file) as f:
                for name in f.keys():
                    piece = f.get_slice(name)
                    dtype = _DTYPES.get(piece.get_dtype())
                    if dtype is None:
                        raise UserError(
                            f"safetensors file {str(file)!r}: tensor {name!r} has type "
                            f"{piece.get_dtype()}, which titanlite does not read"
                        )
                    self.files[name] = file
                    self.metas[name] = torch.empty(piece.get_shape(), dtype=dtype, device="meta")
        converted = self._convert(dict(self.metas))
        by_id = {id(t): name for name, t in self.metas.items()}
        self.renamed = {n: by_id[id(t)] for n, t in converted.items() if id(t) in by_id}
        self.shapes = {n: tuple(t.shape) for n, t in converted.items()}
        self.computed_from = sorted(set(self.metas) - set(self.renamed.values()))
        self.metadata = Metadata(
            state_dict_metadata={
                f"{PREFIX}.{name}": TensorStorageMetadata(
                    TensorProperties(dtype=torch.float32),
                    torch.Size(shape),
                    [ChunkStorageMetadata(torch.Size([0] * len(shape)), torch.Size(shape))],
                )
                for name, shape in self.shapes.items()
            }
        )
        logger.info(
            "%s: %d tensors read as slices, %d computed layer by layer",
            path,
            len(self.renamed),
            len(self.shapes) - len(self.renamed),
        )

    def _convert(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The adapter's titanlite tensors of HF ``state`` (quantized weights dequantized)."""
        state = mxfp4.dequantize(fp8.dequantize(state, self.config))
        return self.adapter.from_hf_state_dict(state, self.args)

    # ------------------------------------------------------------------ StorageReader
    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        wanted: dict[str, list[ReadItem]] = defaultdict(list)
        for item in plan.items:
            wanted[item.storage_index.fqn.removeprefix(f"{PREFIX}.")].append(item)
        for name in [n for n in wanted if n in self.renamed]:
            # One opening per tensor: the file's pages this rank touched are let go (munmap)
            # before the next tensor, so they never add up to more than one tensor's boxes.
            with _opened(self.files[self.renamed[name]]) as f:
                piece = f.get_slice(self.renamed[name])
                for item in wanted.pop(name):
                    _deliver(planner, item, _read_box(piece, item))
        if wanted:
            self._compute(wanted, planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _compute(self, wanted: dict[str, list[ReadItem]], planner: LoadPlanner) -> None:
        """Deliver the computed tensors ``wanted``, one layer's inputs read at a time (this
        rank's layers first); whatever no single layer gives, from every input at once."""
        layers = {layer_of(name) for name in wanted}
        groups: dict[int, list[str]] = defaultdict(list)
        for name in self.computed_from:
            groups[layer_of(name)].append(name)
        order = sorted(groups, key=lambda g: (g not in layers, g))
        for group in [*order, None]:
            if not wanted:
                return
            names = self.computed_from if group is None else groups[group]
            state = dict(self.metas)
            state.update(self._read_whole(names))
            try:
                converted = self._convert(state)
            except RuntimeError:  # an output mixing this layer's inputs and others' (meta)
                continue
            for name, tensor in converted.items():
                if name in wanted and tensor.device.type != "meta":
                    for item in wanted.pop(name):
                        _deliver(planner, item, _box(tensor, item))
            del state, converted
        if wanted:
            raise UserError(f"{self.path}: could not compute {sorted(wanted)[0]!r}")

    def _read_whole(self, names: list[str]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        by_file: dict[Path, list[str]] = defaultdict(list)
        for name in names:
            by_file[self.files[name]].append(name)
        for file, in_file in by_file.items():
            with _opened(file) as f:
                out.update({name: f.get_tensor(name) for name in in_file})
        return out


def layer_of(name: str) -> int:
    """The block a tensor name belongs to (-1: outside the blocks)."""
    match = _LAYER.search(name)
    return int(match.group(1)) if match else -1


def _read_box(piece: Any, item: ReadItem) -> torch.Tensor:
    """The item's box of a lazy safetensors slice: only those bytes are read."""
    offsets, lengths = item.storage_offsets, item.lengths
    boxes = tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))
    return piece[boxes] if boxes else piece[:]


def _box(tensor: torch.Tensor, item: ReadItem) -> torch.Tensor:
    for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
        tensor = tensor.narrow(dim, offset, length)
    return tensor


def _deliver(planner: LoadPlanner, item: ReadItem, tensor: torch.Tensor) -> None:
    target = planner.resolve_tensor(item).detach()
    if target.shape != tensor.shape:
        raise UserError(
            f"tensor {item.storage_index.fqn!r}: the folder gives shape {list(tensor.shape)}, "
            f"the model needs {list(target.shape)}"
        )
    target.copy_(tensor)
    planner.commit_tensor(item, target)


class _opened:
    """safe_open as a context manager whose errors are one line."""

    def __init__(self, file: Path):
        self.file = file

    def __enter__(self) -> Any:
        from safetensors import SafetensorError, safe_open

        try:
            self.handle = safe_open(str(self.file), framework="pt")
        except (SafetensorError, OSError) as e:
            raise UserError(f"safetensors file {str(self.file)!r} is unreadable ({e})") from None
        return self.handle.__enter__()

    def __exit__(self, *exc: Any) -> Iterator[None] | None:
        return self.handle.__exit__(*exc)
