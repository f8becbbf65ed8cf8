"""The Qwen3 modules: the shared decoder with q/k norms and rotate-half RoPE (set by
Qwen3Args' class constants)."""

from __future__ import annotations

from titanlite.models.layers import Decoder
from titanlite.models.qwen3.args import Qwen3Args


def build(args: Qwen3Args) -> Decoder:
    return Decoder(args)


def init_buffers(model: Decoder) -> None:
    model.init_buffers()
