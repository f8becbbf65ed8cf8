"""What the decoder families' Hugging Face adapters share: renaming state dicts between
titanlite's module names and a ``*ForCausalLM`` layout, and reading config.json fields.

Each adapter (``models/<family>/hf.py``) provides, for ``titanlite.interop.hf``:
``HF_MODEL_TYPE``, ``HF_ARCHITECTURE``, ``to_hf_state_dict(state, args, dtype=None)``,
``from_hf_state_dict(state, args)``, ``to_hf_config(args, special_ids, dtype)`` and
``from_hf_config(config)``. Errors a user can cause (a foreign or unsupported config, missing
tensors) are UserErrors naming the key.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from titanlite.errors import UserError

TOP_NAMES = {  # titanlite name -> HF name, outside the layers
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {  # titanlite name within a layer -> HF name within a layer
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}

Transform = Callable[[str, torch.Tensor], torch.Tensor]

EXPERT_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
"""titanlite's [experts, in, out] weights -> the projection of HF's per-expert [out, in] ones."""


def hf_name(name: str, layer_names: Mapping[str, str]) -> str:
    """The HF name of a titanlite parameter name (KeyError for one HF has no place for)."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    match = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if match is None or match.group(2) not in layer_names:
        raise KeyError(name)
    return f"model.layers.{match.group(1)}.{layer_names[match.group(2)]}"


def expected_names(n_layers: int, layer_names: Mapping[str, str]) -> list[str]:
    names = list(TOP_NAMES)
    for i in range(n_layers):
        names += [f"layers.{i}.{n}" for n in layer_names]
    return names


