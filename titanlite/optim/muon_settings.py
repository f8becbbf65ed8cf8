"""[muon]: the settings of the Muon optimizer (``titanlite.optim.muon``), the checks of their
values, and the section as the optimizer registry declares it. Plain Python: the config
parser reads it without torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from titanlite.config.catalog import Section
from titanlite.config.planned import PlannedRun


@dataclass
class MuonSettings:
    """[muon]: the update of Muon groups (optimizer.name = "Muon"); their lr and weight decay come
    from [optimizer] and its param_groups rules, like AdamW's."""

    momentum: float = 0.95
    """Momentum of the gradient buffer (buf = momentum * buf + grad)."""
    nesterov: bool = True
    """Orthogonalize grad + momentum * buf (Nesterov) rather than buf."""
    ns_steps: int = 5
    """Newton-Schulz iterations per step."""
    ns_a: float = 3.4445
    """Quintic Newton-Schulz coefficient a (X <- a X + b (X X^T) X + c (X X^T)^2 X)."""
    ns_b: float = -4.7750
    """Quintic Newton-Schulz coefficient b."""
    ns_c: float = 2.0315
    """Quintic Newton-Schulz coefficient c."""
    ns_dtype: Literal["float32", "bfloat16"] = "float32"
    """Precision of the Newton-Schulz iteration: float32 (exact across layouts) or bfloat16 (about
    twice as fast on GPUs)."""
    lr_adjustment: Literal["match_rms_adamw", "original", "none"] = "match_rms_adamw"
    """Scale of a matrix's step: match_rms_adamw = lr * 0.2 * sqrt(max(rows, cols)) (Moonlight:
    AdamW's lr and weight decay fit), original = lr * sqrt(max(1, fan_out / fan_in)), none = lr."""
    eps: float = 1e-7
    """Added to the update's Frobenius norm before the iteration divides by it."""
    block: Literal["full", "head"] = "full"
    """Unit the attention projections are orthogonalized in: full = the whole matrix, head = each
    head's rows of wq, wk, wv and columns of wo on their own (under tensor parallelism no gather;
    docs/muon.md)."""
    qk_clip_threshold: float | None = None
    """QK-clip (Kimi K2's MuonClip): after each step, scale the query and key weights of every head
    whose largest attention logit of the step exceeded this, down to it (unset = off; about 100 in
    Kimi K2; costs one extra q.k product per forward)."""


def check(cfg: Any, problems: Any) -> None:
    """The [muon] values, and QK-clip's need of Muon (it runs in Muon's step)."""
    mu = cfg.muon
    if not 0 <= mu.momentum < 1:
        problems.add(f"muon.momentum: must be in [0, 1), got {mu.momentum!r}")
    if mu.ns_steps < 1:
        problems.add(f"muon.ns_steps: must be at least 1, got {mu.ns_steps!r}")
    if not mu.eps > 0:
        problems.add(f"muon.eps: must be > 0, got {mu.eps!r}")
    clip = mu.qk_clip_threshold
    if clip is not None and not clip > 0:
        problems.add(f"muon.qk_clip_threshold: must be > 0 (unset: off), got {clip!r}")
    if clip is not None and cfg.optimizer.name.lower() != "muon":
        problems.add(
            f"muon.qk_clip_threshold: QK-clip runs in Muon's step; set optimizer.name = "
            f'"Muon" (got {cfg.optimizer.name!r}) or leave the threshold unset'
        )


SECTION = Section("muon", MuonSettings, after="optimizer", check=check)


def refuses(run: PlannedRun) -> list[str]:
    """Muon's per-head settings need per-head projections (a rule of
    ``titanlite.config.planned``, checked before the run starts)."""
    if run.args is None:
        return []
    mu, name = run.cfg.muon, run.spec.name
    per_head = mu.qk_clip_threshold is not None or mu.block == "head"
    if per_head and getattr(run.args, "attention", None) in _latent_kinds():
        return [
            f"muon: {name}'s latent attention has no per-head query, key and value matrices, "
            'which muon.block = "head" and muon.qk_clip_threshold need; use block "full" and '
            "leave qk_clip_threshold unset"
        ]
    if mu.qk_clip_threshold is not None and getattr(run.args, "qk_norm", False):
        return [
            f"muon.qk_clip_threshold: {name} normalizes each head's queries and keys "
            "(qk-norm), which undoes QK-clip's scaling of wq and wk; leave it unset"
        ]
    return []


def _latent_kinds() -> tuple[str, ...]:
    """The attention kinds with projections of their own (no per-head q/k/v), imported only
    when asked: the registry imports torch, which the launcher's preflight does without."""
    from titanlite.models.attention import LAYERS

    return tuple(LAYERS)
