"""Context-parallel scenarios for tests/test_context.py, run on every rank of a tests/pool.py
pool (the cp group is the whole pool)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from titanlite.models.attention import CausalAttention
from titanlite.parallel.context.attention import ContextParallel


def attention_matches_full(
    rank: int, world: int, kv_heads: int, seq: int, masked: bool, documents: bool = False
) -> dict[str, float]:
    """This rank's queries against the whole sequence give the outputs and the gradients of
    queries, keys and values that full causal attention gives at this rank's positions;
    returns the largest absolute differences. ``masked``: the boolean-mask kernel other
    devices use instead of the CPU's two-part flash kernel. ``documents``: block-causal within
    documents whose boundaries fall inside and across the ranks' chunks."""
    torch.manual_seed(0)  # the same full tensors on every rank
    batch, heads, head_dim = 2, 4, 8
    q = torch.randn(batch, heads, seq, head_dim, dtype=torch.float64, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq, head_dim, dtype=torch.float64, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq, head_dim, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(batch, heads, seq, head_dim, dtype=torch.float64)
    mask, ids = None, None
    if documents:  # boundaries differ per sequence; some inside chunks, some on their edges
        starts = torch.zeros(batch, seq, dtype=torch.long)
        starts[0, [3, seq // 2, seq - 2]] = 1
        starts[1, [seq // 4]] = 1
        ids = starts.cumsum(1)
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        mask = (causal & (ids[:, :, None] == ids[:, None, :]))[:, None]
    full = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=kv_heads != heads
    )
    full.backward(upstream)

    context = ContextParallel(dist.group.WORLD, world, rank, masked=masked)
    mine = context.positions(seq // world, q.device)
    local = [t.detach()[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    out = context.attention(CausalAttention(), *local, documents=ids)
    out.backward(upstream[:, :, mine])
    diffs = {"out": (out - full.detach()[:, :, mine]).abs().max().item()}
    for name, tensor, piece in zip("qkv", (q, k, v), local, strict=True):
        diffs[f"grad_{name}"] = (piece.grad - tensor.grad[:, :, mine]).abs().max().item()
    # Together the ranks hold every position exactly once.
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    assert sorted(torch.cat(everyone).tolist()) == list(range(seq))
    return diffs


def hybrid_matches_full(rank: int, world: int, seq: int, documents: bool) -> dict[str, float]:
    """A Qwen3.5 hybrid (three Gated DeltaNet layers, one full-attention layer) on this
    rank's chunks, given the whole sequence's document ids, gives the logits at this rank's
    positions and (summed over ranks) the parameter gradients of one process; returns the
    largest differences relative to each tensor's largest element (the DeltaNet layers
    compute in float32 even in a float64 model, so these are float32 round-off) and the bytes
    the linear layers' split received against what gathering their keys and values would
    have."""
    from titanlite.models import get
    from titanlite.models.init import init_parameters
    from titanlite.models.qwen3_5.args import Qwen35Args
    from titanlite.models.qwen3_5.model import HybridDecoder
    from titanlite.parallel.context.attention import apply_cp
    from titanlite.parallel.context.recurrent import apply_linear_cp

    args = Qwen35Args(
        dim=32,
        n_layers=4,
        n_heads=2,
        n_kv_heads=1,
        head_dim=16,
        hidden_dim=48,
        linear_k_heads=2,
        linear_v_heads=4,
        linear_k_dim=8,
        linear_v_dim=6,
        chunk_size=4,
        vocab_size=64,
        max_seq_len=seq,
        rope_theta=10_000.0,
    )
    model = HybridDecoder(args)
    init_parameters(model, lambda name: get("qwen3_5").init_rule(args, name), 0)
    model.double()
    gen = torch.Generator().manual_seed(1)  # the same tensors on every rank
    with torch.no_grad():  # decays and norms off their starts, so a wrong state shows
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "A_log", "dt_bias")):
                p.copy_(torch.rand(p.shape, generator=gen, dtype=p.dtype) - 0.5)
    tokens = torch.randint(0, 64, (2, seq), generator=gen)
    upstream = torch.randn(2, seq, 64, generator=gen, dtype=torch.float64)
    ids = None
    if documents:  # inside chunks, on their edges (seq / 2 and the first chunk's end)
        c = seq // (2 * world)
        starts = torch.zeros(2, seq, dtype=torch.long)
        starts[0, sorted({1, c, seq // 2, seq - 2})] = 1
        starts[1, [seq // 4 + 1]] = 1
        ids = starts.cumsum(1)
    full = model(tokens, documents=ids)
    (full * upstream).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    context = ContextParallel(dist.group.WORLD, world, rank)
    apply_cp(model, context)
    split = apply_linear_cp(model, context)
    mine = context.positions(seq // world, tokens.device)
    logits = model(tokens[:, mine], positions=mine, documents=ids)
    (logits * upstream[:, mine]).sum().backward()
    worst = 0.0
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad)
        scale = grads[name].abs().max().item()
        worst = max(worst, (p.grad - grads[name]).abs().max().item() / scale)
    expected = full.detach()[:, mine]
    return {
        "out": ((logits - expected).abs().max() / expected.abs().max()).item(),
        "grads": worst,
        "received_bytes": split.received_bytes,
        "kv_bytes": split.kv_equivalent_bytes,
    }


def window_matches_full(
    rank: int, world: int, seq: int, cases: list[tuple[int, bool, bool]]
) -> list[dict[str, float | int | None]]:
    """Per case (window, documents, sinks): a windowed core (the masked one) on this rank's
    chunks, receiving only the keys its windows reach, against the same core over the whole
    sequence in one process (float64): the largest differences of the outputs at this
    rank's positions, of the gradients of queries, keys, values and sinks (summed over
    ranks), and of QK-clip's largest logits (max over ranks); and how many tokens this rank
    received (None: the layer gathered)."""
    from titanlite.models.attention import MaskedAttention

    results = []
    for window, documents, sinks in cases:
        torch.manual_seed(window)  # the same full tensors on every rank
        batch, heads, kv_heads, head_dim = 2, 4, 2, 8
        q, k, v = (
            torch.randn(batch, h, seq, head_dim, dtype=torch.float64, requires_grad=True)
            for h in (heads, kv_heads, kv_heads)
        )
        upstream = torch.randn(batch, heads, seq, head_dim, dtype=torch.float64)
        ids = None
        if documents:  # a boundary inside a chunk, one on a chunk's edge, one near the end
            starts = torch.zeros(batch, seq, dtype=torch.long)
            starts[0, [3, seq // 2, seq - 2]] = 1
            starts[1, [seq // 4 + 1]] = 1
            ids = starts.cumsum(1)
        core = MaskedAttention(window=window, sink_heads=heads if sinks else 0).double()
        if sinks:
            torch.nn.init.normal_(core.sinks)
        core.record_max_logits = True
        full = core(q, k, v, documents=ids)
        full.backward(upstream)
        full_logits, core.max_logits = core.max_logits, None
        full_sinks = None if core.sinks is None else core.sinks.grad.clone()
        core.zero_grad()

        context = ContextParallel(dist.group.WORLD, world, rank)
        context.windows.add(window)
        mine = context.positions(seq // world, q.device)
        plan = context.exchange(window, seq // world, q.device)
        local = [t.detach()[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
        core.sequence_split = context
        out = core(*local, documents=ids)
        out.backward(upstream[:, :, mine])
        dist.all_reduce(core.max_logits, op=dist.ReduceOp.MAX)
        diffs: dict[str, float | int | None] = {
            "out": (out - full.detach()[:, :, mine]).abs().max().item(),
            "max_logits": (core.max_logits - full_logits).abs().max().item(),
            "received": None if plan is None else sum(plan.recv_counts),
        }
        for name, tensor, piece in zip("qkv", (q, k, v), local, strict=True):
            diffs[f"grad_{name}"] = (piece.grad - tensor.grad[:, :, mine]).abs().max().item()
        if full_sinks is not None:
            dist.all_reduce(core.sinks.grad)
            diffs["grad_sinks"] = (core.sinks.grad - full_sinks).abs().max().item()
        results.append(diffs)
    return results
