"""Hugging Face adapter for Qwen3-MoE: titanlite state dicts and args <-> ``Qwen3MoeForCausalLM``.

Attention is Qwen3's. The router is ``mlp.gate.weight``. titanlite keeps each layer's experts
as three [experts, in, out] tensors (``feed_forward.experts.w1/w3/w2``: gate, up, down);
Hugging Face checkpoints store one [out, in] matrix per expert and projection
(``mlp.experts.E.gate_proj.weight``, ...), which is what an export writes (every transformers
version reads it). An import also takes the fused layout transformers 5 keeps in memory
(``mlp.experts.gate_up_proj`` [experts, 2 x hidden, dim], ``mlp.experts.down_proj``).

What Qwen3-MoE cannot express is refused on export: shared experts, sigmoid scoring, the
auxiliary-loss-free routing bias and a capacity factor (Hugging Face's layer is dropless).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from titanlite.errors import UserError
from titanlite.models import decoder_hf
from titanlite.models.qwen3.hf import LAYER_NAMES as QWEN3_LAYER_NAMES
from titanlite.models.qwen3_moe.args import Qwen3MoeArgs

HF_MODEL_TYPE = "qwen3_moe"
HF_ARCHITECTURE = "Qwen3MoeForCausalLM"

LAYER_NAMES = {
    **{k: v for k, v in QWEN3_LAYER_NAMES.items() if not k.startswith("feed_forward.")},
    "feed_forward.router.weight": "mlp.gate.weight",
}
PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERTS = re.compile(r"layers\.(\d+)\.feed_forward\.experts\.(w[123])")
_BIAS = re.compile(r"layers\.\d+\.feed_forward\.expert_bias")


def _refuse_what_hf_lacks(args: Qwen3MoeArgs) -> None:
    lacking = {
        "shared_experts": (args.shared_experts, 0),
        "score_func": (args.score_func, "softmax"),
        "bias_update_rate": (args.bias_update_rate, 0.0),
        "capacity_factor": (args.capacity_factor, 0.0),
        "n_groups": (args.n_groups, 1),
        "route_scale": (args.route_scale, 1.0),
        "first_k_dense": (args.first_k_dense, 0),
    }
    for key, (value, plain) in lacking.items():
        if value != plain:
            raise UserError(
                f"model.{key}={value!r}: Hugging Face's Qwen3-MoE has no such option "
                f"(needs {plain!r}), so this model cannot be exported to it"
            )


def to_hf_state_dict(
    state: Mapping[str, torch.Tensor], args: Qwen3MoeArgs, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    _refuse_what_hf_lacks(args)
    dense = {k: v for k, v in state.items() if not _EXPERTS.fullmatch(k) and not _BIAS.fullmatch(k)}
    out = decoder_hf.rename_to_hf(dense, args, LAYER_NAMES, dtype=dtype)
    for name, tensor in state.items():
        match = _EXPERTS.fullmatch(name)
        if match is None:
            continue
        layer, weight = match.groups()
        for e, matrix in enumerate(tensor.detach()):  # [in, out] -> HF's [out, in]
            hf = f"model.layers.{layer}.mlp.experts.{e}.{PROJECTIONS[weight]}.weight"
            out[hf] = matrix.t().to(dtype=dtype or matrix.dtype).contiguous()
    return out


def from_hf_state_dict(
    state: Mapping[str, torch.Tensor], args: Qwen3MoeArgs
) -> dict[str, torch.Tensor]:
    experts = {k: v for k, v in state.items() if ".mlp.experts." in k}
    dense = {k: v for k, v in state.items() if k not in experts}
    out = decoder_hf.rename_from_hf(dense, args, LAYER_NAMES, family="Qwen3-MoE")
    for layer in range(args.n_layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        fused = experts.get(prefix + "gate_up_proj")
        for weight, proj in PROJECTIONS.items():
            if fused is not None:  # transformers 5's in-memory layout
                if weight == "w2":
                    stacked = _take(experts, prefix + "down_proj")
                else:
                    gate, up = fused.chunk(2, dim=1)
                    stacked = gate if weight == "w1" else up
            else:
                stacked = torch.stack(
                    [_take(experts, f"{prefix}{e}.{proj}.weight") for e in range(args.num_experts)]
                )
            out[f"layers.{layer}.feed_forward.experts.{weight}"] = stacked.transpose(1, 2)
        out[f"layers.{layer}.feed_forward.expert_bias"] = torch.zeros(args.num_experts)
    known = {f"model.layers.{i}.mlp.experts." for i in range(args.n_layers)}
    stray = sorted(k for k in experts if not any(k.startswith(p) for p in known))
    if stray:
        raise UserError(f"unexpected tensors for a Qwen3-MoE model: {', '.join(stray[:5])}")
    return out


def _take(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise UserError(f"tensor {name!r} is missing")
    return tensors[name]


def to_hf_config(
    args: Qwen3MoeArgs,
    special_ids: Mapping[str, int | None] | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    _refuse_what_hf_lacks(args)
    return {
        "architectures": [HF_ARCHITECTURE],
        "model_type": HF_MODEL_TYPE,
        **decoder_hf.common_hf_config(args, special_ids or {}, dtype),
        "intermediate_size": args.moe_hidden_dim * args.top_k,  # dense layers: there are none
        "moe_intermediate_size": args.moe_hidden_dim,
        "num_experts": args.num_experts,
        "num_experts_per_tok": args.top_k,
        "norm_topk_prob": args.norm_topk,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": args.aux_loss_coef,
        "output_router_logits": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.n_layers,
    }


def from_hf_config(config: Mapping[str, Any]) -> Qwen3MoeArgs:
    """Qwen3MoeArgs of an HF Qwen3-MoE ``config.json``; UserError for what titanlite can't run."""
    decoder_hf.require_family(config, HF_MODEL_TYPE, HF_ARCHITECTURE)

    def build() -> Qwen3MoeArgs:
        n_heads = int(config["num_attention_heads"])
        return Qwen3MoeArgs(
            dim=int(config["hidden_size"]),
            n_layers=int(config["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
            head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // n_heads),
            vocab_size=int(config["vocab_size"]),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=decoder_hf.rope_theta(config, 1_000_000.0),
            max_seq_len=int(config.get("max_position_embeddings", 4096)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            num_experts=int(config.get("num_experts") or config["num_local_experts"]),
            top_k=int(config["num_experts_per_tok"]),
            moe_hidden_dim=int(config["moe_intermediate_size"]),
            norm_topk=bool(config.get("norm_topk_prob", False)),
            aux_loss_coef=float(config.get("router_aux_loss_coef", 0.0)),
        )

    args = decoder_hf.read_fields(config, build)
    supported = {
        "use_sliding_window": (bool(config.get("use_sliding_window", False)), False),
        "decoder_sparse_step": (int(config.get("decoder_sparse_step", 1)), 1),
        "mlp_only_layers": (list(config.get("mlp_only_layers") or []), []),
    }
    decoder_hf.refuse_unsupported(config, supported, args)
    return args
