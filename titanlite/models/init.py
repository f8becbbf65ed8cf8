"""Parameter initialization as a pure function of (seed, parameter name, element index).

Each element's initial value comes from a counter-based hash of a per-parameter key and the
element's global row-major flat index, so a rank computes only the elements it holds, on its
own device, in time and memory proportional to its shard, and every layout (no sharding, any
FSDP or tensor-parallel split, a resharded restart) starts from bit-identical weights.

The pipeline for one element at global flat index ``i`` of parameter ``name``:

1. ``key = stream_key(seed, name)``: 63 bits of BLAKE2b over the seed and the UTF-8 name.
2. ``u = uniform(key, i)``: SplitMix64 of ``key + i * golden_gamma`` (mod 2**64); its top 53
   bits, the lowest forced to 1, become a double strictly inside (0, 1).
3. ``trunc_normal_from_uniform(u, std)``: inverse CDF of the normal truncated at +-3 std,
   in float64.
4. The float64 value is rounded to float32, then to the output dtype. float32 is the
   canonical precision: a bfloat16 copy is exactly the float32 weights rounded to bfloat16
   (rounding float64 straight to bfloat16 could differ by double rounding).

Steps 1-2 are exact integer arithmetic, identical on every device. Steps 3-4 are a handful of
correctly rounded float64 operations plus ``erfinv``; on one device type they are
bit-reproducible, across device types ``erfinv`` may differ in the last float64 bit, which
can, very rarely, move the float32 result by one ulp.

Nothing here imports ``torch.distributed``: callers pass the block's global shape and offset.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from titanlite.models.spec import InitRule

# Elements per chunk: bounds the temporaries (about 30 bytes per element) whatever the size of
# the tensor. On a CPU, chunks whose temporaries fit in the L2 cache are fastest; on an
# accelerator, bigger chunks amortize the kernel launches (a chunk costs about 25 of them).
# Tests shrink them to check that chunking does not change values.
CHUNK_ELEMENTS = 1 << 16
ACCELERATOR_CHUNK_ELEMENTS = 1 << 22

_MASK64 = (1 << 64) - 1
# SplitMix64 constants (Steele, Lea, Flood 2014), stored as the int64 with the same bits.
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed64(x: int) -> int:
    """The int64 with the same 64 bits as unsigned ``x``: torch has only signed int64 math."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GAMMA_S = _signed64(_GOLDEN_GAMMA)
_MIX1_S = _signed64(_MIX1)
_MIX2_S = _signed64(_MIX2)
_TWO_POW_M53 = 2.0**-53
# erf(3 / sqrt(2)) = Phi(3) - Phi(-3): the probability mass inside +-3 std.
_ERF3 = math.erf(3.0 / math.sqrt(2.0))


def stream_key(seed: int, name: str) -> int:
    """A 63-bit key for one parameter's stream of values.

    BLAKE2b rather than Python's ``hash()``: the key must be the same in every process, on
    every run and every Python version, or ranks would disagree about the weights.
    """
    data = (seed & _MASK64).to_bytes(8, "little") + name.encode("utf-8")
    digest = hashlib.blake2b(data, digest_size=8, person=b"titanlite-init").digest()
    return int.from_bytes(digest, "little") >> 1


def _shr_logical_(z: torch.Tensor, shift: int, tmp: torch.Tensor) -> torch.Tensor:
    """``tmp = z >>> shift`` (logical): torch's ``>>`` on int64 is arithmetic, so mask the
    sign-extended bits off."""
    torch.bitwise_right_shift(z, shift, out=tmp)
    return tmp.bitwise_and_((1 << (64 - shift)) - 1)


