"""Hugging Face tokenizer.json tokenizers: trained here with scripts/train_tokenizer.py, found
from a file or a folder, special ids from tokenizer_config.json, vocabularies past 65,535,
and a run that trains, resumes under another layout and exports a folder transformers loads.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from titanlite.data import DataSpec, build_dataloader, load_tokenizer
from titanlite.data.tokenizer import HFTokenizer, SentencePieceTokenizer
from titanlite.errors import EXIT_USER_ERROR, UserError

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import convert_to_hf  # noqa: E402
import train_tokenizer  # noqa: E402

TEXTS = [
    "Hello  world,\n  indented\tand tabbed",
    "ünïcödé, 你好, emoji 🙂 and 12345 + 678",
    "",
    "The quick brown fox jumps over the lazy dog.",
]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE of 400 tokens trained on a small corpus: the folder it is in."""
    root = tmp_path_factory.mktemp("bpe")
    corpus = root / "corpus"
    corpus.mkdir()
    words = (
        "state union nation people congress freedom economy workers families children future "
        "history liberty justice security progress promise courage country citizens"
    ).split()
    for i in range(40):
        lines = [" ".join(words[(i * j + k) % len(words)] for k in range(12)) for j in range(10)]
        (corpus / f"{i:02d}.txt").write_text(f"Document {i}, year {1900 + i}:\n" + "\n".join(lines))
    out = root / "tokenizer"
    args = ["--kind", "hf-bpe", "--dataset-path", str(corpus), "--vocab-size", "400"]
    assert train_tokenizer.main([*args, "--out", str(out)]) == 0
    return out


def test_trained_bpe_is_a_lossless_tokenizer_json_folder(bpe: Path) -> None:
    assert sorted(p.name for p in bpe.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    tok = load_tokenizer(bpe)
    assert isinstance(tok, HFTokenizer) and tok.path == bpe / "tokenizer.json"
    assert tok.vocab_size == 400
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, -1)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == 1 and ids[-1] == 2 and 1 not in ids[1:-1]
        assert tok.decode(ids) == text  # byte-level: nothing lost, specials dropped
    body = [tok.encode(t, bos=False, eos=False) for t in TEXTS]
    assert tok.encode_batch(TEXTS, bos=False, eos=True) == [[*b, 2] for b in body]
    packed = tok.encode_concat(TEXTS)
    assert packed.dtype.name == "int32"
    assert packed.tolist() == [i for b in body for i in (1, *b, 2)]


def test_retraining_never_replaces_a_folder_holding_other_files(bpe: Path, tmp_path: Path) -> None:
    out = tmp_path / "mine"
    shutil.copytree(bpe, out)
    (out / "notes.txt").write_text("keep me")
    before = (out / "tokenizer.json").read_bytes()
    args = ["--kind", "hf-bpe", "--dataset-path", str(bpe), "--out", str(out)]
    assert train_tokenizer.main(args) == EXIT_USER_ERROR
    assert (out / "tokenizer.json").read_bytes() == before
    assert (out / "notes.txt").read_text() == "keep me"
    assert train_tokenizer.main(["--kind", "hf-bpe"]) == EXIT_USER_ERROR  # no --out


def test_the_kind_follows_what_the_path_holds(bpe: Path, tmp_path: Path) -> None:
    assert isinstance(load_tokenizer(bpe / "tokenizer.json"), HFTokenizer)
    sp_folder = tmp_path / "sp"
    sp_folder.mkdir()
    shutil.copyfile(
        REPO / "titanlite" / "assets" / "tokenizer.model", sp_folder / "tokenizer.model"
    )
    assert isinstance(load_tokenizer(sp_folder), SentencePieceTokenizer)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="neither tokenizer.json nor tokenizer.model"):
        load_tokenizer(empty)


