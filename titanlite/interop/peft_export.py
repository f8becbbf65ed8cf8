"""A LoRA run's adapters as a PEFT adapter folder (``scripts/convert_to_hf.py --peft-adapter``):
``adapter_config.json`` and ``adapter_model.safetensors``, which
``peft.PeftModel.from_pretrained`` loads onto the Hugging Face model of the run's base.

Names and layouts come from the family's own Hugging Face adapter (``models/<family>/hf.py``),
never from a second table: the family's ``to_hf_state_dict`` converts the model's state dict on
the meta device with one adapted linear's weight replaced by a real probe (each element
holding its row index, then, a second time, its column index). The one real tensor that comes
out tells the linear's HF name and how HF orders its rows and columns (Llama's RoPE
permutation of the q/k rows, say). B [out, rank] then takes the weight's row order and
A [rank, in] its column order, so B_hf A_hf is the weight's update in HF's layout. A linear
the HF conversion fuses with others, splits or transposes has no single HF linear for the
adapters to sit on, and a mixture's router none that PEFT adapts: refused. Llama and Qwen3
map whole (tests/test_lora_peft.py); so do the attention of Qwen3-MoE and gpt-oss, and
DeepSeek-V3's but for ``wkv_a``/``wk_rope``, Qwen3.5's but for its fused q/k/v and
query-gate projections (mapped, not run through peft in the tests).

The scale is titanlite's alpha / rank, which is PEFT's ``lora_alpha / r`` without rsLoRA.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from titanlite.checkpoint.folders import read_sidecar
from titanlite.errors import UserError
from titanlite.interop.checkpoint_model import spec_and_args
from titanlite.interop.folders import atomic_folder, check_output_folder, write_json
from titanlite.interop.lora_merge import read_adapters
from titanlite.interop.source import is_hf_folder

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
MARKER = "titanlite_export.json"  # as an HF export's: a re-export may replace the folder
_FILES = re.compile(rf"^({re.escape(CONFIG)}|{re.escape(WEIGHTS)}|{re.escape(MARKER)})$")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# What a one-tensor probe may raise from an adapter that needs a linear's partners too.
_NEEDS_MORE = (KeyError, AttributeError, IndexError, ValueError, RuntimeError, TypeError)


@dataclasses.dataclass(frozen=True)
class HfLinear:
    name: str  # the HF module, e.g. model.layers.0.self_attn.q_proj
    rows: torch.Tensor  # HF weight = titanlite weight[rows][:, cols]
    cols: torch.Tensor


@dataclasses.dataclass(frozen=True)
class PeftExport:
    files: list[str]
    step: int | None
    modules: int  # adapted linears written
    rank: int
    base: str  # the base the run loaded (checkpoint.initial_load_path, resolved)
    hf_base: bool  # whether it is an HF folder (then base_model_name_or_path)


def _order(
    adapter: Any, args: Any, context: Mapping[str, torch.Tensor], module: str, *, dim: int
) -> tuple[str, torch.Tensor] | None:
    """(HF weight name, the order of ``dim``) when the HF conversion of ``module``'s weight
    is one tensor of the same shape whose rows (dim 0) or columns (dim 1) are only reordered:
    the weight is replaced by a probe whose elements hold their row (or column) index, and
    the one tensor that comes out off the meta device shows where each went."""
    shape = tuple(context[f"{module}.weight"].shape)
    index = torch.arange(shape[dim], dtype=torch.float32)  # exact: dims are below 2**24
    probe = index.view((-1, 1) if dim == 0 else (1, -1)).expand(shape)
    try:
        converted = adapter.to_hf_state_dict({**context, f"{module}.weight": probe}, args)
    except _NEEDS_MORE:  # e.g. fused with a tensor of the context (on meta: refused)
        return None
    derived = [(name, t) for name, t in converted.items() if not t.is_meta]
    if len(derived) != 1 or tuple(derived[0][1].shape) != shape:
        return None
    name, tensor = derived[0]
    order = tensor[:, 0] if dim == 0 else tensor[0]
    spread = order.view((-1, 1) if dim == 0 else (1, -1)).expand(shape)
    if not (torch.equal(tensor, spread) and torch.equal(order.sort().values, index)):
        return None  # elements moved across rows (columns), or changed: not a reordering
    return name, order.to(torch.int64)


def hf_linear(
    adapter: Any, args: Any, context: Mapping[str, torch.Tensor], module: str
) -> HfLinear:
    """Where the family's HF conversion puts the weight of titanlite linear ``module``: one HF
    linear of the decoder layers, its rows and columns only reordered; else UserError.
    ``context`` is the model's state dict on the meta device (the rest of what it reads)."""
    rows, cols = (_order(adapter, args, context, module, dim=dim) for dim in (0, 1))
    if rows is None or cols is None or rows[0] != cols[0] or not rows[0].endswith(".weight"):
        raise UserError(
            f"--peft-adapter: the adapted linear {module} has no single linear in the Hugging "
            "Face model of this family (its weight is fused, split or transposed there); use "
            "--merge-lora"
        )
    name = rows[0].removesuffix(".weight")
    match = _LAYER.fullmatch(name)
    # A mixture's router is no nn.Linear in transformers (a router module holding the weight).
    if match is None or int(match.group(1)) >= args.n_layers or module.endswith(".router"):
        raise UserError(
            f"--peft-adapter: the adapted linear {module} ({name}) is not a linear of the "
            "Hugging Face model's decoder layers that PEFT adapts; use --merge-lora"
        )
    return HfLinear(name, rows[1], cols[1])


