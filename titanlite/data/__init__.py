"""Data layer: tokenizers, text sources, pre-tokenized folders, mixtures, and the loaders
over them (one interface, ``Loader``; one builder, ``titanlite.data.build``).

The loaders (which need torch) are imported on first use, so that the launcher's preflight
can check a tokenizer through this package without paying for `import torch`.

May import: ``config``, ``errors``, ``files``, ``paths``.
"""

from typing import Any

from titanlite.data.spec import DataSpec
from titanlite.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer, load_tokenizer

_LOADER_NAMES = {  # name -> the module it lives in (imported on first use: it needs torch)
    "IGNORE_INDEX": "batches",
    "Loader": "base",
    "PackedLoader": "loader",
    "build_dataloader": "build",
    "build_training_data": "build",
}

__all__ = ["DEFAULT_TOKENIZER_PATH", "DataSpec", "Tokenizer", "load_tokenizer", *_LOADER_NAMES]


def __getattr__(name: str) -> Any:
    if name in _LOADER_NAMES:
        import importlib

        return getattr(importlib.import_module(f"titanlite.data.{_LOADER_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
