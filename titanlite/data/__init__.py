"""Data layer: sentencepiece tokenizer, text sources and the packed, resumable loader."""

from titanlite.data.loader import IGNORE_INDEX, PackedLoader, build_dataloader
from titanlite.data.spec import DataSpec
from titanlite.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer

__all__ = [
    "DEFAULT_TOKENIZER_PATH",
    "IGNORE_INDEX",
    "DataSpec",
    "PackedLoader",
    "Tokenizer",
    "build_dataloader",
]
