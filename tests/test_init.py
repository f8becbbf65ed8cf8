"""Counter-based initialization: any block of a parameter, computed on its own, equals the same
block of the whole tensor bit for bit, and the values follow the +-3 std truncated normal."""

from __future__ import annotations

import ast
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titanlite.models import init
from titanlite.models.init import (
    fill_local_,
    full_value,
    stream_key,
    trunc_normal_from_uniform,
    uniform,
)
from titanlite.models.spec import InitRule

RULE = InitRule.normal(0.02)
WQ = "layers.0.attention.wq.weight"


def block(shape, offset, global_shape, *, rule=RULE, seed=0, name="w", dtype=torch.float32):
    out = torch.empty(shape, dtype=dtype)
    return fill_local_(
        out, rule, seed, name, global_shape=tuple(global_shape), global_offset=tuple(offset)
    )


def _splitmix_reference(key: int, i: int) -> float:
    """The hash in plain Python integers (unbounded, so shifts are logical and products are
    reduced mod 2**64 by hand): pins the torch int64 emulation down."""
    mask = (1 << 64) - 1
    z = (key + i * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    z ^= z >> 31
    return ((z >> 11) | 1) / 2**53


# --- layout independence ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("global_shape", "offset", "shape"),
    [
        ((64, 48), (0, 0), (64, 48)),  # the whole tensor
        ((64, 48), (17, 5), (20, 30)),  # a 2-D block in the middle: rows and columns offset
        ((64, 48), (63, 47), (1, 1)),  # the last element
        ((64, 48), (10, 0), (0, 48)),  # an empty block (a rank with no rows)
        ((1000,), (333,), (334,)),  # 1-D
        ((1000,), (1000,), (0,)),  # an empty 1-D block at the end
        ((6, 10, 7), (2, 3, 1), (3, 5, 4)),  # 3-D
    ],
)
def test_block_equals_slice_of_full_tensor(global_shape, offset, shape) -> None:
    full = full_value(RULE, 0, "w", global_shape)
    got = block(shape, offset, global_shape)
    index = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
    assert got.shape == full[index].shape
    assert torch.equal(got, full[index])


def test_uneven_shards_reassemble_to_full_tensor() -> None:
    """FSDP-style row shards (torch.chunk sizes, one rank empty) and TP column shards."""
    global_shape = (5, 37)
    full = full_value(RULE, 3, WQ, global_shape)
    rows = [len(c) for c in torch.arange(5).chunk(4)] + [0]  # 2, 2, 1, then an empty rank
    assert sum(rows) == 5
    row_shards, start = [], 0
    for n in rows:
        row_shards.append(block((n, 37), (start, 0), global_shape, seed=3, name=WQ))
        start += n
    assert torch.equal(torch.cat(row_shards), full)
    cols = [13, 13, 11]
    col_shards, start = [], 0
    for n in cols:
        col_shards.append(block((5, n), (0, start), global_shape, seed=3, name=WQ))
        start += n
    assert torch.equal(torch.cat(col_shards, dim=1), full)


def test_zero_dim_tensor() -> None:
    out = block((), (), ())
    assert out.shape == ()
    key = stream_key(0, "w")
    expected = trunc_normal_from_uniform(uniform(key, torch.tensor([0])), RULE.std).float()
    assert torch.equal(out.view(1), expected)


@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
def test_chunking_does_not_change_values(monkeypatch, chunk) -> None:
    """Tiny chunks: many chunks per row, a row split across chunks (rows longer than a
    chunk go down a dimension), and the last chunk shorter than the rest."""
    cases = [((9, 11), (1, 2), (7, 8)), ((3, 4, 9), (0, 1, 2), (3, 3, 6)), ((301,), (5,), (290,))]
    expected = [block(s, o, g) for g, o, s in cases]
    monkeypatch.setattr(init, "CHUNK_ELEMENTS", chunk)
    for (g, o, s), want in zip(cases, expected, strict=True):
        assert torch.equal(block(s, o, g), want)