def test_bad_tokenizer_files_are_one_line_errors(bpe: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text('{"model": {"type": "nothing I know"}}')
    with pytest.raises(UserError) as info:
        load_tokenizer(broken)
    message = str(info.value)
    assert "not a usable Hugging Face tokenizer.json" in message and str(broken) in message
    assert "\n" not in message and "Exception" not in message

    wrong = tmp_path / "wrong"
    shutil.copytree(bpe, wrong)
    config = json.loads((wrong / "tokenizer_config.json").read_text())
    # Two files that disagree on what an id is: not one tokenizer (transformers would load it,
    # giving the config's token a new id, and train on a vocabulary neither file describes).
    clash = {"added_tokens_decoder": {"7": {"content": "<|eot_id|>", "special": True}}}
    (wrong / "tokenizer_config.json").write_text(json.dumps({**config, **clash}))
    with pytest.raises(UserError) as info:
        load_tokenizer(wrong)
    message = str(info.value)
    assert message.startswith(f"{wrong / 'tokenizer_config.json'}: added_tokens_decoder['7']")
    assert "'<|eot_id|>' but id 7 of" in message and "\n" not in message
    bad_id = {"added_tokens_decoder": {"eot": {"content": "<|eot_id|>"}}}
    (wrong / "tokenizer_config.json").write_text(json.dumps({**config, **bad_id}))
    with pytest.raises(UserError, match=r"added_tokens_decoder\['eot'\]: 'eot' is not a token id"):
        load_tokenizer(wrong)
    (wrong / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(UserError, match="tokenizer_config.json is not valid JSON"):
        load_tokenizer(wrong)


def test_special_tokens_from_the_config_or_their_usual_names(bpe: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copyfile(bpe / "tokenizer.json", bare / "tokenizer.json")
    tok = load_tokenizer(bare)  # no tokenizer_config.json: <|begin_of_text|> etc. are found
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    no_bos = tmp_path / "no_bos"
    shutil.copytree(bpe, no_bos)
    config = json.loads((no_bos / "tokenizer_config.json").read_text())
    config["bos_token"] = None  # as Qwen's config says
    (no_bos / "tokenizer_config.json").write_text(json.dumps(config))
    tok2 = load_tokenizer(no_bos)
    assert tok2.bos_id == -1 and tok2.encode("state", bos=True, eos=True)[-1] == 2
    assert tok2.encode("state")[0] != 1
    # What a loader state is checked against: content and specials, not the path.
    assert tok.fingerprint == load_tokenizer(bpe).fingerprint != tok2.fingerprint


def test_a_tokenizer_that_gains_no_ids_keeps_its_fingerprint(bpe: Path) -> None:
    """Token folders and loader states store the fingerprint: for every tokenizer that loaded
    before config-named tokens got ids, it is still sha256(tokenizer.json + its specials)."""
    import hashlib

    tok = load_tokenizer(bpe)
    digest = hashlib.sha256((bpe / "tokenizer.json").read_bytes())
    specials = {"bos": "<|begin_of_text|>", "eos": "<|end_of_text|>", "pad": "<|pad|>"}
    assert {k: tok.token_text(getattr(tok, f"{k}_id")) for k in specials} == specials
    digest.update(json.dumps(specials, sort_keys=True).encode())
    assert tok.fingerprint == digest.hexdigest()[:16]


def special(content: str, **flags: bool) -> dict:
    """An added_tokens_decoder entry as transformers writes one."""
    base = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    return {"content": content, **base, "special": True, **flags}


# Laid out like TorchTitan's tests/assets/tokenizer: tokenizer_config.json names a BOS and an
# EOS, at ids past the vocabulary, and a pad it never lists; tokenizer.json has none of them.
TITAN_CONFIG = {
    "added_tokens_decoder": {
        "128000": special("<|begin_of_text|>"),
        "128001": special("<|end_of_text|>"),
    },
    "bos_token": "<|begin_of_text|>",
    "eos_token": "<|end_of_text|>",
    "pad_token": "<|pad|>",
    "tokenizer_class": "PreTrainedTokenizerFast",
}
# Every way a config names tokens, out of transformers' order: the decoder by falling ids and
# one entry not special, the named tokens (one already held), a model-specific one, extras.
MIXED_CONFIG = {
    "eos_token": "<|end_of_text|>",
    "mask_token": "<mask>",
    "pad_token": "<|pad|>",
    "added_tokens_decoder": {
        "9001": special("<|end_of_text|>"),
        "9000": special("<|begin_of_text|>"),
        "9002": special("<|tool|>", special=False, normalized=True),
    },
    "image_token": "<|image|>",
    "unk_token": "<|unk|>",
    "bos_token": "<|begin_of_text|>",
    "sep_token": "<|endoftext|>",
    "additional_special_tokens": ["<|im_end|>", "<|endoftext|>"],
    "tokenizer_class": "PreTrainedTokenizerFast",
}
SPECIAL_TEXT = "<|begin_of_text|>the state<|pad|> of the<|tool|> union<|image|>.<|end_of_text|>"
# config -> (the tokens given new ids, in id order; bos, eos, pad, unk as those tokens;
# SPECIAL_TEXT decoded)
CONFIG_CASES = {
    "torchtitan": (
        TITAN_CONFIG,
        ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"],
        ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", None),
        "the state of the<|tool|> union<|image|>.",  # no tokens here: plain text
    ),
    "mixed": (
        MIXED_CONFIG,
        [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|tool|>",
            "<|unk|>",
            "<|pad|>",
            "<mask>",
            "<|image|>",
            "<|im_end|>",
        ],
        ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|unk|>"),
        "the state of the<|tool|> union.",  # <|tool|> is a token, but not a special one
    ),
}


def foreign_folder(folder: Path, config: dict) -> int:
    """A byte-level BPE tokenizer.json written by the tokenizers library, holding two special
    tokens of its own (as TorchTitan's does), and ``config`` as its tokenizer_config.json; the
    size of the tokenizer.json's vocabulary."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet, show_progress=False)
    raw.train_from_iterator([" ".join(TEXTS)] * 4 + ["the state of the union"] * 8, trainer)
    raw.add_special_tokens(["<|endoftext|>", "<|im_start|>"])
    folder.mkdir()
    raw.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return raw.get_vocab_size(with_added_tokens=True)


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_config_tokens_the_vocabulary_lacks_get_the_ids_transformers_gives(
    case: str, tmp_path: Path
) -> None:
    """A folder like TorchTitan's test tokenizer loads: the tokens its config names and its
    tokenizer.json lacks are appended after the vocabulary in transformers' order, counted in
    vocab_size (the embedding rows), encoded as one token and dropped by decode when special."""
    config, appended, specials, decoded = CONFIG_CASES[case]
    folder = tmp_path / case
    size = foreign_folder(folder, config)
    tok = load_tokenizer(folder)
    assert tok.vocab_size == size + len(appended)
    assert [tok.token_text(size + i) for i in range(len(appended))] == appended
    ids = {name: size + i for i, name in enumerate(appended)}
    expected = tuple(-1 if name is None else ids[name] for name in specials)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id) == expected
    encoded = tok.encode(SPECIAL_TEXT)
    assert encoded[:2] == [tok.bos_id, tok.bos_id] and encoded[-2:] == [tok.eos_id, tok.eos_id]
    assert tok.pad_id in encoded and max(encoded) < tok.vocab_size
    assert tok.decode(encoded) == decoded

    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    assert len(theirs) == tok.vocab_size
    their_specials = (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id)
    assert their_specials == (tok.bos_id, tok.eos_id, tok.pad_id)
    assert (theirs.unk_token_id if theirs.unk_token_id is not None else -1) == tok.unk_id
    every_id = range(tok.vocab_size)
    assert theirs.convert_ids_to_tokens(list(every_id)) == [tok.token_text(i) for i in every_id]
    assert {i for i, t in theirs.added_tokens_decoder.items() if t.special} == {
        i for i in range(size - 2, tok.vocab_size) if tok.decode([i]) == ""
    }  # the special ones, which decode drops
    for text in [SPECIAL_TEXT, *TEXTS]:
        body = tok.encode(text, bos=False, eos=False)
        assert theirs(text, add_special_tokens=False)["input_ids"] == body, text
        assert theirs.decode(body, skip_special_tokens=True) == tok.decode(body), text


def test_appended_tokens_change_the_fingerprint(tmp_path: Path) -> None:
    """Two folders with one tokenizer.json: the one whose config adds tokens is another
    tokenizer for token folders and loader states."""
    size = foreign_folder(tmp_path / "titan", TITAN_CONFIG)
    plain = tmp_path / "plain"
    shutil.copytree(tmp_path / "titan", plain)
    (plain / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    ours, theirs = load_tokenizer(plain), load_tokenizer(tmp_path / "titan")
    assert ours.vocab_size == size and ours.eos_id == size - 2
    assert ours.fingerprint != theirs.fingerprint


def large_vocab_tokenizer(folder: Path, words: int = 70_000) -> Path:
    """A word-level tokenizer.json whose ids pass 65,535 (what a uint16 token file cannot hold)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i + 3 for i in range(words)}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.decoder = decoders.WordPiece()
    raw.add_special_tokens(["<unk>", "<s>", "</s>"])
    folder.mkdir()
    raw.save(str(folder / "tokenizer.json"))
    return folder


def test_ids_past_65535_survive_encoding_and_packing(tmp_path: Path) -> None:
    tok = load_tokenizer(large_vocab_tokenizer(tmp_path / "big"))
    assert tok.vocab_size == 70_003 and (tok.bos_id, tok.eos_id, tok.unk_id) == (1, 2, 0)
    top = [f"w{i}" for i in range(69_990, 70_000)]
    assert tok.encode(" ".join(top)) == [1, *range(69_993, 70_003), 2]
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(8):
        (docs / f"{i}.txt").write_text(" ".join(top[i:] + [f"w{i}"] * 5))
    spec = DataSpec(dataset_path=str(docs), seq_len=16, local_batch_size=2, validation_fraction=0)
    inputs, labels = next(iter(build_dataloader(tok, spec, 0, 1, split="train")))
    assert inputs.dtype == torch.int64 and int(inputs.max()) > 65_535
    assert set(inputs.flatten().tolist()) <= {1, 2, *range(3, 13), *range(69_993, 70_003)}


@pytest.mark.slow
def test_train_resume_under_another_layout_and_export(bpe: Path, tmp_path: Path) -> None:
    """Two ranks train 6 steps with the BPE folder as model.tokenizer_path; one process
    resumes the step-3 checkpoint and matches them; the export is a folder transformers'
    AutoTokenizer loads, encoding as titanlite did."""
    import train_scenarios
    from pool import get_pool

    common = [
        "--model.tokenizer_path",
        str(bpe),
        "--model.n_layers",
        "2",
        "--training.steps",
        "6",
        "--training.seq_len",
        "32",
        "--checkpoint.interval",
        "3",
        "--metrics.log_freq",
        "1",
        "--validation.enable",
        "false",
    ]

    def losses(run: dict) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in run["records"] if "loss" in r}

    two = tmp_path / "two"
    argv = [*common, "--training.local_batch_size", "2", "--job.dump_folder", str(two)]
    base = losses(get_pool(2).run(train_scenarios.train, argv=argv)[0])
    assert sorted(base) == list(range(1, 7))
    one = tmp_path / "one"
    shutil.copytree(two / "checkpoint" / "step-3", one / "checkpoint" / "step-3")
    argv = [*common, "--training.local_batch_size", "4", "--job.dump_folder", str(one)]
    resumed = losses(get_pool(1).run(train_scenarios.train, argv=argv)[0])
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert abs(resumed[step] - base[step]) <= 1e-5 * base[step], (step, resumed, base)

    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    # The checkpoint carries the tokenizer: the original folder is not needed to export it.
    step = two / "checkpoint" / "step-6"
    assert json.loads((step / "titanlite.json").read_text())["tokenizer"] == "tokenizer.json"
    hidden = bpe.with_name("hidden")
    bpe.rename(hidden)
    try:
        assert convert_to_hf.main([str(step), str(out)]) == 0
    finally:
        hidden.rename(bpe)
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    assert not (out / "tokenizer.model").exists()
    config = json.loads((out / "config.json").read_text())
    assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == (400, 1, 2)
    ours = load_tokenizer(bpe)
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (1, 2, 0)
    for text in TEXTS:
        ids = ours.encode(text, bos=True, eos=False)  # as Llama 3's tokenizer adds BOS
        assert theirs(text)["input_ids"] == ids, text
        assert theirs.decode(ids, skip_special_tokens=True) == text
