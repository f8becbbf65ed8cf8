"""FP8 block-quantized Hugging Face weights in (DeepSeek-V3's and Kimi K2's published form).

Such a folder's config.json has ``quantization_config`` with ``quant_method`` "fp8" and
``weight_block_size`` [rows, columns] (128 x 128 as published); each quantized weight is
float8 (e4m3) and comes with ``<name>_scale_inv``: one float per block of the weight's last
two dimensions, the blocks at the bottom and right edges partial. The weight is the float8
value times its block's scale. ``dequantize`` returns the state dict with every such weight
in float32 (titanlite trains from float32 masters) and the scales gone; a scale that is
missing, unmatched or of the wrong shape is a one-line UserError.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from titanlite.errors import UserError

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIX = "_scale_inv"


def block_size(config: Mapping[str, Any]) -> tuple[int, int] | None:
    """The (rows, columns) of a block of an FP8 folder's config.json, None when not FP8."""
    quant = config.get("quantization_config")
    if not isinstance(quant, Mapping) or quant.get("quant_method") != "fp8":
        return None
    size = quant.get("weight_block_size")
    valid = isinstance(size, list | tuple) and len(size) == 2
    if not valid or not all(isinstance(n, int) and n > 0 for n in size):
        raise UserError(
            f"config.json quantization_config.weight_block_size {size!r} is not two positive "
            "integers (rows, columns) such as [128, 128]"
        )
    return int(size[0]), int(size[1])


def dequantize(
    state: Mapping[str, torch.Tensor], config: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """``state`` with its FP8 weights times their block scales, in float32 (unchanged when
    config.json declares no FP8 quantization and no weight is float8)."""
    block = block_size(config)
    quantized = sorted(name for name, t in state.items() if t.dtype in FP8_DTYPES)
    if block is None:
        if quantized:
            raise UserError(
                f"tensor {quantized[0]!r} is float8 but config.json has no quantization_config "
                'with quant_method "fp8" and its weight_block_size'
            )
        return dict(state)
    scales = {name for name in state if name.endswith(SCALE_SUFFIX)}
    unmatched = sorted(s for s in scales if s.removesuffix(SCALE_SUFFIX) not in quantized)
    if unmatched:
        raise UserError(f"scale {unmatched[0]!r} belongs to no float8 weight")
    out = {name: t for name, t in state.items() if name not in scales}
    for name in quantized:
        if name + SCALE_SUFFIX not in scales:
            raise UserError(f"float8 weight {name!r} has no {name + SCALE_SUFFIX!r}")
        out[name] = dequantize_blocks(state[name], state[name + SCALE_SUFFIX], block, name)
    return out


def dequantize_blocks(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], name: str = "weight"
) -> torch.Tensor:
    """float32 ``weight`` x ``scale`` broadcast over its blocks of the last two dimensions."""
    rows, cols = weight.shape[-2:] if weight.dim() >= 2 else (0, 0)
    grid = (*weight.shape[:-2], math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if weight.dim() < 2 or tuple(scale.shape) != grid:
        raise UserError(
            f"{name + SCALE_SUFFIX!r} has shape {list(scale.shape)}; {name!r} of shape "
            f"{list(weight.shape)} in {block[0]}x{block[1]} blocks needs {list(grid)}"
        )
    full = scale.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]
    full = full.repeat_interleave(block[1], dim=-1)[..., :cols]
    return weight.float() * full
