"""Qwen3-MoE (Alibaba): Qwen3's attention with a mixture of experts in every layer
(``titanlite.models.moe``). Plain Python here (the spec); the modules are the shared
decoder's, the Hugging Face adapter is ``hf``.

FLOPs and MFU count the active parameters: attention, the router, the top-k experts and any
shared experts a token goes through.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from titanlite.models.decoder_spec import decoder_flops_per_token, decoder_init_rule, decoder_spec
from titanlite.models.qwen3 import TP_PLAN as QWEN3_TP_PLAN
from titanlite.models.qwen3_moe.args import FLAVORS, OVERRIDES, Qwen3MoeArgs
from titanlite.models.spec import InitRule, TensorParallelPlan

# Attention is split as in Qwen3; the mixture of experts (router, experts, shared experts)
# runs whole on each TP rank's shard of the sequence, routing those tokens itself.
TP_PLAN = TensorParallelPlan(
    root=QWEN3_TP_PLAN.root,
    block={
        **{k: v for k, v in QWEN3_TP_PLAN.block.items() if not k.startswith("feed_forward")},
        "feed_forward": "local_tokens",
    },
)


def moe_init_rule(args: Any, name: str) -> InitRule:
    """Experts as the dense SwiGLU (the down projection shrinks with depth), router 0.02."""
    if name.endswith(("feed_forward.experts.w2", "feed_forward.shared.w2.weight")):
        return InitRule.normal(0.02 / math.sqrt(2 * args.n_layers))
    return decoder_init_rule(args, name)


def moe_flops_per_token(args: Any, seq_len: int) -> int:
    """The dense formula with the active expert width (top_k + shared experts), plus the
    router's matmul."""
    moe_layers = args.n_layers - args.first_k_dense
    return decoder_flops_per_token(args, seq_len) + 6 * moe_layers * args.dim * args.num_experts


def active_params(args: Any, total: int) -> int:
    """Parameters one token uses: all but the experts it is not routed to (in the blocks
    after the first ``first_k_dense``, which have none; families without the field have
    experts in every block)."""
    unused = args.num_experts - args.top_k
    moe_layers = args.n_layers - getattr(args, "first_k_dense", 0)
    return total - moe_layers * unused * 3 * args.dim * args.moe_hidden_dim


SPEC = dataclasses.replace(
    decoder_spec(
        "qwen3_moe", __name__, Qwen3MoeArgs, FLAVORS, overrides=OVERRIDES, tp_plan=TP_PLAN
    ),
    init_rule=moe_init_rule,
    flops_per_token=moe_flops_per_token,
    active_params=active_params,
    experts=True,
)
