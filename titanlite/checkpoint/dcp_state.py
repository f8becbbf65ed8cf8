"""Where a Stateful's state meets DCP: its tensors apart from its plain values (those go to the
sidecar as JSON), the part of a template that a checkpoint holds, and the cause of a failure.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from titanlite.runtime.heartbeat import is_comm_failure


def split_state(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensor leaves, every other leaf) of a nested dict, each keeping the nesting."""
    tensors: dict[str, Any] = {}
    plain: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            t, p = split_state(v)
            if t:
                tensors[k] = t
            if p:
                plain[k] = p
        elif isinstance(v, torch.Tensor):
            tensors[k] = v
        else:
            plain[k] = v
    return tensors, plain


def merge_state(tensors: dict[str, Any], plain: dict[str, Any] | None) -> dict[str, Any]:
    """``split_state`` undone: the tensors put back into the plain values' nesting."""
    out = dict(plain or {})
    for k, v in tensors.items():
        out[k] = merge_state(v, out.get(k)) if isinstance(v, dict) else v
    return out


def tensors_in(state: dict[str, Any], prefix: str, saved: dict[str, Any]) -> tuple[dict, list]:
    """The tensor part of ``state`` that the checkpoint holds (DCP names nested keys with
    dots), and the names of the tensors it lacks."""
    tensors, _ = split_state(state)
    missing: list[str] = []

    def keep(tree: dict[str, Any], path: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in tree.items():
            name = f"{path}.{k}"
            if isinstance(v, dict):
                sub = keep(v, name)
                if sub:
                    out[k] = sub
            elif name in saved:
                size = getattr(saved[name], "size", None)
                if _is_blob(v) and size is not None and tuple(size) != tuple(v.shape):
                    v = torch.empty(size, dtype=torch.uint8)  # a byte blob: the saved length
                out[k] = v
            else:
                missing.append(name)
        return out

    return keep(tensors, prefix), missing


def _is_blob(value: Any) -> bool:
    """A 1-D uint8 tensor: serialized bytes (a rank's own data position, RNG state) whose
    length may differ between the saving and the loading run."""
    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1


def lost_collective(e: BaseException) -> BaseException | None:
    """The failed or timed-out collective behind a DCP failure (a rank lost during a save), if
    that is what it was: the caller re-raises it so that the run stops as for any lost rank
    (exit 4, naming it) rather than as for a checkpoint that could not be written."""
    causes = [f[0] for f in e.failures.values()] if isinstance(e, CheckpointException) else [e]
    return next((c for c in causes if is_comm_failure(c)), None)


def failure_cause(e: BaseException) -> str:
    """First line of the error behind a DCP failure (CheckpointException holds one per rank)."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
