"""What the decoder-only families (Llama, Qwen3, Qwen3-MoE) share in their specs, in plain
Python: FLOPs, init rules, the tensor-parallel plan and the sizes tensor parallelism must
divide. (Their modules are ``titanlite.models.decoder``.)

Their args dataclasses differ (Llama derives head_dim and the SwiGLU width, Qwen3 states them),
but each exposes the same derived properties: dim, n_layers, n_heads, kv_heads, head_dim,
ffn_hidden_dim, vocab_size, tie_embeddings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from titanlite.models.spec import InitRule, ModelSpec, TensorParallelPlan


@dataclass
class AttentionVariants:
    """The attention options every decoder family takes (its args dataclass inherits them;
    they are ``model.*`` config keys). The attention registry
    (``titanlite.models.attention.for_layer``) reads them per layer."""

    sliding_window: int = 0
    """Sliding-window attention: a query of a local layer sees at most this many keys, ending at its
    own (0 = full attention everywhere)."""
    window_pattern: str = "L"
    """Which layers are local (L, sliding window) and which global (G, full attention): the string
    repeated over the layers from layer 0. "LG" alternates starting local (gpt-oss), "LLLG" is 3
    local : 1 global; "L" = every layer local."""
    attention_sinks: bool = False
    """A learned logit per query head joins every softmax row and attends to nothing
    (gpt-oss's sinks)."""
    attention_kernel: Literal["auto", "explicit", "flex"] = "auto"
    """The kernel of the layers with a sliding window or sinks: "auto" runs FlexAttention (compiled)
    on CUDA and titanlite's blocked explicit kernel elsewhere; "explicit" or "flex" forces one (flex
    off CUDA is its dense reference: tests only)."""

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of block ``layer`` (None: full causal attention)."""
        if self.sliding_window <= 0:
            return None
        local = self.window_pattern[layer % len(self.window_pattern)] == "L"
        return self.sliding_window if local else None

    def check_attention(self) -> None:
        """ValueError naming the field for attention options that cannot be run."""
        if not 0 <= self.sliding_window < 2**31:  # a window is an int32 in the masks
            raise ValueError(
                f"sliding_window must be between 0 and {2**31 - 1:,}, got {self.sliding_window}"
            )
        if not self.window_pattern or set(self.window_pattern) - {"L", "G"}:
            raise ValueError(
                f"window_pattern must be a string of L (local) and G (global), got "
                f"{self.window_pattern!r}"
            )


ATTENTION_OVERRIDES = ("sliding_window", "window_pattern", "attention_sinks", "attention_kernel")
"""The config keys of ``AttentionVariants`` (each family lists them in its overrides)."""

# Megatron-style TP with sequence parallelism: column-wise q/k/v and gate/up projections,
# row-wise output projections, so each sub-layer needs one all-gather in and one
# reduce-scatter out; norms between sub-layers run on sequence shards.
DECODER_TP_PLAN = TensorParallelPlan(
    root={"tok_embeddings": "embedding", "norm": "norm", "output": "output"},
    block={
        "attention_norm": "norm",
        "attention": "gather_input",
        "attention.wq": "colwise",
        "attention.wk": "colwise",
        "attention.wv": "colwise",
        "attention.wo": "rowwise",
        "attention.core": "heads",  # sinks, one per query head (no parameters otherwise)
        "ffn_norm": "norm",
        "feed_forward": "gather_input",
        "feed_forward.w1": "colwise",
        "feed_forward.w2": "rowwise",
        "feed_forward.w3": "colwise",
    },
)

# Residual-branch outputs: their init shrinks with depth so the residual stream stays O(1).
_RESIDUAL_OUTPUTS = ("attention.wo.weight", "feed_forward.w2.weight")


def decoder_init_rule(args: Any, name: str) -> InitRule:
    """Norm weights start at one; embeddings, projections and the output layer from truncated
    normals whose std depends on the role of the weight."""
    if name.endswith("norm.weight"):
        return InitRule.constant(1.0)
    if name == "tok_embeddings.weight":
        # Tied embeddings also act as the output projection, so keep them small.
        return InitRule.normal(args.dim**-0.5 if args.tie_embeddings else 1.0)
    if name == "output.weight":
        return InitRule.normal(args.dim**-0.5)
    if name.endswith(_RESIDUAL_OUTPUTS):
        return InitRule.normal(0.02 / math.sqrt(2 * args.n_layers))
    return InitRule.normal(0.02)


def keys_per_query(seq_len: int, window: int | None) -> float:
    """The keys a query attends on average: half the sequence causally (the triangle of the
    seq x seq square), the band's area over the sequence with a sliding window (the same
    when the window covers the sequence)."""
    if window is None or window >= seq_len:
        return seq_len / 2
    return window - window * window / (2 * seq_len)


def attention_flops_per_token(args: Any, seq_len: int) -> int:
    """QK^T and AV (2 matmuls of 2 FLOPs per multiply-add), forward and backward (x3), over
    the keys each layer's queries see: 12 x width x keys per query, summed over layers."""
    width = args.n_heads * args.head_dim
    window = args.layer_window if isinstance(args, AttentionVariants) else lambda _: None
    keys = sum(keys_per_query(seq_len, window(i)) for i in range(args.n_layers))
    return round(12 * width * keys)


