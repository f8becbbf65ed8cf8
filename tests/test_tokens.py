"""Pre-tokenized token folders (issue 12, first part): writing, resuming, reading, verifying."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_data import make_docs, write_jsonl

from titanlite.data import DEFAULT_TOKENIZER_PATH, DataSpec, Tokenizer, load_tokenizer
from titanlite.data.sources import in_split
from titanlite.data.tokens import META_NAME, TokenFolder, is_token_folder, pretokenize, verify
from titanlite.errors import UserError


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(DEFAULT_TOKENIZER_PATH)


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return make_docs(60, seed=3)


@pytest.fixture()
def spec(tmp_path: Path, docs: list[str]) -> DataSpec:
    source = write_jsonl(tmp_path / "docs.jsonl", docs)
    return DataSpec(dataset_path=str(source), validation_fraction=0.1)


def expected(tok: Tokenizer, docs: list[str], split: str) -> np.ndarray:
    texts = [d for d in docs if d.strip() and in_split(d, split, 0.1)]
    return tok.encode_concat(texts).astype(np.int64)


def test_folder_holds_each_splits_token_stream_in_source_order(tmp_path, tok, docs, spec):
    out = tmp_path / "tokens"
    meta = pretokenize(spec, tok, out, shard_tokens=500, progress=False)
    assert meta["complete"] and meta["dtype"] == "uint16" and is_token_folder(out)
    assert len(meta["splits"]["train"]["shards"]) > 2  # several shards, cut at documents
    for split in ("train", "validation"):
        want = expected(tok, docs, split)
        folder = TokenFolder(out, split)
        assert folder.num_tokens == want.size == meta["splits"][split]["tokens"] > 0
        assert np.array_equal(folder.read(0, want.size), want)
        # A read spanning a shard boundary.
        edge = int(folder.starts[1])
        assert np.array_equal(folder.read(edge - 7, 20), want[edge - 7 : edge + 13])
    assert sum(s["documents"] for s in meta["splits"].values()) == len(docs)
    assert "ok (train" in verify(out)


def test_an_interrupted_job_finishes_to_the_same_folder(tmp_path, tok, spec):
    whole = tmp_path / "whole"
    pretokenize(spec, tok, whole, shard_tokens=500, progress=False)

    class Interrupt(Exception):
        pass

    def stop_after_two(shards: int) -> None:
        if shards == 2:
            (cut / "train-00002.bin.tmp").write_bytes(b"half")  # a shard being written
            raise Interrupt

    cut = tmp_path / "cut"
    with pytest.raises(Interrupt):
        pretokenize(spec, tok, cut, shard_tokens=500, progress=False, after_shard=stop_after_two)
    with pytest.raises(UserError, match="did not finish"):
        TokenFolder(cut, "train")
    pretokenize(spec, tok, cut, shard_tokens=500, progress=False)
    assert not list(cut.glob("*.tmp"))
    assert json.loads((cut / META_NAME).read_text()) == json.loads((whole / META_NAME).read_text())


def test_bad_folders_are_one_line_errors(tmp_path, tok, spec):
    good = tmp_path / "good"
    pretokenize(spec, tok, good, shard_tokens=500, progress=False)

    def broken(name: str) -> Path:
        folder = tmp_path / name
        shutil.copytree(good, folder)
        return folder

    truncated = broken("truncated")
    shard = truncated / "train-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(UserError, match="truncated or corrupt shard"):
        TokenFolder(truncated, "train")

    missing = broken("missing")
    (missing / "train-00000.idx").unlink()
    with pytest.raises(UserError, match="missing from the token folder"):
        TokenFolder(missing, "train")

    flipped = broken("flipped")
    shard = flipped / "train-00000.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(UserError, match="checksum mismatch"):
        verify(flipped)

    with pytest.raises(UserError, match="no tokens.json"):
        TokenFolder(tmp_path, "train")
    other = DataSpec(dataset_path=spec.dataset_path, validation_fraction=0.2)
    with pytest.raises(UserError, match="validation_fraction"):
        pretokenize(other, tok, good, progress=False)


def test_an_empty_source_says_so(tmp_path, tok):
    source = write_jsonl(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(UserError, match="no documents in"):
        pretokenize(DataSpec(dataset_path=str(source)), tok, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
