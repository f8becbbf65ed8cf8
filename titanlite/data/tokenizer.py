"""Tokenizers: sentencepiece ``.model`` files and Hugging Face ``tokenizer.json`` files.

``load_tokenizer(path)`` picks the kind from what ``path`` holds:

- a sentencepiece model (the shipped one, or a Llama 2 / Mistral ``tokenizer.model``): the
  special ids come from the model itself;
- a Hugging Face ``tokenizer.json`` (Llama 3's 128K BPE, Qwen, GPT-2, one trained with
  ``scripts/train_tokenizer.py --kind bpe``), or a folder holding one: loaded with the
  ``tokenizers`` library; BOS/EOS/pad/unk are the tokens its ``tokenizer_config.json`` names
  (beside the file), else the usual names (``<|begin_of_text|>``, ``<s>``, ...) when present.
  Tokens that the config names but tokenizer.json lacks (TorchTitan's test tokenizer names
  a BOS, EOS and pad its vocabulary does not have) get new ids after the vocabulary, the ids
  transformers' ``AutoTokenizer`` gives them, and count in ``vocab_size``.

Both encode the same way for the data pipeline: BOS first and EOS last when asked and the
tokenizer has them (never a tokenizer.json's own post-processing), ids as int32 (any
vocabulary below 2**31 fits). An id the tokenizer does not have is -1.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm

from titanlite.errors import UserError

logger = logging.getLogger(__name__)

DEFAULT_TOKENIZER_PATH = Path(__file__).resolve().parent.parent / "assets" / "tokenizer.model"
HF_TOKENIZER_FILE = "tokenizer.json"
HF_TOKENIZER_CONFIG = "tokenizer_config.json"
SENTENCEPIECE_FILE = "tokenizer.model"
SPECIAL_KINDS = ("bos", "eos", "pad", "unk")
# transformers' named special tokens, in the order it appends those a tokenizer.json lacks.
_NAMED_SPECIALS = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")
# Special tokens looked for when a tokenizer.json comes without a tokenizer_config.json.
_USUAL_NAMES = {
    "bos": ("<|begin_of_text|>", "<s>", "<|startoftext|>", "<bos>"),
    "eos": ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>"),
    "pad": ("<pad>", "<|pad|>", "<|finetune_right_pad_id|>"),
    "unk": ("<unk>", "<|unk|>"),
}


def default_num_threads() -> int:
    """Encoding threads: the cores this process may use, capped so that several ranks on one
    node do not oversubscribe the CPU."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


