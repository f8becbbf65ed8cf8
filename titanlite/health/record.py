"""The collective record: every collective this rank entered and left, and its time blocked.

gloo has no flight recorder (NCCL's keeps a ring per group), so titanlite keeps its own, for
every backend. ``CollectiveRecord.install`` wraps, in place, the Python entry points that
collectives pass through (``record_hooks`` says which, and what stays unseen), and each call
appends an ``Entry`` to a ring (the last 256): the op, the group (its name and global ranks),
a sequence number per group counted here (every rank issues a group's collectives in the
same order, so #57 of a group is the same collective on all its ranks; point-to-point
traffic is counted per direction, ``src->dst``, on both ends), the data's dtype and shape,
the start and end wall times, and whether it is asynchronous (its end is when a wait for it
returned).

``blocked_seconds`` is the time the installing thread (the trainer's) spent inside sync
collectives and in waits for async ones; the straggler detector subtracts its increase from
the step time to get a rank's own time. ``format_lines`` is the record as a hang dump shows
it (``hang_report`` parses it back).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections import deque
from typing import Any

logger = logging.getLogger(__name__)

ACTIVE: CollectiveRecord | None = None
"""The record installed in this process, if any."""

RING = 256
"""Entries kept: a step or more of a large model's collectives (FSDP: about 3 per block)."""
TENSORS_KEPT = 1024
"""Functional collectives' results awaiting their wait, at most (the oldest are forgotten)."""


class Channel:
    """What a sequence number counts: a group's collectives, or one direction of its P2P."""

    __slots__ = ("name", "ranks", "count")

    def __init__(self, name: str, ranks: tuple[int, ...]) -> None:
        self.name, self.ranks, self.count = name, ranks, 0


class Entry:
    """One collective as this rank saw it. Times are ``time.time()``; ``end`` None while in
    flight; ``waited``: when a wait for it began; ``data``: (dtype, shape, count) or a word."""

    __slots__ = ("op", "channel", "seq", "data", "start", "end", "is_async", "waited", "ref")
    __slots__ += ("thread",)

    def __init__(self, op: str, channel: Channel, data: Any, is_async: bool) -> None:
        channel.count += 1
        self.op, self.channel, self.seq, self.data = op, channel, channel.count, data
        self.is_async, self.thread = is_async, threading.get_ident()
        self.start = time.time()
        self.end: float | None = None
        self.waited: float | None = None
        self.ref: Any = None  # a weak reference to its Work, Future or tensor

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.channel.ranks

    def state(self) -> str:
        """done; waiting (a thread is blocked in it); issued (async, not waited yet);
        completed (async, done but not waited yet); released (its handle is gone, unwaited)."""
        if self.end is not None:
            return "done"
        if not self.is_async or self.waited is not None:
            return "waiting"
        handle = self.ref() if self.ref is not None else None
        if handle is None:
            return "released" if self.ref is not None else "issued"
        done = getattr(handle, "is_completed", None) or getattr(handle, "done", None)
        with contextlib.suppress(Exception):
            if done is not None and done():
                return "completed"
        return "issued"

    def line(self, now: float, threads: dict[int, str]) -> str:
        """``key=value`` fields without spaces (titanlite.health.hang_report parses them)."""
        took = (self.end if self.end is not None else now) - self.start
        thread = threads.get(self.thread, str(self.thread)).replace(" ", "_")
        return (
            f"state={self.state()} op={self.op} seq={self.seq} channel={self.channel.name} "
            f"ranks={','.join(map(str, self.ranks))} data={describe(self.data)} "
            f"start={self.start:.6f} end={'-' if self.end is None else f'{self.end:.6f}'} "
            f"took={took:.6f} async={'yes' if self.is_async else 'no'} thread={thread}"
        )


def describe(data: Any) -> str:
    """``float32[4,8]``, ``float32[4,8]x3`` for a list of tensors, or the kind of objects."""
    if data is None:
        return "-"
    if isinstance(data, str):
        return data
    dtype, shape, count = data
    text = f"{str(dtype).removeprefix('torch.')}[{','.join(map(str, shape))}]"
    return text if count == 1 else f"{text}x{count}"


