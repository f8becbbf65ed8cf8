"""DeepSeek-V3 (and DeepSeek-V2-Lite, Kimi K2): multi-head latent attention and a mixture of
fine-grained experts after dense first blocks. Plain Python here (the spec); the modules are
the shared decoder's with the attention registry's "mla" layer, the Hugging Face adapter is
``hf``.

FLOPs and MFU count the active parameters: attention's projections, the router, the top-k and
shared experts (dense blocks whole), and the attention products at the query/key and value
head sizes; multi-token prediction depths (``titanlite.models.mtp``) count as one more
mixture-of-experts block, projection and output head each.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from titanlite.models.decoder_spec import decoder_spec
from titanlite.models.deepseek_v3.args import FLAVORS, OVERRIDES, DeepseekV3Args
from titanlite.models.qwen3_moe import moe_init_rule
from titanlite.models.spec import TensorParallelPlan, TPStyle

# Latent attention split by heads: the query and key/value up-projections column-wise, the
# output row-wise; the latent projections and their norms replicated (their outputs feed every
# head). The positional key ("latent_local") is used by this rank's heads only, so its
# gradient is a partial sum over TP. The feed-forward (dense or experts) runs whole on each
# rank's shard of the sequence, as Qwen3-MoE's experts do.
_BLOCK_PLAN: dict[str, TPStyle] = {
    "attention_norm": "norm",
    "attention": "gather_input",
    "attention.wq": "colwise",
    "attention.wq_a": "latent",
    "attention.q_norm": "latent",
    "attention.wq_b": "colwise",
    "attention.wkv_a": "latent",
    "attention.kv_norm": "latent",
    "attention.wkv_b": "colwise",
    "attention.wk_rope": "latent_local",
    "attention.wo": "rowwise",
    "ffn_norm": "norm",
    "feed_forward": "local_tokens",
}
_MTP_PLAN: dict[str, TPStyle] = {
    # Multi-token prediction depths: norms on sequence shards; the projection runs on each
    # rank's shard with whole weights (partial gradients, as the experts'); the block as above.
    "enorm": "norm",
    "hnorm": "norm",
    "eh_proj": "local_tokens",
    "norm": "norm",
    **{f"block.{path}": style for path, style in _BLOCK_PLAN.items()},
}
TP_PLAN = TensorParallelPlan(
    root={"tok_embeddings": "embedding", "norm": "norm", "output": "output"},
    block=_BLOCK_PLAN,
    extra={"mtp": _MTP_PLAN},
)


def attention_params(args: DeepseekV3Args) -> int:
    """Parameters of one latent attention layer's projections (norms aside)."""
    qk = args.qk_nope_head_dim + args.qk_rope_head_dim
    q = (
        args.dim * args.q_lora_rank + args.q_lora_rank * args.n_heads * qk
        if args.q_lora_rank
        else args.dim * args.n_heads * qk
    )
    kv = args.dim * (args.kv_lora_rank + args.qk_rope_head_dim)
    kv += args.kv_lora_rank * args.n_heads * (args.qk_nope_head_dim + args.v_head_dim)
    return q + kv + args.n_heads * args.v_head_dim * args.dim


def flops_per_token(args: DeepseekV3Args, seq_len: int) -> int:
    """6 x active matmul params + 6 x layers x heads x mean(qk, v head size) x seq (the
    causal half of QK^T and AV, forward and backward)."""
    moe_layers = args.n_layers - args.first_k_dense
    ffn = (
        3
        * args.dim
        * (args.first_k_dense * args.dense_hidden_dim + moe_layers * args.ffn_hidden_dim)
    )
    matmul = (
        args.n_layers * attention_params(args)
        + ffn
        + moe_layers * args.dim * args.num_experts  # the router
        + args.vocab_size * args.dim
    )
    # Each multi-token prediction depth: a mixture-of-experts block, its projection of the
    # joined embedding and hidden state, and the output head again.
    depth = (
        attention_params(args) + 3 * args.dim * args.ffn_hidden_dim + args.dim * args.num_experts
    )
    matmul += args.mtp_layers * (depth + 2 * args.dim * args.dim + args.vocab_size * args.dim)
    qk = args.qk_nope_head_dim + args.qk_rope_head_dim
    blocks = args.n_layers + args.mtp_layers
    return 6 * matmul + 3 * blocks * args.n_heads * (qk + args.v_head_dim) * seq_len


def active_params(args: DeepseekV3Args, total: int) -> int:
    """Parameters one token uses: all but the routed experts it is not sent to."""
    unused = args.num_experts - args.top_k
    moe_layers = args.n_layers - args.first_k_dense + args.mtp_layers
    return total - moe_layers * unused * 3 * args.dim * args.moe_hidden_dim


def tp_divisible(args: Any) -> dict[str, int]:
    """Each rank holds whole heads."""
    return {"n_heads": args.n_heads}


SPEC = dataclasses.replace(
    decoder_spec(
        "deepseek_v3", __name__, DeepseekV3Args, FLAVORS, overrides=OVERRIDES, tp_plan=TP_PLAN
    ),
    init_rule=moe_init_rule,
    flops_per_token=flops_per_token,
    active_params=active_params,
    tp_divisible=tp_divisible,
    experts=True,
    # Multi-token prediction depths run after the last block: on the last pipeline stage.
    output_modules=("norm", "output", "mtp"),
)