def _splitmix64_(z: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer, in place on int64 ``z`` (multiplies wrap mod 2**64)."""
    z.bitwise_xor_(_shr_logical_(z, 30, tmp)).mul_(_MIX1_S)
    z.bitwise_xor_(_shr_logical_(z, 27, tmp)).mul_(_MIX2_S)
    return z.bitwise_xor_(_shr_logical_(z, 31, tmp))


def _uniform_(key: int, z: torch.Tensor) -> torch.Tensor:
    """``uniform`` on int64 indices ``z``, which it clobbers (saves a copy per chunk)."""
    z.mul_(_GAMMA_S).add_(_signed64(key))
    tmp = torch.empty_like(z)
    _splitmix64_(z, tmp)
    # The top 53 bits with the lowest forced to 1: an odd k in (0, 2**53), held exactly by a
    # double. u = k / 2**53 is exact, strictly inside (0, 1) and exactly symmetric about 1/2
    # (k and 2**53 - k are equally likely), so 2u - 1 is exact too and the normal's two tails
    # are mirror images. A midpoint (m + 1/2) / 2**53 over all 53 bits would not fit in a
    # double above 1/2, and its top value would round to 1.
    k = _shr_logical_(z, 11, tmp).bitwise_or_(1)
    del z
    return k.to(torch.float64).mul_(_TWO_POW_M53)


def uniform(key: int, index: torch.Tensor) -> torch.Tensor:
    """Float64 values strictly inside (0, 1), one per int64 global flat index in ``index``.

    Counter-based: element ``i`` depends only on (key, i), never on which other indices are
    computed alongside it, so any block of a tensor can be generated on its own.
    """
    if index.dtype != torch.int64:
        raise TypeError(f"index must be int64, got {index.dtype}")
    return _uniform_(key, index.clone())


def trunc_normal_from_uniform(u: torch.Tensor, std: float) -> torch.Tensor:
    """Normal(0, std) truncated at +-3 std, by the inverse CDF of uniforms ``u`` in (0, 1).

    One uniform per element and no rejection, so element ``i`` needs only uniform ``i``.
    Mapping u to u' = Phi(-3) + u (Phi(3) - Phi(-3)) and taking sqrt(2) erfinv(2u' - 1)
    simplifies to sqrt(2) erfinv(erf(3/sqrt(2)) (2u - 1)). Computed in float64; the clamp
    guards the ends against the last bit of rounding.
    """
    y = u.to(torch.float64, copy=True)
    return _trunc_normal_(y, std)


def _trunc_normal_(y: torch.Tensor, std: float) -> torch.Tensor:
    """In place on float64 uniforms ``y``: see ``trunc_normal_from_uniform``."""
    y.mul_(2.0).sub_(1.0).mul_(_ERF3)
    y.erfinv_().mul_(math.sqrt(2.0) * std)
    return y.clamp_(-3.0 * std, 3.0 * std)


def _index_grid(
    shape: Sequence[int], offset: Sequence[int], strides: Sequence[int], device: torch.device
) -> torch.Tensor:
    """Flat global indices (int64, row-major over ``shape``) of a block at ``offset``."""
    grid = torch.zeros((), dtype=torch.int64, device=device)
    for n, off, stride in zip(shape, offset, strides, strict=True):
        axis = torch.arange(off, off + n, dtype=torch.int64, device=device) * stride
        grid = grid.unsqueeze(-1) + axis
    return grid.reshape(-1)


def _fill_block_(
    out: torch.Tensor,
    rule: InitRule,
    key: int,
    *,
    offset: Sequence[int],
    strides: Sequence[int],
    base: int,
    chunk: int,
) -> None:
    """Fill contiguous ``out`` whose element (i_0, ...) has global index
    ``base + sum((offset_d + i_d) * strides_d)``."""
    if out.dim() == 0:
        idx = torch.full((1,), base, dtype=torch.int64, device=out.device)
        out.copy_(_values(key, idx, rule).view(()))
        return
    rows, inner = out.shape[0], math.prod(out.shape[1:])
    if inner > chunk:
        # One row is already too big for a chunk: go down a dimension.
        for r in range(rows):
            row_base = base + (offset[0] + r) * strides[0]
            _fill_block_(
                out[r],
                rule,
                key,
                offset=offset[1:],
                strides=strides[1:],
                base=row_base,
                chunk=chunk,
            )
        return
    device = out.device
    inner_idx = _index_grid(out.shape[1:], offset[1:], strides[1:], device).add_(base)
    rows_per_chunk = max(1, chunk // inner)
    flat = out.view(rows, inner)
    for r0 in range(0, rows, rows_per_chunk):
        n = min(rows_per_chunk, rows - r0)
        start = offset[0] + r0
        row_idx = torch.arange(start, start + n, dtype=torch.int64, device=device)
        idx = (row_idx.mul_(strides[0]).unsqueeze(1) + inner_idx).view(-1)
        flat[r0 : r0 + n].view(-1).copy_(_values(key, idx, rule))


def _values(key: int, idx: torch.Tensor, rule: InitRule) -> torch.Tensor:
    """Canonical float32 values for global indices ``idx`` (clobbered): the rule's map of
    one uniform per element, in float64."""
    u = _uniform_(key, idx)
    if rule.kind == "log_uniform":  # log A, A uniform in (low, high): u is never 0
        return u.mul_(rule.high - rule.low).add_(rule.low).log_().to(torch.float32)
    if rule.kind == "softplus_inverse":  # dt log-uniform in [low, high]; softplus(b) = dt
        span = math.log(rule.high) - math.log(rule.low)
        dt = u.mul_(span).add_(math.log(rule.low)).exp_()
        return (dt + torch.log(-torch.expm1(-dt))).to(torch.float32)
    return _trunc_normal_(u, rule.std).to(torch.float32)


def fill_local_(
    out: torch.Tensor,
    rule: InitRule,
    seed: int,
    name: str,
    *,
    global_shape: tuple[int, ...],
    global_offset: tuple[int, ...],
) -> torch.Tensor:
    """Write into ``out`` the initial values of its block of a ``global_shape`` tensor.

    ``out`` (contiguous, any float dtype, any device) holds the block that starts at
    ``global_offset`` and has ``out.shape``. Its values depend only on (seed, name, global
    flat index), so a rank fills just its own shard, and any sharding of the same parameter
    reassembles to the same tensor. Work goes in chunks of ``CHUNK_ELEMENTS`` so that the
    temporaries stay a small constant, whatever the size of the shard.
    """
    global_shape = tuple(int(n) for n in global_shape)
    global_offset = tuple(int(o) for o in global_offset)
    if not out.is_contiguous():
        raise ValueError("fill_local_ needs a contiguous output tensor")
    if len(global_shape) != out.dim() or len(global_offset) != out.dim():
        raise ValueError(
            f"block of shape {tuple(out.shape)} does not match global shape {global_shape}"
            f" / offset {global_offset}"
        )
    for n, off, total in zip(out.shape, global_offset, global_shape, strict=True):
        if off < 0 or off + n > total:
            raise ValueError(
                f"block {tuple(out.shape)} at {global_offset} is outside {global_shape}"
            )
    if rule.kind == "constant":
        return out.fill_(rule.value)
    if rule.kind not in ("trunc_normal", "log_uniform", "softplus_inverse"):
        raise ValueError(f"unknown init rule kind {rule.kind!r}")
    if not out.is_floating_point():
        raise TypeError(f"{rule.kind} init needs a float tensor, got {out.dtype}")
    if out.numel() == 0:
        return out
    strides = [1] * len(global_shape)
    for d in range(len(global_shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * global_shape[d + 1]
    chunk = CHUNK_ELEMENTS if out.device.type == "cpu" else ACCELERATOR_CHUNK_ELEMENTS
    chunk = max(1, int(chunk))
    with torch.no_grad():
        _fill_block_(
            out,
            rule,
            stream_key(seed, name),
            offset=global_offset,
            strides=strides,
            base=0,
            chunk=chunk,
        )
    return out


def full_value(
    rule: InitRule,
    seed: int,
    name: str,
    shape: tuple[int, ...],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The whole initial tensor: what every sharding of it reassembles to."""
    out = torch.empty(shape, dtype=dtype, device=device)
    return fill_local_(
        out, rule, seed, name, global_shape=tuple(shape), global_offset=(0,) * len(shape)
    )


