"""Qwen3 dense (Alibaba): the Llama-style decoder with per-head q/k RMSNorm, an explicit
head size, rotate-half RoPE and tied embeddings at the small sizes.

This package's top level is plain Python (the spec); the modules are in ``model`` and the
Hugging Face adapter in ``hf``, imported when first needed.
"""

from titanlite.models.decoder import (
    DECODER_TP_PLAN,
    decoder_flops_per_token,
    decoder_init_rule,
    decoder_tp_divisible,
)
from titanlite.models.qwen3.args import FLAVORS, OVERRIDES, Qwen3Args
from titanlite.models.spec import ModelSpec, TensorParallelPlan

# The q/k norms act on whole heads, which tensor parallelism keeps together on one rank.
TP_PLAN = TensorParallelPlan(
    root=DECODER_TP_PLAN.root,
    block={
        **DECODER_TP_PLAN.block,
        "attention.q_norm": "head_norm",
        "attention.k_norm": "head_norm",
    },
)

SPEC = ModelSpec(
    name="qwen3",
    args_cls=Qwen3Args,
    flavors=FLAVORS,
    model_module="titanlite.models.qwen3.model",
    hf_module="titanlite.models.qwen3.hf",
    tp_plan=TP_PLAN,
    flops_per_token=decoder_flops_per_token,
    init_rule=decoder_init_rule,
    tp_divisible=decoder_tp_divisible,
    overrides=OVERRIDES,
)
