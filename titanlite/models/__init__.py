"""Model families, each behind a ModelSpec; ``get(name)`` is how the rest of titanlite finds
one. Plain Python: importing this package does not import torch.

Adding a family: a folder here with its args and flavors, a spec in its ``__init__``, its
modules (``build``, ``init_buffers``) and its Hugging Face adapter; then one line below (the
config, --help and the checks find it there through ``titanlite.components``; docs/models.md
walks through Qwen3). ``torchtitan`` says which TorchTitan models the families reproduce.

May import: ``errors``. Never torch.distributed, parallel/ or the config: a family is
plain modules and a spec, parallelized from outside through that spec.
"""

from __future__ import annotations

from titanlite.models.deepseek_v3 import SPEC as DEEPSEEK_V3
from titanlite.models.gpt_oss import SPEC as GPT_OSS
from titanlite.models.llama import SPEC as LLAMA3
from titanlite.models.qwen3 import SPEC as QWEN3
from titanlite.models.qwen3_5 import SPEC as QWEN3_5
from titanlite.models.qwen3_5_moe import SPEC as QWEN3_5_MOE
from titanlite.models.qwen3_moe import SPEC as QWEN3_MOE
from titanlite.models.spec import InitRule, ModelSpec

REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (LLAMA3, QWEN3, QWEN3_MOE, DEEPSEEK_V3, QWEN3_5, QWEN3_5_MOE, GPT_OSS)
}

__all__ = ["REGISTRY", "InitRule", "ModelSpec", "get"]


def get(name: str) -> ModelSpec:
    """The spec of a family; KeyError for an unknown name (config validation catches it first)."""
    return REGISTRY[name]
