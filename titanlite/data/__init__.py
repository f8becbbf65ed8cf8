"""Data layer: sentencepiece tokenizer, text sources and the packed, resumable loader.

The loader (which needs torch) is imported on first use, so that the launcher's preflight
can check a tokenizer through this package without paying for `import torch`.
"""

from typing import Any

from titanlite.data.spec import DataSpec
from titanlite.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer, load_tokenizer

_LOADER_NAMES = ("IGNORE_INDEX", "PackedLoader", "build_dataloader")

__all__ = ["DEFAULT_TOKENIZER_PATH", "DataSpec", "Tokenizer", "load_tokenizer", *_LOADER_NAMES]


def __getattr__(name: str) -> Any:
    if name in _LOADER_NAMES:
        from titanlite.data import loader

        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
