"""Hugging Face adapter for Qwen3.5-MoE (text): titanlite state dicts and args <->
``Qwen3_5MoeForCausalLM`` (model_type ``qwen3_5_moe_text``).

Attention and the DeltaNet layers are Qwen3.5's (``titanlite.models.qwen3_5.hf``, whose
fusions this reuses); each block's ``mlp`` is the mixture of experts: the router
``mlp.gate.weight``, the experts written one [out, in] matrix per expert and projection
(``mlp.experts.E.gate_proj.weight``, ...; an import also takes the fused
``gate_up_proj``/``down_proj`` of transformers 5's memory and of the published checkpoints),
the shared expert ``mlp.shared_expert.*`` and its gate ``mlp.shared_expert_gate.weight``
([1, dim]).

What Hugging Face's model cannot express is refused on export: sigmoid scores, unnormalized
top-k weights, a routing bias, a capacity factor, other than one gated shared expert.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from titanlite.errors import UserError
from titanlite.models import decoder_hf
from titanlite.models.qwen3_5 import hf as dense
from titanlite.models.qwen3_5_moe.args import Qwen35MoeArgs

HF_MODEL_TYPE = "qwen3_5_moe_text"
HF_ARCHITECTURE = "Qwen3_5MoeForCausalLM"

MOE_NAMES = {  # titanlite name within a block's feed_forward -> HF name within its mlp
    "router.weight": "gate.weight",
    "shared_gate.weight": "shared_expert_gate.weight",
    **{
        f"shared.{w}.weight": f"shared_expert.{p}.weight"
        for w, p in decoder_hf.EXPERT_PROJECTIONS.items()
    },
}
_MOE = re.compile(r"layers\.(\d+)\.feed_forward\.(.+)")


def _refuse_what_hf_lacks(args: Qwen35MoeArgs) -> None:
    lacking = {
        "score_func": (args.score_func, "softmax"),
        "norm_topk": (args.norm_topk, True),
        "bias_update_rate": (args.bias_update_rate, 0.0),
        "capacity_factor": (args.capacity_factor, 0.0),
        "shared_experts": (args.shared_experts, 1),
        "shared_expert_gate": (args.shared_expert_gate, True),
    }
    for key, (value, plain) in lacking.items():
        if value != plain:
            raise UserError(
                f"model.{key}={value!r}: Hugging Face's Qwen3.5-MoE has no such option "
                f"(needs {plain!r}), so this model cannot be exported to it"
            )


def to_hf_state_dict(
    state: Mapping[str, torch.Tensor], args: Qwen35MoeArgs, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    _refuse_what_hf_lacks(args)
    out = dense.to_hf_state_dict(state, args, dtype)  # all but the feed-forwards
    for name, tensor in state.items():
        match = _MOE.fullmatch(name)
        if match is None or match.group(2) == "expert_bias":  # zero: refused otherwise
            continue
        layer, local = match.groups()
        prefix = f"model.layers.{layer}.mlp."
        if local.startswith("experts."):
            tensors = decoder_hf.experts_to_hf(prefix + "experts.", local[-2:], tensor)
        else:
            tensors = {prefix + MOE_NAMES[local]: tensor}
        out |= {k: t.detach().to(dtype=dtype or t.dtype).contiguous() for k, t in tensors.items()}
    return out


def from_hf_state_dict(
    state: Mapping[str, torch.Tensor], args: Qwen35MoeArgs
) -> dict[str, torch.Tensor]:
    mixtures = {k: v for k, v in state.items() if ".mlp." in k}
    out = dense.from_hf_state_dict({k: v for k, v in state.items() if k not in mixtures}, args)
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in mixtures:
            raise UserError(f"tensor {name!r} is missing")
        used.add(name)
        return mixtures[name]

    for layer in range(args.n_layers):
        prefix = f"model.layers.{layer}.mlp."
        ours = f"layers.{layer}.feed_forward."
        for name, hf in MOE_NAMES.items():
            out[ours + name] = take(prefix + hf)
        experts = decoder_hf.experts_from_hf(
            mixtures, take, prefix=prefix + "experts.", num_experts=args.num_experts
        )
        out |= {f"layers.{layer}.{name}": tensor for name, tensor in experts.items()}
        out[ours + "expert_bias"] = torch.zeros(args.num_experts)
    stray = sorted(k for k in set(mixtures) - used if not k.startswith(("mtp.", "model.visual.")))
    if stray:
        raise UserError(f"unexpected tensors for a Qwen3.5-MoE model: {', '.join(stray[:5])}")
    return out


def to_hf_config(
    args: Qwen35MoeArgs,
    special_ids: Mapping[str, int | None] | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    _refuse_what_hf_lacks(args)
    config = dense.to_hf_config(args, special_ids, dtype)
    config.pop("intermediate_size")  # no dense feed-forward
    return {
        **config,
        "architectures": [HF_ARCHITECTURE],
        "model_type": HF_MODEL_TYPE,
        "num_experts": args.num_experts,
        "num_experts_per_tok": args.top_k,
        "moe_intermediate_size": args.moe_hidden_dim,
        "shared_expert_intermediate_size": args.moe_hidden_dim,
        "router_aux_loss_coef": args.aux_loss_coef,
        "output_router_logits": False,
    }


def from_hf_config(config: Mapping[str, Any]) -> Qwen35MoeArgs:
    """Qwen35MoeArgs of an HF Qwen3.5-MoE text ``config.json`` (or a multimodal one's
    ``text_config``); UserError for anything titanlite can't run."""
    config = dense.text_config(config, HF_MODEL_TYPE)
    decoder_hf.require_family(config, HF_MODEL_TYPE, HF_ARCHITECTURE)

    def build() -> Qwen35MoeArgs:
        return Qwen35MoeArgs(
            **dense.hybrid_fields(config),
            num_experts=int(config["num_experts"]),
            top_k=int(config["num_experts_per_tok"]),
            moe_hidden_dim=int(config["moe_intermediate_size"]),
            aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)),
        )

    args = decoder_hf.read_fields(config, build)
    shared = int(config.get("shared_expert_intermediate_size", args.moe_hidden_dim))
    supported = {"shared_expert_intermediate_size": (shared, args.moe_hidden_dim)}
    dense.refuse_unsupported(config, args, supported)
    return args
