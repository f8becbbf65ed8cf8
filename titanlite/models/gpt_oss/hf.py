"""Hugging Face adapter for gpt-oss: titanlite state dicts and args <-> ``GptOssForCausalLM``.

Names differ, and the experts' layout: titanlite keeps gate, up and down as three
[experts, in, out] tensors with their biases (``feed_forward.experts.w1/w3/w2``,
``b1/b3/b2``); Hugging Face fuses gate and up into ``mlp.experts.gate_up_proj`` [experts,
dim, 2 x hidden] with the two interleaved (gate in the even columns, up in the odd), likewise
their biases, and stores ``down_proj`` [experts, hidden, dim] as titanlite does. The sinks are
``self_attn.sinks``; the per-layer windows are ``layer_types`` (read as ``model.layer_types``
unless they are the default alternation) and YaRN ``rope_parameters``.

Published checkpoints store the experts in MXFP4 (``*_blocks`` + ``*_scales``):
``titanlite.interop.mxfp4`` dequantizes them before this adapter sees them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from titanlite.errors import UserError
from titanlite.models import decoder_hf
from titanlite.models.gpt_oss.args import GptOssArgs

HF_MODEL_TYPE = "gpt_oss"
HF_ARCHITECTURE = "GptOssForCausalLM"

LAYER_NAMES = {
    **{k: v for k, v in decoder_hf.LAYER_NAMES.items() if not k.startswith("feed_forward.")},
    **{f"attention.w{p}.bias": f"self_attn.{p}_proj.bias" for p in "qkvo"},
    "attention.core.sinks": "self_attn.sinks",
    "feed_forward.router.weight": "mlp.router.weight",
    "feed_forward.router.bias": "mlp.router.bias",
}
_EXPERTS = re.compile(r"layers\.(\d+)\.feed_forward\.(experts\.[wb][123]|expert_bias)")


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[..., hidden] gate and up -> [..., 2 x hidden], gate at even positions."""
    return torch.stack([gate, up], dim=-1).flatten(-2)


