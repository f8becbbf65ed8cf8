"""gpt-oss shapes: GptOssArgs and the flavors (plain Python, no torch).

gpt-oss (OpenAI, 2025) is a decoder with grouped-query attention whose four projections have
biases, a learned sink per query head, sliding-window (128 tokens) and full attention on
alternate layers starting with a local one, YaRN RoPE (rotate-half) and a mixture of experts
in every layer: a router with a bias picks each token's top-k experts by logit and weights
them by a softmax over the chosen (the shared MoE layer's softmax scores renormalized over
the top-k are the same numbers), and each expert is a SwiGLU with biases and gpt-oss's
clamped activation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from titanlite.models.decoder_spec import ATTENTION_OVERRIDES
from titanlite.models.qwen3_moe.args import Qwen3MoeArgs

GPT_OSS_VOCAB = 201088
"""The vocabulary of gpt-oss's o200k_harmony tokenizer (the published counts assume it)."""


@dataclass
class GptOssArgs(Qwen3MoeArgs):
    """Qwen3-MoE's fields (shape, experts, routing and balancing options), gpt-oss's
    defaults, and its own: YaRN and the clamped SwiGLU."""

    dim: int = 2880
    n_layers: int = 24
    n_heads: int = 64
    n_kv_heads: int = 8
    head_dim: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    max_seq_len: int = 131072
    # Its router weights the top-k by a softmax over them: score_func "softmax" and norm_topk,
    # the defaults (gpt-oss's OVERRIDES leave them out).
    num_experts: int = 32
    top_k: int = 4
    moe_hidden_dim: int = 2880
    sliding_window: int = 128
    window_pattern: str = "LG"
    layer_types: list[str] = field(default_factory=list)
    """Each layer's attention kind as Hugging Face's config.json lists them, one per layer:
    "sliding_attention" (the sliding window) or "full_attention" (empty = window_pattern)."""
    attention_sinks: bool = True
    rope_factor: float = 32.0
    """YaRN: the context extension factor (1 = plain RoPE)."""
    rope_original_max_seq_len: int = 4096
    """YaRN: the context length the RoPE frequencies were first trained at."""
    rope_beta_fast: float = 32.0
    """YaRN: frequencies turning more than this many times over that context are kept."""
    rope_beta_slow: float = 1.0
    """YaRN: frequencies turning fewer than this many times are divided by rope_factor."""
    rope_truncate: bool = False
    """YaRN: round the ends of the ramp between the two outwards to whole frequencies."""
    swiglu_alpha: float = 1.702
    """Clamped SwiGLU of the experts: (up + 1) * gate * sigmoid(swiglu_alpha * gate)."""
    swiglu_limit: float = 7.0
    """Clamped SwiGLU: the gate is clamped above, the up projection on both sides, at this."""

    qk_norm: ClassVar[bool] = False
    rope_style: ClassVar[str] = "halves"
    attention: ClassVar[str] = "sdpa"
    attention_bias: ClassVar[bool] = True
    router_bias: ClassVar[bool] = True
    expert_biases: ClassVar[bool] = True

    @property
    def yarn(self) -> dict[str, Any] | None:
        """YaRN's keyword arguments (``titanlite.models.yarn.YaRN``), None for plain RoPE.
        gpt-oss scales the tables by the whole 0.1 ln(factor) + 1 and leaves the softmax
        scale alone: mscale 1, mscale_all_dim 0."""
        if self.rope_factor == 1.0:
            return None
        return {
            "factor": self.rope_factor,
            "beta_fast": self.rope_beta_fast,
            "beta_slow": self.rope_beta_slow,
            "truncate": self.rope_truncate,
            "original_seq_len": self.rope_original_max_seq_len,
            "mscale": 1.0,
            "mscale_all_dim": 0.0,
        }

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of block ``layer``: layer_types' kind when it is set, else
        window_pattern's."""
        if not self.layer_types:
            return super().layer_window(layer)
        local = self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if local and self.sliding_window > 0 else None

    def check(self) -> None:
        super().check()
        kinds = {"full_attention", "sliding_attention"}
        if self.layer_types and (
            len(self.layer_types) != self.n_layers or set(self.layer_types) - kinds
        ):
            raise ValueError(
                f"layer_types must list {self.n_layers} (n_layers) kinds, each full_attention "
                f"or sliding_attention, got {self.layer_types!r}"
            )
        if self.rope_factor < 1:
            raise ValueError(f"rope_factor must be >= 1, got {self.rope_factor}")
        if self.swiglu_limit <= 0:
            raise ValueError(f"swiglu_limit must be > 0, got {self.swiglu_limit}")


# Published shapes (openai/gpt-oss-20b and -120b config.json), plus a small CPU flavor.
FLAVORS: dict[str, GptOssArgs] = {
    # About 8 M parameters with the shipped 4 K tokenizer; windows of 32 at seq_len 256.
    "debugmodel": GptOssArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        num_experts=8,
        top_k=2,
        moe_hidden_dim=256,
        sliding_window=32,
        aux_loss_coef=0.001,
        max_seq_len=4096,
    ),
    "20b": GptOssArgs(n_layers=24, num_experts=32),
    "120b": GptOssArgs(n_layers=36, num_experts=128),
}

OVERRIDES = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "rope_theta",
    "norm_eps",
    "num_experts",
    "top_k",
    "moe_hidden_dim",
    "aux_loss_coef",
    "bias_update_rate",
    "capacity_factor",
    "router_z_loss_coef",
    *ATTENTION_OVERRIDES,
    "layer_types",
    "rope_factor",
    "rope_original_max_seq_len",
    "rope_beta_fast",
    "rope_beta_slow",
    "rope_truncate",
    "swiglu_alpha",
    "swiglu_limit",
)
