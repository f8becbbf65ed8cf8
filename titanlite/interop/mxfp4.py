"""MXFP4 weights in: the published gpt-oss checkpoints store every expert projection as
4-bit floats with a shared exponent per 32 values; ``dequantize`` turns them back into
ordinary tensors before a family's adapter maps the names.

The format (OCP microscaling, as gpt-oss writes it), for a projection ``<name>``:

- ``<name>_blocks`` uint8 [experts, rows, groups, 16]: each byte holds two e2m1 values (one
  sign bit, two exponent bits, one mantissa bit), the even element of a pair in the low four
  bits and the odd one in the high four; 16 bytes make a group of 32 values;
- ``<name>_scales`` uint8 [experts, rows, groups]: the group's e8m0 exponent, biased by 127,
  so an element is its e2m1 value times 2 ** (scale - 127);
- a row of groups is one output feature: [experts, rows, groups x 32] transposed to
  [experts, groups x 32, rows] is the tensor Hugging Face's unquantized model holds
  (``gate_up_proj`` [experts, dim, 2 x hidden], ``down_proj`` [experts, hidden, dim]).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from titanlite.errors import UserError

BLOCKS, SCALES = "_blocks", "_scales"
GROUP = 32
"""Values sharing one exponent (16 bytes of a ``_blocks`` tensor)."""
EXPONENT_BIAS = 127


def e2m1_values() -> torch.Tensor:
    """The 16 values of a 4-bit e2m1 code, by code: bit 3 the sign, bits 2-1 the exponent
    (bias 1; 0 means subnormal), bit 0 the mantissa."""
    values = []
    for code in range(16):
        exponent, mantissa = (code >> 1) & 3, code & 1
        magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
        values.append(-magnitude if code & 8 else magnitude)
    return torch.tensor(values, dtype=torch.float32)


def dequantize_one(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[..., rows, groups, 16] codes and [..., rows, groups] exponents -> [..., groups x 32,
    rows] values (assumed checked: see ``dequantize``). One leading slice (an expert) at a
    time, so the temporaries stay a few times one expert's size."""
    if blocks.dim() > 3:
        return torch.stack(
            [dequantize_one(b, s, dtype) for b, s in zip(blocks, scales, strict=True)]
        )
    table = e2m1_values().to(blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # the low nibble first
    values = table[codes.long()] * torch.exp2(scales.float() - EXPONENT_BIAS)[..., None]
    return values.flatten(-2).transpose(-1, -2).to(dtype).contiguous()


def dequantize(
    state: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """``state`` with each ``<name>_blocks`` / ``<name>_scales`` pair replaced by ``<name>``
    dequantized to ``dtype``; the other tensors as they are. UserError for a pair that is
    incomplete or whose shapes or types are not MXFP4's."""
    out = {k: v for k, v in state.items() if not k.endswith((BLOCKS, SCALES))}
    names = sorted({k.removesuffix(BLOCKS).removesuffix(SCALES) for k in state} - set(out))
    for name in names:
        blocks, scales = state.get(name + BLOCKS), state.get(name + SCALES)
        if blocks is None or scales is None:
            missing = name + (BLOCKS if blocks is None else SCALES)
            raise UserError(f"MXFP4 tensor {missing!r} is missing (blocks need their scales)")
        _check(name, blocks, scales)
        out[name] = dequantize_one(blocks, scales, dtype)
    return out


def _check(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    problem = None
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        problem = f"are {blocks.dtype} and {scales.dtype}, not uint8"
    elif blocks.dim() < 3 or blocks.shape[-1] != GROUP // 2:
        problem = f"blocks have shape {list(blocks.shape)}, not [..., rows, groups, {GROUP // 2}]"
    elif blocks.shape[:-1] != scales.shape:
        problem = (
            f"blocks {list(blocks.shape)} and scales {list(scales.shape)} disagree (scales "
            f"must be the blocks' shape without its last {GROUP // 2})"
        )
    if problem:
        raise UserError(f"MXFP4 tensor {name!r}: {problem}")
