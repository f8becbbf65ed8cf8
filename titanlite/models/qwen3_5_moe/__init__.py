"""Qwen3.5-MoE (Alibaba), the text model: Qwen3.5's hybrid of Gated DeltaNet and gated full
attention (``titanlite.models.qwen3_5``: the same modules) with a mixture of experts in every
block (``titanlite.models.moe``): softmax top-k routing renormalized, and a shared expert
scaled by a per-token sigmoid gate. Plain Python here (the spec); the Hugging Face adapter
is ``hf``.

Tensor parallelism splits attention and the DeltaNet layers as Qwen3.5's plan does; the
mixture of experts runs whole on each rank's shard of the sequence, as Qwen3-MoE's does.
FLOPs and MFU count the active parameters.
"""

from __future__ import annotations

import math

from titanlite.models.qwen3_5 import TP_PLAN as DENSE_TP_PLAN
from titanlite.models.qwen3_5 import flops_per_token as dense_flops_per_token
from titanlite.models.qwen3_5 import init_rule as dense_init_rule
from titanlite.models.qwen3_5 import tp_divisible
from titanlite.models.qwen3_5_moe.args import FLAVORS, OVERRIDES, Qwen35MoeArgs
from titanlite.models.qwen3_moe import active_params  # experts in every block
from titanlite.models.spec import InitRule, ModelSpec, TensorParallelPlan

TP_PLAN = TensorParallelPlan(
    root=DENSE_TP_PLAN.root,
    block={
        **{k: v for k, v in DENSE_TP_PLAN.block.items() if not k.startswith("feed_forward")},
        "feed_forward": "local_tokens",
    },
)


def init_rule(args: Qwen35MoeArgs, name: str) -> InitRule:
    """Qwen3.5's rules; the experts' and shared expert's down projections shrink with depth
    as the dense SwiGLU's does; the router and the shared expert's gate at 0.02."""
    if name.endswith(("feed_forward.experts.w2", "feed_forward.shared.w2.weight")):
        return InitRule.normal(0.02 / math.sqrt(2 * args.n_layers))
    return dense_init_rule(args, name)


def flops_per_token(args: Qwen35MoeArgs, seq_len: int) -> int:
    """Qwen3.5's formula with the active experts' width (top_k + shared), plus the router's
    and the shared expert gate's matmuls."""
    gates = args.num_experts + (1 if args.shared_expert_gate and args.shared_experts else 0)
    return dense_flops_per_token(args, seq_len) + 6 * args.n_layers * args.dim * gates


SPEC = ModelSpec(
    name="qwen3_5_moe",
    args_cls=Qwen35MoeArgs,
    flavors=FLAVORS,
    model_module="titanlite.models.qwen3_5.model",
    hf_module="titanlite.models.qwen3_5_moe.hf",
    tp_plan=TP_PLAN,
    flops_per_token=flops_per_token,
    init_rule=init_rule,
    tp_divisible=tp_divisible,
    overrides=OVERRIDES,
    active_params=active_params,
    experts=True,
    # Qwen3.5's MoE sizes, as users name them under qwen3_5: this family builds them (its own
    # spec and Hugging Face class, as in transformers).
    also_named={
        ("qwen3_5", "debugmodel_moe"): "debugmodel",
        ("qwen3_5", "35B-A3B"): "35B-A3B",
        ("qwen3_5", "397B-A17B"): "397B-A17B",
    },
)
