"""Reading and tokenizing documents in rounds, optionally ahead of the trainer on a thread.

A *round* reads documents of one split until it has a few hundred kilobytes of text, tokenizes
them together (sentencepiece spreads a batch over threads) and reports the tokens plus the
stream position after its last document. Rounds only cut the token stream into pieces; where
they fall never changes the stream, so a position saved after any round resumes exactly.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from titanlite.data.sources import Documents, in_split, one_line, ordered_dataset
from titanlite.data.tokenizer import Tokenizer
from titanlite.errors import UserError

logger = logging.getLogger(__name__)

_SLOW_ROUND_S = 5.0


@dataclass(frozen=True)
class Position:
    """Where a split's document stream stands (after some round)."""

    epoch: int = 0
    epoch_documents: int = 0  # documents of the split read so far in this epoch
    dataset_state: dict[str, Any] | None = None  # `datasets` state after the last row read
    exhausted: bool = False  # a finite pass has ended


@dataclass(frozen=True)
class Round:
    tokens: np.ndarray
    after: Position = field(default_factory=Position)


def read_rounds(
    documents: Documents,
    tokenizer: Tokenizer,
    *,
    split: str,
    validation_fraction: float,
    seed: int,
    infinite: bool,
    start: Position,
    chars_per_round: int,
) -> Iterator[Round]:
    """Rounds of tokens from ``start`` on; ends after the round that finishes a finite pass."""
    position = start
    while not position.exhausted:
        dataset = _dataset_for(documents, split, seed, position)
        rows = _rows(dataset, documents)
        ended = False
        while not ended:
            started = time.perf_counter()
            texts: list[str] = []
            chars = 0
            ended = True
            for row in rows:
                text = documents.text_of(row)
                if text.strip() and in_split(text, split, validation_fraction):
                    texts.append(text)
                    chars += len(text)
                    if chars >= chars_per_round:
                        ended = False
                        break
            tokens = tokenizer.encode_concat(texts)
            count = position.epoch_documents + len(texts)
            position = Position(position.epoch, count, dataset.state_dict())
            if ended:
                position = _next_epoch(documents, position, infinite)
            elapsed = time.perf_counter() - started
            if elapsed > _SLOW_ROUND_S:
                logger.info("data: reading %d %s documents took %.1f s", len(texts), split, elapsed)
            yield Round(tokens, position)


def _rows(dataset: Any, documents: Documents) -> Iterator[dict[str, Any]]:
    """The dataset's rows; unreadable local files (bad encoding, malformed JSON or parquet)
    become a one-line error naming the source. Hub errors (often transient network trouble)
    keep their traceback."""
    if not documents.num_files:
        yield from dataset
        return
    try:
        yield from dataset
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"{documents.name}: cannot read the data: {one_line(exc)}") from None


def _dataset_for(documents: Documents, split: str, seed: int, position: Position) -> Any:
    dataset = ordered_dataset(documents, split, seed, position.epoch)
    if position.dataset_state is not None:
        # With buffer_size=1 the shuffle buffer is empty between rows, yet `datasets` warns
        # on every resume that its content is lost; silence that one misleading warning.
        ds_logger = logging.getLogger("datasets.iterable_dataset")
        previous = ds_logger.level
        ds_logger.setLevel(logging.ERROR)
        try:
            dataset.load_state_dict(position.dataset_state)
        finally:
            ds_logger.setLevel(previous)
    return dataset


def _next_epoch(documents: Documents, position: Position, infinite: bool) -> Position:
    if not infinite:
        return Position(position.epoch, position.epoch_documents, position.dataset_state, True)
    if position.epoch_documents == 0:
        raise UserError(f"{documents.name}: the train split has no text; check the data")
    logger.info(
        "data: finished epoch %d of %s (%d documents)",
        position.epoch,
        documents.name,
        position.epoch_documents,
    )
    return Position(epoch=position.epoch + 1)


_END = object()
_LIVE_PREFETCHERS: weakref.WeakSet[Prefetcher] = weakref.WeakSet()
_EXIT_JOIN_TIMEOUT_S = 10.0


@atexit.register
def _stop_prefetchers_at_exit() -> None:
    # A daemon thread still inside sentencepiece's C++ threads when the interpreter finalizes
    # aborts the process ("terminate called without an active exception"): stop and join.
    live = list(_LIVE_PREFETCHERS)
    for prefetcher in live:
        prefetcher.close()
    for prefetcher in live:
        prefetcher.join(_EXIT_JOIN_TIMEOUT_S)


class Prefetcher:
    """Runs a round generator on a daemon thread, at most ``depth`` rounds ahead."""

    def __init__(self, rounds: Iterator[Round], depth: int) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(rounds,), name="titanlite-data", daemon=True
        )
        self._thread.start()
        _LIVE_PREFETCHERS.add(self)

    def _run(self, rounds: Iterator[Round]) -> None:
        try:
            for item in rounds:
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as exc:  # re-raised on the consumer's thread
            self._put(exc)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Round:
        item = self._queue.get()
        if item is _END:
            self._queue.put(_END)  # stay ended
            raise StopIteration
        if isinstance(item, BaseException):
            self._queue.put(item)  # fail the same way on a retry
            raise item
        return item

    def close(self) -> None:
        """Stop reading ahead; the thread ends after its current round, without blocking."""
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
