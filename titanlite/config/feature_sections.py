"""Sections of the optional training features: [muon] (titanlite.optim.muon), [float8] (the
float8 converter) and [eval] (downstream tasks). Part of the schema of ``job_config``, which
imports them; kept here so that no schema file grows past the size the project allows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class Muon:
    """[muon]: the update of Muon groups (optimizer.name = "Muon"); their lr and weight decay come from [optimizer] and its param_groups rules, like AdamW's."""

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
    """Precision of the Newton-Schulz iteration: float32 (exact across layouts) or bfloat16 (about twice as fast on GPUs)."""
    lr_adjustment: Literal["match_rms_adamw", "original", "none"] = "match_rms_adamw"
    """Scale of a matrix's step: match_rms_adamw = lr * 0.2 * sqrt(max(rows, cols)) (Moonlight: AdamW's lr and weight decay fit), original = lr * sqrt(max(1, fan_out / fan_in)), none = lr."""
    eps: float = 1e-7
    """Added to the update's Frobenius norm before the iteration divides by it."""
    block: Literal["full", "head"] = "full"
    """Unit the attention projections are orthogonalized in: full = the whole matrix, head = each head's rows of wq, wk, wv and columns of wo on their own (under tensor parallelism no gather; docs/muon.md)."""
    qk_clip_threshold: float | None = None
    """QK-clip (Kimi K2's MuonClip): after each step, scale the query and key weights of every head whose largest attention logit of the step exceeded this, down to it (unset = off; about 100 in Kimi K2; costs one extra q.k product per forward)."""


@dataclass
class Float8:
    """[float8]: settings of the float8 converter (model.converters = ["float8"]; needs torchao:
    pip install 'titanlite[float8]'). docs/performance.md says when it pays."""

    recipe: Literal["rowwise", "tensorwise", "rowwise_with_gw_hp"] = "rowwise"
    """Scaling recipe: rowwise (one scale per row of each operand), tensorwise (one per tensor; the fastest, allows the float8 FSDP all-gather), rowwise_with_gw_hp (rowwise, weight gradients in high precision)."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output", "router"])
    """Linears kept in high precision: those whose module path contains any of these strings (default: the output projection and MoE routers)."""
    auto_filter_small: bool = True
    """Also keep in high precision the linears too small to gain on H100-class GPUs (torchao's measured thresholds for the recipe); linears whose sizes are not multiples of 16 always stay."""
    enable_fsdp_float8_all_gather: bool = False
    """tensorwise only: FSDP all-gathers the weights in float8 (half of bf16's bytes), with scales from the sharded weights."""
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """With enable_fsdp_float8_all_gather: compute every weight's scale in one all-reduce after each optimizer step instead of one per weight."""
    emulate: bool = False
    """Run the float8 matmuls in high precision on the float8-rounded values (GPUs without float8 units; results as float8's, speed not)."""
    experts: bool = False
    """Also the routed experts' grouped matmuls (rowwise; CUDA GPUs of compute capability 9.0 and later, through torchao)."""


@dataclass
class Eval:
    """[eval]: downstream multiple-choice tasks scored during training (docs/evaluation.md)."""

    enable: bool = False
    """Score the tasks periodically (and after the last step)."""
    freq: int = 50
    """Every this many steps."""
    tasks: list[str] = field(default_factory=lambda: ["sotu_word_order"])
    """Built-in tasks (sotu_word_order, sotu_next_sentence) or JSONL task files (docs/evaluation.md has the format)."""
    limit: int = 100
    """Questions scored per task (0 = all)."""
    batch_size: int = 16
    """Rows (one per question and choice) per forward pass."""