def test_fill_equals_public_pipeline() -> None:
    """fill_local_ is uniform -> trunc_normal_from_uniform -> float32, index by index."""
    global_shape = (7, 9)
    key = stream_key(11, "tok_embeddings.weight")
    u = uniform(key, torch.arange(63))
    expected = trunc_normal_from_uniform(u, 0.5).float().view(global_shape)
    got = full_value(InitRule.normal(0.5), 11, "tok_embeddings.weight", global_shape)
    assert torch.equal(got, expected)


def test_decay_rules_draw_per_head_values_in_the_published_ranges() -> None:
    """Gated DeltaNet's A_log = log A, A uniform in (0, 16), and dt_bias = softplus^-1(dt),
    dt log-uniform in [0.001, 0.1]: per element from its own uniform (so any shard of the
    heads gets the same values), spread over the range rather than constant."""
    heads = 4096
    key_a, key_dt = stream_key(5, "a.A_log"), stream_key(5, "a.dt_bias")
    a_log = full_value(InitRule.log_uniform(0.0, 16.0), 5, "a.A_log", (heads,))
    u = uniform(key_a, torch.arange(heads))
    assert torch.equal(a_log, (16 * u).log().float())
    assert a_log.exp().max() < 16 and 7.5 < a_log.exp().mean() < 8.5
    dt_bias = full_value(InitRule.softplus_inverse(0.001, 0.1), 5, "a.dt_bias", (heads,))
    dt = torch.nn.functional.softplus(dt_bias.double())
    log_dt = math.log(0.001) + uniform(key_dt, torch.arange(heads)) * math.log(100)
    torch.testing.assert_close(dt.log(), log_dt, rtol=0, atol=1e-6)
    assert dt.min() >= 0.001 * (1 - 1e-6) and dt.max() <= 0.1 * (1 + 1e-6)
    assert abs(dt.log().mean() - math.log(0.01)) < 0.1  # the middle of the log range
    shards = [
        block(
            (1024,),
            (i * 1024,),
            (heads,),
            rule=InitRule.softplus_inverse(0.001, 0.1),
            seed=5,
            name="a.dt_bias",
        )
        for i in range(4)
    ]
    assert torch.equal(torch.cat(shards), dt_bias)


# --- the hash ---------------------------------------------------------------------------------


def test_uniform_matches_plain_integer_reference() -> None:
    key = stream_key(1234, "output.weight")
    indices = [0, 1, 2, 3, 1000, 12345, 2**31 - 1, 2**31, 2**32 + 5, 2**40 + 7, 2**62 + 1]
    got = uniform(key, torch.tensor(indices, dtype=torch.int64)).tolist()
    assert got == [_splitmix_reference(key, i) for i in indices]


def test_uniform_is_strictly_inside_unit_interval() -> None:
    u = uniform(stream_key(0, "w"), torch.arange(1 << 20))
    assert u.dtype == torch.float64
    assert bool((u > 0).all()) and bool((u < 1).all())
    # The extreme odd integers still map inside (0, 1) exactly.
    assert 0 < 1 / 2**53 and (2**53 - 1) / 2**53 < 1


def test_stream_key_is_stable_and_63_bit() -> None:
    keys = {stream_key(s, n) for s in (0, 1, -1, 2**40) for n in ("a", "b", "layers.0.w", "é")}
    assert len(keys) == 16
    assert all(0 <= k < 2**63 for k in keys)
    assert stream_key(0, "a") == stream_key(0, "a")


def test_names_and_seeds_give_different_values_same_give_identical() -> None:
    shape = (64, 64)
    a = full_value(RULE, 0, "layers.0.w", shape)
    assert torch.equal(a, full_value(RULE, 0, "layers.0.w", shape))
    for seed, name in [(0, "layers.1.w"), (1, "layers.0.w"), (0, "layers.0.w ")]:
        other = full_value(RULE, seed, name, shape)
        # Independent streams: essentially no element coincides.
        assert (a == other).float().mean().item() < 0.01


def test_cross_process_values_are_identical(tmp_path: Path) -> None:
    """Another interpreter, with another hash seed, computes the same bytes."""
    code = (
        "import sys, torch\n"
        "from titanlite.models.init import full_value\n"
        "from titanlite.models.spec import InitRule\n"
        "x = full_value(InitRule.normal(0.02), 7, 'layers.3.feed_forward.w2.weight', (33, 17))\n"
        "sys.stdout.write(x.numpy().tobytes().hex())\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True
    )
    here = full_value(RULE, 7, "layers.3.feed_forward.w2.weight", (33, 17))
    assert bytes.fromhex(proc.stdout) == here.numpy().tobytes()