def rename_to_hf(
    state: Mapping[str, torch.Tensor],
    args: Any,
    layer_names: Mapping[str, str],
    *,
    dtype: torch.dtype | None = None,
    transform: Transform | None = None,
) -> dict[str, torch.Tensor]:
    """titanlite state dict -> HF names (contiguous tensors, optionally cast); with tied
    embeddings lm_head.weight is left out (HF ties it to the embedding)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name == "output.weight" and args.tie_embeddings:
            continue
        if transform is not None:
            tensor = transform(name, tensor)
        tensor = tensor.detach().to(dtype=dtype or tensor.dtype)
        out[hf_name(name, layer_names)] = tensor.contiguous()
    return out


def rename_from_hf(
    state: Mapping[str, torch.Tensor],
    args: Any,
    layer_names: Mapping[str, str],
    *,
    family: str,
    transform: Transform | None = None,
) -> dict[str, torch.Tensor]:
    """HF state dict -> the full set of titanlite names (``output.weight`` is the embedding
    when tied); UserError naming missing or unexpected tensors."""
    by_hf = {hf_name(n, layer_names): n for n in expected_names(args.n_layers, layer_names)}
    # Non-parameter buffers some exporters write (HF's rotary inv_freq) carry no weights.
    given = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    unexpected = sorted(set(given) - set(by_hf))
    if unexpected:
        raise UserError(f"unexpected tensors for a {family} model: {', '.join(unexpected[:5])}")
    out: dict[str, torch.Tensor] = {}
    for hf, name in by_hf.items():
        if hf not in given:
            if name == "output.weight" and args.tie_embeddings:
                continue
            raise UserError(f"tensor {hf!r} is missing")
        out[name] = given[hf] if transform is None else transform(name, given[hf])
    if args.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def common_hf_config(
    args: Any,
    special_ids: Mapping[str, int | None],
    dtype: torch.dtype,
    *,
    attention_variants: bool = False,
) -> dict[str, Any]:
    """The config.json fields every decoder family writes the same way. Unless the family's
    Hugging Face model has them (``attention_variants``), a sliding window or sinks are
    refused: its config would describe a different model."""
    if not attention_variants:
        for key in ("sliding_window", "attention_sinks"):
            if getattr(args, key, 0):
                raise UserError(
                    f"model.{key}={getattr(args, key)!r}: this family's Hugging Face model "
                    "has no such attention, so this model cannot be exported to it"
                )
    return {
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        # Both spellings: transformers < 5 reads rope_theta, >= 5 reads rope_parameters.
        "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "rope_scaling": None,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        **{f"{kind}_token_id": token_id for kind, token_id in special_ids.items()},
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def require_family(config: Mapping[str, Any], model_type: str, architecture: str) -> None:
    archs = config.get("architectures") or []
    if config.get("model_type") != model_type and architecture not in archs:
        found = config.get("model_type") or archs
        raise UserError(
            f"not a {architecture.removesuffix('ForCausalLM')} model "
            f"(model_type/architectures: {found!r})"
        )


def read_fields(config: Mapping[str, Any], build: Callable[[], Any]) -> Any:
    """``build()`` reading config fields; a missing one, one of the wrong type, or a zero
    head count (a division in the build) becomes a UserError."""
    try:
        return build()
    except KeyError as e:
        raise UserError(f"config.json has no {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise UserError(f"config.json holds a value of the wrong type ({e})") from None
    except ZeroDivisionError:
        raise UserError("config.json: num_attention_heads must be at least 1") from None


def rope_theta(config: Mapping[str, Any], default: float) -> float:
    rope = config.get("rope_parameters") or {}
    return float(rope.get("rope_theta", config.get("rope_theta", default)))


def refuse_unsupported(
    config: Mapping[str, Any], supported: Mapping[str, tuple[Any, Any]], args: Any
) -> None:
    """UserError for a config value titanlite cannot run, then for impossible shapes.

    ``supported`` maps a key to (the config's value, the one value titanlite supports)."""
    rope = config.get("rope_parameters") or {}
    checks = {
        "hidden_act": (config.get("hidden_act", "silu"), "silu"),
        "attention_bias": (bool(config.get("attention_bias", False)), False),
        "rope_scaling": (config.get("rope_scaling") or None, None),
        "rope_type": (rope.get("rope_type", "default"), "default"),
        **supported,
    }
    for key, (value, wanted) in checks.items():
        if value != wanted:
            raise UserError(f"config.json {key}={value!r} is not supported (needs {wanted!r})")
    try:
        args.check()
    except ValueError as e:
        raise UserError(f"config.json: {e}") from None


def experts_to_hf(prefix: str, name: str, stacked: torch.Tensor) -> dict[str, torch.Tensor]:
    """One titanlite expert weight ``name`` (w1, w3 or w2: [experts, in, out]) as HF's
    per-expert matrices ``{prefix}{e}.{projection}.weight`` ([out, in]): the layout every
    transformers version reads."""
    projection = EXPERT_PROJECTIONS[name]
    return {f"{prefix}{e}.{projection}.weight": m.t() for e, m in enumerate(stacked.detach())}


def experts_from_hf(
    given: Mapping[str, torch.Tensor],
    take: Callable[[str], torch.Tensor],
    *,
    prefix: str,
    num_experts: int,
) -> dict[str, torch.Tensor]:
    """``feed_forward.experts.w1/w3/w2`` from HF's experts under ``prefix``: per-expert
    matrices, or the fused layout transformers 5 keeps in memory (``gate_up_proj``
    [experts, 2 x hidden, dim] and ``down_proj``). ``take(name)`` reads (and marks used) one."""
    out = {}
    for weight, proj in EXPERT_PROJECTIONS.items():
        if prefix + "gate_up_proj" in given:
            if weight == "w2":
                stacked = take(prefix + "down_proj")
            else:
                gate, up = take(prefix + "gate_up_proj").chunk(2, dim=1)
                stacked = gate if weight == "w1" else up
        else:
            stacked = torch.stack([take(f"{prefix}{e}.{proj}.weight") for e in range(num_experts)])
        out[f"feed_forward.experts.{weight}"] = stacked.transpose(1, 2)
    return out
