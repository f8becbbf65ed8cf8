"""The chunked gated delta rule equals the recurrence it stands for, written step by step here
(fp64): outputs, final state and gradients, for several chunk sizes, with and without an
initial state and document resets."""

from __future__ import annotations

import pytest
import torch

from titanlite.models.attention import delta_rule
from titanlite.models.attention.delta_rule import document_starts

pytestmark = pytest.mark.usefixtures("one_thread")


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
