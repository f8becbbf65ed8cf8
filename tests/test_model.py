"""The Llama family: published sizes, shapes, causality, GQA, RoPE, deterministic init, FLOPs,
shape validation, and that it learns."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from titanlite.config import load_config
from titanlite.models import get
from titanlite.models.decoder import Decoder as Transformer
from titanlite.models.init import full_value, init_parameters
from titanlite.models.layers import apply_rope, count_params, rope_tables
from titanlite.models.llama.args import FLAVORS
from titanlite.models.llama.args import LlamaArgs as ModelArgs
from titanlite.optim import build_optimizer
from titanlite.parallel.materialize import materialize

LLAMA = get("llama3")
flops_per_token = LLAMA.flops_per_token


def model_args(flavor: str, vocab_size: int, max_seq_len: int, **overrides: object) -> ModelArgs:
    return LLAMA.make_args(flavor, vocab_size, max_seq_len, overrides)


def init_weights(model: Transformer, seed: int = 0) -> None:
    init_parameters(model, lambda name: LLAMA.init_rule(model.args, name), seed)


LLAMA3_VOCAB = 128256


def tiny_args(**changes: object) -> ModelArgs:
    base = {
        "dim": 64,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "vocab_size": 97,
        "multiple_of": 32,
        "max_seq_len": 32,
    }
    base.update(changes)
    return ModelArgs(**base)  # type: ignore[arg-type]


def build(args: ModelArgs, seed: int = 0) -> Transformer:
    model = Transformer(args)
    init_weights(model, seed)
    return model


def expected_params(args: ModelArgs) -> int:
    """Parameter count written out from the architecture, independent of the module code."""
    hd, kv = args.head_dim, args.kv_heads
    attention = args.dim * (args.n_heads * hd) * 2 + args.dim * (kv * hd) * 2
    ffn = 3 * args.dim * args.ffn_hidden_dim
    per_layer = attention + ffn + 2 * args.dim
    embeddings = args.vocab_size * args.dim * (1 if args.tie_embeddings else 2)
    return args.n_layers * per_layer + embeddings + args.dim


# --- published sizes --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flavor", "published", "ffn_hidden"),
    [
        ("1B", 1_235_814_400, 8192),  # Llama 3.2 1B (tied)
        ("3B", 3_212_749_824, 8192),  # Llama 3.2 3B (tied)
        ("8B", 8_030_261_248, 14336),  # Llama 3 / 3.1 8B
        ("70B", 70_553_706_496, 28672),  # Llama 3 / 3.1 70B
        ("405B", 405_853_388_800, 53248),  # Llama 3.1 405B
    ],
)
def test_published_parameter_counts(flavor: str, published: int, ffn_hidden: int) -> None:
    args = model_args(flavor, LLAMA3_VOCAB, 2048)
    assert args.ffn_hidden_dim == ffn_hidden
    with torch.device("meta"):
        model = Transformer(args)
    assert count_params(model) == published
    assert expected_params(args) == published
    assert all(p.is_meta for p in model.parameters())


def test_debug_model_size() -> None:
    """The comment in FLAVORS promises about 5 M parameters with the shipped 4 K tokenizer."""
    with torch.device("meta"):
        model = Transformer(model_args("debugmodel", 4096, 256))
    assert 4_000_000 < count_params(model) < 6_000_000


# --- shapes -----------------------------------------------------------------------------------


def test_debug_model_output_shape_and_dtype() -> None:
    model = build(model_args("debugmodel", 4096, 16))
    tokens = torch.randint(0, 4096, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 4096)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_bfloat16_model_returns_float32_logits() -> None:
    model = build(tiny_args()).to(torch.bfloat16)
    logits = model(torch.randint(0, 97, (1, 8)))
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_sequence_shorter_than_max_seq_len() -> None:
    model = build(tiny_args())
    assert model(torch.randint(0, 97, (3, 5))).shape == (3, 5, 97)


def test_gqa_projection_shapes() -> None:
    args = tiny_args(dim=96, n_heads=6, n_kv_heads=2)
    model = build(args)
    attention = model.layers["0"].attention
    head_dim = 96 // 6
    assert attention.wq.weight.shape == (6 * head_dim, 96)
    assert attention.wk.weight.shape == (2 * head_dim, 96)
    assert attention.wv.weight.shape == (2 * head_dim, 96)
    assert attention.wo.weight.shape == (96, 6 * head_dim)
    assert model(torch.randint(0, 97, (2, 7))).shape == (2, 7, 97)


def test_gqa_equals_mha_with_repeated_kv_heads() -> None:
    """Grouped-query attention is multi-head attention whose k/v heads are shared by groups
    of consecutive query heads."""
    gqa = build(tiny_args(n_heads=4, n_kv_heads=2))
    mha = Transformer(tiny_args(n_heads=4, n_kv_heads=None))
    state = gqa.state_dict()
    head_dim = 16
    for i in range(2):
        for w in ("wk", "wv"):
            key = f"layers.{i}.attention.{w}.weight"
            heads = state[key].view(2, head_dim, 64)
            state[key] = heads.repeat_interleave(2, dim=0).reshape(4 * head_dim, 64)
    mha.load_state_dict(state)
    tokens = torch.randint(0, 97, (2, 9))
    torch.testing.assert_close(mha(tokens), gqa(tokens), rtol=1e-4, atol=1e-4)


# --- causality --------------------------------------------------------------------------------


def test_causal_future_tokens_do_not_change_earlier_logits() -> None:
    model = build(tiny_args())
    tokens = torch.randint(0, 97, (2, 12))
    changed = tokens.clone()
    changed[:, 7] = (tokens[:, 7] + 1) % 97
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 7:], b[:, 7:], atol=1e-3)  # the change does propagate


def test_logits_of_a_prefix_equal_logits_of_the_prefix_alone() -> None:
    model = build(tiny_args())
    tokens = torch.randint(0, 97, (1, 16))
    with torch.no_grad():
        full, prefix = model(tokens), model(tokens[:, :6])
    torch.testing.assert_close(full[:, :6], prefix, rtol=1e-5, atol=1e-5)


# --- RoPE -------------------------------------------------------------------------------------


def test_rope_tables_shape_and_position_zero() -> None:
    table = rope_tables(16, 10, 10000.0)
    assert table.shape == (10, 8, 2)
    torch.testing.assert_close(table[0, :, 0], torch.ones(8))  # cos 0
    torch.testing.assert_close(table[0, :, 1], torch.zeros(8))  # sin 0
    # The first pair rotates by one radian per position; the frequencies fall from there.
    torch.testing.assert_close(table[3, 0, 0], torch.tensor(math.cos(3.0)))
    assert (table[1, 1:, 1] < table[1, :-1, 1]).all()


def test_rope_preserves_norms() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 10, 3, 16)
    rotated = apply_rope(x, rope_tables(16, 10, 10000.0))
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rotated[:, 0], x[:, 0])  # position 0 is not rotated
    assert not torch.allclose(rotated[:, 1:], x[:, 1:], atol=1e-3)


def test_rope_scores_depend_only_on_relative_position() -> None:
    torch.manual_seed(0)
    seq, head_dim = 24, 16
    table = rope_tables(head_dim, seq, 10000.0)
    q = torch.randn(head_dim).expand(1, seq, 1, head_dim)
    k = torch.randn(head_dim).expand(1, seq, 1, head_dim)
    rq, rk = apply_rope(q, table)[0, :, 0], apply_rope(k, table)[0, :, 0]
    scores = rq @ rk.T  # scores[m, n] = <q at m, k at n>
    for offset in (0, 1, 5, -3):
        diagonal = torch.diagonal(scores, offset=offset)
        torch.testing.assert_close(diagonal, diagonal[:1].expand_as(diagonal), rtol=0, atol=1e-4)
    assert not torch.isclose(scores[0, 0], scores[0, 5], atol=1e-3)


# --- initialization ---------------------------------------------------------------------------


def test_init_is_deterministic_for_a_seed() -> None:
    a, b = build(tiny_args(), seed=3), build(tiny_args(), seed=3)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name


def test_different_seeds_give_different_weights() -> None:
    a, b = build(tiny_args(), seed=0), build(tiny_args(), seed=1)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        if name.endswith("norm.weight"):
            assert torch.equal(pa, torch.ones_like(pa)) and torch.equal(pb, pa)
        else:
            assert not torch.equal(pa, pb), name


def test_init_ignores_global_rng_and_previous_values() -> None:
    torch.manual_seed(123)
    a = build(tiny_args())
    torch.manual_seed(456)
    b = Transformer(tiny_args())
    with torch.no_grad():
        for p in b.parameters():
            p.fill_(7.0)
    init_weights(b, 0)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name


def test_each_weight_depends_only_on_its_name_not_construction_order() -> None:
    """Layers shared by a 2- and a 3-layer model start identical (residual-branch outputs are
    scaled by 1/sqrt(2 * n_layers), so those differ by exactly that factor)."""
    two, three = build(tiny_args(n_layers=2)), build(tiny_args(n_layers=3))
    params3 = dict(three.named_parameters())
    ratio = math.sqrt(2 * 3) / math.sqrt(2 * 2)
    for name, p2 in two.named_parameters():
        p3 = params3[name]
        if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            torch.testing.assert_close(p2, p3 * ratio, rtol=1e-5, atol=1e-7)
        else:
            assert torch.equal(p2, p3), name
    # Generating values one by one in reverse order gives the same weights.
    names = [n for n, _ in three.named_parameters()]
    for name in reversed(names):
        rule = LLAMA.init_rule(three.args, name)
        value = full_value(rule, 0, name, tuple(params3[name].shape))
        assert torch.equal(value, params3[name]), name


def test_init_statistics() -> None:
    args = tiny_args(dim=256, n_layers=4, vocab_size=512)
    model = build(args)
    params = dict(model.named_parameters())
    assert params["tok_embeddings.weight"].std().item() == pytest.approx(1.0, rel=0.05)
    assert params["output.weight"].std().item() == pytest.approx(256**-0.5, rel=0.05)
    wq = params["layers.0.attention.wq.weight"]
    assert wq.std().item() == pytest.approx(0.02 * 0.9866, rel=0.05)  # truncated at 3 sigma
    assert wq.abs().max().item() <= 3 * 0.02 + 1e-7
    wo = params["layers.0.attention.wo.weight"]
    assert wo.std().item() == pytest.approx(0.02 / math.sqrt(8) * 0.9866, rel=0.05)


def test_init_recomputes_rope_after_meta_construction() -> None:
    args = tiny_args()
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_buffers()
    init_weights(model, 0)
    reference = build(args)
    torch.testing.assert_close(model.rope, rope_tables(args.head_dim, args.max_seq_len, 5e5))
    tokens = torch.randint(0, 97, (1, 8))
    assert torch.equal(model(tokens), reference(tokens))


# --- tied embeddings --------------------------------------------------------------------------


def test_tied_embeddings_share_storage_and_count_once() -> None:
    tied = build(tiny_args(tie_embeddings=True))
    untied = build(tiny_args(tie_embeddings=False))
    assert tied.output.weight is tied.tok_embeddings.weight
    assert tied.output.weight.data_ptr() == tied.tok_embeddings.weight.data_ptr()
    assert count_params(untied) - count_params(tied) == 97 * 64
    assert count_params(tied) == expected_params(tied.args)
    assert "output.weight" not in dict(tied.named_parameters())
    assert tied.tok_embeddings.weight.std().item() == pytest.approx(64**-0.5, rel=0.1)
    # One gradient, accumulated from both uses.
    tied(torch.randint(0, 97, (1, 8))).sum().backward()
    assert tied.tok_embeddings.weight.grad is not None


# --- FLOPs ------------------------------------------------------------------------------------


def test_flops_per_token_hand_computed() -> None:
    args = tiny_args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100, multiple_of=32)
    assert args.ffn_hidden_dim == 192  # int(8 * 64 / 3) = 170, rounded up to 32
    seq = 128
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 192  # wq, wo, wk, wv, w1, w2, w3
    matmul = 2 * per_layer + 100 * 64  # + output projection
    assert flops_per_token(args, seq) == 6 * matmul + 6 * 2 * 64 * seq


@pytest.mark.parametrize("tie", [False, True])
def test_flops_matmul_term_counts_every_linear_weight_once(tie: bool) -> None:
    args = tiny_args(tie_embeddings=tie)
    model = Transformer(args)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert flops_per_token(args, seq_len=0) == 6 * linear


# --- model_args and shape validation -----------------------------------------------------------


def test_model_args_applies_only_set_overrides() -> None:
    args = model_args("debugmodel", 4096, 128, dim=128, n_layers=None, rope_theta=1e4)
    base = FLAVORS["debugmodel"]
    assert (args.dim, args.n_layers, args.rope_theta) == (128, base.n_layers, 1e4)
    assert (args.vocab_size, args.max_seq_len) == (4096, 128)
    assert FLAVORS["debugmodel"].dim == 256  # the preset itself is untouched


def test_model_overrides_from_config_reach_the_model() -> None:
    from titanlite.assembly import build_model_args

    cfg = load_config(
        [
            "--model.n_layers=1",
            "--model.n_kv_heads=8",
            "--model.tie_embeddings",
            "--training.seq_len=64",
        ]
    )
    _, args = build_model_args(cfg, 4096)
    assert (args.n_layers, args.kv_heads, args.tie_embeddings, args.max_seq_len) == (1, 8, True, 64)


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        ({"dim": 250}, ("dim 250", "n_heads 8")),
        ({"n_kv_heads": 3}, ("n_heads 8", "n_kv_heads 3")),
        ({"dim": 24, "n_heads": 8}, ("head_dim 3",)),
    ],
)
def test_invalid_shapes_raise_value_error_naming_fields(
    overrides: dict[str, int], names: tuple[str, ...]
) -> None:
    with pytest.raises(ValueError) as info:
        model_args("debugmodel", 4096, 128, **overrides)
    for name in names:
        assert name in str(info.value)


def test_missing_vocab_size_is_rejected() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        Transformer(ModelArgs(dim=64, n_layers=1, n_heads=4))


def test_unknown_flavor() -> None:
    with pytest.raises(KeyError):
        model_args("7B", 4096, 128)


# --- learning ---------------------------------------------------------------------------------


def test_a_few_optimizer_steps_reduce_the_loss() -> None:
    torch.manual_seed(0)
    model = build(tiny_args())
    cfg = load_config(["--optimizer.lr=3e-3", "--optimizer.weight_decay=0.0"])
    optimizer = build_optimizer(model, cfg.optimizer, torch.device("cpu"))[0]
    tokens = torch.randint(0, 97, (4, 17))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    losses = []
    for _ in range(12):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(97), rel=0.3)  # starts near uniform
    assert losses[-1] < 0.8 * losses[0]
    assert all(math.isfinite(v) for v in losses)


def test_tied_embeddings_stay_tied_when_materialized_from_meta() -> None:
    args = model_args("debugmodel", 512, 32, tie_embeddings=True)
    with torch.device("meta"):
        model = Transformer(args)
    materialize(model, LLAMA, args, "cpu", seed=0)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.device.type == "cpu"
    assert count_params(model) == sum(p.numel() for p in model.parameters())
