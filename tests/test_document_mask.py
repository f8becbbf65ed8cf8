"""Document masking (training.document_mask): document boundaries in packed windows, the
block-causal kernel against an explicit mask, and what it means for a model: one document per
window changes nothing, and a window's second document does not see its first."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_model import build, tiny_args

from titanlite.data.documents import document_ids, document_positions
from titanlite.models.attention import document_attention

BOS, EOS = 1, 2


def test_documents_start_at_bos_or_after_eos() -> None:
    tokens = torch.tensor([[5, 6, BOS, 7, EOS, BOS, 8, 9]])
    assert document_ids(tokens, BOS, EOS).tolist() == [[0, 0, 1, 1, 1, 2, 2, 2]]
    # Without BOS (Qwen-style) the token after EOS opens the next document.
    assert document_ids(tokens, -1, EOS).tolist() == [[0, 0, 0, 0, 0, 1, 1, 1]]
    positions = document_positions(document_ids(tokens, BOS, EOS))
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0, 1, 2]]


def block_causal_reference(q, k, v, documents):  # noqa: ANN001, ANN201
    seq = q.shape[2]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    same = documents[:, :, None] == documents[:, None, :]
    mask = (causal & same)[:, None]  # [b, 1, s, s]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("masked", [False, True], ids=["flash", "mask"])
def test_block_causal_kernel_matches_an_explicit_mask(masked: bool) -> None:
    torch.manual_seed(0)
    b, h, kv, s, d = 3, 4, 2, 24, 8
    q, k, v = (
        torch.randn(b, n, s, d, dtype=torch.float64, requires_grad=True) for n in (h, kv, kv)
    )
    # Different boundaries per sequence, a one-token document and one spanning all.
    starts = torch.zeros(b, s, dtype=torch.long)
    starts[0, [5, 6, 17]] = 1
    starts[2, [1, 12, 23]] = 1
    documents = starts.cumsum(1)
    grad = torch.randn(b, h, s, d, dtype=torch.float64)
    want = block_causal_reference(q, k, v, documents)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    got = document_attention(q, k, v, documents, chunks=[(0, s)], masked=masked)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    assert (got - want).abs().max() < 1e-12
    for a, b_ in zip(got_grads, want_grads, strict=True):
        assert (a - b_).abs().max() < 1e-12


def logits(model, tokens: torch.Tensor, reset: bool) -> torch.Tensor:  # noqa: ANN001
    documents = document_ids(tokens, BOS, EOS)
    positions = document_positions(documents) if reset else None
    return model(tokens, positions=positions, documents=documents)


def test_one_document_per_window_changes_nothing() -> None:
    model = build(tiny_args())
    tokens = torch.randint(3, 97, (2, 32))
    tokens[:, 0] = BOS
    for reset in (False, True):
        assert torch.equal(logits(model, tokens, reset), model(tokens))


@pytest.mark.parametrize("reset", [False, True], ids=["positions", "reset_positions"])
def test_second_document_does_not_depend_on_the_first(reset: bool) -> None:
    model = build(tiny_args())
    torch.manual_seed(1)
    second = torch.randint(3, 97, (1, 12))
    second[0, 0] = BOS
    first_a, first_b = torch.randint(3, 97, (1, 20)), torch.randint(3, 97, (1, 20))
    a = logits(model, torch.cat([first_a, second], 1), reset)[:, 20:]
    b = logits(model, torch.cat([first_b, second], 1), reset)[:, 20:]
    assert (a - b).abs().max() < 1e-5
    unmasked = (
        model(torch.cat([first_a, second], 1))[:, 20:]
        - model(torch.cat([first_b, second], 1))[:, 20:]
    )
    assert unmasked.abs().max() > 1e-3  # without the mask it does depend on it
    if reset:  # positions restart: the second document as if it were alone
        alone = model(second)
        assert (a - alone).abs().max() < 1e-5


def test_document_settings_are_checked_before_launch() -> None:
    from titanlite.checks import check
    from titanlite.config import ConfigError, JobConfig

    cfg = JobConfig()
    cfg.training.document_positions = True
    cfg.parallelism.pipeline_parallel_degree = 2
    with pytest.raises(ConfigError, match="document_positions needs training.document_mask"):
        check(cfg, 2)
    cfg.training.document_mask = True
    cfg.compile.enable = True
    with pytest.raises(ConfigError) as info:
        check(cfg, 2)
    lines = str(info.value).split("\n")
    assert any("document_mask does not combine with pipeline" in line for line in lines)
    assert any("document_mask does not combine with compile.enable" in line for line in lines)
