"""Batches from a pre-tokenized folder (titanlite.data.tokens), read by each rank for itself.

A split's tokens are cut into W non-overlapping windows of seq_len + 1 tokens. Global window k
(all ranks together, in order) is window ``permute(k mod W)`` of epoch ``k div W``, where the
permutation is a seeded Feistel network over the window numbers (a bijection computed per
index: no O(W) array). A step takes the next local_batch_size * dp windows and rank r reads
only its own local_batch_size of them from the memory-mapped shards, so a rank's cost per
batch does not depend on the data-parallel degree or the dataset's size. The saved position
is one integer, valid under any data-parallel degree: the tokens consumed of the train
stream, which is those windows end to end. Under a sequence-length ramp (``set_seq_len``) a
shorter window is the next tokens of that stream (a piece of one window, or the end of one
and the start of the next), so the ramped run reads exactly the tokens an unramped one does.
Validation reads the windows in order, one finite pass, the partial end padded as in the
text loader.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from titanlite.data.batches import padded_chunk
from titanlite.data.spec import SPLITS, DataSpec, Split
from titanlite.data.tokenizer import Tokenizer
from titanlite.data.tokens import TokenFolder
from titanlite.errors import UserError

logger = logging.getLogger(__name__)

STATE_FORMAT = 2
"""2: the position in tokens (``tokens_consumed``; a mixture also its stage's start). 1 (still
loaded): windows of seq_len + 1 tokens consumed."""
_ROUNDS = 4


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def permute(index: np.ndarray, n: int, key: int) -> np.ndarray:
    """A keyed pseudo-random bijection of [0, n), applied to each element of ``index``."""
    if n <= 1:
        return np.zeros_like(index, dtype=np.int64)
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    low = np.uint64((1 << half) - 1)
    keys = _mix(np.arange(1, _ROUNDS + 1, dtype=np.uint64) + np.uint64(key % (1 << 63)))
    x = index.astype(np.uint64)
    todo = np.ones(x.shape, dtype=bool)
    while todo.any():  # cycle-walking: the domain 2^(2 half) < 4n, so a few passes at most
        y = x[todo]
        left, right = y >> np.uint64(half), y & low
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & low)
        y = (left << np.uint64(half)) | right
        x[todo] = y
        todo[todo] = y >= np.uint64(n)
    return x.astype(np.int64)


class WindowCountState:
    """The saved position of a loader whose batches follow from a few counts alone (global
    windows consumed, and what ``_counts`` adds) plus the loader's ``_identity()``, which must
    match on resume."""

    _windows_consumed: int
    _resume_hint = "the same data"

    def _identity(self) -> dict[str, Any]:
        raise NotImplementedError

    def _counts(self) -> dict[str, Any]:
        return {}

    def _load_counts(self, state: dict[str, Any]) -> None:
        """The counts of ``_counts`` from ``state`` (after windows_consumed is set)."""

    def state_dict(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            **self._identity(),
            "windows_consumed": self._windows_consumed,
            **self._counts(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in self._identity().items():
            if state.get(key) != value:
                raise UserError(
                    f"data loader state does not match this run: {key} was {state.get(key)!r} "
                    f"when saved, now {value!r}; resume with {self._resume_hint} or start a "
                    "new run"
                )
        self._windows_consumed = int(state["windows_consumed"])
        self._load_counts(state)


class TokenLoader(WindowCountState):
    """Iterable of ``(inputs, labels)`` LongTensors ``[local_batch_size, seq_len]`` (the
    PackedLoader interface), over a folder written by scripts/pretokenize.py."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        spec: DataSpec,
        dp_rank: int,
        dp_world_size: int,
        *,
        split: Split,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if dp_world_size < 1 or not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"need 0 <= dp_rank < dp_world_size, got {dp_rank}, {dp_world_size}")
        self.folder = TokenFolder(spec.dataset_path, split)
        if self.folder.meta["tokenizer"] != tokenizer.fingerprint:
            raise UserError(
                f"{spec.dataset_path} was tokenized with another tokenizer "
                f"({self.folder.meta['tokenizer_path']}, "
                f"fingerprint {self.folder.meta['tokenizer']}) "
                f"than {str(tokenizer.path)!r}; use that tokenizer or pretokenize again"
            )
        fraction = self.folder.meta.get("validation_fraction")
        if split == "train" and fraction is not None and fraction != spec.validation_fraction:
            logger.warning(
                "%s: its held-out split was made at validation_fraction %s when it was "
                "pre-tokenized; this run's %s does not change it",
                spec.dataset_path,
                fraction,
                spec.validation_fraction,
            )
        self.spec, self.split = spec, split
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.window = spec.seq_len + 1
        self.num_windows = self.folder.num_tokens // self.window
        self.chunk = spec.local_batch_size * dp_world_size
        if split == "train" and self.num_windows < self.chunk:
            raise UserError(
                f"{spec.dataset_path}: the train split has {self.folder.num_tokens:,} tokens, "
                f"fewer than one global batch ({self.chunk} windows of {self.window})"
            )
        if self.folder.num_tokens < 2:
            raise UserError(f"{spec.dataset_path}: the {split} split has no tokens")
        self.infinite = spec.infinite and split == "train"
        pad = tokenizer.pad_id if tokenizer.pad_id >= 0 else max(tokenizer.eos_id, 0)
        self._input_pad_id = pad
        self._windows_consumed = 0  # global windows handed out, of any length
        self._tokens_consumed = 0  # of the stream, by all ranks together: the position
        self._cut = self.window  # tokens of the windows cut next (set_seq_len)

    def close(self) -> None:
        pass

    def set_seq_len(self, seq_len: int) -> None:
        """Windows of ``seq_len`` + 1 tokens from the next batch on (see ``Loader``)."""
        if not 1 <= seq_len <= self.spec.seq_len:
            raise ValueError(f"seq_len must be in [1, {self.spec.seq_len}], got {seq_len}")
        self._cut = seq_len + 1

    def __iter__(self) -> TokenLoader:
        if self.split == "validation":
            self._windows_consumed = self._tokens_consumed = 0
        return self

    def _window_ids(self, k: np.ndarray) -> np.ndarray:
        """The folder's window numbers of this split's windows ``k`` (0, 1, ... in order of
        use: shuffled per epoch for train, in order for validation)."""
        if self.split == "validation":
            return k
        epoch, within = np.divmod(k, self.num_windows)
        out = np.empty_like(k)
        for e in np.unique(epoch):  # a chunk spans at most two epochs
            key = int(_mix(np.array([self.spec.seed * 1_000_003 + int(e)], np.uint64))[0])
            mask = epoch == e
            out[mask] = permute(within[mask], self.num_windows, key)
        return out

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        b, cut, start = self.spec.local_batch_size, self._cut, self._tokens_consumed
        end_of_pass = start + self.chunk * cut > self.num_windows * self.window
        if end_of_pass and not self.infinite:
            if self.split == "validation" and start < self.folder.num_tokens - 1:
                return self._last_padded_batch()
            raise StopIteration
        first = start + self.dp_rank * b * cut
        rows = [self.read_span(first + i * cut, cut) for i in range(b)]
        self._windows_consumed += self.chunk
        self._tokens_consumed += self.chunk * cut
        mine = torch.from_numpy(np.stack(rows))
        return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()

    def read_span(self, start: int, count: int) -> np.ndarray:
        """Tokens ``[start, start + count)`` of this split's stream: its windows of seq_len + 1
        tokens end to end, in the order of ``_window_ids`` (shuffled per epoch for train)."""
        w = self.window
        first, last = start // w, (start + count - 1) // w
        ids = self._window_ids(np.arange(first, last + 1, dtype=np.int64))
        pieces = []
        for k, window in enumerate(ids.tolist(), start=first):
            begin, end = max(start, k * w), min(start + count, (k + 1) * w)
            pieces.append(self.folder.read(window * w + begin - k * w, end - begin))
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _last_padded_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        begin = self._tokens_consumed
        rest = torch.from_numpy(self.folder.read(begin, self.folder.num_tokens - begin))
        self._tokens_consumed = self.folder.num_tokens  # the pass is over
        self._windows_consumed += self.chunk
        b = self.spec.local_batch_size
        mine = slice(self.dp_rank * b, (self.dp_rank + 1) * b)
        return padded_chunk(rest, self.chunk, self.window, pad_id=self._input_pad_id, rows=mine)

    def describe(self) -> str:
        epoch = self._tokens_consumed // max(self.num_windows * self.window, 1)
        return (
            f"token folder {self.spec.dataset_path} ({self.split}): epoch {epoch}, "
            f"{self._windows_consumed:,} windows consumed (now of {self._cut} tokens; "
            f"{self.num_windows:,} of {self.window} per epoch)"
        )

    def _counts(self) -> dict[str, Any]:
        return {"tokens_consumed": self._tokens_consumed}

    def _load_counts(self, state: dict[str, Any]) -> None:
        whole_windows = self._windows_consumed * self.window  # format 1 saved no more
        self._tokens_consumed = int(state.get("tokens_consumed", whole_windows))

    def _identity(self) -> dict[str, Any]:
        return {
            "kind": "tokens",
            "folder": self.folder.id,
            "seq_len": self.spec.seq_len,
            "split": self.split,
            "seed": self.spec.seed,
        }
