"""The trainer's side of a model's mixture-of-experts layers: the auxiliary loss's weight, the
routing-bias updates after each step and the per-step routing metrics.

The layers (``titanlite.models.moe.MoE``) only add up what their forwards saw; the global
sums, which need collectives, are taken here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titanlite.models.moe import MoE


class MoETracker:
    """The trainer's side of the MoE layers of a model: their auxiliary loss per micro-batch,
    the bias updates after each step and the per-step metrics.

    Counts are summed over the step's micro-batches on the device; after the step they are
    all-reduced over ``group`` (the ranks that route different tokens: the batch's split and,
    under context and tensor parallelism, the sequence's) only when they are needed: every
    step with the bias update on, otherwise at log steps.
    """

    def __init__(
        self,
        layers: list[MoE],
        group: Any,
        *,
        global_batch: int,
        grad_weight: float = 1.0,
        stage_group: Any = None,
        n_layers: int = 0,
        seq_len: int = 1,
    ):
        """``grad_weight`` multiplies the auxiliary losses' gradients (the data-parallel
        engines average gradients over that many ranks); under pipeline parallelism
        ``stage_group`` (pp) gathers the other stages' layers (of ``n_layers``) at log steps;
        ``seq_len`` tokens a sequence (the router z-loss is a mean over the tokens)."""
        self.layers = layers
        self.group = group
        self.grad_weight, self.seq_len = grad_weight, seq_len
        self.router_z = any(m.router_z_loss_coef > 0 for m in layers)
        self.stage_group = stage_group
        self.n_layers = n_layers
        self.balancing = any(m.bias_update_rate > 0 for m in layers)
        self.no_layers: torch.Tensor | None = None  # a stage's empty rows (see ``of``)
        self.set_global_batch(global_batch)
        self.discard()  # forwards before the first step (a pipeline's warm-up) do not count

    def set_global_batch(self, sequences: int, seq_len: int | None = None) -> None:
        """The global batch of the coming step (batch-size and sequence-length warmup change
        it: ``seq_len`` tokens a sequence, default the run's): the losses are means over its
        sequences (balancing) and tokens (router z-loss)."""
        self.global_batch = sequences
        self.global_tokens = sequences * (seq_len or self.seq_len)
        for m in self.layers:
            m.aux_weight = self.grad_weight / self.global_batch
            m.router_z_weight = self.grad_weight / self.global_tokens

    @classmethod
    def of(cls, parts: list[nn.Module], group: Any, **settings: Any) -> MoETracker | None:
        """The tracker of the MoE layers of ``parts`` (None when the model has none)."""
        layers = cls.find(parts)
        if layers:
            return cls(layers, group, **settings)
        # Under pipeline parallelism a rank may hold only dense blocks (DeepSeek-V3's first
        # ones) of a mixture-of-experts model: it still joins the stages' metrics gathering.
        experts = getattr(getattr(parts[0], "args", None), "num_experts", 0)
        if settings.get("stage_group") is None or not experts:
            return None
        tracker = cls([], group, **settings)
        device = next(parts[0].parameters()).device
        tracker.no_layers = torch.zeros(0, experts + 3, device=device)
        return tracker

    @staticmethod
    def layer_count(args: Any) -> int:
        """Layer numbers a model's MoE layers may have: its blocks', then its multi-token
        prediction depths' (``titanlite.models.mtp``)."""
        return args.n_layers + getattr(args, "mtp_layers", 0)

    @staticmethod
    def find(parts: list[nn.Module]) -> list[MoE]:
        return [m for part in parts for m in part.modules() if isinstance(m, MoE)]

    def discard(self) -> None:
        """Forget what the layers recorded so far (forwards that were not training steps)."""
        self._take()

    def _take(self) -> torch.Tensor | None:
        """[layers, experts + 3] of the step's training forwards; the layers start afresh."""
        if not self.layers:
            return self.no_layers
        rows = [m.totals for m in self.layers]
        for m in self.layers:
            m.totals = None
        if any(row is None for row in rows):
            return None
        return torch.stack(rows)

    def after_step(self, log: bool, update: bool = True) -> dict[str, float] | None:
        """Bias updates (every step, when on, unless the step's ``update`` was skipped) and,
        at a log step, the metrics."""
        step = self._take()
        if step is None or not (self.balancing or log):
            return None
        if self.layers and self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(step, group=self.group)
        counts = step[:, :-3]
        if self.balancing and update:
            with torch.no_grad():
                for layer, load in zip(self.layers, counts, strict=True):
                    if layer.bias_update_rate > 0:
                        push = torch.sign(load.mean() - load) * layer.bias_update_rate
                        layer.expert_bias.add_(push)
        if not log:
            return None
        if self.stage_group is not None:  # every stage's layers, in block order
            whole = step.new_zeros(self.n_layers, step.shape[1])
            whole[[m.layer_id for m in self.layers]] = step
            dist.all_reduce(whole, group=self.stage_group)
            step, counts = whole, whole[:, :-3]
        balance = (counts.max(1).values / counts.mean(1).clamp(min=1e-9)).tolist()
        slots = counts.sum(1)
        dropped = (step[:, -3].sum() / slots.sum().clamp(min=1)).item()
        metrics = {f"moe_load_max_mean_{i}": v for i, v in enumerate(balance)}
        metrics.update(
            moe_load_max_mean=max(balance),
            moe_dropped_fraction=dropped,
            moe_aux_loss=(step[:, -2].sum() / self.global_batch).item(),
        )
        if self.router_z:
            metrics["moe_router_z_loss"] = (step[:, -1].sum() / self.global_tokens).item()
        return metrics
