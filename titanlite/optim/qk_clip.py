"""QK-clip (Kimi K2's MuonClip): after each optimizer step, the query and key weights of every
attention head whose largest pre-softmax logit in the step exceeded ``muon.qk_clip_threshold``
t are scaled down so that logit would have been t.

For a head h with largest logit S_h > t, gamma_h = t / S_h. A logit is bilinear in the head's
query rows and its key head's rows (RoPE rotates within a head, so scaling a head's rows
scales its rotated queries or keys alike), so:

  - a key head that serves one query head (multi-head attention): both the query rows and
    the key rows of h are multiplied by sqrt(gamma_h), the split of the published MuonClip;
  - a key head shared by a group of query heads (grouped-query attention): the key rows stay
    as they are and each clipped query head's rows take the whole gamma_h, as Kimi K2 does
    with the rotary key that all of MLA's heads share.

Either way each clipped head's largest logit becomes exactly t, and the heads at or below t
keep their weights bit for bit (their factor is 1). Families with qk-norm are refused at
start-up: normalizing queries and keys after the projections undoes any scaling of wq and wk.

The largest logits come from the attention cores (``AttentionCore.record_max_logits``): each
training forward of the step folds in its own, per local query head, masks honoured (causal,
documents). Here they become exact over every layout with one all-reduce (MAX) per model part
and step: over the ranks that see different tokens (dp_replicate x dp_shard x cp) and, under
tensor parallelism, the tp ranks, each of which writes its own heads at their offset (TP
splits heads in rank order) into a [layers, heads] table of -inf. Each rank then scales its
own piece of wq and wk, whatever FSDP and TP cut (``pieces.piece``); pipeline stages clip their
own layers. The records are reset with the gradients (``zero_grad``), so a step the spike
guard skips leaves nothing behind.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.models.interfaces import AttentionLayer, find
from titanlite.optim.pieces import local, piece

logger = logging.getLogger(__name__)


class QKClip:
    """QK-clip of ``layers`` (a model part's attention) at ``threshold``; ``dims`` is the
    run's ParallelDims (None: one process), ``n_layers`` the whole model's blocks (metrics
    name every layer, whichever stage holds it)."""

    def __init__(
        self,
        layers: Sequence[AttentionLayer],
        threshold: float,
        *,
        dims: Any = None,
        n_layers: int = 0,
    ):
        self.layers, self.threshold = list(layers), threshold
        self.tp = dims.degrees.tp if dims is not None else 1
        self.tp_rank = dims.local_rank("tp") if self.tp > 1 else 0
        # The ranks whose records differ: other tokens (loss) and, under TP, other heads.
        name = "tokens" if self.tp > 1 else "loss"
        self.group = dims.group(name) if dims is not None and dims.size(name) > 1 else None
        pp = dims is not None and dims.degrees.pp > 1
        self.stage_group = dims.group("pp") if pp else None
        self.n_layers = max(n_layers, 1 + max(layer.layer_id for layer in self.layers))
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None
        """Of the last step: per layer, the largest logit and the number of clipped heads."""
        for layer in self.layers:
            layer.core.record_max_logits = True
        self.reset()

    @classmethod
    def of(cls, model: nn.Module | None, threshold: float | None, **settings: Any) -> QKClip | None:
        """QK-clip of ``model``'s attention layers, or None (no threshold, no layers)."""
        if threshold is None or model is None:
            return None
        layers = find(model, AttentionLayer)
        return cls(layers, threshold, **settings) if layers else None

    def reset(self) -> None:
        """Forget the records (with the gradients: what comes next is another step)."""
        for layer in self.layers:
            layer.core.max_logits = None
        self.last = None

    def maxima(self) -> torch.Tensor:
        """[layers, heads]: each head's largest logit of the step over every rank."""
        rows, template = [], None
        for layer in self.layers:
            heads = layer.heads()
            count = heads.query.shape[0] // heads.head_dim // self.tp  # this rank's heads
            rows.append((count, layer.core.max_logits))
            if layer.core.max_logits is not None:
                template = layer.core.max_logits
        if template is None:  # no training forward since the reset: nothing to clip
            template = local(self.layers[0].heads().query).new_empty(0)
        table = template.new_full((len(rows), rows[0][0] * self.tp), -math.inf)
        for i, (count, recorded) in enumerate(rows):
            if recorded is not None:
                table[i, self.tp_rank * count : (self.tp_rank + 1) * count] = recorded
        if self.group is not None:
            dist.all_reduce(table, op=dist.ReduceOp.MAX, group=self.group)
        return table

    @torch.no_grad()
    def apply(self) -> None:
        """Scale the query (and key) rows of every head whose largest logit exceeded the
        threshold; after the optimizer's update, on every rank that holds a piece of them."""
        maxima = self.maxima()
        clipped = maxima > self.threshold
        # Heads at or below the threshold get a factor of 1.0 (their rows keep their values
        # bit for bit), so no head needs to be read on the host.
        gamma = torch.where(clipped, self.threshold / maxima, torch.ones_like(maxima))
        for layer, factor in zip(self.layers, gamma, strict=True):
            heads = layer.heads()
            if heads.key.shape[0] == heads.query.shape[0]:  # one query head per key head
                scale_heads(heads.query, factor.sqrt(), heads.head_dim)
                scale_heads(heads.key, factor.sqrt(), heads.head_dim)
            else:  # a shared key head stays; each query head takes its whole factor
                scale_heads(heads.query, factor, heads.head_dim)
        self.last = (maxima.amax(1), clipped.sum(1))
        if logger.isEnabledFor(logging.DEBUG):
            for layer, row in zip(self.layers, clipped, strict=True):
                if row.any():
                    logger.debug(
                        "qk-clip: layer %d heads %s", layer.layer_id, row.nonzero()[:, 0].tolist()
                    )


def scale_heads(weight: torch.Tensor, factor: torch.Tensor, head_dim: int) -> None:
    """Multiply each head's ``head_dim`` rows of ``weight`` ([heads * head_dim, dim], plain or
    a DTensor: each rank its own piece) by that head's ``factor``."""
    rows = factor.repeat_interleave(head_dim).to(weight.dtype)
    whole = rows[:, None].expand(weight.shape)  # a view: no memory of the matrix's size
    if isinstance(weight, DTensor):
        mesh = weight.device_mesh
        coordinate = mesh.get_coordinate()
        assert coordinate is not None  # a parameter lives on the meshes of its ranks
        whole = piece(whole, mesh.shape, tuple(weight.placements), tuple(coordinate))
    local(weight).mul_(whole)


def step_metrics(optimizers: Sequence[torch.optim.Optimizer]) -> dict[str, float]:
    """The last step's QK-clip metrics of these optimizers (a rank's model parts): the
    largest logit per layer (qk_max_logit_N) and overall (qk_max_logit), and the heads
    clipped (qk_clipped_heads); under pipeline parallelism over every stage (one all-reduce).
    Empty without QK-clip, or after a skipped step."""
    clips = [c for o in optimizers if (c := getattr(o, "qk_clip", None)) is not None]
    if not clips or any(c.last is None for c in clips):
        return {}
    first = clips[0]
    table = first.last[0].new_zeros(2, first.n_layers)  # type: ignore[index]
    table[0] = -math.inf
    for clip in clips:
        assert clip.last is not None
        ids = [layer.layer_id for layer in clip.layers]
        table[0, ids] = clip.last[0].to(table.dtype)
        table[1, ids] = clip.last[1].to(table.dtype)
    if first.stage_group is not None:  # each stage its own layers: MAX takes the owner's
        dist.all_reduce(table, op=dist.ReduceOp.MAX, group=first.stage_group)
    maxima, clipped = table.tolist()
    metrics = {f"qk_max_logit_{i}": v for i, v in enumerate(maxima)}
    metrics.update(qk_max_logit=max(maxima), qk_clipped_heads=int(sum(clipped)))
    return metrics
