"""The chunked gated delta rule equals the recurrence it stands for, written step by step here
(fp64): outputs, final state and gradients, for several chunk sizes, with and without an
initial state and document resets; the mapping onto flash-linear-attention's op (against its
documented contract: the kernel needs a GPU) and when that op is chosen."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from titanlite.models.attention import delta_rule
from titanlite.models.attention.delta_rule import document_starts


def stepwise(q, k, v, g, beta, initial_state=None, resets=None):  # noqa: ANN001, ANN201
    """One token at a time: reset, decay, delta-rule write, read."""
    b, h, T, dk = k.shape
    state = torch.zeros(b, h, dk, v.shape[-1], dtype=v.dtype)
    if initial_state is not None:
        state = initial_state.clone()
    outs = []
    for t in range(T):
        if resets is not None:
            state = state * (~resets[:, t]).to(v.dtype)[:, None, None, None]
        state = state * g[:, :, t].exp()[..., None, None]
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, :, t])
        correction = beta[:, :, t, None] * (v[:, :, t] - predicted)
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, :, t], correction)
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t]))
    return torch.stack(outs, dim=2), state


def chunk_gated_delta_rule(q, k, v, g, beta, **options):  # noqa: ANN001, ANN003, ANN201
    return delta_rule.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, **options)


def inputs(T: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    b, h, dk, dv = 2, 3, 8, 6

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    k = torch.nn.functional.normalize(rand(b, h, T, dk), dim=-1)
    q = rand(b, h, T, dk) / dk**0.5
    g = -torch.nn.functional.softplus(rand(b, h, T))  # decays in (0, 1)
    beta = torch.sigmoid(rand(b, h, T))
    state = rand(b, h, dk, dv)
    return [x.requires_grad_() for x in (q, k, rand(b, h, T, dv), g, beta, state)]


DOCUMENTS = torch.tensor([[0] * 5 + [1] * 9 + [2] * 1 + [3] * 8, [0] * 16 + [1] * 7])


@pytest.mark.parametrize("resets", [False, True], ids=["one-document", "documents"])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
def test_chunked_equals_stepwise(resets: bool, with_state: bool) -> None:
    T = DOCUMENTS.shape[1]  # 23: no chunk size below divides it, so padding is exercised
    *tensors, state = inputs(T)
    starts = document_starts(DOCUMENTS) if resets else None
    if resets:
        assert starts.sum() == 4  # a one-token document, and resets at chunk edges for C=5
    initial = state if with_state else None
    want, want_state = stepwise(*tensors, initial_state=initial, resets=starts)
    weights = torch.randn(want.shape, dtype=torch.float64)
    state_weights = torch.randn(want_state.shape, dtype=torch.float64)
    leaves = [*tensors, state] if with_state else tensors
    want_grads = torch.autograd.grad(
        (want * weights).sum() + (want_state * state_weights).sum(), leaves
    )
    for chunk in (1, 4, 5, 16, 64):
        out, final = chunk_gated_delta_rule(
            *tensors, chunk_size=chunk, initial_state=initial, resets=starts
        )
        torch.testing.assert_close(out, want, rtol=0, atol=1e-10)
        torch.testing.assert_close(final, want_state, rtol=0, atol=1e-10)
        grads = torch.autograd.grad((out * weights).sum() + (final * state_weights).sum(), leaves)
        for got, expected in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)


def test_resets_make_documents_independent() -> None:
    """A document's outputs are those of the rule run on that document alone."""
    *tensors, _ = inputs(DOCUMENTS.shape[1], seed=1)
    out, _ = chunk_gated_delta_rule(
        *tensors, chunk_size=4, resets=document_starts(DOCUMENTS), initial_state=None
    )
    alone, _ = chunk_gated_delta_rule(*(x[:1, :, 5:14] for x in tensors), chunk_size=4)
    torch.testing.assert_close(out[:1, :, 5:14], alone, rtol=0, atol=1e-12)
    assert (
        out[:1, :, 5:14] - chunk_gated_delta_rule(*tensors, chunk_size=4)[0][:1, :, 5:14]
    ).abs().max() > 1e-3


