"""The one interface every loader implements (text stream, token folder, mixture).

The trainer and the validator know only this: iterate (inputs, labels) batches, save and
restore the position (``Stateful``, so the checkpointer saves it with everything else), say
in one line what is read and where it stands, and stop any background work.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch

Batch = tuple[torch.Tensor, torch.Tensor]
"""(inputs, labels) LongTensors [local_batch_size, seq_len] (``titanlite.data.batches``)."""


@runtime_checkable
class Loader(Protocol):
    """A loader of one split as seen by one data-parallel rank.

    Train split: iterating continues from the current position (``iter()`` does not rewind);
    validation split: every ``iter()`` starts a fresh, finite pass from the beginning.
    """

    def __iter__(self) -> Iterator[Batch]: ...

    def __next__(self) -> Batch: ...

    def state_dict(self) -> dict[str, Any]:
        """The position, valid under another data-parallel degree unless documented."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` was saved; a UserError naming the mismatch when
        it belongs to other data."""
        ...

    def set_seq_len(self, seq_len: int) -> None:
        """Cut the windows of the batches that follow to ``seq_len`` + 1 tokens (at most the
        spec's; training.seq_len_schedule). The train split's position is counted in tokens:
        the next window starts where the last one ended, whatever their lengths, so the
        windows of a ramped run, put end to end, are the stream an unramped run reads."""
        ...

    def describe(self) -> str:
        """One line: what is read and how far (for logs)."""
        ...

    def close(self) -> None:
        """Stop background reading, if any (iterating again restarts it)."""
        ...
