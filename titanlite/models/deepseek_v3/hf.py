"""Hugging Face adapter for DeepSeek-V3: titanlite state dicts and args <->
``DeepseekV3ForCausalLM`` (also the format of Kimi K2's checkpoints).

Names differ, and two layouts: Hugging Face keeps the key/value latent and the positional key
as one matrix (``kv_a_proj_with_mqa``: the kv_lora_rank latent rows, then the
qk_rope_head_dim positional rows), titanlite as ``wkv_a`` and ``wk_rope``; experts are
written one [out, in] matrix per expert and projection, as in Qwen3-MoE (an import also takes
transformers 5's fused in-memory layout). RoPE pairs are interleaved on both sides
(``rope_interleave``), so no weight is permuted. The routing bias is the router's
``e_score_correction_bias``.

Multi-token prediction depth d is written as block ``n_layers + d`` (``model.layers.61`` for
DeepSeek-V3), as the published checkpoints keep it: the block's usual names plus ``enorm``,
``hnorm``, ``eh_proj``, ``shared_head.norm`` and copies of the embedding and output head
(``embed_tokens``, ``shared_head.head``; import takes the model's own).
``DeepseekV3ForCausalLM`` skips that block when it loads (a warning names its tensors).

Softmax-scored models (the 16B flavor, DeepSeek-V2-Lite's shape) are written as
``DeepseekV2ForCausalLM`` (``model_type`` "deepseek_v2"), whose weights are named as
DeepSeek-V3's and whose router is softmax top-k times ``routed_scaling_factor`` ("greedy");
its folders import back. What the target cannot express is refused on export: for either, a
capacity factor (both are dropless); for DeepSeek-V2, group-limited routing (it rates a group by
its best score, titanlite by its two best), renormalized weights (its router never
renormalizes), a routing bias and multi-token prediction (it has neither).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Collection, Mapping
from typing import Any

import torch

from titanlite.errors import UserError
from titanlite.models import decoder_hf
from titanlite.models.deepseek_v3.args import DeepseekV3Args
from titanlite.models.qwen3_moe.hf import PROJECTIONS

HF_MODEL_TYPE = "deepseek_v3"
HF_ARCHITECTURE = "DeepseekV3ForCausalLM"
V2_MODEL_TYPE = "deepseek_v2"
V2_ARCHITECTURE = "DeepseekV2ForCausalLM"
HF_ALSO_READS = {V2_MODEL_TYPE: V2_ARCHITECTURE}
"""Other model types (-> architecture) this adapter reads: DeepSeek-V2's, for softmax scores."""

logger = logging.getLogger(__name__)


def fit_to_tensors(args: DeepseekV3Args, names: Collection[str]) -> DeepseekV3Args:
    """args for the tensors a folder holds: multi-token prediction blocks that config.json's
    num_nextn_predict_layers names and the folder lacks (transformers' save_pretrained
    writes none) are left out of the model."""
    block = f"model.layers.{args.n_layers}."
    if args.mtp_layers and not any(name.startswith(block) for name in names):
        logger.info(
            "config.json names %d multi-token prediction block(s) and the folder holds none "
            "(no %s* tensors): the model is loaded without them",
            args.mtp_layers,
            block,
        )
        return dataclasses.replace(args, mtp_layers=0)
    return args


BIAS = "feed_forward.expert_bias"

ATTENTION_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
DENSE_NAMES = {f"feed_forward.{w}.weight": f"mlp.{p}.weight" for w, p in PROJECTIONS.items()}
MOE_NAMES = {
    "feed_forward.router.weight": "mlp.gate.weight",
    "feed_forward.expert_bias": "mlp.gate.e_score_correction_bias",
    **{
        f"feed_forward.shared.{w}.weight": f"mlp.shared_experts.{p}.weight"
        for w, p in PROJECTIONS.items()
    },
}
KV_A = "self_attn.kv_a_proj_with_mqa.weight"
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def layer_names(args: DeepseekV3Args, layer: int) -> dict[str, str]:
    """titanlite -> HF names within block ``layer`` (the latent split and experts aside)."""
    unused = (
        ("attention.wq.",)
        if args.q_lora_rank
        else ("attention.wq_a", "attention.q_norm", "attention.wq_b")
    )
    names = {k: v for k, v in ATTENTION_NAMES.items() if not k.startswith(unused)}
    if layer < args.first_k_dense:
        return names | DENSE_NAMES
    return names | {k: v for k, v in MOE_NAMES.items() if not (k == BIAS and is_v2(args))}


