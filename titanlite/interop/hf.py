"""Hugging Face folders <-> titanlite state dicts, for every family through its adapter.

Each family's adapter (``models/<family>/hf.py``; ``titanlite.models.decoder_hf`` lists
what it provides) maps names, configs and any layout difference (Llama's RoPE permutation);
this module does what is the same for all: safetensors shards and their index, tokenizer
files, the export marker, and never overwriting a user's folder. Only ``safetensors`` is
needed at run time, never ``transformers``. ``scripts/convert_to_hf.py`` and
``scripts/convert_from_hf.py`` call ``save_hf`` and ``load_hf``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from titanlite import models
from titanlite.data.tokenizer import Tokenizer
from titanlite.errors import UserError
from titanlite.interop import fp8, mxfp4
from titanlite.interop.checkpoint_model import spec_and_args
from titanlite.interop.folders import atomic_folder, check_output_folder, read_json, write_json
from titanlite.models.spec import ModelSpec

# Written into every HF export: marks the folder as ours (so a re-export may replace it) and
# keeps the exact args (e.g. Llama's multiple_of/ffn_dim_multiplier as trained).
EXPORT_MARKER = "titanlite_export.json"
# Files an export (or an import) may contain; a folder with anything else is never replaced.
_HF_EXPORT_FILES = re.compile(
    r"^(config\.json|model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|"
    r"tokenizer\.model|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|"
    + re.escape(EXPORT_MARKER)
    + r")$"
)
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


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


def special_ids(tokenizer: Tokenizer | None) -> dict[str, int | None]:
    def known(token_id: int | None) -> int | None:
        return token_id if token_id is not None and token_id >= 0 else None

    if tokenizer is None:
        return {"bos": None, "eos": None, "pad": None}
    return {
        "bos": known(tokenizer.bos_id),
        "eos": known(tokenizer.eos_id),
        "pad": known(tokenizer.pad_id),
    }


def tokenizer_files(tokenizer: Tokenizer, max_seq_len: int) -> dict[str, dict[str, Any]]:
    """tokenizer_config.json and special_tokens_map.json for an export, so ``AutoTokenizer``
    loads the tokenizer: a sentencepiece model as a Llama tokenizer (BOS added, EOS not, as HF
    Llama does); a tokenizer.json as itself, keeping what its own config says (class, chat
    template) and naming the special tokens titanlite trained with."""
    specials = {
        f"{kind}_token": tokenizer.token_text(token_id)
        for kind, token_id in (
            ("bos", tokenizer.bos_id),
            ("eos", tokenizer.eos_id),
            ("unk", tokenizer.unk_id),
            ("pad", tokenizer.pad_id),
        )
        if token_id >= 0
    }
    if tokenizer.kind == "huggingface":
        source = tokenizer.config_path
        config = read_json(source) if source.is_file() else {}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **config, **specials}
        config |= {"clean_up_tokenization_spaces": False, "model_max_length": max_seq_len}
    else:
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
    spec: ModelSpec,
    args: Any,
    out: str | Path,
    *,
    tokenizer: Tokenizer,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = 5 * 10**9,
    source: Mapping[str, Any] | None = None,
) -> list[str]:
    """Write an HF folder for a titanlite state dict, atomically. Returns the file names.

    ``out`` must be missing, empty or an earlier export (UserError otherwise).
    """
    save_file = _safetensors().torch.save_file
    adapter = spec.hf_adapter()
    out = Path(out)
    check_output_folder(out, _HF_EXPORT_FILES, EXPORT_MARKER, key="model_args")
    tensors = adapter.to_hf_state_dict(state, args, dtype)
    groups = shard(tensors, max_shard_bytes)
    with atomic_folder(out) as tmp:
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
            write_json(tmp / "model.safetensors.index.json", index)
        write_json(tmp / "config.json", adapter.to_hf_config(args, special_ids(tokenizer), dtype))
        tokenizer.copy_files(tmp)
        for name, content in tokenizer_files(tokenizer, args.max_seq_len).items():
            write_json(tmp / name, content)
        marker = {
            "format": 1,
            "model_name": spec.name,
            "model_args": dataclasses.asdict(args),
            **(source or {}),
        }
        write_json(tmp / EXPORT_MARKER, marker)
        names = sorted(p.name for p in tmp.iterdir())
    return names


def family_of(config: Mapping[str, Any]) -> tuple[ModelSpec, ModuleType]:
    """The spec and adapter whose model_type or architecture a config.json names."""
    archs = config.get("architectures") or []
    for spec in models.REGISTRY.values():
        adapter = spec.hf_adapter()
        # An adapter may read more than its own model type (deepseek_v3: DeepSeek-V2's too).
        reads = {adapter.HF_MODEL_TYPE: adapter.HF_ARCHITECTURE}
        reads |= getattr(adapter, "HF_ALSO_READS", {})
        if config.get("model_type") in reads or any(a in archs for a in reads.values()):
            return spec, adapter
    known = ", ".join(s.hf_adapter().HF_ARCHITECTURE for s in models.REGISTRY.values())
    found = config.get("model_type") or archs
    raise UserError(
        f"not a model titanlite trains (model_type/architectures: {found!r}; knows {known})"
    )


def read_hf_model(path: str | Path) -> tuple[ModelSpec, Any, dict[str, Any]]:
    """(spec, args, config.json) of an HF folder. The args come from a titanlite export marker
    when it describes the same HF model as config.json (it keeps how a shape was expressed),
    else from config.json."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"HF folder {str(path)!r} does not exist")
    config = read_json(path / "config.json")
    spec, adapter = family_of(config)
    args = adapter.from_hf_config(config)
    if hasattr(adapter, "fit_to_tensors"):  # config.json naming more than the folder holds
        args = adapter.fit_to_tensors(args, tensor_names(path))
    marker = path / EXPORT_MARKER
    if marker.is_file():
        exported_spec, exported = spec_and_args(read_json(marker), str(path))
        if exported_spec is spec and adapter.to_hf_config(exported) == adapter.to_hf_config(args):
            args = exported
    return spec, args, config


