"""A thin sentencepiece wrapper: the only tokenizer titanlite needs.

Any sentencepiece ``.model`` works (the shipped one, or a Llama 2 / Mistral ``tokenizer.model``):
the special ids come from the model itself and ``pad_id`` is -1 when the model has none.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import sentencepiece as spm

from titanlite.errors import UserError

DEFAULT_TOKENIZER_PATH = Path(__file__).resolve().parent.parent / "assets" / "tokenizer.model"


def default_num_threads() -> int:
    """Encoding threads: the cores this process may use, capped so that several ranks on one
    node do not oversubscribe the CPU."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


class Tokenizer:
    """Encode text to token ids and back with a sentencepiece model file."""

    def __init__(self, path: str | os.PathLike[str], num_threads: int | None = None) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise UserError(f"tokenizer file {str(self.path)!r} does not exist or is not a file")
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(str(self.path))
        except (RuntimeError, OSError) as exc:
            raise UserError(
                f"tokenizer file {str(self.path)!r} is not a sentencepiece model "
                f"({type(exc).__name__}); give the path of a sentencepiece .model file"
            ) from None
        self.num_threads = num_threads or default_num_threads()
        self.vocab_size: int = self._sp.vocab_size()
        self.bos_id: int = self._sp.bos_id()
        self.eos_id: int = self._sp.eos_id()
        self.pad_id: int = self._sp.pad_id()
        self.unk_id: int = self._sp.unk_id()
        # Identifies the model's content (not its path): a loader state made with one
        # tokenizer must not be resumed with another.
        self.fingerprint: str = hashlib.sha256(self._sp.serialized_model_proto()).hexdigest()[:16]

    def _flags(self, bos: bool, eos: bool) -> dict[str, bool]:
        # sentencepiece refuses add_bos/add_eos for a model without that token: skip it instead.
        return {"add_bos": bos and self.bos_id >= 0, "add_eos": eos and self.eos_id >= 0}

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        """Token ids of ``text``, with BOS first and EOS last when asked (and the model has them)."""
        return self._sp.encode(text, **self._flags(bos, eos))

    def encode_batch(
        self, texts: Sequence[str], bos: bool = True, eos: bool = True
    ) -> list[list[int]]:
        """``[encode(t, bos, eos) for t in texts]``, computed on ``num_threads`` threads."""
        return self._sp.encode(list(texts), num_threads=self.num_threads, **self._flags(bos, eos))

    def encode_concat(self, texts: Sequence[str], bos: bool = True, eos: bool = True) -> np.ndarray:
        """All ``texts`` encoded and concatenated into one int32 array (the packing input)."""
        if not texts:
            return np.empty(0, dtype=np.int32)
        arrays = self._sp.encode_as_numpy(
            list(texts), num_threads=self.num_threads, **self._flags(bos, eos)
        )
        return np.concatenate(arrays).astype(np.int32, copy=False)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of ``ids``; control tokens (BOS, EOS, pad) decode to nothing."""
        return self._sp.decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"