def peft_tensors(
    adapters: Mapping[str, torch.Tensor], spec: Any, args: Any, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], list[str], int]:
    """(PEFT's tensors by name, the adapted HF modules, the rank) of titanlite ``adapters``
    (``P.lora_a`` [rank, in] and ``P.lora_b`` [out, rank] by titanlite name)."""
    with torch.device("meta"):
        context = spec.build(args).state_dict()
    adapter = spec.hf_adapter()
    tensors: dict[str, torch.Tensor] = {}
    modules, ranks = [], set()
    for name in sorted(adapters):
        if not name.endswith(".lora_a"):
            continue
        module = name.removesuffix(".lora_a")
        a, b = adapters[name], adapters.get(module + ".lora_b")
        weight = context.get(module + ".weight")
        if b is None or weight is None or b.shape + a.shape[1:] != weight.shape[:1] + a.shape:
            raise UserError(
                f"--peft-adapter: the adapters of {module} do not fit the model's weights"
            )
        linear = hf_linear(adapter, args, context, module)
        prefix = f"base_model.model.{linear.name}"
        tensors[f"{prefix}.lora_A.weight"] = a[:, linear.cols].to(dtype).contiguous()
        tensors[f"{prefix}.lora_B.weight"] = b[linear.rows].to(dtype).contiguous()
        modules.append(linear.name)
        ranks.add(a.shape[0])
    if len(ranks) != 1:
        raise UserError(f"--peft-adapter: adapters of ranks {sorted(ranks)}; PEFT takes one")
    return tensors, modules, ranks.pop()


def target_modules(modules: list[str], n_layers: int) -> list[str]:
    """PEFT's target_modules (names matched at the end of a module's path): the paths within
    a layer (``self_attn.q_proj``) when every layer has the same adapted linears, else the
    full paths, so exactly the adapted linears get adapters."""
    per_layer: dict[int, set[str]] = {}
    for name in modules:
        layer, local = _LAYER.fullmatch(name).groups()
        per_layer.setdefault(int(layer), set()).add(local)
    locals_ = set().union(*per_layer.values())
    if sorted(per_layer) == list(range(n_layers)) and all(s == locals_ for s in per_layer.values()):
        return sorted(locals_)
    return sorted(modules)


def lora_alpha(scale: float, rank: int) -> float | int:
    """PEFT's lora_alpha for titanlite's scale alpha / rank (an integer when it is one, so
    PEFT divides exactly what titanlite divided)."""
    alpha = scale * rank
    return round(alpha) if abs(alpha - round(alpha)) < 1e-9 * max(1.0, abs(alpha)) else alpha


def export_peft_adapter(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
) -> PeftExport:
    """Write the adapters of the LoRA checkpoint folder ``checkpoint`` as a PEFT adapter
    folder ``out`` (missing, empty or an earlier one of ours), atomically; UserError for a
    checkpoint without adapters or a family whose HF model has no place for them."""
    path, out = Path(checkpoint), Path(out)
    meta = read_sidecar(path)
    if not meta.get("adapters_only"):
        raise UserError(
            f"--peft-adapter: checkpoint folder {str(path)!r} holds no LoRA adapters (not a "
            'checkpoint of a run with model.converters = ["lora"])'
        )
    scale = meta.get("adapter_scale")
    if scale is None:
        raise UserError(f"--peft-adapter: checkpoint folder {str(path)!r} records no LoRA scale")
    base = meta.get("base")
    if not base:
        raise UserError(
            f"--peft-adapter: checkpoint folder {str(path)!r}: its adapters were trained on a "
            "base that was not loaded from a folder (no checkpoint.initial_load_path), which "
            "no Hugging Face model holds"
        )
    spec, args = spec_and_args(meta, str(path))
    check_output_folder(out, _FILES, MARKER, key="adapters_of")
    tensors, modules, rank = peft_tensors(read_adapters(path), spec, args, dtype)
    # Gone: the recorded path is all that names it (a titanlite checkpoint has a sidecar).
    hf_base = is_hf_folder(base) or not Path(base).exists()
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        # A titanlite checkpoint as base: no name; its HF export is the model to adapt.
        "base_model_name_or_path": base if hf_base else None,
        "r": rank,
        "lora_alpha": lora_alpha(float(scale), rank),
        "use_rslora": False,
        "lora_dropout": 0.0,  # not recorded in the checkpoint; it matters to training only
        "target_modules": target_modules(modules, args.n_layers),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
    }
    from safetensors.torch import save_file

    with atomic_folder(out) as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        write_json(tmp / CONFIG, config)
        marker = {"format": 1, "adapters_of": str(path.resolve()), "step": meta.get("step")}
        write_json(tmp / MARKER, {**marker, "base": base, "model_name": spec.name})
        files = sorted(p.name for p in tmp.iterdir())
    return PeftExport(files, meta.get("step"), len(modules), rank, base, hf_base)
