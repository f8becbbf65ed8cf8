"""Hugging Face adapter for Qwen3.5 (text): titanlite state dicts and args <->
``Qwen3_5ForCausalLM`` (model_type ``qwen3_5_text``).

Besides names, Hugging Face fuses what titanlite keeps apart (so tensor parallelism can
split each by heads): a full-attention layer's q_proj holds, per head, the query rows then
the gate rows; a DeltaNet layer's in_proj_qkv and conv1d hold queries, keys and values one
after the other, and conv1d keeps a singleton middle dimension.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from titanlite.errors import UserError
from titanlite.models import decoder_hf
from titanlite.models.qwen3_5.args import Qwen35Args

HF_MODEL_TYPE = "qwen3_5_text"
HF_ARCHITECTURE = "Qwen3_5ForCausalLM"

COMMON = {  # titanlite name within any layer -> HF name within the layer
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
FULL = {
    **COMMON,
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
LINEAR = {
    **COMMON,
    "linear_attn.wz.weight": "linear_attn.in_proj_z.weight",
    "linear_attn.wb.weight": "linear_attn.in_proj_b.weight",
    "linear_attn.wa.weight": "linear_attn.in_proj_a.weight",
    "linear_attn.decay.A_log": "linear_attn.A_log",
    "linear_attn.decay.dt_bias": "linear_attn.dt_bias",
    "linear_attn.norm.weight": "linear_attn.norm.weight",
    "linear_attn.wo.weight": "linear_attn.out_proj.weight",
}
# Fused on the HF side: HF name -> the titanlite names it concatenates.
FUSED_LINEAR = {
    "linear_attn.in_proj_qkv.weight": [f"linear_attn.w{p}.weight" for p in "qkv"],
    "linear_attn.conv1d.weight": [f"linear_attn.conv.{p}" for p in "qkv"],
}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def _renames(args: Qwen35Args, layer: int) -> dict[str, str]:
    names = FULL if args.is_full_attention(layer) else LINEAR
    if getattr(args, "num_experts", 0):  # a mixture of experts: the MoE adapter's to name
        names = {k: v for k, v in names.items() if not k.startswith("feed_forward.")}
    return names


def to_hf_state_dict(
    state: Mapping[str, torch.Tensor], args: Qwen35Args, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(dtype=dtype or t.dtype).contiguous()

    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name in decoder_hf.TOP_NAMES:
            if not (name == "output.weight" and args.tie_embeddings):
                out[decoder_hf.TOP_NAMES[name]] = cast(tensor)
            continue
        layer, local = _LAYER.fullmatch(name).groups()
        renames = _renames(args, int(layer))
        if local in renames:
            out[f"model.layers.{layer}.{renames[local]}"] = cast(tensor)
    for i in range(args.n_layers):
        prefix = f"layers.{i}."
        if args.is_full_attention(i):
            q = state[prefix + "attention.wq.weight"].unflatten(0, (args.n_heads, -1))
            gate = state[prefix + "attention.wg.weight"].unflatten(0, (args.n_heads, -1))
            fused = torch.cat([q, gate], dim=1).flatten(0, 1)  # per head: query, then gate
            out[f"model.{prefix}self_attn.q_proj.weight"] = cast(fused)
            continue
        for hf, parts in FUSED_LINEAR.items():
            fused = torch.cat([state[prefix + p] for p in parts])
            if hf.endswith("conv1d.weight"):
                fused = fused.unsqueeze(1)
            out[f"model.{prefix}{hf}"] = cast(fused)
    return out


def _take(state: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in state:
        raise UserError(f"tensor {name!r} is missing")
    return state[name]


def _carries_no_weights(name: str) -> bool:
    """Tensors of a published folder the text model has no use for: RoPE buffers, the
    multi-token-prediction head and the vision tower."""
    return name.endswith("rotary_emb.inv_freq") or name.startswith(("mtp.", "model.visual."))


def from_hf_state_dict(
    state: Mapping[str, torch.Tensor], args: Qwen35Args
) -> dict[str, torch.Tensor]:
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        used.add(name)
        return _take(state, name)

    out: dict[str, torch.Tensor] = {}
    for name, hf in decoder_hf.TOP_NAMES.items():
        if name == "output.weight" and args.tie_embeddings and hf not in state:
            continue
        out[name] = take(hf)
    if args.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    keys = args.linear_k_heads * args.linear_k_dim
    for i in range(args.n_layers):
        prefix = f"model.layers.{i}."
        for local, hf in _renames(args, i).items():
            out[f"layers.{i}.{local}"] = take(prefix + hf)
        if args.is_full_attention(i):
            fused = take(prefix + "self_attn.q_proj.weight").unflatten(0, (args.n_heads, -1))
            q, gate = fused.chunk(2, dim=1)
            out[f"layers.{i}.attention.wq.weight"] = q.flatten(0, 1)
            out[f"layers.{i}.attention.wg.weight"] = gate.flatten(0, 1)
            continue
        for hf, parts in FUSED_LINEAR.items():
            fused = take(prefix + hf)
            if hf.endswith("conv1d.weight"):
                fused = fused.squeeze(1)
            pieces = fused.split([keys, keys, fused.shape[0] - 2 * keys])
            out.update({f"layers.{i}.{p}": t for p, t in zip(parts, pieces, strict=True)})
    used.add("lm_head.weight")  # with tied embeddings some exporters write it anyway
    stray = sorted(k for k in state if k not in used and not _carries_no_weights(k))
    if stray:
        raise UserError(f"unexpected tensors for a Qwen3.5 model: {', '.join(stray[:5])}")
    return out


def to_hf_config(
    args: Qwen35Args,
    special_ids: Mapping[str, int | None] | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    config = decoder_hf.common_hf_config(args, special_ids or {}, dtype)
    config.pop("rope_scaling")
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    return {
        "architectures": [HF_ARCHITECTURE],
        "model_type": HF_MODEL_TYPE,
        **config,
        "rope_parameters": {**rope, "partial_rotary_factor": args.partial_rotary},
        "partial_rotary_factor": args.partial_rotary,
        "layer_types": [
            "full_attention" if args.is_full_attention(i) else "linear_attention"
            for i in range(args.n_layers)
        ],
        "full_attention_interval": args.full_attention_interval,
        "linear_conv_kernel_dim": args.conv_kernel,
        "linear_key_head_dim": args.linear_k_dim,
        "linear_value_head_dim": args.linear_v_dim,
        "linear_num_key_heads": args.linear_k_heads,
        "linear_num_value_heads": args.linear_v_heads,
    }


def text_config(config: Mapping[str, Any], model_type: str) -> Mapping[str, Any]:
    """A multimodal ``config.json``'s ``text_config`` as a text model's (else the config)."""
    if "text_config" not in config:
        return config
    return {
        **config["text_config"],
        "architectures": config.get("architectures"),
        "model_type": model_type,
    }


def hybrid_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The Qwen35Args fields (all but the feed-forward's) of a text ``config.json``;
    KeyError for a missing one (``decoder_hf.read_fields`` names it)."""
    rope = config.get("rope_parameters") or {}
    return dict(
        dim=int(config["hidden_size"]),
        n_layers=int(config["num_hidden_layers"]),
        n_heads=int(config["num_attention_heads"]),
        n_kv_heads=int(config["num_key_value_heads"]),
        head_dim=int(config["head_dim"]),
        vocab_size=int(config["vocab_size"]),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=decoder_hf.rope_theta(config, 10_000_000.0),
        partial_rotary=float(
            rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))
        ),
        max_seq_len=int(config.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        full_attention_interval=int(config.get("full_attention_interval", 4)),
        linear_k_heads=int(config["linear_num_key_heads"]),
        linear_v_heads=int(config["linear_num_value_heads"]),
        linear_k_dim=int(config["linear_key_head_dim"]),
        linear_v_dim=int(config["linear_value_head_dim"]),
        conv_kernel=int(config.get("linear_conv_kernel_dim", 4)),
        layer_types=explicit_layer_types(config),
    )


