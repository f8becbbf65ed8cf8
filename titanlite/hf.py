"""Hugging Face interop: titanlite checkpoints <-> ``LlamaForCausalLM`` folders.

The two models compute the same function but differ in three ways, all handled here:

* names: titanlite keeps Meta's (``layers.0.attention.wq``), HF has its own
  (``model.layers.0.self_attn.q_proj``);
* RoPE: titanlite rotates interleaved pairs (x0, x1), (x2, x3), ... of each head, HF rotates
  the two halves (x_i, x_{i + head_dim/2}). Permuting the output rows of wq and wk per head
  maps one onto the other (q.k is unchanged, so attention is too);
* config: ``ModelArgs`` derives the SwiGLU width from ``multiple_of``/``ffn_dim_multiplier``,
  HF stores ``intermediate_size``.

The pure functions (state dicts, configs, permutations) have no file I/O; the folder helpers
below them are what ``scripts/convert_to_hf.py`` and ``scripts/convert_from_hf.py`` call.
Only ``safetensors`` is needed at run time, never ``transformers``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sentencepiece as spm
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from titanlite.checkpoint import FORMAT, SIDECAR, SafeFileSystemReader, read_sidecar
from titanlite.data.tokenizer import Tokenizer
from titanlite.errors import UserError
from titanlite.models.llama import FLAVORS, ModelArgs, Transformer, rope_tables

logger = logging.getLogger(__name__)

# Written into every HF export: marks the folder as ours (so a re-export may replace it) and
# keeps the exact ModelArgs, so an import reproduces multiple_of/ffn_dim_multiplier as trained.
EXPORT_MARKER = "titanlite_export.json"
# Files an export (or an import) may contain; a folder with anything else is never replaced.
_HF_EXPORT_FILES = re.compile(
    r"^(config\.json|model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|"
    r"tokenizer\.model|tokenizer_config\.json|special_tokens_map\.json|"
    + re.escape(EXPORT_MARKER)
    + r")$"
)
_CHECKPOINT_FILES = re.compile(r"^(\.metadata|.*\.distcp|titanlite\.json|tokenizer\.model)$")
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------- RoPE layout
def interleaved_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection, per head, from Meta's (x0, x1), (x2, x3) pair order to HF's
    rotate-half order (x0 .. x_{d/2-1} first elements, then the second elements)."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def halves_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of :func:`interleaved_to_halves`."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


# --------------------------------------------------------------------------- state dicts
_LAYER_NAMES = {  # titanlite name within a layer -> HF name within a layer
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(name: str) -> str:
    """The HF name of a titanlite parameter name."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    match = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise KeyError(name)
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"


