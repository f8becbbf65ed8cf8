"""The LoRA converter's torch side: freeze the model, give chosen linears low-rank adapters.

Each chosen ``nn.Linear`` becomes a ``LoraLinear`` at the same module path, keeping its
``weight`` (and bias) under the same names, so checkpoints, Hugging Face imports and the
tensor-parallel plan address it as before; its adapters are two more parameters of the same
module, ``lora_a`` [rank, in] and ``lora_b`` [out, rank]. The forward adds
``dropout(x) A^T B^T * alpha / rank``. Every other parameter of the model is frozen
(``requires_grad`` False): the optimizer's groups skip it, FSDP and DDP reduce no gradient
for it. B starts at zero, so the converted model computes what the base model computes.

An export folds the trained adapters into their weights (``titanlite.interop.lora_merge``).
"""

from __future__ import annotations

import fnmatch
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.errors import UserError
from titanlite.models.interfaces import LowRankLinear
from titanlite.models.spec import InitRule

logger = logging.getLogger(__name__)

ADAPTER_NAMES = ("lora_a", "lora_b")


class LoraLinear(LowRankLinear):
    """An ``nn.Linear`` plus a trained update of rank ``rank`` (see the module docstring)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        rank: int,
        alpha: float,
        dropout: float,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.rank = rank
        self.scale = alpha / rank
        self.dropout = dropout
        self.lora_a = nn.Parameter(torch.empty(rank, in_features))
        self.lora_b = nn.Parameter(torch.empty(out_features, rank))
        # A like a fan-in-scaled projection; B zero, so training starts from the base model.
        self.adapter_init = {
            "lora_a": InitRule.normal(in_features**-0.5),
            "lora_b": InitRule.constant(0.0),
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        h = F.dropout(x, self.dropout, self.training) if self.dropout else x
        return out + F.linear(F.linear(h, self.lora_a), self.lora_b) * self.scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scale={self.scale:g}"


def targeted(path: str, patterns: list[str]) -> bool:
    """Whether the module at ``path`` matches a pattern (at the end of its path)."""
    return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path, f"*.{p}") for p in patterns)


def convert(model: nn.Module, spec: Any, settings: Any) -> int:
    """Freeze every parameter of ``model`` and replace the targeted linears (meta device or
    real: the weights are moved, not copied). UserError when no linear matches."""
    for param in model.parameters():
        param.requires_grad_(False)
    chosen = [
        (path, module)
        for path, module in model.named_modules()
        if type(module) is nn.Linear
        and path.rpartition(".")[2] != "output"
        and targeted(path, settings.target_modules)
    ]
    if not chosen:
        raise UserError(
            f"lora.target_modules {settings.target_modules} matches no linear of the model "
            "(patterns match the end of a module path, e.g. attention.wq)"
        )
    for path, old in chosen:
        with torch.device(old.weight.device):  # meta stays meta: nothing is allocated
            new = LoraLinear(
                old.in_features,
                old.out_features,
                bias=old.bias is not None,
                rank=settings.rank,
                alpha=settings.alpha,
                dropout=settings.dropout,
            ).to(dtype=old.weight.dtype)
        new.weight = old.weight
        new.bias = old.bias
        for name in ADAPTER_NAMES:
            getattr(new, name).requires_grad_(True)
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    logger.info(
        "lora: rank %d adapters on %d linears; %s trainable parameters, the rest frozen",
        settings.rank,
        len(chosen),
        f"{trainable:,}",
    )
    return len(chosen)
