"""The optional fast kernel for the gated delta rule: flash-linear-attention's on CUDA.

The ``gated_delta`` core runs ``delta_rule.chunk_gated_delta_rule`` (plain PyTorch, any
device) unless three things hold, checked on every call: its kernel setting is "auto"
(``model.linear_attention_kernel``), its tensors are on a CUDA device, and the
``flash-linear-attention`` package imports (module ``fla``; its Triton kernels run on GPUs
only). Then ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` runs instead. The package is
never required: without it, or on a CPU, nothing changes.

The mapping (``run``), for the op's documented signature (read from fla-core 0.6.0):
titanlite's [b, heads, T, d] becomes the op's [b, T, heads, d]; queries and keys come
L2-normalized and the queries already scaled, so the op gets ``scale=1`` and no
normalization of its own; g is the log-decay and beta the step size, as the op takes them;
value heads > key heads are handled before (the core repeats each query/key head over its
value heads, consecutive ones as fla's own grouping does). Document resets become
variable-length sequences: the rows are laid end to end as one sequence cut at every row
start and every reset (``cu_seqlens``); each row's initial state goes to its first piece
(unless the row itself begins with a reset) and its final state is its last piece's.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

KERNELS = ("auto", "torch")
"""``model.linear_attention_kernel``: "auto" takes fla's kernel where it can run, "torch"
always the plain chunked rule."""


@functools.cache
def fast_op() -> tuple[Callable | None, str]:
    """fla's chunked gated delta rule and its version, or None and why it is unavailable."""
    try:
        module = importlib.import_module("fla.ops.gated_delta_rule")
        op = module.chunk_gated_delta_rule
    except Exception as error:  # not installed, or a broken Triton/driver under it: plain path
        return None, f"flash-linear-attention does not import: {error}"
    version = getattr(importlib.import_module("fla"), "__version__", "?")
    return op, f"flash-linear-attention {version}"


def choose(kernel: str, device: torch.device) -> Callable | None:
    """The op to run for tensors on ``device``: fla's when ``kernel`` is "auto", the device is
    CUDA and fla imports; else None (the plain chunked rule)."""
    if kernel != "auto" or device.type != "cuda":
        return None
    return fast_op()[0]


def describe(kernel: str, *, cuda: bool) -> str:
    """Which kernel the layers will run and why, for the start-up log."""
    if kernel == "torch":
        return 'chunked PyTorch (model.linear_attention_kernel = "torch")'
    if not cuda:
        return "chunked PyTorch (no CUDA device; flash-linear-attention runs on GPUs)"
    op, what = fast_op()
    if op is None:
        return f"chunked PyTorch ({what})"
    return f"{what}'s Triton kernel (fla.ops.gated_delta_rule.chunk_gated_delta_rule)"


def run(
    op: Callable,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    resets: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``delta_rule.chunk_gated_delta_rule``'s contract (q, k [b, h, T, d_k], v [b, h, T,
    d_v], g, beta [b, h, T], resets [b, T], initial_state [b, h, d_k, d_v]; queries scaled)
    computed by ``op``, which takes fla's (see the module docstring)."""
    b, h, T, dk = k.shape
    dv = v.shape[-1]
    wide = torch.promote_types(v.dtype, torch.float32)
    q, k, v, g, beta = (x.transpose(1, 2) for x in (q, k, v, g, beta))  # [b, T, h, ...]
    options = {"scale": 1.0, "output_final_state": True}
    if resets is None:
        out, state = op(q, k, v, g, beta, initial_state=initial_state, **options)
        return out.transpose(1, 2).to(v.dtype), state.to(wide)
    first = resets.clone()
    first[:, 0] = True  # every row starts a piece of its own
    starts = first.flatten().nonzero().squeeze(1)  # piece starts in the rows laid end to end
    cu_seqlens = torch.cat([starts, starts.new_tensor([b * T])])
    row_first = torch.searchsorted(starts, torch.arange(b, device=starts.device) * T)
    row_last = torch.cat([row_first[1:] - 1, row_first.new_tensor([len(starts) - 1])])
    pieces_initial = None
    if initial_state is not None:
        kept = initial_state * (~resets[:, 0]).to(initial_state.dtype)[:, None, None, None]
        pieces_initial = kept.new_zeros(len(starts), h, dk, dv).index_copy(0, row_first, kept)
    flat = [x.reshape(1, b * T, *x.shape[2:]) for x in (q, k, v, g, beta)]
    out, states = op(*flat, initial_state=pieces_initial, cu_seqlens=cu_seqlens, **options)
    out = out.reshape(b, T, h, dv).transpose(1, 2)
    return out.to(v.dtype), states[row_last].to(wide)
