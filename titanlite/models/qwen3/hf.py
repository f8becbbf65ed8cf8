"""Hugging Face adapter for Qwen3: titanlite state dicts and args <-> ``Qwen3ForCausalLM``.

titanlite's Qwen3 rotates halves as HF does and states head_dim and the MLP width as HF does,
so the two differ in names only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from titanlite.models import decoder_hf
from titanlite.models.qwen3.args import Qwen3Args

HF_MODEL_TYPE = "qwen3"
HF_ARCHITECTURE = "Qwen3ForCausalLM"

LAYER_NAMES = {
    **decoder_hf.LAYER_NAMES,
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}


def to_hf_state_dict(
    state: Mapping[str, torch.Tensor], args: Qwen3Args, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    return decoder_hf.rename_to_hf(state, args, LAYER_NAMES, dtype=dtype)


def from_hf_state_dict(
    state: Mapping[str, torch.Tensor], args: Qwen3Args
) -> dict[str, torch.Tensor]:
    return decoder_hf.rename_from_hf(state, args, LAYER_NAMES, family="Qwen3")


def to_hf_config(
    args: Qwen3Args,
    special_ids: Mapping[str, int | None] | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    return {
        "architectures": [HF_ARCHITECTURE],
        "model_type": HF_MODEL_TYPE,
        **decoder_hf.common_hf_config(args, special_ids or {}, dtype),
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.n_layers,
        "layer_types": ["full_attention"] * args.n_layers,
    }


def from_hf_config(config: Mapping[str, Any]) -> Qwen3Args:
    """Qwen3Args of an HF Qwen3 ``config.json``; UserError for anything titanlite can't run."""
    decoder_hf.require_family(config, HF_MODEL_TYPE, HF_ARCHITECTURE)

    def build() -> Qwen3Args:
        n_heads = int(config["num_attention_heads"])
        return Qwen3Args(
            dim=int(config["hidden_size"]),
            n_layers=int(config["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
            head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // n_heads),
            hidden_dim=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=decoder_hf.rope_theta(config, 1_000_000.0),
            max_seq_len=int(config.get("max_position_embeddings", 4096)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

    args = decoder_hf.read_fields(config, build)
    layer_types = set(config.get("layer_types") or ["full_attention"])
    supported = {
        "use_sliding_window": (bool(config.get("use_sliding_window", False)), False),
        "layer_types": (sorted(layer_types), ["full_attention"]),
    }
    decoder_hf.refuse_unsupported(config, supported, args)
    return args