class CollectiveRecord:
    """This rank's ring of collectives and its blocked time; see the module docstring.

    The methods after ``uninstall`` are what ``record_hooks``' wrappers call."""

    def __init__(self, size: int = RING) -> None:
        self._ring: deque[Entry] = deque(maxlen=size)
        self._channels: list[Channel] = []  # every group's and P2P direction's, in order
        self._p2p: dict[tuple[Channel, int | None, int | None], Channel] = {}
        self._groups: dict[int, tuple[Any, Channel]] = {}  # id(group) -> (weakref, channel)
        self._pending: dict[int, tuple[Any, Entry]] = {}  # id(handle) -> (weakref, entry)
        self._tensors: dict[int, Entry] = {}  # a functional collective's storage -> entry
        self._unknown_waits: dict[int, tuple[str, float]] = {}  # thread -> (what, since)
        self._patches: list[tuple[Any, str, Any, Any]] = []
        self.local = threading.local()  # .depth: inside a recorded call or wait
        self.on = False
        self._blocked = 0.0
        self._main: int | None = None
        self._rank: int | None = None
        self._last = 0.0
        self._total = 0

    # -- what it holds ------------------------------------------------------------------------

    def entries(self) -> list[Entry]:
        """The ring, oldest first."""
        return list(self._ring)

    def in_flight(self) -> list[Entry]:
        """The entries not left yet (sync calls in progress, async work not waited for)."""
        return [e for e in list(self._ring) if e.end is None]

    def blocked_seconds(self) -> float:
        """Seconds the installing thread spent in sync collectives and in waits, so far."""
        return self._blocked

    def last_activity(self) -> float:
        """Wall time of the last collective entered or left, or wait ended, on any thread."""
        return self._last

    def format_lines(self) -> list[str]:
        """The record for a dump file: entries, channels (collectives entered so far) and
        waits for collectives that were not recorded."""
        now = time.time()
        threads = {t.ident: t.name for t in threading.enumerate() if t.ident is not None}
        ring = list(self._ring)
        lines = [f"collectives: last {len(ring)} of {self._total}, oldest first"]
        lines += [f"  {e.line(now, threads)}" for e in ring]
        lines.append("channels: collectives entered so far")
        for channel in list(self._channels):
            ranks = ",".join(map(str, channel.ranks))
            lines.append(f"  channel={channel.name} ranks={ranks} entered={channel.count}")
        lines.append("waits for collectives not recorded:")
        for ident, (what, since) in list(self._unknown_waits.items()):
            thread = threads.get(ident, str(ident)).replace(" ", "_")
            lines.append(f"  wait={what} thread={thread} since={since:.6f}")
        lines.append(f"blocked_s={self._blocked:.6f}")
        return lines

    # -- installing ----------------------------------------------------------------------------

    def install(self) -> None:
        """Wrap the entry points (idempotent; another installed record is uninstalled). The
        calling thread's sync collectives and waits count as blocked time."""
        global ACTIVE
        if self._patches:
            return
        if ACTIVE is not None and ACTIVE is not self:
            ACTIVE.uninstall()
        from titanlite.health import record_hooks

        self._main = threading.get_ident()
        self.on = True
        try:
            self._patches = record_hooks.install(self)
        except Exception:  # a torch without one of the entry points: train without the record
            self.on = False
            logger.warning("the collective record could not be installed", exc_info=True)
            return
        ACTIVE = self

    def uninstall(self) -> None:
        """Put every wrapped entry point back (idempotent); see ``record_hooks.restore``."""
        global ACTIVE
        from titanlite.health import record_hooks

        self.on = False
        record_hooks.restore(self._patches)
        self._patches = []
        if ACTIVE is self:
            ACTIVE = None

    # -- what the wrappers tell it -------------------------------------------------------------

    def new_entry(self, op: str, channel: Channel, data: Any, is_async: bool) -> Entry:
        return Entry(op, channel, data, is_async)

    def enter(self, entry: Entry) -> Entry:
        self._ring.append(entry)
        self._total += 1
        self._last = entry.start
        return entry

    def left(self, entry: Entry | None, *, blocked: bool = True) -> None:
        """A call is over: ``entry`` ends now, its whole time blocked (a sync call's)."""
        end = time.time()
        if entry is not None and entry.end is None:
            entry.end = end
            if blocked and threading.get_ident() == self._main:
                self._blocked += end - entry.start
        self._last = end

    def register(self, handle: Any, entry: Entry) -> None:
        """``handle`` (a Work, a Future, a functional collective's tensor) stands for
        ``entry`` until it is waited for or garbage."""
        key, pending = id(handle), self._pending
        try:
            ref = weakref.ref(handle, lambda _, key=key: pending.pop(key, None))
        except TypeError:
            return
        entry.ref = ref
        pending[key] = (ref, entry)

    def register_tensor(self, tensor: Any, entry: Entry) -> None:
        """A functional collective's result, by its storage: DTensor waits on a view of it,
        after the tensor object itself may be gone."""
        tensors = self._tensors
        tensors[tensor.untyped_storage().data_ptr()] = entry
        if len(tensors) > TENSORS_KEPT:  # results never waited for (dropped unused)
            del tensors[next(iter(tensors))]

    def lookup_tensor(self, tensor: Any) -> Entry | None:
        if not self._tensors:
            return None
        try:
            return self._tensors.pop(tensor.untyped_storage().data_ptr(), None)
        except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
            return None

    def lookup(self, handle: Any) -> Entry | None:
        if not self._pending:
            return None
        item = self._pending.get(id(handle))
        return item[1] if item is not None and item[0]() is handle else None

    def wait_began(self, entry: Entry | None, what: str) -> float:
        """A thread blocks in a wait (for ``entry``, or a collective not recorded)."""
        start = time.time()
        if entry is not None:
            entry.waited = entry.waited or start
        else:
            self._unknown_waits[threading.get_ident()] = (what, start)
        return start

    def wait_ended(self, entry: Entry | None, start: float) -> None:
        end, ident = time.time(), threading.get_ident()
        if entry is None:
            self._unknown_waits.pop(ident, None)
        elif entry.end is None:
            entry.end = end
        if ident == self._main:
            self._blocked += end - start
        self._last = end

    def channel(self, group: Any, direction: str | None = None, peer: Any = None) -> Channel:
        """The group's channel (None: the default group), or for P2P (``direction`` "send"
        or "recv") the channel from sender to receiver; ``peer``: (global rank, group rank),
        either given, or neither for any source."""
        if group is None:
            from torch.distributed import distributed_c10d as c10d

            group = c10d._world.default_pg
        item = self._groups.get(id(group))
        if item is None or item[0]() is not group:
            item = self._new_group(group)
        channel = item[1]
        if direction is None:
            return channel
        other = peer[0] if peer else None
        if other is None and peer and peer[1] is not None:
            other = channel.ranks[peer[1]]
        src, dst = (self._my_rank(), other) if direction == "send" else (other, self._my_rank())
        p2p = self._p2p.get((channel, src, dst))
        if p2p is None:
            name = f"{channel.name}:{'any' if src is None else src}->{dst}"
            p2p = self._p2p[(channel, src, dst)] = Channel(name, channel.ranks)
            self._channels.append(p2p)
        return p2p

    def _new_group(self, group: Any) -> tuple[Any, Channel]:
        from torch.distributed import distributed_c10d as c10d

        key, groups = id(group), self._groups
        ref = weakref.ref(group, lambda _, key=key: groups.pop(key, None))
        channel = Channel(str(group.group_name), tuple(c10d.get_process_group_ranks(group)))
        self._channels.append(channel)
        groups[key] = (ref, channel)
        return groups[key]

    def _my_rank(self) -> int:
        if self._rank is None:
            import torch.distributed as dist

            self._rank = dist.get_rank()
        return self._rank
