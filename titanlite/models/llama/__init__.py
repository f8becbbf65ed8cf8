"""Llama 3 (Meta): RMSNorm, RoPE on interleaved pairs, grouped-query attention, SwiGLU.

This package's top level is plain Python (the spec); the modules are the shared decoder's
(``titanlite.models.decoder``) and the Hugging Face adapter is ``hf``, imported when first
needed.
"""

from titanlite.models.decoder_spec import decoder_spec
from titanlite.models.llama.args import FLAVORS, OVERRIDES, LlamaArgs

SPEC = decoder_spec("llama3", __name__, LlamaArgs, FLAVORS, overrides=OVERRIDES)
