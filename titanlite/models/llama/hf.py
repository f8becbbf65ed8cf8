"""Hugging Face adapter for Llama: titanlite state dicts and args <-> ``LlamaForCausalLM``.

Besides names, the two differ in RoPE: titanlite rotates interleaved pairs (x0, x1), ... of
each head as Meta's checkpoints do, HF rotates the two halves (x_i, x_{i + head_dim/2}).
Permuting the output rows of wq and wk per head maps one onto the other (q.k is unchanged,
so attention is too). And LlamaArgs derive the SwiGLU width from multiple_of and
ffn_dim_multiplier, while HF stores intermediate_size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from titanlite.errors import UserError
from titanlite.models import decoder_hf
from titanlite.models.llama.args import FLAVORS, LlamaArgs

HF_MODEL_TYPE = "llama"
HF_ARCHITECTURE = "LlamaForCausalLM"


def interleaved_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection, per head, from Meta's (x0, x1), (x2, x3) pair order to HF's
    rotate-half order (x0 .. x_{d/2-1} first elements, then the second elements)."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def halves_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of :func:`interleaved_to_halves`."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _permute(args: LlamaArgs, forward: bool) -> decoder_hf.Transform:
    permute = interleaved_to_halves if forward else halves_to_interleaved

    def transform(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith("attention.wq.weight"):
            return permute(tensor, args.n_heads)
        if name.endswith("attention.wk.weight"):
            return permute(tensor, args.kv_heads)
        return tensor

    return transform


def to_hf_state_dict(
    state: Mapping[str, torch.Tensor], args: LlamaArgs, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    return decoder_hf.rename_to_hf(
        state, args, decoder_hf.LAYER_NAMES, dtype=dtype, transform=_permute(args, forward=True)
    )


def from_hf_state_dict(
    state: Mapping[str, torch.Tensor], args: LlamaArgs
) -> dict[str, torch.Tensor]:
    return decoder_hf.rename_from_hf(
        state, args, decoder_hf.LAYER_NAMES, family="Llama", transform=_permute(args, forward=False)
    )


def to_hf_config(
    args: LlamaArgs,
    special_ids: Mapping[str, int | None] | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    return {
        "architectures": [HF_ARCHITECTURE],
        "model_type": HF_MODEL_TYPE,
        **decoder_hf.common_hf_config(args, special_ids or {}, dtype),
        "mlp_bias": False,
    }


def from_hf_config(config: Mapping[str, Any]) -> LlamaArgs:
    """LlamaArgs of an HF Llama ``config.json``; UserError for anything titanlite can't run."""
    decoder_hf.require_family(config, HF_MODEL_TYPE, HF_ARCHITECTURE)

    def build() -> tuple[LlamaArgs, int]:
        n_heads = int(config["num_attention_heads"])
        args = LlamaArgs(
            dim=int(config["hidden_size"]),
            n_layers=int(config["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
            vocab_size=int(config["vocab_size"]),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=decoder_hf.rope_theta(config, 10000.0),
            max_seq_len=int(config.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        )
        return args, int(config["intermediate_size"])

    args, intermediate = decoder_hf.read_fields(config, build)
    if args.n_heads < 1:
        raise UserError(f"config.json: num_attention_heads must be at least 1, got {args.n_heads}")
    head_dim = args.dim // args.n_heads
    supported = {
        "mlp_bias": (bool(config.get("mlp_bias", False)), False),
        "head_dim": (config.get("head_dim") or head_dim, head_dim),
    }
    decoder_hf.refuse_unsupported(config, supported, args)
    return _with_ffn_width(args, intermediate)


def _with_ffn_width(args: LlamaArgs, width: int) -> LlamaArgs:
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
    raise UserError(f"config.json intermediate_size={width} cannot be expressed by LlamaArgs")
