"""gpt-oss (OpenAI): the shared decoder with biased GQA projections, attention sinks,
alternating sliding-window / full layers, YaRN RoPE and a mixture of experts with biases
and a clamped SwiGLU (``args`` describes it). Plain Python here (the spec); the modules are
the shared decoder's, the Hugging Face adapter is ``hf``.

Active parameters follow OpenAI's model card: every parameter a token's matmuls use (the
output projection included), not the embedding table it only looks a row up in.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from titanlite.models.decoder_spec import DECODER_TP_PLAN, decoder_spec
from titanlite.models.gpt_oss.args import FLAVORS, OVERRIDES, GptOssArgs
from titanlite.models.qwen3_moe import moe_flops_per_token, moe_init_rule
from titanlite.models.spec import InitRule, TensorParallelPlan

# Attention split by heads (biases with their rows, sinks with their heads); the mixture of
# experts runs whole on each TP rank's shard of the sequence, as in Qwen3-MoE.
TP_PLAN = TensorParallelPlan(
    root=DECODER_TP_PLAN.root,
    block={
        **{k: v for k, v in DECODER_TP_PLAN.block.items() if not k.startswith("feed_forward")},
        "feed_forward": "local_tokens",
    },
)


def init_rule(args: Any, name: str) -> InitRule:
    """Biases start at zero (the router's too); the rest as Qwen3-MoE (sinks 0.02)."""
    if name.endswith(".bias") or name.endswith(("experts.b1", "experts.b2", "experts.b3")):
        return InitRule.constant(0.0)
    return moe_init_rule(args, name)


def active_params(args: Any, total: int) -> int:
    """All but the experts a token is not routed to and the embedding table."""
    unused = args.num_experts - args.top_k
    per_expert = 3 * args.dim * args.moe_hidden_dim + 2 * args.moe_hidden_dim + args.dim
    return total - args.n_layers * unused * per_expert - args.vocab_size * args.dim


SPEC = dataclasses.replace(
    decoder_spec("gpt_oss", __name__, GptOssArgs, FLAVORS, overrides=OVERRIDES, tp_plan=TP_PLAN),
    init_rule=init_rule,
    flops_per_token=moe_flops_per_token,
    active_params=active_params,
    experts=True,
)
