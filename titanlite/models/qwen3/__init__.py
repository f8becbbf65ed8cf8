"""Qwen3 dense (Alibaba): the Llama-style decoder with per-head q/k RMSNorm, an explicit
head size, rotate-half RoPE and tied embeddings at the small sizes.

This package's top level is plain Python (the spec); the modules are the shared decoder's
(``titanlite.models.decoder``) and the Hugging Face adapter is ``hf``, imported when first
needed.
"""

from titanlite.models.decoder_spec import DECODER_TP_PLAN, decoder_spec
from titanlite.models.qwen3.args import FLAVORS, OVERRIDES, Qwen3Args
from titanlite.models.spec import TensorParallelPlan

# The q/k norms act on whole heads, which tensor parallelism keeps together on one rank.
TP_PLAN = TensorParallelPlan(
    root=DECODER_TP_PLAN.root,
    block={
        **DECODER_TP_PLAN.block,
        "attention.q_norm": "head_norm",
        "attention.k_norm": "head_norm",
    },
)

SPEC = decoder_spec("qwen3", __name__, Qwen3Args, FLAVORS, overrides=OVERRIDES, tp_plan=TP_PLAN)