def to_hf_state_dict(
    state: Mapping[str, torch.Tensor], args: GptOssArgs, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    _refuse_what_hf_lacks(args)
    dense = {k: v for k, v in state.items() if not _EXPERTS.fullmatch(k)}
    out = decoder_hf.rename_to_hf(dense, args, LAYER_NAMES, dtype=dtype)
    for layer in range(args.n_layers):
        mine, hf = f"layers.{layer}.feed_forward.experts.", f"model.layers.{layer}.mlp.experts."
        if mine + "w1" not in state:
            continue
        tensors = {
            "gate_up_proj": _interleave(state[mine + "w1"], state[mine + "w3"]),
            "gate_up_proj_bias": _interleave(state[mine + "b1"], state[mine + "b3"]),
            "down_proj": state[mine + "w2"],
            "down_proj_bias": state[mine + "b2"],
        }
        for name, tensor in tensors.items():
            out[hf + name] = tensor.detach().to(dtype=dtype or tensor.dtype).contiguous()
    return out


def from_hf_state_dict(
    state: Mapping[str, torch.Tensor], args: GptOssArgs
) -> dict[str, torch.Tensor]:
    experts = {k: v for k, v in state.items() if ".mlp.experts." in k}
    dense = {k: v for k, v in state.items() if k not in experts}
    out = decoder_hf.rename_from_hf(dense, args, LAYER_NAMES, family="gpt-oss")
    for layer in range(args.n_layers):
        hf, mine = f"model.layers.{layer}.mlp.experts.", f"layers.{layer}.feed_forward."
        gate_up, gate_up_bias = (
            _take(experts, hf + "gate_up_proj"),
            _take(experts, hf + "gate_up_proj_bias"),
        )
        out[mine + "experts.w1"], out[mine + "experts.w3"] = gate_up[..., ::2], gate_up[..., 1::2]
        out[mine + "experts.b1"] = gate_up_bias[..., ::2]
        out[mine + "experts.b3"] = gate_up_bias[..., 1::2]
        out[mine + "experts.w2"] = _take(experts, hf + "down_proj")
        out[mine + "experts.b2"] = _take(experts, hf + "down_proj_bias")
        out[mine + "expert_bias"] = torch.zeros(args.num_experts)
    if experts:
        raise UserError(f"unexpected tensors for a gpt-oss model: {', '.join(sorted(experts)[:5])}")
    return out


def _take(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise UserError(f"tensor {name!r} is missing")
    return tensors.pop(name)


def _refuse_what_hf_lacks(args: GptOssArgs) -> None:
    lacking = {
        "shared_experts": (args.shared_experts, 0),
        "score_func": (args.score_func, "softmax"),
        "norm_topk": (args.norm_topk, True),
        "bias_update_rate": (args.bias_update_rate, 0.0),
        "capacity_factor": (args.capacity_factor, 0.0),
        "attention_sinks": (args.attention_sinks, True),
    }
    for key, (value, plain) in lacking.items():
        if value != plain:
            raise UserError(
                f"model.{key}={value!r}: Hugging Face's gpt-oss has no such option "
                f"(needs {plain!r}), so this model cannot be exported to it"
            )


def _layer_types(args: GptOssArgs) -> list[str]:
    return [
        "full_attention" if args.layer_window(i) is None else "sliding_attention"
        for i in range(args.n_layers)
    ]


def to_hf_config(
    args: GptOssArgs,
    special_ids: Mapping[str, int | None] | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    _refuse_what_hf_lacks(args)
    common = decoder_hf.common_hf_config(args, special_ids or {}, dtype, attention_variants=True)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.yarn is not None:
        rope = {
            "rope_type": "yarn",
            "rope_theta": args.rope_theta,
            "factor": args.rope_factor,
            "beta_fast": args.rope_beta_fast,
            "beta_slow": args.rope_beta_slow,
            "truncate": args.rope_truncate,
            "original_max_position_embeddings": args.rope_original_max_seq_len,
        }
    return {
        "architectures": [HF_ARCHITECTURE],
        "model_type": HF_MODEL_TYPE,
        **common,
        "intermediate_size": args.moe_hidden_dim,
        "num_local_experts": args.num_experts,
        "num_experts_per_tok": args.top_k,
        "router_aux_loss_coef": args.aux_loss_coef,
        "output_router_logits": False,
        "rope_parameters": rope,
        "rope_scaling": None,
        "attention_bias": True,
        "sliding_window": args.sliding_window or None,
        "layer_types": _layer_types(args),
        "swiglu_alpha": args.swiglu_alpha,
        "swiglu_limit": args.swiglu_limit,
    }


def explicit_layer_types(config: Mapping[str, Any]) -> list[str]:
    """config.json's layer_types when they are not gpt-oss's alternation (sliding first: the
    default window_pattern "LG"; that one is kept as the pattern, the args stay a flavor's)."""
    types = [str(t) for t in config.get("layer_types") or []]
    alternating = [("sliding_attention", "full_attention")[i % 2] for i in range(len(types))]
    return [] if types == alternating else types


def from_hf_config(config: Mapping[str, Any]) -> GptOssArgs:
    """GptOssArgs of an HF gpt-oss ``config.json``; UserError for what titanlite can't run."""
    decoder_hf.require_family(config, HF_MODEL_TYPE, HF_ARCHITECTURE)
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})

    def build() -> GptOssArgs:
        n_heads = int(config["num_attention_heads"])
        n_layers = int(config["num_hidden_layers"])
        yarn = rope.get("rope_type") == "yarn"
        return GptOssArgs(
            dim=int(config["hidden_size"]),
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
            head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // n_heads),
            vocab_size=int(config["vocab_size"]),
            norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 150000.0))),
            max_seq_len=int(config.get("max_position_embeddings", 131072)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            num_experts=int(config.get("num_local_experts") or config["num_experts"]),
            top_k=int(config["num_experts_per_tok"]),
            moe_hidden_dim=int(config["intermediate_size"]),
            aux_loss_coef=float(config.get("router_aux_loss_coef", 0.0)),
            sliding_window=int(config.get("sliding_window") or 0),
            layer_types=explicit_layer_types(config),
            rope_factor=float(rope.get("factor", 1.0)) if yarn else 1.0,
            rope_original_max_seq_len=int(rope.get("original_max_position_embeddings", 4096)),
            rope_beta_fast=float(rope.get("beta_fast") or 32.0),
            rope_beta_slow=float(rope.get("beta_slow") or 1.0),
            rope_truncate=bool(rope.get("truncate", True)),
            swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(config.get("swiglu_limit", 7.0)),
        )

    args = decoder_hf.read_fields(config, build)
    supported = {
        "attention_bias": (bool(config.get("attention_bias", True)), True),
        "rope_type": (rope.get("rope_type", "default") in ("default", "yarn"), True),
        "rope_scaling": (None, None),
        # The published checkpoints' experts: dequantized on import (titanlite.interop.mxfp4).
        "quantization_config.quant_method": (
            (config.get("quantization_config") or {}).get("quant_method", "mxfp4"),
            "mxfp4",
        ),
        "rope attention_factor / mscale": (
            [rope.get(k) for k in ("attention_factor", "mscale", "mscale_all_dim")],
            [None, None, None],
        ),
    }
    decoder_hf.refuse_unsupported(config, supported, args)
    return args
