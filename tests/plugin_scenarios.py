"""Pool scenarios for tests/test_plugins.py: training with an entry added to a registry at
run time, as a later feature adds one in code (workers import only this module)."""

from __future__ import annotations

from typing import Any

from torch import nn

from titanlite import converters
from titanlite.models import attention
from titanlite.models.attention.causal import CausalAttention
from titanlite.models.interfaces import Mask


class CountingLinear(nn.Linear):
    """nn.Linear that counts its calls: the same math and parameter names, another class."""

    calls = 0

    def forward(self, x):  # noqa: ANN001, ANN201
        CountingLinear.calls += 1
        return super().forward(x)


def convert(model: nn.Module, spec: Any, settings: Any) -> int:
    """The toy converter's torch side: every block's nn.Linear becomes a CountingLinear."""
    replaced = 0
    for block in getattr(model, spec.blocks).values():
        for module in block.modules():
            for child in list(module.children()):
                if type(child) is nn.Linear:
                    child.__class__ = CountingLinear
                    replaced += 1
    return replaced


def train_with_counting_converter(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    """Train with model.converters = ["counting"] registered for this run; what the run
    wrote, the class the blocks' projections have and how often they ran."""
    import train_scenarios

    converters.REGISTRY["counting"] = converters.ConverterEntry(
        module=__name__, replaces="every nn.Linear of the blocks by a counting one"
    )
    try:
        CountingLinear.calls = 0
        out = train_scenarios.train(rank, world, [*argv, "--model.converters", "counting"])
        return {"run": out, "calls": CountingLinear.calls}
    finally:
        del converters.REGISTRY["counting"]


class BidirectionalForTest(CausalAttention):
    """A core that declares bidirectional attention (it computes causal attention: only its
    mask description matters here)."""

    mask = Mask(causal=False)


def context_parallel_reads_the_mask(rank: int, world: int, argv: list[str]) -> str:
    """A family whose attention core is not causal: context parallelism refuses it by
    reading the core's mask, not its class."""
    import train_scenarios

    from titanlite.models.llama.args import LlamaArgs

    attention.REGISTRY["bidirectional_for_test"] = BidirectionalForTest
    before = LlamaArgs.attention
    LlamaArgs.attention = "bidirectional_for_test"
    try:
        train_scenarios.train(rank, world, argv)
    except ValueError as e:
        return str(e)
    finally:
        LlamaArgs.attention = before
        del attention.REGISTRY["bidirectional_for_test"]
    return "trained"