def test_state_passes_between_halves() -> None:
    """Running the second half from the first half's final state equals one run: what a
    context-parallel rank relies on."""
    *tensors, _ = inputs(24, seed=2)
    whole, whole_state = chunk_gated_delta_rule(*tensors, chunk_size=8)
    first, mid = chunk_gated_delta_rule(*(x[:, :, :12] for x in tensors), chunk_size=8)
    second, end = chunk_gated_delta_rule(
        *(x[:, :, 12:] for x in tensors), chunk_size=8, initial_state=mid
    )
    torch.testing.assert_close(torch.cat([first, second], 2), whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(end, whole_state, rtol=0, atol=1e-12)


def fla_contract(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens=None):  # noqa: ANN001, ANN201
    """flash-linear-attention's chunk_gated_delta_rule as its docstring states it (fla-core
    0.6.0), written plainly: [B, T, H, ...] tensors, queries times ``scale``, and with
    ``cu_seqlens`` (B = 1) independent sequences, each from its own initial state."""
    assert output_final_state and scale == 1.0  # the core's queries come scaled
    heads_first = [x.transpose(1, 2) for x in (q, k, v, g, beta)]
    if cu_seqlens is None:
        out, state = stepwise(*heads_first, initial_state=initial_state)
        return out.transpose(1, 2), state
    assert q.shape[0] == 1 and cu_seqlens.dtype == torch.long
    bounds = cu_seqlens.tolist()
    outs, states = [], []
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False)):
        start = None if initial_state is None else initial_state[i : i + 1]
        out, state = stepwise(
            *(x[..., lo:hi, :] if x.dim() == 4 else x[..., lo:hi] for x in heads_first),
            initial_state=start,
        )
        outs.append(out)
        states.append(state)
    return torch.cat(outs, dim=2).transpose(1, 2), torch.cat(states)


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
def test_fla_argument_mapping_equals_the_plain_rule(with_state: bool) -> None:
    """``fla_rule.run`` hands flash-linear-attention's op (here its documented contract,
    since the kernel needs a GPU) the layout, scale, states and document pieces that give the
    plain rule's outputs, final states and gradients, resets included (one at a row's first
    token, as a context-parallel chunk beginning a document has)."""
    from titanlite.models.attention import fla_rule

    *tensors, state = inputs(DOCUMENTS.shape[1], seed=3)
    resets = document_starts(DOCUMENTS)
    resets[1, 0] = True
    initial = state if with_state else None
    leaves = [*tensors, state] if with_state else tensors
    for starts in (None, resets):
        want, want_state = chunk_gated_delta_rule(*tensors, initial_state=initial, resets=starts)
        q, k, v, g, beta = tensors
        out, final = fla_rule.run(
            fla_contract, q, k, v, g=g, beta=beta, resets=starts, initial_state=initial
        )
        torch.testing.assert_close(out, want, rtol=0, atol=1e-10)
        torch.testing.assert_close(final, want_state, rtol=0, atol=1e-10)
        weights = torch.randn(want.shape, dtype=torch.float64)
        want_grads = torch.autograd.grad((want * weights).sum() + want_state.sum(), leaves)
        grads = torch.autograd.grad((out * weights).sum() + final.sum(), leaves)
        for got, expected in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)


FAKE_FLA = """
__version__ = "9.9"
"""
FAKE_OP = """
def chunk_gated_delta_rule(*args, **kwargs):
    raise AssertionError("the fake flash-linear-attention ran")
"""


def test_fla_kernel_is_chosen_only_on_cuda_and_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An importable ``fla`` is chosen for CUDA tensors only: CPU tensors run the plain rule
    whatever is installed, and ``linear_attention_kernel = "torch"`` never takes it; the
    start-up line says which kernel and why."""
    import sys

    from titanlite.models.attention import GatedDeltaAttention, fla_rule

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    fla_rule.fast_op.cache_clear()
    assert fla_rule.choose("auto", cuda) is None  # not installed here
    assert "flash-linear-attention does not import" in fla_rule.describe("auto", cuda=True)
    package = tmp_path / "fla" / "ops" / "gated_delta_rule"
    package.mkdir(parents=True)
    (tmp_path / "fla" / "__init__.py").write_text(FAKE_FLA)
    (tmp_path / "fla" / "ops" / "__init__.py").write_text("")
    (package / "__init__.py").write_text(FAKE_OP)
    monkeypatch.syspath_prepend(str(tmp_path))
    fla_rule.fast_op.cache_clear()
    try:
        fake = sys.modules["fla.ops.gated_delta_rule"] if fla_rule.fast_op()[0] else None
        assert fake is not None and fla_rule.choose("auto", cuda) is fake.chunk_gated_delta_rule
        assert fla_rule.choose("auto", cpu) is None and fla_rule.choose("torch", cuda) is None
        assert fla_rule.describe("auto", cuda=True).startswith(
            "flash-linear-attention 9.9's Triton kernel"
        )
        assert "no CUDA device" in fla_rule.describe("auto", cuda=False)
        assert '"torch"' in fla_rule.describe("torch", cuda=True)
        core = GatedDeltaAttention()  # on CPU tensors: the plain rule, the fake never runs
        q, k, v, g, beta, _ = (x.detach().float() for x in inputs(8))
        out = core(q, k, v, g=g, beta=beta)
        plain = GatedDeltaAttention()
        plain.kernel = "torch"
        torch.testing.assert_close(out, plain(q, k, v, g=g, beta=beta), rtol=0, atol=0)
    finally:
        for name in [n for n in sys.modules if n == "fla" or n.startswith("fla.")]:
            del sys.modules[name]
        fla_rule.fast_op.cache_clear()

    import dataclasses

    from titanlite.models.qwen3_5 import model
    from titanlite.models.qwen3_5.args import FLAVORS

    with caplog.at_level("INFO", logger="titanlite.models.attention"), torch.device("meta"):
        model.build(dataclasses.replace(FLAVORS["debugmodel"], vocab_size=64))
    assert (
        "linear attention: 3 of 4 layers (Gated DeltaNet) run the delta rule with chunked "
        "PyTorch (no CUDA device" in caplog.text
    )
