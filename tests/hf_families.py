"""Hugging Face folders as a new user meets them: a tiny model of each family built by
transformers with its own config class and random weights, written by ``save_pretrained``,
with titanlite's small tokenizer beside it. And transformers' loss and logits on a batch, to
compare titanlite's with.

Shapes are small enough for CPU runs at 4 ranks, and divisible as the layouts need (heads
and experts by 2)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = REPO / "titanlite" / "assets" / "tokenizer.model"
VOCAB = 4096
# model_type -> (transformers config class, causal LM class, config kwargs)
COMMON: dict[str, Any] = dict(vocab_size=VOCAB, max_position_embeddings=128, rms_norm_eps=1e-5)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=10000.0,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            norm_topk_prob=True,
            router_aux_loss_coef=0.0,
        ),
    ),
    "qwen3_5": (
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            # Not the 3 linear : 1 full pattern: the explicit list HF gives (model.layer_types).
            layer_types=["linear_attention", "full_attention"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            router_aux_loss_coef=0.0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            # Windows of 8 in a 32-token sequence, on the second layer only: not gpt-oss's
            # sliding-first alternation, the explicit list (model.layer_types).
            sliding_window=8,
            layer_types=["full_attention", "sliding_attention"],
            router_aux_loss_coef=0.0,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            hidden_size=48,
            intermediate_size=40,
            moe_intermediate_size=12,
            num_hidden_layers=2,
            first_k_dense_replace=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=6,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            # Kept by transformers' config, though save_pretrained writes no MTP block.
            num_nextn_predict_layers=1,
            rope_theta=10000.0,
        ),
    ),
}


def write_folder(family: str, out: Path, seed: int = 0) -> Path:
    """``out`` holding the family's tiny transformers model (random weights) and a tokenizer."""
    import transformers

    config_class, model_class, kwargs = FAMILIES[family]
    config = getattr(transformers, config_class)(**COMMON, **kwargs, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():  # non-zero everywhere (some inits are zero: gates, norms)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(out)
    shutil.copy(TOKENIZER, out / "tokenizer.model")
    return out


def load(out: Path) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def loss_of(model: Any, inputs: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean cross-entropy over the target tokens (titanlite's: a sum over the global count)."""
    with torch.no_grad():
        logits = model(inputs).logits.float()
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=-100
    ).item()
