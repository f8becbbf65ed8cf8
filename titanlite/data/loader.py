"""Packed, data-parallel, exactly resumable batches of token ids.

One global stream, identical on every rank: documents (train split: file order shuffled per
epoch) are tokenized as BOS ... EOS, concatenated, and cut into non-overlapping windows of
seq_len + 1 tokens. Windows are consumed in chunks of local_batch_size * dp_world_size; rank r
takes windows [r * B, (r + 1) * B) of each chunk. The global batch at step s is therefore the same
set of sequences for any data-parallel degree, and the saved position (which is global) can be
loaded under a different degree. The position is counted in tokens, so a sequence-length ramp
(``set_seq_len``) cuts its next, shorter or longer, window where the last one ended.
"""

from __future__ import annotations

import collections
import json
import logging
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from titanlite.data.batches import padded_chunk
from titanlite.data.reader import Position, Prefetcher, Round, read_rounds
from titanlite.data.sources import Documents, open_documents, rank_share
from titanlite.data.spec import SPLITS, DataSpec, Split
from titanlite.data.tokenizer import Tokenizer
from titanlite.errors import UserError

logger = logging.getLogger(__name__)

STATE_FORMAT = 2
"""2: the position is the start of the oldest round not yet used up, plus how many of its
tokens were (constant size; the round is read again on resume). 1 (still loaded): the
position after the rounds read, plus every token read but not yet used."""
# Text read per round: enough for one global chunk (about 4 characters per token in English
# BPE) and at least _MIN_READ_CHARS, so that several documents are encoded in parallel. The
# tokens read but not yet used (about a round's worth) are part of the saved state.
_CHARS_PER_TOKEN = 4
_MIN_READ_CHARS = 1 << 18
_PREFETCH_ROUNDS = 2
_THROUGHPUT_LOG_EVERY_S = 300.0


