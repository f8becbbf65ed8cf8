"""A weighted mixture of pre-tokenized folders ([[training.datasets]]), read per rank.

Global window k (all ranks together, in order) is given to a dataset by a fixed, stateless
rule whose counts have a closed form: with normalized weights p_0..p_{D-1}, the first k windows
give dataset 0 exactly round(k * p_0) of them; the windows dataset 0 does not take pass on, in
order, to dataset 1 with weight p_1 / (1 - p_0), and so on. Any prefix of the run therefore holds
each dataset within about one window per dataset of its weight's share, the n-th window a
dataset receives is its own window sequence's n-th (shuffled per epoch exactly as a single
folder, TokenLoader), and a rank computes its windows' datasets and positions from k alone:
no state but the number of windows consumed, valid under any data-parallel degree. Weights are
held as exact fractions so that every rank (and every resume) rounds identically.

A sequence-length ramp (``set_seq_len``) keeps the rule and changes how long each window is:
each dataset's own stream is read on in tokens (TokenLoader.read_span) from where its last
window ended. The state adds where the current window length began (global windows, and each
dataset's position in tokens there), so it stays a few integers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from titanlite.data.spec import DataSpec
from titanlite.data.token_loader import TokenLoader, WindowCountState
from titanlite.data.tokenizer import Tokenizer
from titanlite.data.tokens import is_token_folder
from titanlite.errors import UserError

_WEIGHT_DENOMINATOR = 1 << 20  # weights are exact multiples of 2^-20 of the total


@dataclass(frozen=True)
class Part:
    """One dataset of a mixture: its name (in logs and per-dataset validation), normalized
    weight, and the spec of its folder."""

    name: str
    weight: float
    spec: DataSpec


def _round_half_up(numerator: int, denominator: int) -> int:
    return (2 * numerator + denominator) // (2 * denominator)


class Interleave:
    """The window-to-dataset rule (see the module docstring), in exact integer arithmetic."""

    def __init__(self, weights: list[float]) -> None:
        if not weights or any(not w > 0 for w in weights):
            raise ValueError(f"weights must be positive, got {weights}")
        total = sum(weights)
        units = [max(1, round(w / total * _WEIGHT_DENOMINATOR)) for w in weights]
        # Level d takes share units[d] / (sum of units[d:]) of what reaches it.
        self.shares = [Fraction(u, sum(units[d:])) for d, u in enumerate(units)]
        self.weights = [Fraction(u, sum(units)) for u in units]
        self._units = units

    def _taken(self, level: int, n: int) -> int:
        share = self.shares[level]
        return _round_half_up(n * share.numerator, share.denominator)

    def counts(self, k: int) -> list[int]:
        """How many of global windows 0..k-1 each dataset received."""
        out = []
        for level in range(len(self.shares)):
            taken = self._taken(level, k)
            out.append(taken)
            k -= taken
        return out

    def locate(self, k: int) -> tuple[int, int]:
        """(dataset, its own window number) of global window k."""
        for level in range(len(self.shares)):
            before = self._taken(level, k)
            if self._taken(level, k + 1) > before:
                return level, before
            k -= before
        raise AssertionError("the last share is 1: every window is taken")  # pragma: no cover

    def worst_deviation(self, k: int) -> float:
        """Largest |received - weight * k| over the datasets after k windows, in windows."""
        return max(abs(c - float(w) * k) for c, w in zip(self.counts(k), self.weights, strict=True))

    def worst_deviation_upto(self, k: int) -> float:
        """The largest ``worst_deviation(j)`` over every prefix j <= k, exactly.

        Every level's share u_d / S_d gains exactly u_d when what reaches it gains S_d, so
        counts(j + U) = counts(j) + units (U = sum of units) and the deviations repeat with
        period U (about 2^20): one vectorized pass over j <= min(k, U) covers any run.
        """
        total = sum(self._units)
        j = np.arange(min(k, total) + 1, dtype=np.int64)
        rest = j.copy()
        worst = np.zeros_like(j)  # in units of 1/U of a window: exact integers
        for share, unit in zip(self.shares, self._units, strict=True):
            got = _round_half_up(rest * share.numerator, share.denominator)  # elementwise
            np.maximum(worst, np.abs(got * total - unit * j), out=worst)
            rest -= got
        return int(worst.max()) / total


class MixtureLoader(WindowCountState):
    """Iterable of ``(inputs, labels)`` like TokenLoader, over several token folders."""

    _resume_hint = "the same datasets and weights"

    def __init__(
        self, tokenizer: Tokenizer, parts: list[Part], dp_rank: int, dp_world_size: int
    ) -> None:
        for part in parts:
            if not is_token_folder(part.spec.dataset_path):
                raise UserError(
                    f"training.datasets: {part.spec.dataset_path!r} ({part.name}) is not a "
                    "pre-tokenized folder; mixtures read folders made by scripts/pretokenize.py"
                )
        self.parts = parts
        self.spec = parts[0].spec
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.chunk = self.spec.local_batch_size * dp_world_size
        # Each part's own window sequence; only its epoch/permutation logic and reads are used.
        # Seeds differ by part, so a folder listed twice is not read in lockstep.
        self.sources = [
            TokenLoader(tokenizer, replace(p.spec, seed=p.spec.seed + i), 0, 1, split="train")
            for i, p in enumerate(parts)
        ]
        self.interleave = Interleave([p.weight for p in parts])
        self._windows_consumed = 0
        self._start_stage(0, [0] * len(parts), self.spec.seq_len + 1)

    def _start_stage(self, windows: int, offsets: list[int], cut: int) -> None:
        """Windows of ``cut`` tokens from global window ``windows`` on, where each dataset's
        stream stands at ``offsets`` tokens."""
        self._stage_start, self._stage_offsets, self._cut = windows, offsets, cut
        self._stage_counts = self.interleave.counts(windows)

    def close(self) -> None:
        pass

    def set_seq_len(self, seq_len: int) -> None:
        """Windows of ``seq_len`` + 1 tokens from the next batch on (see ``Loader``)."""
        if not 1 <= seq_len <= self.spec.seq_len:
            raise ValueError(f"seq_len must be in [1, {self.spec.seq_len}], got {seq_len}")
        if seq_len + 1 != self._cut:
            now = self.interleave.counts(self._windows_consumed)
            offsets = [
                offset + (count - before) * self._cut
                for offset, count, before in zip(
                    self._stage_offsets, now, self._stage_counts, strict=True
                )
            ]
            self._start_stage(self._windows_consumed, offsets, seq_len + 1)

    def __iter__(self) -> MixtureLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.spec.local_batch_size
        first = self._windows_consumed + self.dp_rank * b
        rows = []
        for k in range(first, first + b):
            part, n = self.interleave.locate(k)
            at = self._stage_offsets[part] + (n - self._stage_counts[part]) * self._cut
            rows.append(self.sources[part].read_span(at, self._cut))
        self._windows_consumed += self.chunk
        mine = torch.from_numpy(np.stack(rows))
        return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()

    def describe(self) -> str:
        """The shares each dataset got, and how far they ever were from the weights (host
        arithmetic on the window count alone, exact: see ``Interleave``)."""
        k = self._windows_consumed
        shares = ", ".join(
            f"{name} {share:.2%} (weight {part.weight:.2%})"
            for (name, share), part in zip(self.realized().items(), self.parts, strict=True)
        )
        return (
            f"data mixture after {k} windows: {shares}; deviation from the weights "
            f"{self.interleave.worst_deviation(k):.2f} windows now, at most "
            f"{self.interleave.worst_deviation_upto(k):.2f} over the run"
        )

    def realized(self) -> dict[str, float]:
        """Each dataset's share of the windows consumed so far."""
        k = max(self._windows_consumed, 1)
        counts = self.interleave.counts(self._windows_consumed)
        return {p.name: c / k for p, c in zip(self.parts, counts, strict=True)}

    def _counts(self) -> dict[str, Any]:
        return {
            "stage_start": self._stage_start,
            "stage_offsets": list(self._stage_offsets),
            "stage_window": self._cut,
        }

    def _load_counts(self, state: dict[str, Any]) -> None:
        self._start_stage(  # format 1: no ramp, one stage from the start
            int(state.get("stage_start", 0)),
            [int(o) for o in state.get("stage_offsets", [0] * len(self.parts))],
            int(state.get("stage_window", self.spec.seq_len + 1)),
        )

    def _identity(self) -> dict[str, Any]:
        return {
            "kind": "mixture",
            "folders": [s.folder.id for s in self.sources],
            "weights": [str(w) for w in self.interleave.weights],
            "seq_len": self.spec.seq_len,
            "seed": self.spec.seed,
        }
