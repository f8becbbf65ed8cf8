"""The TorchTitan v0.2.x models the families reproduce, as data: which family and flavor
builds each of TorchTitan's (model.name, flavor), with the overrides that make it TorchTitan's
model. The config's TorchTitan import reads it through the component catalog
(``titanlite.components``). No torch here."""

from __future__ import annotations

from typing import Any

# (TorchTitan model.name, flavor) -> (titanlite family, flavor, model overrides reproducing
# its model; vocab_size only when the file names a tokenizer, titanlite's own being larger).
# TorchTitan's MoE balances by a routing bias moved 1e-3 a step, with no auxiliary loss.
TT_BALANCING = {"aux_loss_coef": 0.0, "bias_update_rate": 1e-3}
# TorchTitan v0.2's DeepSeek-V3 (torchtitan/models/deepseek_v3/__init__.py): its debugmodel
# and 16B route softmax top-k without renormalizing or groups, and sharpen the softmax by
# mscale 0.7 when YaRN is on; 236B is DeepSeek-V2's shape.
TT_SOFTMAX_ROUTING = {
    "score_func": "softmax",
    "norm_topk": False,
    "n_groups": 1,
    "topk_groups": 1,
    "route_scale": 1.0,
    "first_k_dense": 1,
}
TT_DSV3_ROPE = {"rope_factor": 1.0, "rope_mscale": 0.7, "rope_mscale_all_dim": 0.7}
FLAVORS: dict[tuple[str, str], tuple[str, str, dict[str, Any]]] = {
    ("llama3", "debugmodel"): (
        "llama3",
        "debugmodel",
        {"n_layers": 6, "n_heads": 16, "n_kv_heads": 16, "multiple_of": 256, "vocab_size": 2048},
    ),
    **{("llama3", f): ("llama3", f, {"vocab_size": 128256}) for f in ("8B", "70B", "405B")},
    ("qwen3", "debugmodel"): (
        "qwen3",
        "debugmodel",
        {
            "n_layers": 8,
            "n_heads": 16,
            "n_kv_heads": 8,
            "head_dim": 128,
            "hidden_dim": 3072,
            "vocab_size": 2048,
        },
    ),
    **{
        ("qwen3", f): ("qwen3", f, {"vocab_size": 151936})
        for f in ("0.6B", "1.7B", "4B", "8B", "14B", "32B")
    },
    ("qwen3", "debugmodel_moe"): (
        "qwen3_moe",
        "debugmodel",
        {
            "n_layers": 8,
            "n_heads": 16,
            "n_kv_heads": 8,
            "head_dim": 128,
            "num_experts": 64,
            "top_k": 8,
            "moe_hidden_dim": 768,
            "tie_embeddings": False,
            **TT_BALANCING,
            "vocab_size": 2048,
        },
    ),
    ("qwen3", "30B-A3B"): ("qwen3_moe", "30B-A3B", {**TT_BALANCING, "vocab_size": 151936}),
    ("qwen3", "235B-A22B"): (
        "qwen3_moe",
        "235B-A22B",
        {"rope_theta": 5_000_000.0, **TT_BALANCING, "vocab_size": 151936},
    ),
    ("deepseek_v3", "debugmodel"): (
        "deepseek_v3",
        "debugmodel",
        {
            "n_layers": 6,
            "n_heads": 16,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "dense_hidden_dim": 1024,
            "num_experts": 8,
            "moe_hidden_dim": 256,
            "top_k": 3,
            "shared_experts": 2,
            **TT_SOFTMAX_ROUTING,
            "tie_embeddings": False,
            **TT_DSV3_ROPE,
            **TT_BALANCING,
            "vocab_size": 2048,
        },
    ),
    ("deepseek_v3", "16B"): (
        "deepseek_v3",
        "16B",
        {**TT_DSV3_ROPE, **TT_BALANCING, "vocab_size": 102400},
    ),
    ("deepseek_v3", "236B"): (
        "deepseek_v3",
        "671B",
        {
            "dim": 5120,
            "n_layers": 60,
            "dense_hidden_dim": 12288,
            "first_k_dense": 1,
            "num_experts": 160,
            "top_k": 6,
            "moe_hidden_dim": 1536,
            "shared_experts": 2,
            **TT_SOFTMAX_ROUTING,
            "n_groups": 8,
            "topk_groups": 3,
            "route_scale": 16.0,
            "rope_factor": 1.0,
            **TT_BALANCING,
            "vocab_size": 102400,
        },
    ),
    ("deepseek_v3", "671B"): (
        "deepseek_v3",
        "671B",
        {"rope_factor": 1.0, **TT_BALANCING, "vocab_size": 129280},
    ),
    # gpt_oss: its debug model keeps the published heads and expert width on 4 layers of dim
    # 256 with top-4 of 8 experts and windows of 128; its vocabulary is always the published one.
    ("gpt_oss", "debugmodel"): (
        "gpt_oss",
        "debugmodel",
        {
            "n_heads": 64,
            "n_kv_heads": 8,
            "head_dim": 64,
            "top_k": 4,
            "moe_hidden_dim": 2880,
            "sliding_window": 128,
            **TT_BALANCING,
            "vocab_size": 201088,
        },
    ),
    **{
        ("gpt_oss", f): ("gpt_oss", f, {**TT_BALANCING, "vocab_size": 201088})
        for f in ("20b", "120b")
    },
}
TT_YARN_FROM = 4096
"""TorchTitan's DeepSeek-V3 stretches RoPE (YaRN, factor 40) only for training.seq_len above
this: plain RoPE up to it (the flavors above), ``rope_factor`` 40 past it."""
