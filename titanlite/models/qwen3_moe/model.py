"""The Qwen3-MoE modules: the shared decoder (q/k norms, rotate-half RoPE) whose blocks hold
a ``titanlite.models.moe.MoE`` feed-forward, because Qwen3MoeArgs has experts."""

from __future__ import annotations

from titanlite.models.layers import Decoder
from titanlite.models.qwen3_moe.args import Qwen3MoeArgs


def build(args: Qwen3MoeArgs) -> Decoder:
    return Decoder(args)


def init_buffers(model: Decoder) -> None:
    model.init_buffers()