Block = tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]
"""What a rank holds of one parameter: (local tensor, global shape, global offset)."""


def whole(param: torch.Tensor) -> Block:
    """A parameter held entirely by this rank."""
    return param, tuple(param.shape), (0,) * param.dim()


# Wrappers that change parameter names but not what a weight starts as.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def canonical_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


@torch.no_grad()
def init_parameters(
    model: nn.Module,
    rule_of: Callable[[str], InitRule],
    seed: int,
    *,
    locate: Callable[[torch.Tensor], Block] = whole,
    aliases: Mapping[str, str] | None = None,
    only: Callable[[str], bool] | None = None,
) -> int:
    """Initialize every parameter of ``model`` (tied ones once; with ``only``, those whose
    name it accepts) from its rule, computing only the elements ``locate`` says this rank
    holds. Returns the elements written.

    ``aliases`` maps a parameter name to the name whose values it takes: a tied weight's
    copy on another pipeline stage starts as the owner does."""
    written = 0
    seen: set[int] = set()
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        local, shape, offset = locate(param)
        name = canonical_name(name)
        name = (aliases or {}).get(name, name)
        if only is not None and not only(name):
            continue
        fill_local_(local, rule_of(name), seed, name, global_shape=shape, global_offset=offset)
        written += local.numel()
    return written