def load_hf(path: str | Path) -> tuple[dict[str, torch.Tensor], ModelSpec, Any]:
    """(titanlite state dict, spec, args) of an HF folder (single or sharded safetensors),
    read whole in this process (``interop.hf_reader`` reads a run's shards instead)."""
    safetensors = _safetensors()
    path = Path(path)
    spec, args, config = read_hf_model(path)
    adapter = spec.hf_adapter()
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        try:
            state |= safetensors.torch.load_file(str(file))
        except (safetensors.SafetensorError, OSError) as e:
            raise UserError(f"safetensors file {str(file)!r} is unreadable ({e})") from None
    # Quantized published weights become plain tensors first: DeepSeek-V3 / Kimi K2's FP8
    # blocks (interop/fp8.py) and gpt-oss's MXFP4 experts (interop/mxfp4.py).
    state = mxfp4.dequantize(fp8.dequantize(state, config))
    return adapter.from_hf_state_dict(state, args), spec, args


def tensor_names(path: Path) -> list[str]:
    """The names of the folder's tensors, from the index or the file's header (no data)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return sorted(read_json(index).get("weight_map") or {})
    safetensors = _safetensors()
    names: list[str] = []
    for file in safetensors_files(path):
        try:
            with safetensors.safe_open(str(file), framework="pt") as f:
                names += list(f.keys())
        except (safetensors.SafetensorError, OSError) as e:
            raise UserError(f"safetensors file {str(file)!r} is unreadable ({e})") from None
    return names


def safetensors_files(path: Path) -> list[Path]:
    """The folder's safetensors files (one, or those its index lists); UserError if missing."""
    files = [path / name for name in _safetensors_files(path)]
    for file in files:
        if not file.is_file():
            raise UserError(f"safetensors file {str(file)!r} (listed in the index) is missing")
    return files


def _safetensors_files(path: Path) -> list[str]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise UserError(f"{str(index)!r} has no weight_map")
        return sorted(set(weight_map.values()))
    if (path / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise UserError(
        f"HF folder {str(path)!r} has no model.safetensors or model.safetensors.index.json"
    )


def _safetensors() -> Any:
    """The safetensors package (only these two functions need it)."""
    try:
        import safetensors.torch
    except ModuleNotFoundError:
        raise UserError("safetensors is not installed: pip install safetensors") from None
    return safetensors
