"""Llama 3 (Meta): RMSNorm, RoPE on interleaved pairs, grouped-query attention, SwiGLU.

This package's top level is plain Python (the spec); the modules are in ``model`` and the
Hugging Face adapter in ``hf``, imported when first needed.
"""

from titanlite.models.decoder import decoder_spec
from titanlite.models.llama.args import FLAVORS, OVERRIDES, LlamaArgs

SPEC = decoder_spec("llama3", __name__, LlamaArgs, FLAVORS, OVERRIDES)