def decoder_flops_per_token(args: Any, seq_len: int) -> int:
    """Training FLOPs per token: 6 x matmul params + the attention term.

    Matmul params exclude the embedding lookup but include the output projection (once, even
    when tied). The attention term (``attention_flops_per_token``) is 6 x layers x width x
    seq with full causal attention; sliding-window layers count their band only.
    """
    per_layer = (
        args.dim * args.head_dim * (args.n_heads * 2 + args.kv_heads * 2)  # wq, wo, wk, wv
        + 3 * args.dim * args.ffn_hidden_dim  # w1, w2, w3
    )
    matmul_params = args.n_layers * per_layer + args.vocab_size * args.dim
    return 6 * matmul_params + attention_flops_per_token(args, seq_len)


def decoder_tp_divisible(args: Any) -> dict[str, int]:
    """Each rank holds whole heads, so the TP degree must divide both head counts."""
    return {"n_heads": args.n_heads, "n_kv_heads": args.kv_heads}


def check_decoder_shape(args: Any) -> None:
    """ValueError naming the field for shapes a decoder cannot take."""
    if args.head_dim % 2:
        raise ValueError(f"head_dim {args.head_dim} must be even for RoPE")
    if args.n_heads % args.kv_heads:
        raise ValueError(f"n_heads {args.n_heads} is not divisible by n_kv_heads {args.kv_heads}")
    if args.vocab_size <= 0:
        raise ValueError("vocab_size must be set (it comes from the tokenizer)")
    if isinstance(args, AttentionVariants):  # the families whose blocks take windows and sinks
        args.check_attention()


SCORE_FUNCS = ("softmax", "sigmoid")
"""How a MoE router may score experts (``model.score_func``)."""


def check_score_func(args: Any) -> None:
    """ValueError naming ``score_func`` when it is not one of SCORE_FUNCS."""
    if args.score_func not in SCORE_FUNCS:
        raise ValueError(
            f"score_func must be one of {', '.join(SCORE_FUNCS)}, got {args.score_func!r}"
        )


def check_moe_routing(args: Any) -> None:
    """ValueError naming the field for routing options the MoE layer cannot take."""
    if args.n_groups < 1 or args.num_experts % args.n_groups:
        raise ValueError(f"n_groups {args.n_groups} does not divide num_experts {args.num_experts}")
    if not 1 <= args.topk_groups <= args.n_groups:
        raise ValueError(f"topk_groups {args.topk_groups} must be between 1 and n_groups")
    per_group = args.num_experts // args.n_groups
    if args.top_k > args.topk_groups * per_group:
        raise ValueError(
            f"top_k {args.top_k} exceeds the {args.topk_groups * per_group} experts of "
            f"topk_groups {args.topk_groups} groups"
        )
    if args.route_scale <= 0:
        raise ValueError(f"route_scale must be > 0, got {args.route_scale}")
    if not 0 <= args.first_k_dense <= args.n_layers:
        raise ValueError(f"first_k_dense {args.first_k_dense} must be between 0 and n_layers")


def decoder_spec(
    name: str,
    package: str,
    args_cls: type,
    flavors: dict[str, Any],
    *,
    overrides: tuple[str, ...],
    tp_plan: TensorParallelPlan = DECODER_TP_PLAN,
) -> ModelSpec:
    """The spec of a family built by the shared decoder (``titanlite.models.decoder``) whose
    Hugging Face adapter is ``package.hf``, with the shared init rules, FLOPs and TP
    constraints."""
    return ModelSpec(
        name=name,
        args_cls=args_cls,
        flavors=flavors,
        model_module="titanlite.models.decoder",
        hf_module=f"{package}.hf",
        tp_plan=tp_plan,
        flops_per_token=decoder_flops_per_token,
        init_rule=decoder_init_rule,
        tp_divisible=decoder_tp_divisible,
        overrides=overrides,
    )
