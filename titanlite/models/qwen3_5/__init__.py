"""Qwen3.5 (Alibaba), the text model: a hybrid of Gated DeltaNet linear attention and gated
full attention, three to one (``args`` has the shapes, ``model`` the modules, ``hf`` the
Hugging Face adapter). Plain Python here: the spec.

Tensor parallelism splits both layer kinds by heads: full attention as Qwen3's plus its
gate projection; in a DeltaNet layer every projection column-wise (the key, value and
step-size heads of a rank stay together because value head j reads key head
j / (value heads / key heads)), the convolution and decay parameters by channel, and the
output projection row-wise.
"""

from __future__ import annotations

import math

from titanlite.models.decoder_spec import DECODER_TP_PLAN, decoder_init_rule
from titanlite.models.qwen3_5.args import FLAVORS, OVERRIDES, Qwen35Args
from titanlite.models.spec import InitRule, ModelSpec, TensorParallelPlan

TP_PLAN = TensorParallelPlan(
    root=DECODER_TP_PLAN.root,
    block={
        **DECODER_TP_PLAN.block,
        "attention.wg": "colwise",
        "attention.q_norm": "head_norm",
        "attention.k_norm": "head_norm",
        "linear_attn": "gather_input",
        **{f"linear_attn.w{p}": "colwise" for p in "qkvzba"},
        "linear_attn.conv": "channels",
        "linear_attn.decay": "channels",
        "linear_attn.norm": "head_norm",
        "linear_attn.wo": "rowwise",
    },
)

_RESIDUAL_OUTPUTS = ("attention.wo.weight", "linear_attn.wo.weight", "feed_forward.w2.weight")


def init_rule(args: Qwen35Args, name: str) -> InitRule:
    """Zero-centered norms start at zero (a scale of one); the DeltaNet output norm at one;
    the decay per value head as the published model's: A uniform in (0, 16) (A_log = log A)
    and dt_bias the inverse softplus of a dt log-uniform in [0.001, 0.1], so that heads start
    with decay rates spread over orders of magnitude; the convolution as a depthwise
    convolution's default (the variance of U(-1/sqrt(k), 1/sqrt(k))); the rest as Qwen3."""
    if name.endswith("decay.A_log"):
        return InitRule.log_uniform(0.0, 16.0)
    if name.endswith("decay.dt_bias"):
        return InitRule.softplus_inverse(0.001, 0.1)
    if name.endswith("linear_attn.norm.weight"):
        return InitRule.constant(1.0)
    if name.endswith("norm.weight"):
        return InitRule.constant(0.0)
    if ".linear_attn.conv." in name:
        return InitRule.normal((3 * args.conv_kernel) ** -0.5)
    if name.endswith(_RESIDUAL_OUTPUTS):
        return InitRule.normal(0.02 / math.sqrt(2 * args.n_layers))
    return decoder_init_rule(args, name)


def _layers(args: Qwen35Args) -> tuple[int, int]:
    full = sum(args.is_full_attention(i) for i in range(args.n_layers))
    return full, args.n_layers - full


def flops_per_token(args: Qwen35Args, seq_len: int) -> int:
    """6 x matmul params, plus full attention's 6 x layers x width x seq, plus the delta
    rule's per-token work in the linear layers (state reads and writes, 3 d_k d_v per
    value head, and the within-chunk products, chunk x (d_k + d_v)), which does not grow
    with the sequence."""
    full, linear = _layers(args)
    keys, values = args.linear_k_heads * args.linear_k_dim, args.linear_v_heads * args.linear_v_dim
    attn = args.dim * args.head_dim * (args.n_heads * 3 + args.kv_heads * 2)
    delta = args.dim * (2 * keys + 3 * values + 2 * args.linear_v_heads)
    matmul = full * attn + linear * delta + args.n_layers * 3 * args.dim * args.ffn_hidden_dim
    matmul += args.vocab_size * args.dim
    rule = args.linear_v_heads * (
        3 * args.linear_k_dim * args.linear_v_dim
        + args.chunk_size * (args.linear_k_dim + args.linear_v_dim)
    )
    return 6 * matmul + 6 * full * args.n_heads * args.head_dim * seq_len + 6 * linear * rule


def tp_divisible(args: Qwen35Args) -> dict[str, int]:
    return {
        "n_heads": args.n_heads,
        "n_kv_heads": args.kv_heads,
        "linear_k_heads": args.linear_k_heads,
        "linear_v_heads": args.linear_v_heads,
    }


SPEC = ModelSpec(
    name="qwen3_5",
    args_cls=Qwen35Args,
    flavors=FLAVORS,
    model_module="titanlite.models.qwen3_5.model",
    hf_module="titanlite.models.qwen3_5.hf",
    tp_plan=TP_PLAN,
    flops_per_token=flops_per_token,
    init_rule=init_rule,
    tp_divisible=tp_divisible,
    overrides=OVERRIDES,
)