class PackedLoader:
    """Iterable of ``(inputs, labels)`` LongTensors of shape ``[local_batch_size, seq_len]``.

    Train split: iterating continues from the current position (``iter()`` does not rewind);
    with ``spec.infinite`` it never ends. Validation split: every ``iter()`` starts a fresh,
    finite pass from the beginning, so validation loss is comparable over time.
    A background thread reads and tokenizes up to two rounds ahead (``prefetch=False``: none).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        spec: DataSpec,
        dp_rank: int,
        dp_world_size: int,
        *,
        split: Split,
        prefetch: bool = True,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if dp_world_size < 1 or not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"need 0 <= dp_rank < dp_world_size, got {dp_rank}, {dp_world_size}")
        if split == "validation" and spec.validation_fraction <= 0.0:
            raise UserError(
                "validation_fraction is 0, so there is no validation split; "
                "set it to e.g. 0.05 or disable validation"
            )
        self.tokenizer = tokenizer
        self.spec = spec
        self.split = split
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.infinite = spec.infinite and split == "train"
        self.prefetch = prefetch
        self._seq_len = spec.seq_len  # of the windows cut next (set_seq_len)
        self._documents: Documents = open_documents(spec)
        # training.split_by_rank: this rank reads its own shards as a stream of its own, so a
        # chunk is its local batch alone and the position is this rank's (saved per rank).
        self.rank_split = spec.split_by_rank and split == "train"
        if self.rank_split:
            self._documents = rank_share(self._documents, dp_rank, dp_world_size)
        self._chunk_ranks = 1 if self.rank_split else dp_world_size
        self._chunk_index = 0 if self.rank_split else dp_rank
        pad = tokenizer.pad_id if tokenizer.pad_id >= 0 else max(tokenizer.eos_id, 0)
        self._input_pad_id = pad
        self._rounds: Iterator[Round] | None = None
        # The running read-ahead thread, if any; closed when the loader is garbage collected,
        # so no thread outlives its loader (the list, not self, is what the finalizer holds).
        self._prefetchers: list[Prefetcher] = []
        weakref.finalize(self, _close_all, self._prefetchers)
        self._reset()

    # -- position ----------------------------------------------------------------------------

    def _reset(self) -> None:
        self.close()
        self._position = Position()  # of the document stream, after the last round applied
        self._tokens = np.empty(0, dtype=np.int32)  # read, tokenized, not yet in a window
        # The rounds whose tokens are (partly) in _tokens: (position before it, its size);
        # the first one's first _used tokens are gone. The saved state is the first entry's
        # position and _used, so it does not grow with the batch or the data-parallel degree.
        # An entry without a position holds tokens loaded from a format-1 state.
        self._buffered: collections.deque[tuple[Position | None, int]] = collections.deque()
        self._used = 0
        self._discard = 0  # tokens to drop from the next rounds read (set by a resume)
        self._windows_consumed = 0  # global windows handed out (all ranks together)
        self._tokens_read = 0
        self._started = time.perf_counter()
        self._last_log = self._started

    def close(self) -> None:
        """Stop the read-ahead thread (iterating again restarts it where the loader stands)."""
        _close_all(self._prefetchers)
        self._rounds = None

    def _next_round(self) -> Round:
        if self._rounds is None:
            chunk_tokens = self.spec.local_batch_size * self._chunk_ranks * (self.spec.seq_len + 1)
            rounds = read_rounds(
                self._documents,
                self.tokenizer,
                split=self.split,
                validation_fraction=self.spec.validation_fraction,
                seed=self.spec.seed,
                infinite=self.infinite,
                start=self._position,
                chars_per_round=max(chunk_tokens * _CHARS_PER_TOKEN, _MIN_READ_CHARS),
            )
            if self.prefetch:
                prefetcher = Prefetcher(rounds, depth=_PREFETCH_ROUNDS)
                self._prefetchers.append(prefetcher)
                self._rounds = prefetcher
            else:
                self._rounds = rounds
        return next(self._rounds)

    # -- iteration ---------------------------------------------------------------------------

    def __iter__(self) -> PackedLoader:
        if self.split == "validation":
            self._reset()
        return self

    def set_seq_len(self, seq_len: int) -> None:
        """Windows of ``seq_len`` + 1 tokens from the next batch on (see ``Loader``)."""
        if not 1 <= seq_len <= self.spec.seq_len:
            raise ValueError(f"seq_len must be in [1, {self.spec.seq_len}], got {seq_len}")
        self._seq_len = seq_len

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        window = self._seq_len + 1
        chunk = self.spec.local_batch_size * self._chunk_ranks
        needed = chunk * window
        while self._tokens.size < needed and not self._position.exhausted:
            before = self._position
            round_ = self._next_round()
            self._position = round_.after
            tokens = round_.tokens
            if self._discard:  # used before the resume: read again only to find the cut
                drop = min(self._discard, tokens.size)
                self._discard -= drop
                if drop < tokens.size:
                    self._buffered.append((before, tokens.size))
                    self._used = drop
                tokens = tokens[drop:]
            elif tokens.size:
                self._buffered.append((before, tokens.size))
            if tokens.size:
                self._tokens = np.concatenate([self._tokens, tokens])
                self._tokens_read += tokens.size
        if self._tokens.size >= needed:
            block = self._tokens[:needed].reshape(chunk, window)
            self._tokens = self._tokens[needed:]
            self._use(needed)
            self._windows_consumed += chunk
            first = self._chunk_index * self.spec.local_batch_size
            mine = torch.from_numpy(block[first : first + self.spec.local_batch_size])
            mine = mine.to(torch.int64)
            self._maybe_log_throughput()
            return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()
        if self.split == "validation" and self._tokens.size >= 2:
            return self._last_padded_batch(chunk, window)
        if self._windows_consumed == 0 and self._tokens.size == 0:
            raise UserError(
                f"{self._documents.name}: the {self.split} split has no text "
                f"(validation_fraction={self.spec.validation_fraction}); "
                "check the data or the fraction"
            )
        # A finite train pass drops its last partial chunk so that every label is a real token
        # and every rank stops after the same number of batches.
        raise StopIteration

    def _last_padded_batch(self, chunk: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rest of a validation pass as one global chunk (see ``padded_chunk``)."""
        tokens = torch.from_numpy(self._tokens).to(torch.int64)
        self._use(self._tokens.size)
        self._tokens = np.empty(0, dtype=np.int32)
        self._windows_consumed += chunk
        first = self.dp_rank * self.spec.local_batch_size
        rows = slice(first, first + self.spec.local_batch_size)
        return padded_chunk(tokens, chunk, window, pad_id=self._input_pad_id, rows=rows)

    def _use(self, count: int) -> None:
        """``count`` tokens left the buffer: forget the rounds they used up."""
        self._used += count
        while self._buffered and self._used >= self._buffered[0][1]:
            self._used -= self._buffered.popleft()[1]

    def _maybe_log_throughput(self) -> None:
        now = time.perf_counter()
        if self._windows_consumed == self.spec.local_batch_size * self._chunk_ranks:
            logger.info("data: first %s batch after %.2f s", self.split, now - self._started)
        elif now - self._last_log > _THROUGHPUT_LOG_EVERY_S:
            logger.info(
                "data: %s epoch %d, %d windows so far, %.0f tokens/s read",
                self.split,
                self._position.epoch,
                self._windows_consumed,
                self._tokens_read / (now - self._started),
            )
            self._last_log = now

    def describe(self) -> str:
        return (
            f"text {self.spec.source_name} ({self.split}"
            f"{', split by rank' if self.rank_split else ''}): epoch {self._position.epoch}, "
            f"{self._windows_consumed:,} windows consumed (now of {self._seq_len + 1} tokens)"
        )

    # -- checkpointing -----------------------------------------------------------------------

    def _identity(self) -> dict[str, Any]:
        return {
            "seq_len": self.spec.seq_len,
            "source": self.spec.source_name,
            "text_field": self.spec.text_field,
            "split": self.split,
            "validation_fraction": self.spec.validation_fraction,
            "seed": self.spec.seed,
        }

    @property
    def partial_ok(self) -> bool:
        """With split_by_rank a checkpoint may lack this rank's entry (saved by another
        data-parallel degree): load_state_dict then names the problem."""
        return self.rank_split

    def state_dict(self) -> dict[str, Any]:
        """The stream position. One global stream: plain values, the same on every rank.
        split_by_rank: each rank's own position as a JSON byte tensor under its own key, so
        that every rank's is saved (in DCP; plain values go to rank 0's sidecar)."""
        own = self._stream_state()
        if not self.rank_split:
            return own
        blob = torch.frombuffer(bytearray(json.dumps(own).encode()), dtype=torch.uint8)
        return {
            "format": STATE_FORMAT,
            "split_by_rank": self.dp_world_size,
            "ranks": {f"dp{self.dp_rank}": blob},
        }

    def _stream_state(self) -> dict[str, Any]:
        """The position of the stream this loader reads, as plain Python values.

        Flat, with fixed keys (friendly to torch.distributed.checkpoint); the dataset's own
        nested state is kept as a JSON string. Its size does not depend on the batch or the
        data-parallel degree: the position is where the oldest round still in use began and
        ``skip`` how many of the tokens from there were used (a resume reads that round
        again). Rounds read ahead but not yet used are not part of it either.
        """
        legacy = bool(self._buffered) and self._buffered[0][0] is None
        if legacy:  # tokens loaded from a format-1 state are still in use: save them alike
            position, skip = self._position, 0
        elif self._buffered:
            position, skip = self._buffered[0][0], self._used
        else:
            position, skip = self._position, self._discard
        state = {
            "format": 1 if legacy else STATE_FORMAT,
            **self._identity(),
            "tokenizer": self.tokenizer.fingerprint,
            "epoch": position.epoch,
            "epoch_documents": position.epoch_documents,
            "windows_consumed": self._windows_consumed,
            "exhausted": position.exhausted,
            "dataset_state": json.dumps(position.dataset_state) if position.dataset_state else "",
        }
        if legacy:
            state["tokens"] = self._tokens.tolist()
        else:
            state["skip"] = skip
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` was saved (one global stream: under any
        data-parallel degree; split_by_rank: under the same one)."""
        saved_ranks = int(state.get("split_by_rank", 0))
        if saved_ranks == 0 and self.rank_split:
            raise UserError(
                "the data position was saved for one global stream; training.split_by_rank "
                "cannot continue it (resume without split_by_rank, or start a new run)"
            )
        if saved_ranks and not self.rank_split:
            raise UserError(
                f"the data position was saved per rank by {saved_ranks} data-parallel ranks "
                "(training.split_by_rank); resume with split_by_rank = true"
            )
        if saved_ranks != self._split_ranks():
            raise UserError(
                f"the data position was saved per rank by {saved_ranks} data-parallel ranks "
                f"(training.split_by_rank), this run has {self.dp_world_size}; resume with "
                f"{saved_ranks}, or exclude the dataloader from loading "
                '(checkpoint.exclude_from_loading = ["dataloader"]) to restart the data'
            )
        if self.rank_split:
            blob = state["ranks"][f"dp{self.dp_rank}"]
            state = json.loads(bytes(blob.numpy()).decode())
        self._load_stream_state(state)

    def _split_ranks(self) -> int:
        return self.dp_world_size if self.rank_split else 0

    def _load_stream_state(self, state: dict[str, Any]) -> None:
        if state.get("format") not in (1, STATE_FORMAT):
            raise UserError(
                f"data loader state has format {state.get('format')!r}, expected {STATE_FORMAT}; "
                "it was saved by an incompatible titanlite version"
            )
        for key, value in self._identity().items():
            if state.get(key) != value:
                raise UserError(
                    f"data loader state does not match this run: {key} was {state.get(key)!r} "
                    f"when saved, now {value!r}; resume with the same {key} or start a new run"
                )
        if state.get("tokenizer") != self.tokenizer.fingerprint:
            raise UserError(
                f"data loader state was saved with a different tokenizer than "
                f"{str(self.tokenizer.path)!r}; resume with the same tokenizer or start a new run"
            )
        self._reset()
        self._position = Position(
            epoch=int(state["epoch"]),
            epoch_documents=int(state["epoch_documents"]),
            dataset_state=json.loads(state["dataset_state"]) if state["dataset_state"] else None,
            exhausted=bool(state["exhausted"]),
        )
        self._windows_consumed = int(state["windows_consumed"])
        if state["format"] == 1:
            self._tokens = np.asarray(state["tokens"], dtype=np.int32)
            if self._tokens.size:
                self._buffered.append((None, self._tokens.size))
        else:
            self._discard = int(state["skip"])


def _close_all(prefetchers: list[Prefetcher]) -> None:
    while prefetchers:
        prefetchers.pop().close()
