"""Muon (momentum orthogonalized by a quintic Newton-Schulz iteration) for hidden matrices, and
AdamW for every other group, in one torch optimizer.

One optimizer per model part keeps checkpoints (optimizer state by parameter name, through
DCP), the learning-rate schedule and everything that loops over a part's optimizer unchanged:
each param group's "optimizer" key ("muon" or "adamw") says which update applies. AdamW groups
run torch's own AdamW kernels (this class is a torch.optim.AdamW that steps Muon groups
itself), so their numbers are AdamW's exactly.

The Muon update of a matrix W with gradient G (per step, in this order):

    B <- momentum * B + G                        (B starts at zero; the checkpointed state)
    U <- G + momentum * B    (Nesterov; else U <- B)
    O <- NewtonSchulz(U)     (the orthogonal factor of U, approximately: U = P S Q^T -> P Q^T)
    W <- W * (1 - lr * weight_decay) - lr * scale(W) * O

with scale = 0.2 * sqrt(max(rows, cols)) (match_rms_adamw, Moonlight: the step's RMS matches
AdamW's, so AdamW's lr and weight decay carry over), sqrt(max(1, fan_out / fan_in))
(original, Keller Jordan's) or 1. A stack of expert matrices ([experts, in, out]) is
orthogonalized expert by expert. Where the matrix is split over ranks (FSDP, TP), O is computed
from the whole matrix on one rank and sent back as shards (``titanlite.optim.orthogonalize``).
With ``muon.block = "head"`` the attention projections are orthogonalized head by head (each
head's rows of wq, wk, wv, its columns of wo), and scale(W) is that of one head's block.
With ``muon.qk_clip_threshold`` the step ends with QK-clip (``titanlite.optim.qk_clip``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from titanlite.config.job_config import Optimizer
from titanlite.models.interfaces import AttentionLayer, find
from titanlite.optim import BuildContext
from titanlite.optim.adamw import adamw_defaults
from titanlite.optim.muon_settings import MuonSettings
from titanlite.optim.orthogonalize import Block, Orthogonalizer, blocked
from titanlite.optim.pieces import local
from titanlite.optim.qk_clip import QKClip


@dataclass(frozen=True)
class NewtonSchulz:
    """The quintic iteration X <- a X + (b A + c A^2) X with A = X X^T, from X = U / |U|_F."""

    steps: int = 5
    coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
    dtype: torch.dtype = torch.float32
    eps: float = 1e-7

    def __call__(self, update: torch.Tensor) -> torch.Tensor:
        """The orthogonalized ``update`` (a matrix, or a stack of them over leading dims), in
        ``update``'s dtype."""
        a, b, c = self.coefficients
        x = update.to(self.dtype)
        # Iterate on the wide orientation: X X^T is then the smaller Gram matrix.
        tall = x.size(-2) > x.size(-1)
        if tall:
            x = x.mT
        x = x / (torch.linalg.matrix_norm(x, keepdim=True) + self.eps)
        for _ in range(self.steps):
            gram = x @ x.mT
            x = a * x + (b * gram + c * (gram @ gram)) @ x
        if tall:
            x = x.mT
        return x.to(update.dtype)