def is_v2(args: DeepseekV3Args) -> bool:
    """Softmax scores: written and read as DeepSeek-V2 (DeepSeek-V3's router is sigmoid only)."""
    return args.score_func == "softmax"


def _refuse_what_hf_lacks(args: DeepseekV3Args) -> None:
    lacking: dict[str, tuple[Any, Any]] = {"capacity_factor": (args.capacity_factor, 0.0)}
    if is_v2(args):
        lacking |= {
            "n_groups": (args.n_groups, 1),
            "norm_topk": (args.norm_topk, False),
            "mtp_layers": (args.mtp_layers, 0),
        }
    target = "DeepSeek-V2 (softmax scores)" if is_v2(args) else "DeepSeek-V3"
    for key, (value, plain) in lacking.items():
        if value != plain:
            raise UserError(
                f"model.{key}={value!r}: Hugging Face's {target} has no such option "
                f"(needs {plain!r}), so this model cannot be exported to it"
            )


MTP_NAMES = {  # titanlite (within mtp.D) -> HF (within the block after the last)
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
MTP_SHARED = {
    "tok_embeddings.weight": "embed_tokens.weight",
    "output.weight": "shared_head.head.weight",
}
"""Copies of the shared embedding and output head that the published checkpoints keep in
each multi-token prediction block: written on export, taken as the shared ones on import."""
_MTP = re.compile(r"mtp\.(\d+)\.(.+)")


def to_hf_state_dict(
    state: Mapping[str, torch.Tensor], args: DeepseekV3Args, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Blocks as ``model.layers.N``; multi-token prediction depth d as block n_layers + d,
    where DeepSeek-V3's checkpoints keep it."""
    _refuse_what_hf_lacks(args)

    def put(name: str, tensor: torch.Tensor) -> None:
        out[name] = tensor.detach().to(dtype=dtype or tensor.dtype).contiguous()

    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name in decoder_hf.TOP_NAMES:
            if not (name == "output.weight" and args.tie_embeddings):
                put(decoder_hf.TOP_NAMES[name], tensor)
            continue
        if match := _LAYER.fullmatch(name):
            ours, layer, rest = f"layers.{match.group(1)}.", int(match.group(1)), match.group(2)
        elif match := _MTP.fullmatch(name):
            layer = args.n_layers + int(match.group(1))
            if match.group(2) in MTP_NAMES:
                put(f"model.layers.{layer}.{MTP_NAMES[match.group(2)]}", tensor)
                continue
            ours, rest = f"mtp.{match.group(1)}.block.", match.group(2).removeprefix("block.")
        else:
            raise KeyError(name)
        prefix = f"model.layers.{layer}."
        if rest == "attention.wkv_a.weight":
            latent = torch.cat([tensor, state[f"{ours}attention.wk_rope.weight"]])
            put(prefix + KV_A, latent)
        elif rest.startswith("feed_forward.experts."):
            for e, matrix in enumerate(tensor.detach()):  # [in, out] -> HF's [out, in]
                put(f"{prefix}mlp.experts.{e}.{PROJECTIONS[rest[-2:]]}.weight", matrix.t())
        elif rest == BIAS and is_v2(args):
            if tensor.detach().abs().max() > 0:
                raise UserError(
                    f"{ours}{BIAS} is not zero: Hugging Face's DeepSeek-V2 (softmax scores) "
                    "has no routing bias, so this model cannot be exported to it (train it "
                    "with model.bias_update_rate 0)"
                )
        elif rest != "attention.wk_rope.weight":
            put(prefix + layer_names(args, layer)[rest], tensor)
    embedding = state["tok_embeddings.weight"]  # the output head too when tied
    for d in range(args.mtp_layers):
        for ours, hf in MTP_SHARED.items():
            # A copy of its own: safetensors refuses tensors that share memory.
            put(f"model.layers.{args.n_layers + d}.{hf}", state.get(ours, embedding).clone())
    return out


def from_hf_state_dict(
    state: Mapping[str, torch.Tensor], args: DeepseekV3Args
) -> dict[str, torch.Tensor]:
    given = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in given:
            raise UserError(f"tensor {name!r} is missing")
        used.add(name)
        return given[name]

    out: dict[str, torch.Tensor] = {}
    for name, hf in decoder_hf.TOP_NAMES.items():
        if name == "output.weight" and args.tie_embeddings and hf not in given:
            continue
        out[name] = take(hf)
    mtp_block = f"model.layers.{args.n_layers}."
    if args.mtp_layers and not any(name.startswith(mtp_block) for name in given):
        raise UserError(
            f"config.json's num_nextn_predict_layers {args.mtp_layers} names multi-token "
            f"prediction blocks, but the folder has no {mtp_block}* tensors; set it to 0 to "
            "import the model without them"
        )
    blocks = [f"layers.{i}." for i in range(args.n_layers)]
    blocks += [f"mtp.{d}.block." for d in range(args.mtp_layers)]
    for layer, ours in enumerate(blocks):
        prefix = f"model.layers.{layer}."
        for name, hf in layer_names(args, layer).items():
            out[ours + name] = take(prefix + hf)
        latent, rope = take(prefix + KV_A).split([args.kv_lora_rank, args.qk_rope_head_dim])
        out[ours + "attention.wkv_a.weight"] = latent
        out[ours + "attention.wk_rope.weight"] = rope
        if layer >= args.first_k_dense:
            experts = decoder_hf.experts_from_hf(
                given, take, prefix=f"{prefix}mlp.experts.", num_experts=args.num_experts
            )
            for name, tensor in experts.items():
                out[ours + name] = tensor
            if is_v2(args):  # DeepSeek-V2 routes without a bias
                out[ours + BIAS] = torch.zeros(args.num_experts)
    for d in range(args.mtp_layers):
        prefix = f"model.layers.{args.n_layers + d}."
        for name, hf in MTP_NAMES.items():
            out[f"mtp.{d}.{name}"] = take(prefix + hf)
        used.update(prefix + hf for hf in MTP_SHARED.values())  # the shared ones serve
    if args.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    stray = sorted(set(given) - used)
    if stray:
        raise UserError(f"unexpected tensors for a DeepSeek-V3 model: {', '.join(stray[:5])}")
    return out


def _rope_parameters(args: DeepseekV3Args) -> dict[str, Any]:
    if args.yarn is None:
        return {"rope_type": "default", "rope_theta": args.rope_theta}
    return {
        "rope_type": "yarn",
        "rope_theta": args.rope_theta,
        "factor": args.rope_factor,
        "original_max_position_embeddings": args.rope_original_seq_len,
        "beta_fast": args.rope_beta_fast,
        "beta_slow": args.rope_beta_slow,
        "mscale": args.rope_mscale,
        "mscale_all_dim": args.rope_mscale_all_dim,
    }


V2_ROUTING = dict(score_func="softmax", n_groups=1, topk_groups=1, bias_update_rate=0.0)
"""DeepSeek-V2's "greedy" routing as titanlite's options (no groups; no routing bias)."""


def to_hf_config(
    args: DeepseekV3Args,
    special_ids: Mapping[str, int | None] | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    _refuse_what_hf_lacks(args)
    rope = _rope_parameters(args)
    config = {
        "architectures": [HF_ARCHITECTURE],
        "model_type": HF_MODEL_TYPE,
        **decoder_hf.common_hf_config(args, special_ids or {}, dtype),
        "intermediate_size": args.dense_hidden_dim,
        "moe_intermediate_size": args.moe_hidden_dim,
        "rope_parameters": rope,
        "rope_scaling": None if args.yarn is None else {**rope, "type": "yarn"},
        "rope_interleave": True,
        "q_lora_rank": args.q_lora_rank or None,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "n_routed_experts": args.num_experts,
        "num_experts_per_tok": args.top_k,
        "n_shared_experts": args.shared_experts,
        "first_k_dense_replace": args.first_k_dense,
        "n_group": args.n_groups,
        "topk_group": args.topk_groups,
        "norm_topk_prob": args.norm_topk,
        "routed_scaling_factor": args.route_scale,
        "scoring_func": args.score_func,
        "topk_method": "noaux_tc",
        "num_nextn_predict_layers": args.mtp_layers,
    }
    if is_v2(args):  # DeepSeek-V2: softmax top-k without groups, bias or MTP; RoPE interleaved
        for key in ("rope_interleave", "num_nextn_predict_layers"):
            del config[key]
        config |= {
            "architectures": [V2_ARCHITECTURE],
            "model_type": V2_MODEL_TYPE,
            "topk_method": "greedy",
            "n_group": None,
            "topk_group": None,
        }
    return config


def from_hf_config(config: Mapping[str, Any]) -> DeepseekV3Args:
    """DeepseekV3Args of an HF DeepSeek-V3 (or DeepSeek-V2) ``config.json``; UserError for
    what titanlite can't run."""
    v2 = config.get("model_type") == V2_MODEL_TYPE or V2_ARCHITECTURE in (
        config.get("architectures") or []
    )
    if v2:
        decoder_hf.require_family(config, V2_MODEL_TYPE, V2_ARCHITECTURE)
    else:
        decoder_hf.require_family(config, HF_MODEL_TYPE, HF_ARCHITECTURE)
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))

    def build() -> DeepseekV3Args:
        yarn = {}
        if rope_type == "yarn":
            yarn = dict(
                rope_factor=float(rope["factor"]),
                rope_original_seq_len=int(rope["original_max_position_embeddings"]),
                rope_beta_fast=float(rope.get("beta_fast") or 32),
                rope_beta_slow=float(rope.get("beta_slow") or 1),
                rope_mscale=float(rope.get("mscale") or 1.0),
                rope_mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
            )
        routing = dict(
            norm_topk=bool(config.get("norm_topk_prob", not v2)),
            n_groups=int(config.get("n_group") or 1),
            topk_groups=int(config.get("topk_group") or 1),
        )
        return DeepseekV3Args(
            dim=int(config["hidden_size"]),
            n_layers=int(config["num_hidden_layers"]),
            n_heads=int(config["num_attention_heads"]),
            vocab_size=int(config["vocab_size"]),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=decoder_hf.rope_theta(config, 10_000.0),
            max_seq_len=int(config.get("max_position_embeddings", 4096)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            q_lora_rank=int(config.get("q_lora_rank") or 0),
            kv_lora_rank=int(config["kv_lora_rank"]),
            qk_nope_head_dim=int(config["qk_nope_head_dim"]),
            qk_rope_head_dim=int(config["qk_rope_head_dim"]),
            v_head_dim=int(config["v_head_dim"]),
            dense_hidden_dim=int(config["intermediate_size"]),
            first_k_dense=int(config.get("first_k_dense_replace", 0)),
            num_experts=int(config["n_routed_experts"]),
            top_k=int(config["num_experts_per_tok"]),
            moe_hidden_dim=int(config["moe_intermediate_size"]),
            shared_experts=int(config.get("n_shared_experts") or 0),
            route_scale=float(config.get("routed_scaling_factor", 1.0)),
            mtp_layers=int(config.get("num_nextn_predict_layers") or 0),
            **yarn,
            **(routing | V2_ROUTING if v2 else routing),
        )

    args = decoder_hf.read_fields(config, build)
    supported = {  # key: (the config's value, the values titanlite runs)
        "rope_interleave": (bool(config.get("rope_interleave", True)), (True,)),
        "rope_type": (rope_type, ("default", "yarn")),
        "scoring_func": (
            config.get("scoring_func", "softmax" if v2 else "sigmoid"),
            ("softmax",) if v2 else ("sigmoid",),
        ),
        "num_key_value_heads": (
            int(config.get("num_key_value_heads") or args.n_heads),
            (args.n_heads,),
        ),
        "hidden_act": (config.get("hidden_act", "silu"), ("silu",)),
        "attention_bias": (bool(config.get("attention_bias", False)), (False,)),
    }
    if v2:  # titanlite rates a group by its two best scores, DeepSeek-V2 by its best
        supported["topk_method"] = (config.get("topk_method", "greedy"), ("greedy",))
    for key, (value, runs) in supported.items():
        if value not in runs:
            raise UserError(f"config.json {key}={value!r} is not supported (needs {runs[0]!r})")
    try:
        args.check()
    except ValueError as e:
        raise UserError(f"config.json: {e}") from None
    return args
