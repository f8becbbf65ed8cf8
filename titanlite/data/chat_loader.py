"""``ChatLoader``: conversations (``titanlite.data.chat``) in packed training windows, the loss
on the assistants' tokens only.

Reading: the records of ``titanlite.data.chat_sources`` (JSONL lines, or the rows of a
``datasets`` dataset). Every record of this split (held out by a stable hash of its line or
row, as text sources are) is rendered once, when the loader is built; records that cannot be
used are counted by reason and reported in one line then (and in ``describe``), never dropped
silently.

Truncation: a conversation longer than a window (seq_len + 1 tokens) keeps its first
seq_len + 1 tokens; it is counted as truncated, or left out as ``too_long`` when no
assistant token is left in it.

Packing: with training.document_mask and a tokenizer with BOS, whole conversations are packed
into each window while they fit (each begins with BOS, added when its template has none, so
the document mask keeps them from attending to each other); otherwise one conversation per
window. The rest of a window is padding, never a target. A conversation is never split
between windows.

Order and position: the train split visits the conversations in a fresh order each epoch
(seeded by training.seed and the epoch); the windows form one global stream, of which
data-parallel rank r takes rows r x local ... of each global batch, so any layout with the
same global batch trains on the same windows. The position is (epoch, next conversation):
a resume continues exactly, under any data-parallel degree.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import torch

from titanlite.data.batches import IGNORE_INDEX
from titanlite.data.chat import REASONS, BadRecord, Example, messages_of, renderer
from titanlite.data.chat_sources import ChatRecords, open_records
from titanlite.data.sources import in_split
from titanlite.data.spec import DataSpec, Split
from titanlite.data.tokenizer import Tokenizer
from titanlite.errors import UserError

logger = logging.getLogger(__name__)


class ChatLoader:
    """A ``titanlite.data.base.Loader`` of conversations (see the module docstring)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        spec: DataSpec,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        *,
        split: Split = "train",
    ) -> None:
        self.spec, self.split, self.tokenizer = spec, split, tokenizer
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.window = spec.seq_len + 1
        self.pack = spec.document_mask and tokenizer.bos_id >= 0
        self.pad_id = max(tokenizer.pad_id, tokenizer.eos_id, 0)
        self.examples = self._render_all(open_records(spec))
        self.epoch, self.cursor = 0, 0
        self.order = self._order(0)

    def _render_all(self, source: ChatRecords) -> list[Example]:
        render, bos = renderer(self.tokenizer), self.tokenizer.bos_id
        self.name = source.name
        self.left_out: Counter[str] = Counter()
        self.truncated = 0
        examples = []
        for key, record in source.records:
            if not in_split(key, self.split, self.spec.validation_fraction):
                continue
            try:
                example = render.render(messages_of(record))
            except BadRecord as e:
                self.left_out[e.reason] += 1
                continue
            ids, trained = example.ids, example.trained
            if self.pack and ids[0] != bos:
                ids, trained = [bos, *ids], [False, *trained]
            if len(ids) > self.window:
                ids, trained = ids[: self.window], trained[: self.window]
                if not any(trained[1:]):
                    self.left_out["too_long"] += 1
                    continue
                self.truncated += 1
            examples.append(Example(ids, trained))
        self.report = self._report(len(examples))
        (logger.warning if self.left_out else logger.info)("%s", self.report)
        if not examples:
            raise UserError(f"{self.report}: no conversation left to train on")
        return examples

    def _report(self, kept: int) -> str:
        left = ", ".join(f"{r} {self.left_out[r]}" for r in REASONS if self.left_out[r])
        return (
            f"chat data {self.name} ({self.split}): {kept} conversations, "
            f"{sum(self.left_out.values())} left out{f' ({left})' if left else ''}, "
            f"{self.truncated} truncated to {self.window} tokens"
        )

    def _order(self, epoch: int) -> list[int]:
        if self.split == "validation":
            return list(range(len(self.examples)))
        generator = torch.Generator().manual_seed(self.spec.seed * 100_003 + epoch)
        return torch.randperm(len(self.examples), generator=generator).tolist()

    # -- windows -------------------------------------------------------------------------

    def _next_window(self) -> tuple[list[int], list[bool]] | None:
        """The next window's conversations (None: a validation pass is over)."""
        ids: list[int] = []
        trained: list[bool] = []
        while True:
            if self.cursor == len(self.order):
                if self.split == "validation" or not self.spec.infinite:
                    return (ids, trained) if ids else None
                self.epoch, self.cursor = self.epoch + 1, 0
                self.order = self._order(self.epoch)
            example = self.examples[self.order[self.cursor]]
            if ids and (not self.pack or len(ids) + len(example.ids) > self.window):
                return ids, trained
            ids, trained = ids + example.ids, trained + example.trained
            self.cursor += 1
            if not self.pack:
                return ids, trained

    def _row(self, window: tuple[list[int], list[bool]] | None) -> tuple[torch.Tensor, ...]:
        ids, trained = window or ([], [])
        pad = self.window - len(ids)
        tokens = torch.tensor(ids + [self.pad_id] * pad, dtype=torch.int64)
        targets = torch.tensor(trained + [False] * pad)
        labels = torch.where(targets[1:], tokens[1:], IGNORE_INDEX)
        return tokens[:-1], labels

    def __iter__(self) -> ChatLoader:
        if self.split == "validation":
            self.cursor = 0
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        local = self.spec.local_batch_size
        windows = [self._next_window() for _ in range(local * self.dp_world_size)]
        if windows[0] is None:
            raise StopIteration
        rows = [self._row(w) for w in windows[self.dp_rank * local : (self.dp_rank + 1) * local]]
        return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])

    def set_seq_len(self, seq_len: int) -> None:
        self.window = min(seq_len, self.spec.seq_len) + 1

    # -- state ---------------------------------------------------------------------------

    def _identity(self) -> dict[str, Any]:
        return {
            "source": self.spec.source_name,
            "split": self.split,
            "seq_len": self.spec.seq_len,
            "seed": self.spec.seed,
            "conversations": len(self.examples),
            "tokenizer": self.tokenizer.fingerprint,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"format": "chat-1", **self._identity(), "epoch": self.epoch, "next": self.cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        differs = [k for k, v in self._identity().items() if state.get(k) != v]
        if state.get("format") != "chat-1" or differs:
            raise UserError(
                f"the data position in the checkpoint belongs to other data "
                f"({', '.join(differs) or 'not chat data'} differ)"
            )
        self.epoch, self.cursor = int(state["epoch"]), int(state["next"])
        self.order = self._order(self.epoch)

    def describe(self) -> str:
        return f"{self.report}; epoch {self.epoch}, conversation {self.cursor}"

    def close(self) -> None:
        pass