# --- dtypes, rules, errors --------------------------------------------------------------------


def test_bfloat16_is_float32_rounded() -> None:
    f32 = full_value(RULE, 5, "w", (128, 96))
    bf16 = full_value(RULE, 5, "w", (128, 96), dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16
    assert torch.equal(bf16, f32.to(torch.bfloat16))
    # float32 is the canonical precision: a float64 copy holds the same values.
    assert torch.equal(full_value(RULE, 5, "w", (128, 96), dtype=torch.float64), f32.double())


def test_constant_rule() -> None:
    out = block((3, 4), (1, 0), (8, 4), rule=InitRule.constant(1.0))
    assert torch.equal(out, torch.ones(3, 4))
    assert torch.equal(block((), (), (), rule=InitRule.constant(0.5)), torch.tensor(0.5))


def test_rejects_bad_blocks() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        fill_local_(torch.empty(4, 6).t(), RULE, 0, "w", global_shape=(6, 4), global_offset=(0, 0))
    with pytest.raises(ValueError, match="outside"):
        fill_local_(torch.empty(4, 6), RULE, 0, "w", global_shape=(8, 6), global_offset=(5, 0))
    with pytest.raises(ValueError, match="does not match"):
        fill_local_(torch.empty(4, 6), RULE, 0, "w", global_shape=(24,), global_offset=(0,))


def test_does_not_import_torch_distributed() -> None:
    tree = ast.parse(Path(init.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    assert "torch" in imported
    assert not any(m.startswith("torch.distributed") for m in imported)


# --- the distribution -------------------------------------------------------------------------


def _trunc_normal_cdf(x: torch.Tensor, std: float) -> torch.Tensor:
    lo = 0.5 * math.erfc(3 / math.sqrt(2))
    mass = math.erf(3 / math.sqrt(2))
    return (torch.special.ndtr(x.double() / std) - lo) / mass


def test_distribution_is_the_truncated_normal() -> None:
    std = 0.02
    n = 1 << 20
    x = full_value(InitRule.normal(std), 42, "layers.7.attention.wo.weight", (1024, 1024))
    x = x.double().view(-1)
    # Standard deviation of the normal cut at +-3: sqrt(1 - 2 * 3 * phi(3) / (Phi(3) - Phi(-3))).
    phi3 = math.exp(-4.5) / math.sqrt(2 * math.pi)
    expected_std = std * math.sqrt(1 - 6 * phi3 / math.erf(3 / math.sqrt(2)))
    assert expected_std / std == pytest.approx(0.9866, abs=1e-4)
    assert abs(x.mean().item()) < 5e-3 * std
    assert x.std().item() == pytest.approx(expected_std, rel=3e-3)
    assert x.abs().max().item() <= 3 * std
    assert x.abs().max().item() > 2.9 * std  # the tails are reached
    # Neighbours are uncorrelated: along a row, and down a column (lag = row length).
    z = (x - x.mean()) / x.std()
    assert abs((z[1:] * z[:-1]).mean().item()) < 5e-3
    assert abs((z[1024:] * z[:-1024]).mean().item()) < 5e-3
    # Kolmogorov-Smirnov distance to the truncated-normal CDF (~0.0009 expected at n = 2**20).
    cdf = _trunc_normal_cdf(x.sort().values, std)
    ranks = torch.arange(1, n + 1, dtype=torch.float64)
    ks = torch.maximum(ranks / n - cdf, cdf - (ranks - 1) / n).max().item()
    assert ks < 3e-3


def test_different_streams_are_uncorrelated() -> None:
    a = full_value(RULE, 0, "layers.0.w", (512, 512)).double().view(-1)
    b = full_value(RULE, 0, "layers.1.w", (512, 512)).double().view(-1)
    c = full_value(RULE, 1, "layers.0.w", (512, 512)).double().view(-1)
    for other in (b, c):
        corr = torch.corrcoef(torch.stack([a, other]))[0, 1].item()
        assert abs(corr) < 1e-2
