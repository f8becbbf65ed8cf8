"""Llama 3 (Meta): RMSNorm, RoPE on interleaved pairs, grouped-query attention, SwiGLU.

This package's top level is plain Python (the spec); the modules are in ``model`` and the
Hugging Face adapter in ``hf``, imported when first needed.
"""

from titanlite.models.decoder import (
    DECODER_TP_PLAN,
    decoder_flops_per_token,
    decoder_init_rule,
    decoder_tp_divisible,
)
from titanlite.models.llama.args import FLAVORS, OVERRIDES, LlamaArgs
from titanlite.models.spec import ModelSpec

SPEC = ModelSpec(
    name="llama3",
    args_cls=LlamaArgs,
    flavors=FLAVORS,
    model_module="titanlite.models.llama.model",
    hf_module="titanlite.models.llama.hf",
    tp_plan=DECODER_TP_PLAN,
    flops_per_token=decoder_flops_per_token,
    init_rule=decoder_init_rule,
    tp_divisible=decoder_tp_divisible,
    overrides=OVERRIDES,
)