def fan_out_in(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """(fan_out, fan_in) of one matrix of a parameter: a linear weight is [out, in]; an expert
    stack is [experts, in, out]."""
    if len(shape) == 2:
        return shape[0], shape[1]
    return shape[-1], shape[-2]


def lr_scale(shape: torch.Size | tuple[int, ...], adjustment: str) -> float:
    """How much larger than the group's lr a matrix's Muon step is."""
    fan_out, fan_in = fan_out_in(shape)
    if adjustment == "match_rms_adamw":
        return 0.2 * math.sqrt(max(fan_out, fan_in))
    if adjustment == "original":
        return math.sqrt(max(1.0, fan_out / fan_in))
    return 1.0


def spectral_lr(shape: tuple[float, ...], adjustment: str) -> float:
    """In proportion, the learning rate at which a Muon step of a matrix of ``shape`` has
    the spectral norm μP's spectral condition asks for, sqrt(fan_out / fan_in): an
    orthogonalized step's spectral norm is its lr times ``lr_scale`` (μP's factor for Muon
    is this ratio between a shape and its base-width shape, titanlite.mup)."""
    fan_out, fan_in = fan_out_in(shape)
    return math.sqrt(fan_out / fan_in) / lr_scale(shape, adjustment)


class Muon(torch.optim.AdamW):
    """Muon for the param groups whose "optimizer" is "muon"; torch's AdamW for the others.

    ``orthogonalize`` maps the (parameter, local update) pairs of a step to their local
    orthogonalized updates (``Orthogonalizer``: whole matrices under every layout);
    ``adamw`` are torch.optim.AdamW's keyword arguments; ``blocks`` the parameters
    orthogonalized block by block (their lr scale is a block's); ``qk_clip`` runs after
    each update.
    """

    def __init__(
        self,
        groups: list[dict[str, Any]],
        *,
        momentum: float,
        nesterov: bool,
        lr_adjustment: str,
        orthogonalize: Callable[[list[tuple[torch.Tensor, torch.Tensor]]], list[torch.Tensor]],
        adamw: dict[str, Any],
        blocks: dict[int, Block] | None = None,
        qk_clip: QKClip | None = None,
    ):
        super().__init__(groups, **adamw)
        self.momentum, self.nesterov = momentum, nesterov
        self.lr_adjustment = lr_adjustment
        self.orthogonalize = orthogonalize
        self.blocks = blocks or {}
        self.qk_clip = qk_clip

    def __setstate__(self, state: dict[str, Any]) -> None:
        # load_state_dict ends here; Adam's version reads "step" from every parameter's state,
        # which Muon's (a momentum buffer only) has none of: show it the AdamW groups only.
        groups = state["param_groups"]
        adamw = [g for g in groups if g.get("optimizer") != "muon"]
        super().__setstate__({**state, "param_groups": adamw})
        self.param_groups = groups

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure() if closure is not None else None
        every = self.param_groups
        muon = [g for g in every if g.get("optimizer") == "muon"]
        self._muon_step(muon)
        # torch's AdamW steps the rest: it loops over self.param_groups, so show it its own.
        self.param_groups = [g for g in every if g.get("optimizer") != "muon"]
        try:
            super().step()
        finally:
            self.param_groups = every
        if self.qk_clip is not None:
            self.qk_clip.apply()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        if self.qk_clip is not None:  # the largest logits are per step, like the gradients
            self.qk_clip.reset()

    def _muon_step(self, groups: list[dict[str, Any]]) -> None:
        todo: list[tuple[dict[str, Any], torch.Tensor, torch.Tensor]] = []
        for group in groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    # Shaped and placed like the parameter (a DTensor for a DTensor), so a
                    # checkpoint holds it at its global shape and resumes under any layout.
                    state["momentum_buffer"] = torch.zeros_like(p)
                grad, buf = local(p.grad), local(state["momentum_buffer"])
                buf.mul_(self.momentum).add_(grad)
                update = grad.add(buf, alpha=self.momentum) if self.nesterov else buf.clone()
                todo.append((group, p, update))
        orthogonal = self.orthogonalize([(p, update) for _, p, update in todo])
        for (group, p, _), o in zip(todo, orthogonal, strict=True):
            lr, decay = group["lr"], group["weight_decay"]
            weight = local(p)
            if decay:
                weight.mul_(1 - lr * decay)
            block = self.blocks.get(id(p))
            shape = p.shape if block is None else blocked(p.shape, block)[1:]
            weight.add_(o.to(weight.dtype), alpha=-lr * lr_scale(shape, self.lr_adjustment))


def build(
    groups: list[dict[str, Any]], settings: Optimizer, context: BuildContext
) -> torch.optim.Optimizer:
    m: MuonSettings = context.settings
    ns = NewtonSchulz(
        steps=m.ns_steps,
        coefficients=(m.ns_a, m.ns_b, m.ns_c),
        dtype=torch.bfloat16 if m.ns_dtype == "bfloat16" else torch.float32,
        eps=m.eps,
    )
    blocks = head_blocks(context.model) if m.block == "head" else {}
    return Muon(
        groups,
        momentum=m.momentum,
        nesterov=m.nesterov,
        lr_adjustment=m.lr_adjustment,
        orthogonalize=Orthogonalizer(ns, replica_group=context.replica_group, blocks=blocks),
        adamw=adamw_defaults(settings, context.device),
        blocks=blocks,
        qk_clip=QKClip.of(
            context.model, m.qk_clip_threshold, dims=context.dims, n_layers=context.n_layers
        ),
    )


def head_blocks(model: torch.nn.Module | None) -> dict[int, Block]:
    """id(weight) -> (dim, head_dim) of the attention projections of ``model``: each head's
    rows of wq, wk and wv, its columns of wo."""
    blocks: dict[int, Block] = {}
    for layer in find(model, AttentionLayer) if model is not None else []:
        heads = layer.heads()
        for weight in (heads.query, heads.key, heads.value):
            blocks[id(weight)] = (0, heads.head_dim)
        blocks[id(heads.output)] = (1, heads.head_dim)
    return blocks
