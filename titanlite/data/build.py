"""Building loaders: one call for a run's training data, one for any single source.

Which loader reads a source is decided here and nowhere else: a folder written by
scripts/pretokenize.py is read by ``TokenLoader``, any other source is a text stream
(``PackedLoader``), and [[training.datasets]] is a ``MixtureLoader`` over token folders.
Everything they return is a ``titanlite.data.base.Loader``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from titanlite.config.job_config import Training, Validation
from titanlite.config.parse import dataset_name
from titanlite.data.base import Loader
from titanlite.data.spec import DataSpec, Split
from titanlite.data.tokenizer import Tokenizer
from titanlite.data.tokens import is_token_folder
from titanlite.paths import resolve_path


def data_spec(training: Training, validation: Validation) -> DataSpec:
    """The run's single data source (training.dataset / dataset_path) as a DataSpec."""
    t = training
    return DataSpec(
        dataset=t.dataset,
        dataset_path=resolve_path(t.dataset_path),
        dataset_config=t.dataset_config,
        text_field=t.text_field,
        seq_len=t.seq_len,
        local_batch_size=t.local_batch_size,
        seed=t.seed,
        validation_fraction=validation.holdout_fraction,
        split_by_rank=t.split_by_rank,
        chat=t.dataset_format == "chat",
        document_mask=t.document_mask,
    )


def build_dataloader(
    tokenizer: Tokenizer,
    spec: DataSpec,
    dp_rank: int = 0,
    dp_world_size: int = 1,
    *,
    split: Split = "train",
    prefetch: bool = True,
) -> Loader:
    """The loader for ``split`` of one source as seen by data-parallel rank ``dp_rank`` of
    ``dp_world_size`` (a pre-tokenized folder when ``spec.dataset_path`` is one, else a text
    stream read ahead by a background thread unless ``prefetch`` is False; conversations
    when ``spec.chat``)."""
    if spec.chat:
        from titanlite.data.chat_loader import ChatLoader

        return ChatLoader(tokenizer, spec, dp_rank, dp_world_size, split=split)
    if is_token_folder(spec.dataset_path):
        from titanlite.data.token_loader import TokenLoader

        return TokenLoader(tokenizer, spec, dp_rank, dp_world_size, split=split)
    from titanlite.data.loader import PackedLoader

    return PackedLoader(tokenizer, spec, dp_rank, dp_world_size, split=split, prefetch=prefetch)


@dataclass(frozen=True)
class TrainingData:
    """A run's data: the training loader and what validation reads (the held-out split of
    each source, named as in val_loss_NAME; one unnamed source without a mixture)."""

    loader: Loader
    validation_sources: list[tuple[str, DataSpec]]


def build_training_data(
    tokenizer: Tokenizer,
    training: Training,
    validation: Validation,
    *,
    dp_rank: int,
    dp_world_size: int,
) -> TrainingData:
    """The training loader for data-parallel rank ``dp_rank`` of ``dp_world_size``: a
    mixture of token folders when training.datasets is set, else the single source."""
    base = data_spec(training, validation)
    if not training.datasets:
        loader = build_dataloader(tokenizer, base, dp_rank, dp_world_size)
        return TrainingData(loader, [("", base)])
    from titanlite.data.mixture import MixtureLoader, Part

    total = sum(e.weight for e in training.datasets)
    parts = [
        Part(dataset_name(e), e.weight / total, replace(base, dataset_path=resolve_path(e.path)))
        for e in training.datasets
    ]
    loader = MixtureLoader(tokenizer, parts, dp_rank, dp_world_size)
    return TrainingData(loader, [(p.name, p.spec) for p in parts])
