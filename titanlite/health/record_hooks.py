"""Where the collective record listens: wrappers around torch.distributed's entry points.

Checked against torch 2.13's callers, each layer and who goes through it:

- the ``torch.distributed`` functions, as both ``torch.distributed.X`` and
  ``distributed_c10d.X`` (callers write ``dist.X``; c10d's own helpers call the module's
  globals): FSDP2 (``all_gather_single``, async, then ``Work.wait``; ``reduce_scatter_single``
  and HSDP's ``all_reduce``, sync), the pipeline schedules' P2P (``isend``/``irecv``, also
  inside ``batch_isend_irecv``, which is left unwrapped so each is recorded with its peer),
  DTensor's ``scatter``/``broadcast`` when distributing, expert and context parallelism, the
  object collectives, and titanlite's own calls;
- the ``ProcessGroup`` methods, for callers that skip the functions: titanlite's DDP engine
  launches its buckets with ``group.allreduce`` and waits on the future;
- the functional collectives (``torch.distributed._functional_collectives``) that DTensor's
  redistribution uses for tensor parallelism: asynchronous, waited by ``wait_tensor`` (looked
  up as a module global by ``AsyncCollectiveTensor``) at first use;
- ``Work.wait``, ``Work.get_future`` and ``Future.wait``/``then``: waits of async work.

A call made inside one already recorded (``all_gather_object``'s all-gathers, the
``allreduce`` under ``dist.all_reduce``, the ``Work.wait`` a sync call ends with) passes
straight through. While torch.compile traces, every wrapper steps aside, so Dynamo sees the
functions it knows. Not seen: collectives issued from C++ (a compiled graph's; the backward of
an autograd-aware functional collective, whose ``wait_tensor`` still counts as blocked time),
and, on CUDA, the kernels themselves: a collective "left" is its launch or CPU-side wait.

Wrappers must not break a collective: a call the record cannot describe goes unrecorded.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

Record = Any
"""A titanlite.health.record.CollectiveRecord (which imports this module, not the reverse)."""

DIST_FUNCTIONS = (
    "all_reduce all_reduce_coalesced reduce broadcast all_gather all_gather_single "
    "all_gather_into_tensor _all_gather_base all_gather_coalesced reduce_scatter "
    "reduce_scatter_single reduce_scatter_tensor _reduce_scatter_base all_to_all_single "
    "all_to_all gather scatter barrier monitored_barrier send recv isend irecv "
    "all_gather_object gather_object broadcast_object_list scatter_object_list "
    "send_object_list recv_object_list"
).split()
# Where a call's data is: the first of these parameters it takes (the input side).
DATA_PARAMS = ("input", "input_tensor", "input_tensor_list", "input_list", "tensor", "tensors")
DATA_PARAMS += ("self", "inputs", "obj", "object_list", "scatter_object_input_list")
SENDS = {"send", "isend", "send_object_list"}
RECEIVES = {"recv", "irecv", "recv_object_list"}

PG_METHODS = (
    "broadcast allreduce allreduce_coalesced reduce allgather all_gather_single "
    "_allgather_base allgather_coalesced all_gather_single_coalesced "
    "allgather_into_tensor_coalesced gather scatter reduce_scatter reduce_scatter_single "
    "_reduce_scatter_base reduce_scatter_single_coalesced reduce_scatter_tensor_coalesced "
    "all_to_all_single alltoall_base alltoall send recv recv_anysource barrier"
).split()
# (outputs, inputs) methods: their data is the second argument.
PG_INPUT_SECOND = {m for m in PG_METHODS if "gather" in m or "scatter" in m or "to" in m}

FUNCOL_FUNCTIONS = (
    "broadcast all_reduce all_gather_single all_gather_single_autograd all_gather_tensor "
    "all_gather_tensor_autograd reduce_scatter_single reduce_scatter_single_autograd "
    "reduce_scatter_tensor reduce_scatter_tensor_autograd all_reduce_coalesced "
    "all_gather_single_coalesced all_gather_into_tensor_coalesced "
    "reduce_scatter_single_coalesced reduce_scatter_tensor_coalesced all_to_all_single "
    "all_to_all_single_autograd permute_tensor all_gather_inplace"
).split()

Patch = tuple[Any, str, Any, Any]  # (owner, attribute, original, wrapper)


def install(record: Record) -> list[Patch]:
    """Wrap every entry point for ``record``; the patches, for ``restore`` (all or none)."""
    patches: list[Patch] = []

    def patch(owner: Any, name: str, original: Any, wrapper: Any) -> None:
        setattr(owner, name, wrapper)
        patches.append((owner, name, original, wrapper))

    try:
        _install(record, patch)
    except BaseException:
        restore(patches)
        raise
    return patches


def _install(record: Record, patch: Callable[[Any, str, Any, Any], None]) -> None:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch._C import Future
    from torch.distributed import distributed_c10d as c10d

    handles = (funcol.AsyncCollectiveTensor, c10d.Work)
    for name in DIST_FUNCTIONS:
        fn = getattr(c10d, name, None)
        if fn is not None:
            wrapper = _recorded(record, fn, _dist_call(record, name, fn), handles)
            if getattr(dist, name, None) is fn:
                patch(dist, name, fn, wrapper)
            patch(c10d, name, fn, wrapper)
    group_class = c10d.ProcessGroup
    for name in PG_METHODS:
        if name in vars(group_class):
            method = getattr(group_class, name)
            wrapper = _recorded(record, method, _pg_call(record, name), handles)
            patch(group_class, name, vars(group_class)[name], wrapper)
    for name in FUNCOL_FUNCTIONS:
        fn = getattr(funcol, name, None)
        if fn is not None:
            patch(funcol, name, fn, _recorded(record, fn, _funcol_call(record, name, fn), handles))
    patch(funcol, "wait_tensor", funcol.wait_tensor, _wait_tensor(record, funcol.wait_tensor))
    work = c10d.Work
    patch(work, "wait", vars(work)["wait"], _wait(record, work.wait, "Work.wait", known=False))
    patch(work, "get_future", vars(work)["get_future"], _chained(record, work.get_future))
    patch(Future, "wait", vars(Future)["wait"], _wait(record, Future.wait, "Future", known=True))
    patch(Future, "then", vars(Future)["then"], _chained(record, Future.then))


def restore(patches: list[Patch]) -> None:
    """Put the originals back, last first. An attribute wrapped again over ours since is
    left alone (ours under it passes calls straight through once the record is off)."""
    for owner, name, original, wrapper in reversed(patches):
        current = vars(owner).get(name)
        if current is wrapper:
            setattr(owner, name, original)
        else:
            logger.warning("%s.%s was wrapped again over the collective record's", owner, name)


# -- describing a call ---------------------------------------------------------------------------


def _param(fn: Callable, names: tuple[str, ...] | str) -> tuple[int | None, str | None]:
    """(positional index, name) of the first of ``names`` that ``fn`` takes."""
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None, None
    for name in (names,) if isinstance(names, str) else names:
        if name in params:
            return params.index(name), name
    return None, None


def _arg(args: tuple, kwargs: dict, where: tuple[int | None, str | None]) -> Any:
    at, name = where
    if at is not None and at < len(args):
        return args[at]
    return kwargs.get(name) if name is not None else None


def data_of(value: Any) -> Any:
    """What ``record.describe`` shows of an argument, taken now: the ring holds no tensors."""
    shape = getattr(value, "shape", None)
    if shape is not None:
        return (value.dtype, shape, 1)
    if isinstance(value, (list, tuple)) and value:
        first = value[0]
        if hasattr(first, "shape"):
            return (first.dtype, first.shape, len(value))
        return f"{len(value)}_objects"
    return None if value is None else type(value).__name__


def _dist_call(record: Record, name: str, fn: Callable) -> Callable[..., Any]:
    group_at, async_at = _param(fn, "group"), _param(fn, "async_op")
    data_at = _param(fn, DATA_PARAMS)
    peer_at = _param(fn, ("dst", "src")), _param(fn, ("group_dst", "group_src"))
    direction = "send" if name in SENDS else "recv" if name in RECEIVES else None
    always_async = name in ("isend", "irecv")

    def describe(args: tuple, kwargs: dict) -> Any:
        peer = None
        if direction is not None:
            peer = (_arg(args, kwargs, peer_at[0]), _arg(args, kwargs, peer_at[1]))
        channel = record.channel(_arg(args, kwargs, group_at), direction, peer)
        is_async = always_async or bool(_arg(args, kwargs, async_at))
        return record.new_entry(name, channel, data_of(_arg(args, kwargs, data_at)), is_async)

    return describe


def _pg_call(record: Record, name: str) -> Callable[..., Any]:
    data_at = 2 if name in PG_INPUT_SECOND else 1  # args[0] is the group
    direction = {"send": "send", "recv": "recv", "recv_anysource": "recv"}.get(name)
    peer_at = 2 if name in ("send", "recv") else None  # (tensors, rank in the group, tag)
    op = f"ProcessGroup.{name}"

    def describe(args: tuple, kwargs: dict) -> Any:
        peer = (None, args[peer_at]) if peer_at is not None and len(args) > peer_at else None
        data = data_of(args[data_at]) if len(args) > data_at else None
        return record.new_entry(op, record.channel(args[0], direction, peer), data, True)

    return describe


def _funcol_call(record: Record, name: str, fn: Callable) -> Callable[..., Any]:
    import torch.distributed._functional_collectives as funcol
    from torch.distributed import distributed_c10d as c10d

    group_at, tag_at = _param(fn, ("group", "group_name")), _param(fn, "tag")
    data_at = _param(fn, DATA_PARAMS)

    def describe(args: tuple, kwargs: dict) -> Any:
        group = funcol._resolve_group(
            _arg(args, kwargs, group_at), _arg(args, kwargs, tag_at) or ""
        )
        if isinstance(group, str):
            group = c10d._resolve_process_group(group)
        data = data_of(_arg(args, kwargs, data_at))
        return record.new_entry(f"funcol.{name}", record.channel(group), data, True)

    return describe


# -- the wrappers --------------------------------------------------------------------------------


def _recorded(
    record: Record, fn: Callable, describe: Callable[..., Any], handles: tuple
) -> Callable:
    """A collective's entry point: an Entry in, the call, then the Entry out, or handed to the
    Work (or functional collective's tensor) whose wait will end it."""
    import torch

    local, compiling = record.local, torch.compiler.is_compiling
    act, work = handles

    def recorded(*args: Any, **kwargs: Any) -> Any:
        if not record.on or getattr(local, "depth", 0) or compiling():
            return fn(*args, **kwargs)
        try:
            entry = record.enter(describe(args, kwargs))
        except Exception:  # unrecorded rather than broken
            logger.debug("a collective could not be recorded", exc_info=True)
            return fn(*args, **kwargs)
        local.depth = 1
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            local.depth = 0
            record.left(entry)
            raise
        local.depth = 0
        if not (entry.is_async and _handed_on(record, entry, result, act=act, work=work)):
            record.left(entry)  # over: a sync call, or one waited inside (a plain tensor back)
        return result

    recorded.__wrapped__ = fn  # type: ignore[attr-defined]
    recorded.__name__ = getattr(fn, "__name__", "collective")
    recorded.__doc__ = fn.__doc__
    return recorded


def _handed_on(record: Record, entry: Any, result: Any, *, act: type, work: type) -> bool:
    """Whether an async call's result holds what its wait will be called on (registered)."""
    handed = False
    try:
        for item in result if isinstance(result, list) else [result]:
            if isinstance(item, act):
                record.register_tensor(item.elem, entry)
                handed = True
            elif isinstance(item, work):
                record.register(item, entry)
                handed = True
    except Exception:  # noqa: BLE001 - the collective went through; only its end goes unseen
        logger.debug("an async collective's handle could not be registered", exc_info=True)
    return handed


def _wait(record: Record, fn: Callable, what: str, *, known: bool) -> Callable:
    """Work.wait (any: a Work is a collective's), Future.wait (``known``: only a collective's
    future; other futures are not collectives)."""
    local = record.local

    def wait(handle: Any, *args: Any, **kwargs: Any) -> Any:
        if not record.on or getattr(local, "depth", 0):
            return fn(handle, *args, **kwargs)
        entry = record.lookup(handle)
        if known and entry is None:
            return fn(handle, *args, **kwargs)
        start = record.wait_began(entry, what)
        local.depth = 1
        try:
            return fn(handle, *args, **kwargs)
        finally:
            local.depth = 0
            record.wait_ended(entry, start)

    return wait


def _wait_tensor(record: Record, fn: Callable) -> Callable:
    import torch

    local, compiling = record.local, torch.compiler.is_compiling

    def wait_tensor(tensor: Any) -> Any:
        if not record.on or getattr(local, "depth", 0) or compiling():
            return fn(tensor)
        entry = record.lookup_tensor(tensor)
        start = record.wait_began(entry, "wait_tensor")
        local.depth = 1
        try:
            return fn(tensor)
        finally:
            local.depth = 0
            record.wait_ended(entry, start)

    wait_tensor.__wrapped__ = fn  # type: ignore[attr-defined]
    return wait_tensor


def _chained(record: Record, fn: Callable) -> Callable:
    """Work.get_future, Future.then: the new future stands for the same collective."""

    def chained(handle: Any, *args: Any, **kwargs: Any) -> Any:
        result = fn(handle, *args, **kwargs)
        entry = record.lookup(handle)
        if entry is not None:
            record.register(result, entry)
        return result

    return chained
