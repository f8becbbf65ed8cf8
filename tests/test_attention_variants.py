"""Sliding-window attention and attention sinks (``model.sliding_window``,
``model.window_pattern``, ``model.attention_sinks``): against full attention and a dense
reference, their reach, their composition with document masking, the FlexAttention path
against the explicit kernel (``model.attention_kernel``), FLOPs, and config errors.
Parity under context and tensor parallelism is in test_parity.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from titanlite import preflight
from titanlite.models import get
from titanlite.models.attention import CausalAttention, MaskedAttention, banded_attention, flex
from titanlite.models.decoder import Decoder
from titanlite.models.init import init_parameters

LLAMA = get("llama3")
DEBUG_CONFIG = str(Path(__file__).resolve().parent.parent / "train_configs" / "debug_model.toml")


def tiny(n_layers: int = 1, **changes: object) -> Decoder:
    args = LLAMA.make_args(
        "debugmodel",
        61,
        48,
        {
            "dim": 32,
            "n_layers": n_layers,
            "n_heads": 4,
            "n_kv_heads": 2,
            "multiple_of": 16,
            **changes,
        },
    )
    model = Decoder(args)
    init_parameters(model, lambda name: LLAMA.init_rule(args, name), seed=3)
    return model.double()


def reference(q, k, v, *, window, sinks=None, documents=None):  # noqa: ANN001, ANN202
    """Softmax over a dense [seq, seq] mask (plus the sink column), float64."""
    b, h, s, d = q.shape
    keys = k.repeat_interleave(h // k.shape[1], 1)
    values = v.repeat_interleave(h // v.shape[1], 1)
    logits = q @ keys.transpose(-1, -2) / math.sqrt(d)
    i = torch.arange(s)
    visible = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    visible = visible.expand(b, s, s)
    if documents is not None:
        visible = visible & (documents[:, None, :] == documents[:, :, None])
    logits = logits.masked_fill(~visible[:, None], -math.inf)
    if sinks is not None:
        logits = torch.cat([logits, sinks.view(1, h, 1, 1).expand(b, h, s, 1)], -1)
    return logits.softmax(-1)[..., :s] @ values


def qkv(seq: int = 40) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    shapes = [(2, 4, seq, 8), (2, 2, seq, 8), (2, 2, seq, 8)]
    return tuple(torch.randn(s, generator=g, dtype=torch.float64) for s in shapes)


def test_window_at_least_the_sequence_equals_full_attention() -> None:
    q, k, v = qkv()
    full = CausalAttention()(q, k, v)
    for window in (40, 100):
        out = MaskedAttention(window=window)(q, k, v)
        torch.testing.assert_close(out, full, rtol=0, atol=1e-13)
    # And a whole model: sliding_window 48 (= seq_len) on every layer equals sliding_window 0.
    tokens = torch.randint(0, 61, (2, 48), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(
        tiny(2, sliding_window=48)(tokens), tiny(2)(tokens), rtol=0, atol=1e-12
    )


def test_a_sink_of_minus_infinity_equals_no_sink() -> None:
    q, k, v = qkv()
    core = MaskedAttention(sink_heads=4)
    with torch.no_grad():
        core.sinks.copy_(torch.full((4,), -math.inf))
    torch.testing.assert_close(core(q, k, v), CausalAttention()(q, k, v), rtol=0, atol=1e-13)
    # A finite sink takes weight away from every token: the output changes.
    with torch.no_grad():
        core.sinks.zero_()
    assert (core(q, k, v) - CausalAttention()(q, k, v)).abs().max() > 1e-3


def test_window_sinks_and_documents_compose_as_the_dense_reference() -> None:
    q, k, v = qkv()
    documents = torch.tensor([[0] * 13 + [1] * 20 + [2] * 7, [0] * 40])
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    want = reference(q, k, v, window=6, sinks=sinks, documents=documents)
    got = banded_attention(q, k, v, [(0, 40)], window=6, sinks=sinks, documents=documents)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
    # A context-parallel rank's two chunks (early, late) against the same rows.
    rows = torch.cat([q[:, :, 0:10], q[:, :, 30:40]], 2)
    got = banded_attention(
        rows, k, v, [(0, 10), (30, 10)], window=6, sinks=sinks, documents=documents
    )
    torch.testing.assert_close(got, torch.cat([want[:, :, :10], want[:, :, 30:]], 2))


def test_gradients_equal_the_dense_reference() -> None:
    documents = torch.tensor([[0] * 13 + [1] * 27, [0] * 40])
    sinks = torch.tensor([0.3, -0.2, 1.0, 0.1], dtype=torch.float64)
    inputs = [t.requires_grad_() for t in (*qkv(), sinks)]
    weights = torch.randn(2, 4, 40, 8, dtype=torch.float64)
    grads = []
    for attend in (banded_attention, reference):
        chunks = ([(0, 40)],) if attend is banded_attention else ()
        out = attend(*inputs[:3], *chunks, window=6, sinks=inputs[3], documents=documents)
        grads.append(torch.autograd.grad((out * weights).sum(), inputs))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert grads[0][3].abs().min() > 0  # every sink gets a gradient


def test_flex_path_equals_the_explicit_kernel() -> None:
    """Outputs and gradients (queries, keys, values, sinks), float64, grouped keys (4 query
    heads over 2): the whole sequence; a context-parallel rank's two chunks over all keys; a
    windowed chunk over only the keys its window reaches, positions counted from the first."""
    q, k, v = qkv()
    documents = torch.tensor([[0] * 13 + [1] * 20 + [2] * 7, [0] * 40])
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    two = torch.cat([q[:, :, 0:10], q[:, :, 30:40]], 2)
    cases = [  # (queries, keys, values, chunks, documents, sinks)
        (q, k, v, [(0, 40)], documents, sinks),
        (q, k, v, [(0, 40)], None, None),
        (two, k, v, [(0, 10), (30, 10)], documents, sinks),
        (q[:, :, 30:], k[:, :, 25:], v[:, :, 25:], [(5, 10)], documents[:, 25:], sinks),
    ]
    for rows, keys, values, chunks, docs, sink in cases:
        leaves = [t.clone().requires_grad_() for t in (rows, keys, values)]
        leaves += [sink.clone().requires_grad_()] if sink is not None else []
        weights = torch.randn(
            rows.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64
        )
        results = []
        for attend in (banded_attention, flex.flex_masked_attention):
            out = attend(
                *leaves[:3],
                chunks,
                window=6,
                sinks=leaves[3] if sink is not None else None,
                documents=docs,
            )
            results.append([out, *torch.autograd.grad((out * weights).sum(), leaves)])
        for got, want in zip(*results, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        assert results[1][-1].abs().min() > 0  # every sink (or value) gets a gradient


def test_attention_kernel_picks_flex_on_cuda_and_logs_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert flex.uses_flex("auto", torch.device("cuda"))
    assert not flex.uses_flex("auto", torch.device("cpu"))
    assert not flex.uses_flex("explicit", torch.device("cuda"))
    assert flex.uses_flex("flex", torch.device("cpu"))
    assert flex.describe("auto", cuda=True).startswith("FlexAttention (compiled")
    assert flex.describe("flex", cuda=True).startswith("FlexAttention (compiled")
    tokens = torch.randint(0, 61, (2, 48), generator=torch.Generator().manual_seed(5))
    logits = {}
    for kernel in ("auto", "flex"):
        caplog.clear()
        flex._masks.clear()
        with caplog.at_level("INFO", logger="titanlite.models.attention"):
            model = tiny(
                2,
                sliding_window=8,
                window_pattern="LG",
                attention_sinks=True,
                attention_kernel=kernel,
            )
        logits[kernel] = model(tokens)
        line = next(r.getMessage() for r in caplog.records if "attention: 2 of 2" in r.getMessage())
        if kernel == "auto":  # this CPU machine: the explicit kernel, and why
            assert "run the blocked explicit kernel" in line and "no CUDA device" in line, line
            assert not flex._masks  # flex never ran
        else:
            assert "FlexAttention's dense reference" in line, line
            assert flex._masks  # flex built its block masks
    torch.testing.assert_close(logits["flex"], logits["auto"], rtol=0, atol=1e-12)


def test_tokens_beyond_the_window_do_not_change_later_logits() -> None:
    """One attention layer, window w: position t sees tokens t - w + 1 .. t only."""
    w, t = 5, 30
    model = tiny(1, sliding_window=w, attention_sinks=True)
    tokens = torch.randint(0, 61, (1, 48), generator=torch.Generator().manual_seed(2))
    base = model(tokens)
    far = tokens.clone()
    far[0, : t - w + 1] = (far[0, : t - w + 1] + 7) % 61  # every token before the window
    assert torch.equal(model(far)[0, t:], base[0, t:])
    near = tokens.clone()
    near[0, t - w + 1] = (near[0, t - w + 1] + 7) % 61  # the window's first token
    assert (model(near)[0, t] - base[0, t]).abs().max() > 1e-6
    # With the pattern "G" the same layer is global: the far change reaches t.
    assert not torch.equal(tiny(1, sliding_window=w, window_pattern="G")(far)[0, t], base[0, t])


def test_window_pattern_picks_the_local_layers() -> None:
    model = tiny(4, sliding_window=8, window_pattern="LG", attention_sinks=True)
    masks = [block.attention.core.mask for block in model.layers.values()]
    assert [m.window for m in masks] == [8, None, 8, None]
    assert all(m.sink for m in masks)
    plain = tiny(2)
    assert all(type(b.attention.core) is CausalAttention for b in plain.layers.values())
    sinks = dict(tiny(2, attention_sinks=True).named_parameters())["layers.1.attention.core.sinks"]
    assert sinks.shape == (4,) and sinks.std() > 0  # one per query head, initialized


def test_flops_count_the_window_band() -> None:
    args = tiny(4).args
    width, seq = args.n_heads * args.head_dim, 48
    full = LLAMA.flops_per_token(args, seq)
    covering = LLAMA.make_args("debugmodel", 61, 48, {**_shape(args), "sliding_window": 48})
    assert LLAMA.flops_per_token(covering, seq) == full
    local = LLAMA.make_args(
        "debugmodel", 61, 48, {**_shape(args), "sliding_window": 8, "window_pattern": "LLLG"}
    )
    band = 8 - 8 * 8 / (2 * seq)  # keys per query in a local layer
    saved = 3 * 12 * width * (seq / 2 - band)
    assert LLAMA.flops_per_token(local, seq) == round(full - saved)


def _shape(args) -> dict[str, int]:  # noqa: ANN001
    return {
        "dim": args.dim,
        "n_layers": args.n_layers,
        "n_heads": args.n_heads,
        "n_kv_heads": args.n_kv_heads,
        "multiple_of": args.multiple_of,
    }


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("window_pattern", "LXG", "window_pattern must be a string of L (local) and G"),
        ("sliding_window", "-1", "sliding_window must be between 0 and 2,147,483,647, got -1"),
        ("sliding_window", str(10**23), "sliding_window must be between 0"),  # was a traceback
        ("attention_kernel", "fast", "model.attention_kernel"),
    ],
)
def test_bad_attention_options_are_one_line_errors(
    key: str,
    value: str,
    words: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    rc = preflight.main(["--job.config_file", DEBUG_CONFIG, f"--model.{key}", value])
    err = capsys.readouterr().err
    assert rc == 2 and words in err and len(err.strip().splitlines()) == 1, err


def test_hf_export_refuses_a_window_hf_llama_lacks() -> None:
    from titanlite.errors import UserError

    with pytest.raises(UserError, match="model.sliding_window=8"):
        LLAMA.hf_adapter().to_hf_config(tiny(1, sliding_window=8).args)


@pytest.mark.slow
def test_eager_only_kernels_run_eagerly_under_compile_and_import_no_dynamo() -> None:
    """document_attention (``layers.outside_graphs``) inside torch.compile: the same output as
    eager and one graph break, as under ``torch.compiler.disable``; importing the models and
    their kernels imports no ``torch._dynamo`` (in a fresh process: this one has it)."""
    import subprocess
    import sys

    import torch._dynamo

    from titanlite.models.attention.kernels import document_attention

    q, k, v = qkv(seq=8)
    documents = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2]] * 2)

    def doubled(q, k, v, documents):  # noqa: ANN001, ANN202
        return document_attention(q * 1.0, k, v, documents, chunks=[(0, 8)]) * 2

    eager = doubled(q, k, v, documents)
    compiled = torch.compile(doubled, backend="eager")(q, k, v, documents)
    assert torch.equal(compiled, eager)
    explained = torch._dynamo.explain(doubled)(q, k, v, documents)
    torch._dynamo.reset()
    assert (explained.graph_count, explained.graph_break_count) == (2, 1)
    code = (
        "import sys, titanlite.models.attention, titanlite.models.decoder; "
        "sys.exit(1 if 'torch._dynamo' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
