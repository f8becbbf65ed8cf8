"""Formats of model weights other than titanlite's own checkpoints, handed in from above.

The checkpoint room reads and writes DCP folders and knows no other format; ``interop`` (which
imports this room) knows Hugging Face folders. ``titanlite.components`` registers interop's
format here, so that a run's ``checkpoint.initial_load_path`` may be such a folder and a save
may also write one. The functions are named as "module:function" and imported on first use
(this module, like the registration, needs no torch).

A format provides:

- ``recognizes(path) -> bool``;
- ``reader``: ``(path, model_name, model_args) -> StorageReader``, a DCP reader whose metadata
  names the run's model tensors ("model.<name>", global shapes) and that reads, per rank, only
  the parts the load plan asks for;
- ``writer``: ``(state, folder, *, model_name, model_args, tokenizer, dtype) -> None``, the
  model state (DTensors as the run holds them) written into ``folder``, every rank taking
  part (collective).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Format:
    name: str
    recognizes: Callable[[Path], bool]
    reader: str
    writer: str

    def open_reader(self, path: Path, model_name: str, model_args: dict[str, Any]) -> Any:
        return _function(self.reader)(path, model_name, model_args)

    def write(self, state: dict[str, Any], folder: Path, **fields: Any) -> None:
        _function(self.writer)(state, folder, **fields)


HUGGING_FACE = "Hugging Face folder"
"""The name interop's format registers under (a save writes it by this name)."""
FORMATS: dict[str, Format] = {}


def register(fmt: Format) -> None:
    FORMATS[fmt.name] = fmt


def recognized(path: Path) -> Format | None:
    """The registered format whose folder ``path`` is, if any."""
    return next((f for f in FORMATS.values() if f.recognizes(path)), None)


def _function(target: str) -> Callable[..., Any]:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)
