"""A mixture-of-experts feed-forward layer, reusable by any decoder family.

A linear router scores every expert for every token (softmax over the experts, or a sigmoid
each), the token goes to its ``top_k`` experts, and their outputs are summed with the scores
as weights (renormalized to sum to one with ``norm_topk``, then times ``route_scale``). Shared
experts, if any, see every token; with ``shared_expert_gate`` (Qwen3-Next, Qwen3.5) their
output is scaled per token by sigmoid(x . w), w a learned vector of the model's width. The
experts are
``titanlite.models.moe.experts.GroupedExperts``.

Group-limited routing (DeepSeek-V3's ``n_groups`` / ``topk_groups``): the experts form
``n_groups`` equal groups in index order; each group is rated by the sum of its two best
choice scores (score plus routing bias), the token keeps its ``topk_groups`` best groups and
picks its ``top_k`` experts among theirs. The weights stay the raw scores, never the bias.

Balancing, both optional:
- a sequence-wise auxiliary loss (DeepSeek-V3's): per sequence, ``coef * sum_e f_e * P_e`` with
  ``f_e`` the share of the sequence's token slots routed to expert e (times the number of
  experts over top_k, so an even load gives 1 per expert) and ``P_e`` the mean normalized
  score of e. Being per sequence it does not depend on how the batch is split over ranks;
  where a sequence is split (sequence shards under TP, chunks under CP) ``f_e`` is summed over
  its shards and each rank's term holds its own tokens' part of ``P_e``, so the ranks' terms
  add up to the whole sequence's loss;
- the auxiliary-loss-free bias update (DeepSeek-V3): a per-expert bias added to the scores
  for choosing experts only (not for weighting them), moved after every step by
  ``rate * sign(mean load - load)`` from the global token counts.

A router z-loss (ST-MoE), optional too: ``router_z_loss_coef`` times the mean over the
global batch's tokens of the square of ``logsumexp`` of each token's router logits, keeping
those logits small (large ones make the softmax over experts brittle in low precision).

Dropless by default; a capacity factor caps each expert at ``ceil(factor * slots / experts)``
token slots per micro-batch (the later ones in token order are dropped and counted).

The auxiliary loss and the router z-loss reach the router through the layer's own backward:
the output passes through an identity whose backward also gives the loss terms their
gradients (``aux_weight``, ``router_z_weight``), so no second loss root is needed and a
pipeline schedule's backward carries them too. Each training forward adds its tokens per
expert, dropped slots, auxiliary loss and router z-loss to the layer's running ``totals``
(not when it is recomputed in backward under activation checkpointing); the trainer's
``titanlite.metrics.moe_tracker.MoETracker`` takes them after the step for the bias updates and the
metrics. ``last`` keeps the latest forward's record.

No torch.distributed here: expert parallelism's dispatch and tensor parallelism's sequence
shards reach the layer through the hooks of ``titanlite.models.interfaces``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from titanlite.models.interfaces import SequenceShards
from titanlite.models.layers import FeedForward
from titanlite.models.moe.experts import GroupedExperts


@dataclass
class Record:
    """What one forward of a layer saw (tensors on the device, detached except the losses)."""

    aux: torch.Tensor  # summed over the micro-batch's sequences, with grad
    router_z: torch.Tensor  # coef x logsumexp(router logits)^2 summed over its tokens, with grad
    counts: torch.Tensor  # [experts] token slots routed to each (before any drop)
    dropped: torch.Tensor  # slots over capacity


class MoE(nn.Module):
    """Tokens [batch, seq, dim] -> [batch, seq, dim] through the top-k of ``num_experts``."""

    def __init__(self, dim: int, args: Any):
        super().__init__()
        self.num_experts, self.top_k = args.num_experts, args.top_k
        self.score_func, self.norm_topk = args.score_func, args.norm_topk
        self.aux_loss_coef, self.capacity_factor = args.aux_loss_coef, args.capacity_factor
        self.bias_update_rate = args.bias_update_rate
        self.router_z_loss_coef = getattr(args, "router_z_loss_coef", 0.0)
        # Options later families brought; a family without the field routes as before.
        self.n_groups = getattr(args, "n_groups", 1)
        self.topk_groups = getattr(args, "topk_groups", 1)
        self.route_scale = getattr(args, "route_scale", 1.0)
        # gpt-oss: a router bias, expert biases and the clamped SwiGLU (family constants).
        self.router = nn.Linear(dim, args.num_experts, bias=getattr(args, "router_bias", False))
        limit = getattr(args, "swiglu_limit", 0.0)
        self.experts = GroupedExperts(
            args.num_experts,
            dim,
            args.moe_hidden_dim,
            bias=getattr(args, "expert_biases", False),
            clamp=(args.swiglu_alpha, limit) if limit > 0 else None,
        )
        self.shared = (
            FeedForward(dim, args.shared_experts * args.moe_hidden_dim)
            if args.shared_experts
            else None
        )
        self.shared_gate = (
            nn.Linear(dim, 1, bias=False)
            if self.shared is not None and getattr(args, "shared_expert_gate", False)
            else None
        )
        # Routing bias of the auxiliary-loss-free balancing: changed by MoETracker, not by
        # the optimizer; persistent, so a resume continues with it.
        self.register_buffer("expert_bias", torch.zeros(args.num_experts, dtype=torch.float32))
        self.last: Record | None = None
        self.totals: torch.Tensor | None = None
        """[experts + 3]: tokens per expert, dropped slots, auxiliary loss and router z-loss
        summed over the training forwards since ``MoETracker`` last took them."""
        self.aux_weight = 0.0
        """The gradient of the training loss with respect to this layer's auxiliary loss sum
        (set by ``MoETracker``: the loss is a mean over the global batch's sequences)."""
        self.router_z_weight = 0.0
        """The same for the router z-loss sum (a mean over the global batch's tokens)."""
        self.layer_id = 0
        """The block this layer belongs to (set by the model), to name its metrics."""
        self.sequence_shards: SequenceShards | None = None
        """Set when tensor or context parallelism hands this layer one shard of each
        sequence (every rank routes its own tokens): the balancing loss then takes its
        per-sequence expert shares over the whole sequence, summed over the shards."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, dim = x.shape
        flat = x.reshape(-1, dim)
        logits = self.router(flat).float()
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        # The bias is zero unless balancing moved it or a checkpoint brought it (DeepSeek-V3's
        # e_score_correction_bias): it steers the choice whenever it is set.
        choose = scores + self.expert_bias
        if self.n_groups > 1:
            choose = self._within_best_groups(choose)
        chosen = torch.topk(choose, self.top_k, dim=-1).indices  # [tokens, k]
        weights = scores.gather(-1, chosen)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.route_scale != 1.0:
            weights = weights * self.route_scale

        slots = chosen.reshape(-1)  # token t's j-th choice is slot t * k + j
        counts = (  # on the meta device (a shape probe) no values: zeros of the shape
            slots.new_zeros(self.num_experts)
            if slots.is_meta
            else torch.bincount(slots, minlength=self.num_experts)
        )
        order = torch.argsort(slots, stable=True)  # slots grouped by expert, in token order
        kept, dropped = order, torch.zeros((), dtype=torch.int64, device=x.device)
        routed = counts
        if self.capacity_factor > 0:
            capacity = math.ceil(self.capacity_factor * slots.numel() / self.num_experts)
            starts = torch.cumsum(counts, 0) - counts
            rank = torch.arange(slots.numel(), device=x.device) - starts[slots[order]]
            keep = rank < capacity
            kept, routed = order[keep], counts.clamp(max=capacity)
            dropped = (~keep).sum()
        outputs = self.experts(flat[kept // self.top_k], routed)
        # Each slot's weighted output in its own row, then the k rows of a token summed:
        # deterministic, unlike an atomic index_add.
        combined = torch.zeros(slots.numel(), dim, dtype=outputs.dtype, device=x.device)
        combined[kept] = outputs * weights.reshape(-1)[kept, None].to(outputs.dtype)
        out = combined.view(-1, self.top_k, dim).sum(1)
        if self.shared is not None:
            shared = self.shared(flat)
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(self.shared_gate(flat))
            out = out + shared

        aux = self._aux(scores, chosen, bsz, seq)
        router_z = (
            self.router_z_loss_coef * torch.logsumexp(logits, -1).square().sum()
            if self.router_z_loss_coef > 0
            else aux.new_zeros(())
        )
        self.last = Record(aux, router_z, counts.detach(), dropped)
        if self.training and torch.is_grad_enabled():
            penalty = aux * self.aux_weight if self.aux_loss_coef > 0 else None
            if self.router_z_loss_coef > 0:
                z = router_z * self.router_z_weight
                penalty = z if penalty is None else penalty + z
            if penalty is not None and (self.aux_weight or self.router_z_weight):
                out = _AuxGradient.apply(out, penalty, 1.0)
            if torch._C._current_graph_task_id() == -1:  # not a recomputation in backward
                losses = torch.stack([aux.detach(), router_z.detach()]).float()
                row = torch.cat([counts.float(), dropped.float().view(1), losses])
                self.totals = row if self.totals is None else self.totals + row
        return out.view(bsz, seq, dim).to(x.dtype)

    def _within_best_groups(self, choose: torch.Tensor) -> torch.Tensor:
        """The choice scores [tokens, experts] with every expert outside the token's
        ``topk_groups`` best groups set to -inf (a group rated by its two best scores)."""
        groups = choose.view(choose.shape[0], self.n_groups, -1)
        best_two = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(-1)
        kept = torch.topk(best_two, self.topk_groups, dim=-1).indices  # [tokens, topk_groups]
        inside = torch.zeros_like(best_two, dtype=torch.bool).scatter_(1, kept, True)
        return groups.masked_fill(~inside[..., None], -math.inf).view_as(choose)

    def _aux(self, scores: torch.Tensor, chosen: torch.Tensor, bsz: int, seq: int) -> torch.Tensor:
        """The sequence-wise balancing loss summed over this micro-batch's sequences."""
        if self.aux_loss_coef <= 0:
            return scores.new_zeros(())
        e, k = self.num_experts, self.top_k
        hits = torch.zeros(bsz, seq * k, e, device=scores.device)
        hits.scatter_(-1, chosen.view(bsz, seq * k, 1), 1.0)
        hits = hits.sum(1)
        if self.sequence_shards is not None:
            # f needs the whole sequence's counts; P's sum over the shards is the sum of
            # every shard's loss term, so each rank's gradient covers its own tokens.
            hits = self.sequence_shards.sum(hits)
            seq *= self.sequence_shards.degree
        share = hits * (e / (k * seq))  # f: [batch, experts]
        normalized = scores / scores.sum(-1, keepdim=True)
        mean_score = normalized.view(bsz, -1, e).sum(1) / seq  # P: [batch, experts]
        return self.aux_loss_coef * (share * mean_score).sum()


class _AuxGradient(torch.autograd.Function):
    """The identity on the layer's output, whose backward also hands the auxiliary loss the
    gradient ``weight``: as if ``weight * aux`` were added to the loss."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight = weight
        ctx.aux_like = (aux.shape, aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        shape, dtype, device = ctx.aux_like
        return grad, torch.full(shape, ctx.weight, dtype=dtype, device=device), None