class Tokenizer:
    """What the data pipeline, the trainer and the exports use of a tokenizer."""

    kind: str
    path: Path
    """The tokenizer's file (a folder given is resolved to the file inside it)."""
    num_threads: int
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int
    unk_id: int
    fingerprint: str
    """Identifies the tokenizer's content (not its path): a loader state made with one
    tokenizer must not be resumed with another."""

    def _ids(self, texts: list[str]) -> list[Sequence[int]]:
        raise NotImplementedError

    def token_text(self, token_id: int) -> str:
        """The string of one token (used to name special tokens in exports)."""
        raise NotImplementedError

    def copy_files(self, folder: Path) -> Path:
        """Copy the files that make this tokenizer into ``folder``; the path to load it from."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of ``ids``; special tokens (BOS, EOS, pad) decode to nothing."""
        raise NotImplementedError

    def _wrap(self, ids: Sequence[int], bos: bool, eos: bool) -> list[int]:
        head = [self.bos_id] if bos and self.bos_id >= 0 else []
        tail = [self.eos_id] if eos and self.eos_id >= 0 else []
        return [*head, *ids, *tail]

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        """Token ids of ``text``, with BOS first and EOS last when asked (and the tokenizer
        has them)."""
        return self.encode_batch([text], bos, eos)[0]

    def encode_batch(
        self, texts: Sequence[str], bos: bool = True, eos: bool = True
    ) -> list[list[int]]:
        """``[encode(t, bos, eos) for t in texts]``, computed on ``num_threads`` threads."""
        return [self._wrap(ids, bos, eos) for ids in self._ids(list(texts))]

    def encode_concat(self, texts: Sequence[str], bos: bool = True, eos: bool = True) -> np.ndarray:
        """All ``texts`` encoded and concatenated into one int32 array (the packing input)."""
        if not texts:
            return np.empty(0, dtype=np.int32)
        head = np.array([self.bos_id] if bos and self.bos_id >= 0 else [], dtype=np.int32)
        tail = np.array([self.eos_id] if eos and self.eos_id >= 0 else [], dtype=np.int32)
        parts: list[np.ndarray] = []
        for ids in self._ids(list(texts)):
            parts += [head, np.asarray(ids, dtype=np.int32), tail]
        return np.concatenate(parts)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, vocab_size={self.vocab_size})"


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model file; ``pad_id`` is -1 when the model has none."""

    kind = "sentencepiece"

    def __init__(self, path: str | os.PathLike[str], num_threads: int | None = None) -> None:
        self.path = Path(path)
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(str(self.path))
        except (RuntimeError, OSError):
            raise UserError(
                f"tokenizer file {str(self.path)!r} is neither a sentencepiece model nor a "
                f"Hugging Face {HF_TOKENIZER_FILE}"
            ) from None
        self.num_threads = num_threads or default_num_threads()
        self.vocab_size = self._sp.vocab_size()
        self.bos_id = self._sp.bos_id()
        self.eos_id = self._sp.eos_id()
        self.pad_id = self._sp.pad_id()
        self.unk_id = self._sp.unk_id()
        self.fingerprint = hashlib.sha256(self._sp.serialized_model_proto()).hexdigest()[:16]

    def _flags(self, bos: bool, eos: bool) -> dict[str, bool]:
        # sentencepiece refuses add_bos/add_eos for a model without that token: skip it instead.
        return {"add_bos": bos and self.bos_id >= 0, "add_eos": eos and self.eos_id >= 0}

    def encode_batch(
        self, texts: Sequence[str], bos: bool = True, eos: bool = True
    ) -> list[list[int]]:
        return self._sp.encode(list(texts), num_threads=self.num_threads, **self._flags(bos, eos))

    def encode_concat(self, texts: Sequence[str], bos: bool = True, eos: bool = True) -> np.ndarray:
        if not texts:
            return np.empty(0, dtype=np.int32)
        arrays = self._sp.encode_as_numpy(
            list(texts), num_threads=self.num_threads, **self._flags(bos, eos)
        )
        return np.concatenate(arrays).astype(np.int32, copy=False)

    def token_text(self, token_id: int) -> str:
        return self._sp.id_to_piece(token_id)

    def copy_files(self, folder: Path) -> Path:
        shutil.copyfile(self.path, folder / SENTENCEPIECE_FILE)
        return folder / SENTENCEPIECE_FILE

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._sp.decode([int(i) for i in ids])


def _token_name(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _model_specific_tokens(config: dict[str, Any]) -> list[tuple[str, Any]]:
    """The other ``*_token`` keys (``image_token``, ...) that transformers takes as special
    tokens, in its order: those written as AddedToken objects, then those written as
    strings, then extra_special_tokens when it is a dict of named tokens."""
    others = [
        (key, value)
        for key, value in config.items()
        if key.endswith("_token") and key.removesuffix("_token") not in _NAMED_SPECIALS
    ]
    as_objects = [
        (key, value)
        for key, value in others
        if isinstance(value, dict) and value.get("__type") == "AddedToken"
    ]
    as_strings = [(key, value) for key, value in others if isinstance(value, str)]
    extras = config.get("extra_special_tokens") or config.get("additional_special_tokens")
    named_extras = list(extras.items()) if isinstance(extras, dict) else []
    merged = dict(as_objects)
    merged.update(as_strings + named_extras)
    return list(merged.items())


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json``, encoded with the ``tokenizers`` library (Rust)."""

    kind = "huggingface"

    def __init__(self, path: str | os.PathLike[str], num_threads: int | None = None) -> None:
        self.path = Path(path)
        self.num_threads = num_threads or default_num_threads()
        # The library's thread pool reads this once, when it first encodes a batch.
        os.environ.setdefault("RAYON_NUM_THREADS", str(self.num_threads))
        try:
            import tokenizers
        except ImportError:
            raise UserError(
                f"tokenizer {str(self.path)!r} is a Hugging Face tokenizer, which needs the "
                "tokenizers package: pip install tokenizers"
            ) from None
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as exc:  # the library raises a bare Exception for any bad file
            reason = str(exc).splitlines()[0] if str(exc) else "unreadable"
            raise UserError(
                f"tokenizer file {str(self.path)!r} is not a usable Hugging Face "
                f"{HF_TOKENIZER_FILE} ({reason})"
            ) from None
        self.config_path = self.path.parent / HF_TOKENIZER_CONFIG
        config = self._read_config()
        base_size = self._tok.get_vocab_size(with_added_tokens=True)
        new_tokens = self._add_config_tokens(config)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_tokens = self._special_tokens(config)
        ids = {kind: self._tok.token_to_id(name) for kind, name in self.special_tokens.items()}
        self.bos_id, self.eos_id, self.pad_id, self.unk_id = (
            ids.get(kind, -1) for kind in SPECIAL_KINDS
        )
        digest = hashlib.sha256(self.path.read_bytes())
        digest.update(json.dumps(self.special_tokens, sort_keys=True).encode())
        if new_tokens:  # only then: a tokenizer that gains no ids keeps its fingerprint
            digest.update(json.dumps(new_tokens).encode())
            listed = ", ".join(f"{name} = {self._tok.token_to_id(name)}" for name in new_tokens)
            logger.info(
                "%s names tokens that %s lacks; they get the ids transformers gives them, "
                "after the vocabulary of %d: %s",
                self.config_path,
                self.path.name,
                base_size,
                listed,
            )
        self.fingerprint = digest.hexdigest()[:16]

    def _read_config(self) -> dict[str, Any] | None:
        """tokenizer_config.json beside the file, or None when there is none."""
        if not self.config_path.is_file():
            return None
        try:
            config = json.loads(self.config_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UserError(f"{self.config_path} is not valid JSON ({exc})") from None
        if not isinstance(config, dict):
            raise UserError(f"{self.config_path} is not a JSON object")
        return config

    def _added_token(self, value: Any, where: str) -> Any:
        """A token as tokenizer_config.json writes one: a string (a special token) or an object
        with its content and flags."""
        from tokenizers import AddedToken

        if isinstance(value, str):
            return AddedToken(value, special=True)
        if isinstance(value, dict) and isinstance(value.get("content"), str):
            flags = {flag: bool(value[flag]) for flag in _TOKEN_FLAGS if flag in value}
            return AddedToken(value["content"], **flags)
        raise UserError(
            f"{self.config_path}: {where} is {value!r}, not a token (a string or an object "
            'with a "content" string)'
        )

    def _add_config_tokens(self, config: dict[str, Any] | None) -> list[str]:
        """Add the tokens that tokenizer_config.json names and tokenizer.json does not hold, in
        transformers' order (so with its ids): added_tokens_decoder's entries by their stated
        id (that id itself is not kept: new ids follow the vocabulary), then the named special
        tokens (bos, eos, unk, sep, pad, cls, mask, then other ``*_token`` keys), then
        extra_special_tokens. The strings that got new ids, in id order."""
        if not config:
            return []
        held = self._tok.get_added_tokens_decoder().values()
        held_content = {token.content for token in held}
        held_repr = {repr(token) for token in held}
        decoder = config.get("added_tokens_decoder") or {}
        if not isinstance(decoder, dict):
            raise UserError(f"{self.config_path}: added_tokens_decoder is not a JSON object")
        stated: dict[int, Any] = {}
        for key, value in decoder.items():
            where = f"added_tokens_decoder[{key!r}]"
            try:
                token_id = int(key)
            except ValueError:
                raise UserError(f"{self.config_path}: {where}: {key!r} is not a token id") from None
            if not isinstance(value, dict):  # transformers takes no bare string here either
                raise UserError(f"{self.config_path}: {where} is {value!r}, not a token object")
            stated[token_id] = token = self._added_token(value, where)
            there = self._tok.id_to_token(token_id)
            if there is not None and there != token.content:
                raise UserError(
                    f"{self.config_path}: {where} is {token.content!r} but id {token_id} of "
                    f"{self.path} is {there!r}: the two files are not of one tokenizer"
                )
        to_add = [stated[i] for i in sorted(stated) if repr(stated[i]) not in held_repr]
        known = held_content | {token.content for token in to_add}
        named = [
            (f"{kind}_token", config.get(f"{kind}_token")) for kind in _NAMED_SPECIALS
        ] + _model_specific_tokens(config)
        extras = config.get("extra_special_tokens") or config.get("additional_special_tokens")
        if isinstance(extras, dict):
            extras = None  # a dict of named tokens: in _model_specific_tokens already
        if extras is not None and not isinstance(extras, list):
            raise UserError(f"{self.config_path}: extra_special_tokens is not a list")
        named += [(f"extra_special_tokens[{i}]", value) for i, value in enumerate(extras or [])]
        named_content: set[str] = set()
        for where, value in named:
            if value is None or value == "":
                continue
            token = self._added_token(value, where)
            if not where.startswith("extra_special_tokens"):
                named_content.add(token.content)
            if token.content not in known:
                known.add(token.content)
                to_add.append(token)
        for token in to_add:  # a named token is special, whatever its entry says
            if not token.special and token.content in named_content:
                token.special = True
        new = [token.content for token in to_add if self._tok.token_to_id(token.content) is None]
        self._tok.add_tokens(to_add)
        return new

    def _special_tokens(self, config: dict[str, Any] | None) -> dict[str, str]:
        """kind -> token string, from tokenizer_config.json, else the usual names present."""
        if config is not None:
            found = {kind: _token_name(config.get(f"{kind}_token")) for kind in SPECIAL_KINDS}
            return {kind: name for kind, name in found.items() if name}
        found = {}
        for kind, names in _USUAL_NAMES.items():
            present = [name for name in names if self._tok.token_to_id(name) is not None]
            if present:
                found[kind] = present[0]
        return found

    def _ids(self, texts: list[str]) -> list[Sequence[int]]:
        # No add_special_tokens: BOS/EOS are placed by _wrap, the same for every tokenizer.
        encodings = self._tok.encode_batch_fast(texts, add_special_tokens=False)
        return [e.ids for e in encodings]

    def token_text(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id)

    def encode_spans(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of ``text`` as transformers encodes a rendered chat (nothing added), and the
        character span each token came from."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def copy_files(self, folder: Path) -> Path:
        shutil.copyfile(self.path, folder / HF_TOKENIZER_FILE)
        if self.config_path.is_file():
            shutil.copyfile(self.config_path, folder / HF_TOKENIZER_CONFIG)
        return folder / HF_TOKENIZER_FILE

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def load_tokenizer(path: str | os.PathLike[str], num_threads: int | None = None) -> Tokenizer:
    """The tokenizer at ``path``: a sentencepiece model, a tokenizer.json, or a folder holding
    either (tokenizer.json first); a UserError naming the path otherwise."""
    path = Path(path)
    if path.is_dir():
        for name in (HF_TOKENIZER_FILE, SENTENCEPIECE_FILE):
            if (path / name).is_file():
                return load_tokenizer(path / name, num_threads)
        raise UserError(
            f"tokenizer folder {str(path)!r} holds neither {HF_TOKENIZER_FILE} nor "
            f"{SENTENCEPIECE_FILE}"
        )
    if not path.is_file():
        raise UserError(f"tokenizer file {str(path)!r} does not exist")
    try:
        with open(path, "rb") as f:
            start = f.read(64).lstrip()
    except OSError as exc:
        raise UserError(f"tokenizer file {str(path)!r} cannot be read ({exc.strerror})") from None
    if start.startswith(b"{"):  # JSON: a serialized sentencepiece model is protobuf
        return HFTokenizer(path, num_threads)
    return SentencePieceTokenizer(path, num_threads)
