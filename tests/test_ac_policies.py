"""What each activation checkpointing mode keeps and what it recomputes in backward, counted op
by op: "full" runs every block's forward again, selective "op" keeps the matmuls' and the
attention's outputs (recomputing only the cheap ops between them), selective N wraps every
Nth block. The memory each saves is measured by scripts/bench_memory.py --ac (BENCHMARKS.md)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from titanlite.models import get
from titanlite.models.decoder import Decoder
from titanlite.models.init import init_parameters
from titanlite.parallel.blocks import apply_ac

LAYERS = 4
MM = torch.ops.aten.mm.default
ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
SILU = torch.ops.aten.silu.default


class Calls(TorchDispatchMode):
    """Counts every aten op that runs while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def calls(mode: str, option: str = "2") -> tuple[Counter, Counter]:
    """The ops one forward and one backward of a 4-block llama run under ``mode``."""
    spec = get("llama3")
    overrides = {"dim": 64, "n_layers": LAYERS, "n_heads": 4, "multiple_of": 32}
    args = spec.make_args("debugmodel", 256, 32, overrides)
    model = Decoder(args)
    init_parameters(model, lambda name: spec.init_rule(args, name), 0)
    if mode != "none":
        apply_ac(model, spec, mode, option)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with Calls() as forward:
        loss = model(tokens).logsumexp(-1).sum()
    with Calls() as backward:
        loss.backward()
    return forward.counts, backward.counts


@pytest.fixture(scope="module")
def without() -> tuple[Counter, Counter]:
    forward, backward = calls("none")
    assert forward[ATTENTION] == forward[SILU] == LAYERS
    assert backward[MM] > 0 and backward[ATTENTION] == 0 and backward[SILU] == 0
    return forward, backward


@pytest.fixture(scope="module")
def plain(without: tuple[Counter, Counter]) -> Counter:
    """The ops of backward without checkpointing: none of the forward's."""
    return without[1]


@pytest.fixture(scope="module")
def block_matmuls(without: tuple[Counter, Counter]) -> int:
    """Matmuls in one block's forward (the projections; the output head's is the one left)."""
    forward = without[0]
    assert (forward[MM] - 1) % LAYERS == 0
    return (forward[MM] - 1) // LAYERS


def test_full_recomputes_every_block(plain: Counter, block_matmuls: int) -> None:
    _, full = calls("full")
    assert full[ATTENTION] == LAYERS and full[SILU] == LAYERS
    # all but each block's last projection, whose output backward does not need (torch's
    # non-reentrant checkpoint stops recomputing once every saved tensor is back)
    assert full[MM] == plain[MM] + (block_matmuls - 1) * LAYERS


def test_selective_op_keeps_matmuls_and_attention(plain: Counter) -> None:
    """Only the cheap ops are run again: no matmul, no attention."""
    _, op = calls("selective", "op")
    assert op[MM] == plain[MM] and op[ATTENTION] == 0
    assert op[SILU] == LAYERS  # the activation between the kept matmuls is recomputed


def test_selective_every_second_block(plain: Counter, block_matmuls: int) -> None:
    _, every_second = calls("selective", "2")
    assert every_second[ATTENTION] == LAYERS // 2
    assert every_second[MM] == plain[MM] + (block_matmuls - 1) * LAYERS // 2
