"""Pre-tokenized token folders (issue 12, first part): writing, resuming, reading, verifying."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
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


def test_the_window_permutation_is_a_bijection():
    from titanlite.data.token_loader import permute

    for n in (1, 2, 3, 7, 64, 1000, 4097):
        out = permute(np.arange(n), n, key=12345)
        assert sorted(out.tolist()) == list(range(n))
    assert not np.array_equal(permute(np.arange(1000), 1000, 1), np.arange(1000))
    assert not np.array_equal(permute(np.arange(1000), 1000, 1), permute(np.arange(1000), 1000, 2))


def test_loader_global_batches_and_resume_do_not_depend_on_the_layout(tmp_path, tok, spec):
    from titanlite.data import build_dataloader

    out = tmp_path / "tokens"
    pretokenize(spec, tok, out, shard_tokens=500, progress=False)
    folder_spec = DataSpec(dataset_path=str(out), seq_len=16, local_batch_size=8)
    one = build_dataloader(tok, folder_spec, 0, 1)
    steps = 12
    reference = [next(one)[0] for _ in range(steps)]
    four_spec = DataSpec(dataset_path=str(out), seq_len=16, local_batch_size=2)
    ranks = [build_dataloader(tok, four_spec, r, 4) for r in range(4)]
    for step in range(5):
        got = torch.cat([next(r)[0] for r in ranks])
        assert torch.equal(got, reference[step])
    # Saved on 4 ranks after 5 steps, resumed on 2.
    two_spec = DataSpec(dataset_path=str(out), seq_len=16, local_batch_size=4)
    resumed = [build_dataloader(tok, two_spec, r, 2) for r in range(2)]
    for loader in resumed:
        loader.load_state_dict(ranks[0].state_dict())
    for step in range(5, steps):
        assert torch.equal(torch.cat([next(r)[0] for r in resumed]), reference[step])
    # Windows are whole, shuffled pieces of the train stream.
    stream = TokenFolder(out, "train").read(0, TokenFolder(out, "train").num_tokens)
    first = reference[0][0].numpy()
    starts = [
        i for i in range(0, stream.size - 17, 17) if np.array_equal(stream[i : i + 16], first)
    ]
    assert starts and starts != [0]

    # Another tokenizer: one line naming both.
    other = load_tokenizer(DEFAULT_TOKENIZER_PATH)
    other.fingerprint = "0" * 16
    with pytest.raises(UserError, match="another tokenizer"):
        build_dataloader(other, folder_spec, 0, 1)


def test_validation_pass_covers_the_held_out_tokens_once(tmp_path, tok, spec):
    from titanlite.data import IGNORE_INDEX, build_dataloader

    out = tmp_path / "tokens"
    pretokenize(spec, tok, out, shard_tokens=500, progress=False)
    folder = TokenFolder(out, "validation")
    loader = build_dataloader(
        tok, DataSpec(dataset_path=str(out), seq_len=16, local_batch_size=4), 0, 1, "validation"
    )
    labels = torch.cat([lab.flatten() for _, lab in loader])
    real = labels[labels != IGNORE_INDEX]
    n = folder.num_tokens
    full = (n // 17) // 4 * 4  # windows in whole global batches of 4
    rest = n - full * 17
    tail = sum(min(17, rest - at) - 1 for at in range(0, rest - 1, 17))
    assert real.numel() == full * 16 + tail > 0
    assert torch.equal(real[:16], torch.from_numpy(folder.read(1, 16)))