def explicit_layer_types(config: Mapping[str, Any]) -> list[str]:
    """config.json's layer_types when they are not the full_attention_interval pattern (that
    one is kept as the interval: the model is the same, its args stay those of a flavor)."""
    types = [str(t) for t in config.get("layer_types") or []]
    interval = int(config.get("full_attention_interval", 4))
    pattern = [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(len(types))
    ]
    return [] if types == pattern else types


def refuse_unsupported(
    config: Mapping[str, Any], args: Qwen35Args, supported: Mapping[str, tuple[Any, Any]]
) -> None:
    """UserError for a layer pattern or option titanlite cannot run (besides ``supported``:
    key -> (the config's value, the one titanlite runs)), then for impossible shapes."""
    pattern = [
        "full_attention" if args.is_full_attention(i) else "linear_attention"
        for i in range(args.n_layers)
    ]
    supported = {
        "layer_types": (list(config.get("layer_types") or pattern), pattern),
        "attn_output_gate": (bool(config.get("attn_output_gate", True)), True),
        **supported,
    }
    decoder_hf.refuse_unsupported(config, supported, args)


def from_hf_config(config: Mapping[str, Any]) -> Qwen35Args:
    """Qwen35Args of an HF Qwen3.5 text ``config.json`` (or a multimodal one's
    ``text_config``); UserError for anything titanlite can't run."""
    config = text_config(config, HF_MODEL_TYPE)
    decoder_hf.require_family(config, HF_MODEL_TYPE, HF_ARCHITECTURE)
    args = decoder_hf.read_fields(
        config,
        lambda: Qwen35Args(**hybrid_fields(config), hidden_dim=int(config["intermediate_size"])),
    )
    refuse_unsupported(config, args, {})
    return args
