"""The Llama 3 modules: the shared decoder with Meta's interleaved RoPE and no q/k norms."""

from __future__ import annotations

from titanlite.models.layers import Decoder
from titanlite.models.llama.args import LlamaArgs


def build(args: LlamaArgs) -> Decoder:
    return Decoder(args)


def init_buffers(model: Decoder) -> None:
    model.init_buffers()