def to_hf_state_dict(
    state: Mapping[str, torch.Tensor], args: ModelArgs, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """titanlite state dict -> HF ``LlamaForCausalLM`` state dict (contiguous tensors).

    With tied embeddings ``lm_head.weight`` is left out (HF ties it to the embedding).
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name == "output.weight" and args.tie_embeddings:
            continue
        if name.endswith("attention.wq.weight"):
            tensor = interleaved_to_halves(tensor, args.n_heads)
        elif name.endswith("attention.wk.weight"):
            tensor = interleaved_to_halves(tensor, args.kv_heads)
        tensor = tensor.detach().to(dtype=dtype or tensor.dtype)
        out[hf_name(name)] = tensor.contiguous()
    return out


def from_hf_state_dict(
    state: Mapping[str, torch.Tensor], args: ModelArgs
) -> dict[str, torch.Tensor]:
    """HF ``LlamaForCausalLM`` state dict -> titanlite state dict (the full set of names a
    ``Transformer(args)`` has; ``output.weight`` is the embedding when tied).

    Raises UserError naming missing or unexpected tensors.
    """
    expected = _expected_names(args)
    by_hf = {hf_name(name): name for name in expected}
    # Non-parameter buffers some exporters write (HF's rotary inv_freq) carry no weights.
    given = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    unexpected = sorted(set(given) - set(by_hf))
    if unexpected:
        raise UserError(f"unexpected tensors for a Llama model: {', '.join(unexpected[:5])}")
    out: dict[str, torch.Tensor] = {}
    for hf, name in by_hf.items():
        if hf not in given:
            if name == "output.weight" and args.tie_embeddings:
                continue
            raise UserError(f"tensor {hf!r} is missing")
        tensor = given[hf]
        if name.endswith("attention.wq.weight"):
            tensor = halves_to_interleaved(tensor, args.n_heads)
        elif name.endswith("attention.wk.weight"):
            tensor = halves_to_interleaved(tensor, args.kv_heads)
        out[name] = tensor
    if args.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def _expected_names(args: ModelArgs) -> list[str]:
    names = ["tok_embeddings.weight", "norm.weight", "output.weight"]
    for i in range(args.n_layers):
        names += [f"layers.{i}.{n}" for n in _LAYER_NAMES]
    return names


# --------------------------------------------------------------------------- configs
def to_hf_config(
    args: ModelArgs, tokenizer: Tokenizer | None = None, dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    """The ``config.json`` of a ``LlamaForCausalLM`` with this shape."""

    def special(token_id: int | None) -> int | None:
        return token_id if token_id is not None and token_id >= 0 else None

    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        # Both spellings: transformers < 5 reads rope_theta, >= 5 reads rope_parameters.
        "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "rope_scaling": None,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": special(tokenizer.bos_id) if tokenizer else None,
        "eos_token_id": special(tokenizer.eos_id) if tokenizer else None,
        "pad_token_id": special(tokenizer.pad_id) if tokenizer else None,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def from_hf_config(config: Mapping[str, Any]) -> ModelArgs:
    """ModelArgs of an HF Llama ``config.json``; UserError for anything titanlite can't run."""
    archs = config.get("architectures") or []
    if config.get("model_type") != "llama" and "LlamaForCausalLM" not in archs:
        found = config.get("model_type") or archs
        raise UserError(f"not a Llama model (model_type/architectures: {found!r})")
    try:
        dim = int(config["hidden_size"])
        n_heads = int(config["num_attention_heads"])
        rope = config.get("rope_parameters") or {}
        args = ModelArgs(
            dim=dim,
            n_layers=int(config["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
            vocab_size=int(config["vocab_size"]),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            max_seq_len=int(config.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        )
        intermediate = int(config["intermediate_size"])
    except KeyError as e:
        raise UserError(f"config.json has no {e.args[0]!r}") from None
    unsupported = {
        "hidden_act": (config.get("hidden_act", "silu"), "silu"),
        "attention_bias": (bool(config.get("attention_bias", False)), False),
        "mlp_bias": (bool(config.get("mlp_bias", False)), False),
        "head_dim": (config.get("head_dim") or dim // n_heads, dim // n_heads),
        "rope_scaling": (config.get("rope_scaling") or None, None),
        "rope_type": (rope.get("rope_type", "default"), "default"),
    }
    for key, (value, supported) in unsupported.items():
        if value != supported:
            raise UserError(f"config.json {key}={value!r} is not supported (needs {supported!r})")
    try:
        args.check()
    except ValueError as e:
        raise UserError(f"config.json: {e}") from None
    return _with_ffn_width(args, intermediate)


def _with_ffn_width(args: ModelArgs, width: int) -> ModelArgs:
    """args with (multiple_of, ffn_dim_multiplier) giving exactly this SwiGLU width; the
    published flavors' settings are preferred so Llama 3 imports look like their flavor."""
    candidates = [(f.multiple_of, f.ffn_dim_multiplier) for f in FLAVORS.values()]
    base = int(2 * 4 * args.dim / 3)
    candidates.append((width, None))  # one multiple of `width` itself when width >= base
    multiplier = width / base
    candidates += [(1, multiplier), (1, multiplier * (1 + 1e-12))]  # float round-off
    for multiple_of, ffn_dim_multiplier in candidates:
        trial = dataclasses.replace(
            args, multiple_of=multiple_of, ffn_dim_multiplier=ffn_dim_multiplier
        )
        if trial.ffn_hidden_dim == width:
            return trial
    raise UserError(f"config.json intermediate_size={width} cannot be expressed by ModelArgs")


# --------------------------------------------------------------------------- checkpoints
def model_args_from_meta(meta: Mapping[str, Any], where: str) -> ModelArgs:
    try:
        args = ModelArgs(**meta["model_args"])
        args.check()
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{where}: {SIDECAR} has no usable model_args ({e})") from None
    return args


def checkpoint_tokenizer(
    meta: Mapping[str, Any], override: str | os.PathLike[str] | None, vocab_size: int
) -> Tokenizer:
    """The tokenizer given on the command line, else the one titanlite.json names; a
    UserError when neither is usable or it has more tokens than the model."""
    path = override or meta.get("tokenizer")
    if not path:
        raise UserError("the checkpoint names no tokenizer: pass --tokenizer PATH")
    if override is None and not Path(path).is_file():
        raise UserError(
            f"tokenizer {str(path)!r} named by the checkpoint is not found from "
            f"{os.getcwd()!r}: pass --tokenizer PATH"
        )
    tokenizer = Tokenizer(path)
    if tokenizer.vocab_size > vocab_size:
        raise UserError(
            f"tokenizer {str(path)!r} has {tokenizer.vocab_size} tokens, the model {vocab_size}"
        )
    return tokenizer


def load_checkpoint_model(
    path: str | os.PathLike[str],
) -> tuple[Transformer, ModelArgs, dict[str, Any]]:
    """The model (float32, CPU, eval mode) of a titanlite checkpoint folder, its args and its
    titanlite.json. Works in one process without a process group; optimizer and other
    training state in the folder are not read. UserError for incomplete or unusable folders.
    """
    path = Path(path)
    meta = read_sidecar(path)
    args = model_args_from_meta(meta, str(path))
    # Built untied (to_empty would untie anyway) and tied again below once both are loaded.
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(args, tie_embeddings=False))
    model.to_empty(device="cpu")
    model.rope = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta)
    try:
        saved = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as e:  # unreadable, or refused: not one of DCP's own metadata classes
        raise UserError(f"checkpoint folder {str(path)!r}: unreadable .metadata ({e})") from None
    state = {}
    for name, tensor in model.state_dict().items():
        info = saved.get(f"model.{name}")
        if info is None:
            if name == "output.weight" and args.tie_embeddings:
                continue  # tied: the embedding is the output projection
            raise UserError(f"checkpoint folder {str(path)!r} has no tensor model.{name}")
        size = tuple(getattr(info, "size", ()))
        if size != tuple(tensor.shape):
            raise UserError(
                f"checkpoint folder {str(path)!r}: model.{name} has shape {list(size)}, "
                f"model_args in {SIDECAR} give {list(tensor.shape)}"
            )
        state[name] = tensor
    with _quiet_single_process():
        try:
            dcp.load({"model": state}, storage_reader=SafeFileSystemReader(str(path)))
        except Exception as e:  # DCP wraps reader failures; the first line says what broke
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UserError(f"checkpoint folder {str(path)!r} is unreadable: {first}") from None
    if args.tie_embeddings:
        if "output.weight" in state and not torch.equal(
            model.output.weight, model.tok_embeddings.weight
        ):
            # Trained untied despite the flag: keep both so the function is unchanged.
            logger.warning("%s: tied model with distinct output weights; loading untied", path)
            args = dataclasses.replace(args, tie_embeddings=False)
        else:
            model.output.weight = model.tok_embeddings.weight
    model.args = args
    model.eval()
    logger.info("loaded %s (step %s)", path, meta.get("step"))
    return model, args, meta


def save_model_checkpoint(
    state: Mapping[str, torch.Tensor],
    args: ModelArgs,
    out: str | os.PathLike[str],
    tokenizer: str | os.PathLike[str] | None = None,
    source: str = "",
) -> Path:
    """Write a model-only titanlite checkpoint (DCP "model" + titanlite.json) to ``out``,
    atomically; a tokenizer file given is copied in as ``tokenizer.model``."""
    out = Path(out)
    check_output_folder(out, _CHECKPOINT_FILES, SIDECAR, key="source")
    with _atomic_folder(out) as tmp:
        with _quiet_single_process():
            dcp.save({"model": dict(state)}, storage_writer=FileSystemWriter(str(tmp)))
        tokenizer_path = None
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / "tokenizer.model")
            tokenizer_path = str((out / "tokenizer.model").resolve())
        sidecar = {
            "format": FORMAT,
            "step": 0,
            "model_only": True,
            "model_args": dataclasses.asdict(args),
            "tokenizer": tokenizer_path,
            "time": time.time(),
            "source": source,
        }
        (tmp / SIDECAR).write_text(json.dumps(sidecar, indent=2) + "\n")
    return out


# --------------------------------------------------------------------------- HF folders
def parse_size(text: str) -> int:
    """Bytes of '5GB', '500MB', '2GiB', '1000' (decimal units as HF, binary with 'i')."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _SIZE_UNITS or float(match.group(1)) <= 0:
        raise UserError(f"size {text!r} is not a positive size like 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def shard(tensors: Mapping[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors of at most max_bytes each (a bigger tensor alone)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def tokenizer_files(tokenizer: Tokenizer, max_seq_len: int) -> dict[str, dict[str, Any]]:
    """tokenizer_config.json and special_tokens_map.json for the sentencepiece model, so
    ``AutoTokenizer`` loads it as a Llama tokenizer (BOS added, EOS not, as HF Llama does)."""
    # The wrapper exposes special ids, not their strings: ask sentencepiece itself.
    piece = spm.SentencePieceProcessor(model_file=str(tokenizer.path)).id_to_piece
    specials = {
        f"{kind}_token": piece(token_id)
        for kind, token_id in (
            ("bos", tokenizer.bos_id),
            ("eos", tokenizer.eos_id),
            ("unk", tokenizer.unk_id),
            ("pad", tokenizer.pad_id),
        )
        if token_id >= 0
    }
    config = {
        "tokenizer_class": "LlamaTokenizer",
        **specials,
        "add_bos_token": tokenizer.bos_id >= 0,
        "add_eos_token": False,
        "legacy": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_seq_len,
    }
    return {"tokenizer_config.json": config, "special_tokens_map.json": specials}


def save_hf(
    state: Mapping[str, torch.Tensor],
    args: ModelArgs,
    out: str | os.PathLike[str],
    tokenizer: Tokenizer,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = 5 * 10**9,
    source: Mapping[str, Any] | None = None,
) -> list[str]:
    """Write an HF Llama folder for a titanlite state dict, atomically. Returns the file names.

    ``out`` must be missing, empty or an earlier export (UserError otherwise).
    """
    save_file = _safetensors().torch.save_file
    out = Path(out)
    check_output_folder(out, _HF_EXPORT_FILES, EXPORT_MARKER, key="model_args")
    tensors = to_hf_state_dict(state, args, dtype)
    groups = shard(tensors, max_shard_bytes)
    with _atomic_folder(out) as tmp:
        if len(groups) == 1:
            save_file(groups[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, group in enumerate(groups, start=1):
                name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
                save_file(group, str(tmp / name), metadata={"format": "pt"})
                weight_map |= {tensor_name: name for tensor_name in group}
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            _write_json(tmp / "model.safetensors.index.json", index)
        _write_json(tmp / "config.json", to_hf_config(args, tokenizer, dtype))
        shutil.copyfile(tokenizer.path, tmp / "tokenizer.model")
        for name, content in tokenizer_files(tokenizer, args.max_seq_len).items():
            _write_json(tmp / name, content)
        marker = {"format": 1, "model_args": dataclasses.asdict(args), **(source or {})}
        _write_json(tmp / EXPORT_MARKER, marker)
        names = sorted(p.name for p in tmp.iterdir())
    return names


def load_hf(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], ModelArgs]:
    """(titanlite state dict, ModelArgs) of an HF Llama folder (single or sharded
    safetensors). ModelArgs come from a titanlite export marker when it agrees with
    config.json (exact multiple_of etc.), else from config.json."""
    safetensors = _safetensors()
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"HF folder {str(path)!r} does not exist")
    config = _read_json(path / "config.json")
    args = from_hf_config(config)
    marker = path / EXPORT_MARKER
    if marker.is_file():
        exported = model_args_from_meta(_read_json(marker), str(path))
        if dataclasses.replace(exported, ffn_dim_multiplier=None, multiple_of=1) == (
            dataclasses.replace(args, ffn_dim_multiplier=None, multiple_of=1)
        ) and (exported.ffn_hidden_dim == args.ffn_hidden_dim):
            args = exported
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise UserError(f"{str(index)!r} has no weight_map")
        files = sorted(set(weight_map.values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise UserError(
            f"HF folder {str(path)!r} has no model.safetensors or model.safetensors.index.json"
        )
    state: dict[str, torch.Tensor] = {}
    for name in files:
        file = path / name
        if not file.is_file():
            raise UserError(f"safetensors file {str(file)!r} (listed in the index) is missing")
        try:
            state |= safetensors.torch.load_file(str(file))
        except (safetensors.SafetensorError, OSError) as e:
            raise UserError(f"safetensors file {str(file)!r} is unreadable ({e})") from None
    return from_hf_state_dict(state, args), args


def _safetensors() -> Any:
    """The safetensors package (only these two functions need it)."""
    try:
        import safetensors.torch
    except ModuleNotFoundError:
        raise UserError("safetensors is not installed: pip install safetensors") from None
    return safetensors


# --------------------------------------------------------------------------- folder safety
def check_output_folder(out: Path, allowed: re.Pattern[str], marker: str, key: str) -> None:
    """UserError unless out is missing, empty, or an earlier output of ours: nothing but
    files we write, and a marker JSON file holding ``key``. User data (a training
    checkpoint, a hand-made HF folder) is never replaced."""
    if not out.exists():
        return
    if not out.is_dir():
        raise UserError(f"output {str(out)!r} exists and is not a folder")
    names = sorted(p.name for p in out.iterdir())
    if not names:
        return
    foreign = [n for n in names if not allowed.match(n)]
    try:
        ours = key in json.loads((out / marker).read_text())
    except (OSError, ValueError, TypeError):
        ours = False
    if foreign or not ours:
        reason = f"holds {', '.join(foreign[:3])}" if foreign else f"{marker} is not ours"
        raise UserError(
            f"output folder {str(out)!r} is not empty and not an earlier conversion "
            f"({reason}); choose a new or empty folder"
        )


@contextmanager
def _atomic_folder(out: Path) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it replaces ``out`` in one rename."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        for file in tmp.iterdir():  # some writers create private (0600) files
            file.chmod(0o666 & ~umask)
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not out.exists():
            os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    # DCP warns that it assumes one process when no process group exists: that is the intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* single process")
        yield


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise UserError(f"{str(path)!r} does not exist")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{str(path)!r} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise UserError(f"{str(path)!r} does not hold a JSON object")
    return data


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
