"""Context parallelism for sliding-window attention: only the keys a window reaches travel.

With the split of ``attention`` (2 x cp chunks of c tokens, rank r holding chunks r and
2 cp - 1 - r), a sliding window of w keys (``core.mask.window``) makes chunk j reach only
the w - 1 keys before its first position, so each rank receives just those
(``WindowExchange``: for w - 1 <= c the tail of the chunk before each of its chunks, from its
two neighbours in rank order; a longer window reaches further back, over several chunks).
One all-to-all per layer moves them (backward: the gradients of those keys go back the same
way, as many bytes again), and the core attends each chunk over [the keys its window reaches
+ its own], with positions counted from the first of them (a windowed core uses positions
only relatively) and the documents sliced alike (``windowed_attention``). With w - 1 <= c a
rank receives at most 2 (w - 1) tokens per layer whatever the sequence length, against
(cp - 1) S / cp for the gather (``kv_bytes_received``), and keeps S / cp + 2 (w - 1) keys for
backward instead of S (``kv_rows_kept``). Where the window reaches as many keys as the gather
would bring, the layer gathers (the plan is None).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from titanlite.models.interfaces import AttentionCore
from titanlite.parallel.expert import AllToAll


def _holder(position: int, c: int, cp: int) -> tuple[int, int]:
    """(cp rank, local row) of the token at ``position`` with chunks of ``c`` tokens."""
    j = position // c
    return (j, position % c) if j < cp else (2 * cp - 1 - j, c + position % c)


def window_reach(local_len: int, cp: int, window: int) -> list[list[int]]:
    """Per cp rank, the positions (ascending) of the other ranks' tokens that its queries
    reach with a sliding ``window``: the ``window - 1`` before each of its two chunks."""
    c = local_len // 2
    reach = []
    for rank in range(cp):
        wanted: set[int] = set()
        for j in (rank, 2 * cp - 1 - rank):
            wanted.update(range(max(0, j * c - (window - 1)), j * c))
        reach.append(sorted(p for p in wanted if _holder(p, c, cp)[0] != rank))
    return reach


def kv_bytes_received(
    *, seq_len: int, cp: int, window: int | None, batch: int, kv_channels: int, element_size: int
) -> int:
    """Bytes of keys and values the busiest cp rank receives for one attention layer in one
    forward (its backward sends as many back): the whole sequence but its own share for full
    attention (``window`` None) or a window that reaches as far, else what the window reaches.
    ``kv_channels``: key heads x head dim (values alike)."""
    local = seq_len // cp
    tokens = (cp - 1) * local
    if window is not None:
        tokens = min(tokens, max(len(r) for r in window_reach(local, cp, window)))
    return tokens * 2 * batch * kv_channels * element_size


def kv_rows_kept(*, seq_len: int, cp: int, window: int | None) -> int:
    """Rows of keys (values alike) the busiest cp rank keeps for one attention layer's
    backward: the whole sequence gathered for full attention (``window`` None) or a window
    that reaches as far, else its two chunks' spans, each chunk with the ``window - 1``
    tokens before it (what ``windowed_attention`` attends over)."""
    local = seq_len // cp
    if window is None or max(len(r) for r in window_reach(local, cp, window)) >= (cp - 1) * local:
        return seq_len
    c = local // 2
    return max(
        sum(c + min(j * c, window - 1) for j in (rank, 2 * cp - 1 - rank)) for rank in range(cp)
    )


@dataclass(frozen=True)
class WindowExchange:
    """What one rank sends and receives for a windowed layer, and how it lays out each
    chunk's keys: ``send`` local rows (grouped by destination, ``send_counts[r]`` to rank r),
    ``recv_counts[r]`` rows from rank r; per local chunk ``spans`` holds (rows of [local,
    received] in sequence order, first position of those keys, the chunk's first position)."""

    send: torch.Tensor
    send_counts: list[int]
    recv_counts: list[int]
    spans: list[tuple[torch.Tensor, int, int]]

    @staticmethod
    def plan(
        *, local_len: int, cp: int, rank: int, window: int, device: torch.device
    ) -> WindowExchange | None:
        """The exchange, or None when the window reaches as much as gathering brings."""
        reach = window_reach(local_len, cp, window)
        if max(len(r) for r in reach) >= (cp - 1) * local_len:
            return None
        c = local_len // 2
        send: list[int] = []
        send_counts = [0] * cp
        for other in range(cp):
            rows = [row for p in reach[other] for r, row in [_holder(p, c, cp)] if r == rank]
            send += rows
            send_counts[other] = len(rows)
        mine = sorted(reach[rank], key=lambda p: (_holder(p, c, cp)[0], p))  # arrival order
        arrived = {p: local_len + i for i, p in enumerate(mine)}
        recv_counts = [sum(_holder(p, c, cp)[0] == r for p in mine) for r in range(cp)]
        spans = []
        for j in (rank, 2 * cp - 1 - rank):
            lo = max(0, j * c - (window - 1))
            rows = [arrived.get(p, _holder(p, c, cp)[1]) for p in range(lo, (j + 1) * c)]
            spans.append((torch.tensor(rows, device=device), lo, j * c))
        return WindowExchange(
            torch.tensor(send, dtype=torch.long, device=device), send_counts, recv_counts, spans
        )


def windowed_attention(
    core: AttentionCore,
    q: torch.Tensor,
    kv: torch.Tensor,
    plan: WindowExchange,
    *,
    group: dist.ProcessGroup,
    documents: torch.Tensor | None,
    masked: bool,
) -> torch.Tensor:
    """``ContextParallel.attention`` for a windowed core: only the keys and values (``kv``
    [local, 2, b, h_kv, d]) the windows reach travel over ``group``, and each chunk attends
    over those before it and its own, positions and documents counted from the first of
    them."""
    source = kv
    if any(plan.send_counts) or any(plan.recv_counts):  # a window of 1 reaches no other
        sent = kv.index_select(0, plan.send)
        received = AllToAll.apply(sent, plan.recv_counts, plan.send_counts, group)
        source = torch.cat([kv, received])
    c = q.shape[2] // 2
    outs = []
    for i, (rows, lo, first) in enumerate(plan.spans):
        keys, values = source.index_select(0, rows).permute(1, 2, 3, 0, 4)
        docs = None if documents is None else documents[:, lo : first + c]
        outs.append(
            core.attend(
                q[:, :, i * c : (i + 1) * c],
                keys,
                values,
                [(first - lo, c)],
                documents=docs,
                masked=masked,
            )
        )
    return torch.cat(outs, dim=2)
