"""Data-parallel scenarios for tests/test_ddp.py, run on every rank of a tests/pool.py pool.

Each scenario is a function ``scenario(rank, world)`` that runs on every rank of the pool's gloo
default process group and raises (usually AssertionError) when the engine misbehaves. Models
and comparison helpers are in tests/ddp_models.py.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F
from ddp_models import (
    MLP,
    TINY_MB,
    Branchy,
    Stack,
    TiedLM,
    TwoBranches,
    UsedTwice,
    assert_close,
    check_parity,
    global_batch,
    grads,
    grads_are_bucket_views,
    local_slice,
    make_optimizer,
    mse_grads_match,
    params,
    same_on_all_ranks,
    torch_ddp,
)
from torch import nn

from titanlite.parallel.ddp import BucketedDDP, GradBucket, allreduce_hook, bf16_compress_hook


def parity_tiny_buckets_sgd(rank: int, world: int) -> None:
    check_parity(rank, world, cap=TINY_MB, view=True, optim="sgd")


def parity_default_buckets_adamw(rank: int, world: int) -> None:
    check_parity(rank, world, cap=25.0, view=True, optim="adamw")


def parity_no_bucket_view(rank: int, world: int) -> None:
    check_parity(rank, world, cap=TINY_MB, view=False, optim="adamw", iters=3)


def no_sync_accumulation(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ours = BucketedDDP(MLP(), bucket_cap_mb=TINY_MB, first_bucket_cap_mb=TINY_MB)
    reference = copy.deepcopy(ours.module)
    theirs_module = copy.deepcopy(ours.module)
    theirs = torch_ddp(theirs_module, bucket_cap_mb=TINY_MB)
    opts = [make_optimizer("sgd", m) for m in (ours, reference, theirs_module)]
    micro = 3
    for cycle in range(3):
        for opt in opts:
            opt.zero_grad(set_to_none=cycle % 2 == 0)
        for m in range(micro + 1):
            x, y = global_batch(10 * cycle + m)
            xl, yl = local_slice(x, rank, world), local_slice(y, rank, world)
            F.mse_loss(reference(x), y).backward()
            if m < micro:
                with ours.no_sync():
                    loss = F.mse_loss(ours(xl), yl)
                loss.backward()  # outside the context on purpose: the forward decides
                with theirs.no_sync():
                    F.mse_loss(theirs(xl), yl).backward()
                w = ours.module.fc1.weight.grad
                assert not same_on_all_ranks(w), "no_sync still communicated"
                assert_close(grads(ours), grads(theirs_module), f"cycle {cycle} micro {m} local")
            else:
                F.mse_loss(ours(xl), yl).backward()
                F.mse_loss(theirs(xl), yl).backward()
        assert_close(grads(ours), grads(reference), f"cycle {cycle} accumulated vs single")
        assert_close(grads(ours), grads(theirs_module), f"cycle {cycle} accumulated vs torch")
        grads_are_bucket_views(ours)
        for opt in opts:
            opt.step()
        assert_close(params(ours), params(reference), f"cycle {cycle} params")


def tied_weights(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ours = BucketedDDP(TiedLM(), bucket_cap_mb=TINY_MB, first_bucket_cap_mb=TINY_MB)
    names = [n for bucket in ours.bucket_parameter_names() for n in bucket]
    assert sorted(names) == ["emb.weight", "mid.bias", "mid.weight"], names
    reference = copy.deepcopy(ours.module)
    theirs_module = copy.deepcopy(ours.module)
    theirs = torch_ddp(theirs_module, bucket_cap_mb=TINY_MB)
    for it in range(3):
        for m in (ours, reference, theirs_module):
            m.zero_grad()
        g = torch.Generator().manual_seed(it)
        tokens = torch.randint(0, 24, (8, 5), generator=g)
        targets = torch.randint(0, 24, (8, 5), generator=g)
        tl, yl = local_slice(tokens, rank, world), local_slice(targets, rank, world)
        F.cross_entropy(ours(tl).flatten(0, 1), yl.flatten()).backward()
        F.cross_entropy(theirs(tl).flatten(0, 1), yl.flatten()).backward()
        F.cross_entropy(reference(tokens).flatten(0, 1), targets.flatten()).backward()
        assert_close(grads(ours), grads(reference), f"iter {it} tied vs single")
        assert_close(grads(ours), grads(theirs_module), f"iter {it} tied vs torch")
        assert ours.module.out.weight.grad is ours.module.emb.weight.grad


def _branch_flag(rank: int, it: int) -> bool:
    return (rank + it) % 2 == 0


def unused_parameters(rank: int, world: int) -> None:
    """``never`` is unused everywhere; ``branch`` is used by some ranks only, varying by step."""
    torch.manual_seed(0)
    ours = BucketedDDP(
        Branchy(), bucket_cap_mb=TINY_MB, first_bucket_cap_mb=TINY_MB, find_unused_parameters=True
    )
    reference = copy.deepcopy(ours.module)
    theirs_module = copy.deepcopy(ours.module)
    theirs = torch_ddp(theirs_module, bucket_cap_mb=TINY_MB, find_unused_parameters=True)
    opts = [make_optimizer("sgd", m) for m in (ours, reference, theirs_module)]
    for it in range(4):
        for opt in opts:
            opt.zero_grad(set_to_none=it != 2)
        x, y = global_batch(it)
        use = _branch_flag(rank, it)
        xl, yl = local_slice(x, rank, world), local_slice(y, rank, world)
        F.mse_loss(ours(xl, use_branch=use), yl).backward()
        F.mse_loss(theirs(xl, use_branch=use), yl).backward()
        total = sum(
            F.mse_loss(
                reference(local_slice(x, r, world), use_branch=_branch_flag(r, it)),
                local_slice(y, r, world),
            )
            for r in range(world)
        )
        (total / world).backward()
        got = grads(ours)
        if it != 2:
            assert got["never.weight"] is None, "a parameter unused on every rank got a gradient"
        assert_close(got, grads(reference), f"iter {it} unused vs single")
        assert_close(got, grads(theirs_module), f"iter {it} unused vs torch")
        for opt in opts:
            opt.step()
        assert_close(params(ours), params(reference), f"iter {it} params")


def unused_without_flag_is_an_error(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ours = BucketedDDP(Branchy(), bucket_cap_mb=TINY_MB, first_bucket_cap_mb=TINY_MB)
    x, y = global_batch(0)
    F.mse_loss(ours(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
    try:
        ours(local_slice(x, rank, world))
    except RuntimeError as err:
        message = str(err)
        assert "never.weight" in message and "never.bias" in message, message
        assert "find_unused_parameters=True" in message, message
        assert "fc1.weight" not in message, message
    else:
        raise AssertionError("a parameter without gradient did not raise at the next forward")


def parameter_used_twice(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ours = BucketedDDP(UsedTwice(), bucket_cap_mb=TINY_MB, first_bucket_cap_mb=TINY_MB)
    reference = copy.deepcopy(ours.module)
    theirs_module = copy.deepcopy(ours.module)
    theirs = torch_ddp(theirs_module, bucket_cap_mb=TINY_MB)
    mse_grads_match(ours, reference, theirs_module, theirs, rank, world, "used twice")


def activation_checkpointing(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ours = BucketedDDP(Stack(checkpointed=True), bucket_cap_mb=TINY_MB, first_bucket_cap_mb=TINY_MB)
    reference = Stack(checkpointed=False)
    reference.load_state_dict(ours.state_dict())
    theirs_module = copy.deepcopy(ours.module)
    theirs = torch_ddp(theirs_module, bucket_cap_mb=TINY_MB)
    mse_grads_match(ours, reference, theirs_module, theirs, rank, world, "checkpointed")


def shape_mismatch_is_an_error(rank: int, world: int) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3 if rank == 0 else 5))
    try:
        BucketedDDP(model)
    except RuntimeError as err:
        assert "'1.weight'" in str(err), str(err)
    else:
        raise AssertionError("mismatched parameter shapes were accepted")


def buffers_are_broadcast(rank: int, world: int) -> None:
    torch.manual_seed(rank)
    module = MLP()
    module.scale.fill_(float(rank + 1))
    ours = BucketedDDP(module)
    assert torch.equal(ours.module.scale, torch.ones(32)), "buffers not broadcast at construction"
    ours.module.scale.fill_(float(rank + 5))
    with torch.no_grad():
        ours(torch.randn(2, 8))
    assert torch.equal(ours.module.scale, torch.full((32,), 5.0)), "buffers not synced in forward"
    quiet = BucketedDDP(MLP(), broadcast_buffers=False)
    quiet.module.scale.fill_(float(rank + 5))
    with torch.no_grad():
        quiet(torch.randn(2, 8))
    assert quiet.module.scale[0].item() == rank + 5


def overlap_is_real(rank: int, world: int) -> None:
    torch.manual_seed(0)
    deep = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(8)])
    ours = BucketedDDP(deep, bucket_cap_mb=TINY_MB, first_bucket_cap_mb=TINY_MB)
    for _ in range(3):
        ours.zero_grad()
        ours(torch.randn(128, 256)).square().mean().backward()
        stats = ours.last_iteration_stats()
        assert stats is not None
        launches = stats.bucket_launch_s
        assert len(launches) == len(ours.bucket_buffers()) >= 16
        assert all(t is not None for t in launches) and launches == sorted(launches)
        assert all(t is not None for t in stats.bucket_done_s)
        assert stats.backward_start_s <= launches[0] < stats.backward_end_s <= stats.finished_s
    early = stats.launched_before_backward_end()
    assert early >= len(launches) // 2, f"only {early} of {len(launches)} launched during backward"


def comm_hooks(rank: int, world: int) -> None:
    torch.manual_seed(0)
    exact = BucketedDDP(MLP(), bucket_cap_mb=TINY_MB, first_bucket_cap_mb=TINY_MB)
    compressed = BucketedDDP(
        copy.deepcopy(exact.module), bucket_cap_mb=TINY_MB, first_bucket_cap_mb=TINY_MB
    )
    compressed.register_comm_hook(None, bf16_compress_hook)
    calls: list[int] = []

    def counting_hook(state: list[int], bucket: GradBucket) -> torch.futures.Future:
        state.append(bucket.index)
        return allreduce_hook(None, bucket)

    hooked = BucketedDDP(
        copy.deepcopy(exact.module), bucket_cap_mb=TINY_MB, first_bucket_cap_mb=TINY_MB
    )
    hooked.register_comm_hook(calls, counting_hook)
    for it in range(2):
        calls.clear()
        x, y = global_batch(it)
        xl, yl = local_slice(x, rank, world), local_slice(y, rank, world)
        for m in (exact, compressed, hooked):
            m.zero_grad()
            F.mse_loss(m(xl), yl).backward()
        assert calls == list(range(len(hooked.bucket_buffers()))), calls
        assert_close(grads(hooked), grads(exact), f"iter {it} allreduce_hook")
        want, got = grads(exact), grads(compressed)
        differs = False
        for name, g in got.items():
            scale = want[name].abs().max().item()
            torch.testing.assert_close(g, want[name], atol=1e-2 * scale, rtol=1e-2)
            differs |= not torch.equal(g, want[name])
        assert differs, "bf16 hook gave bit-identical gradients: was it called?"
        grads_are_bucket_views(compressed)


def compiled_blocks(rank: int, world: int) -> None:
    torch.manual_seed(0)
    module = Stack(depth=2)
    reference = copy.deepcopy(module)
    for block in module.blocks:
        block.compile()
    ours = BucketedDDP(module, bucket_cap_mb=TINY_MB, first_bucket_cap_mb=TINY_MB)
    for it in range(2):
        for m in (ours, reference):
            m.zero_grad()
        x, y = global_batch(it)
        F.mse_loss(ours(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        F.mse_loss(reference(x), y).backward()
        assert_close(grads(ours), grads(reference), f"iter {it} compiled vs single", atol=1e-5)


def dtensor_tensor_parallel(rank: int, world: int) -> None:
    """dp=2 x tp=2: the engine reduces local shards over the dp_replicate group only."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    class TwoLayer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(8, 16)
            self.down = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(torch.tanh(self.up(x)))

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "tp"))
    torch.manual_seed(0)
    reference = TwoLayer()
    model = copy.deepcopy(reference)
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    ours = BucketedDDP(
        model,
        process_group=mesh["dp_replicate"].get_group(),
        bucket_cap_mb=0.0001,
        first_bucket_cap_mb=0.0001,
    )
    assert len(ours.bucket_buffers()) == 4, ours.bucket_parameter_names()
    dp_rank, dp_size = mesh.get_local_rank("dp_replicate"), 2
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, foreach=False) for m in (ours, reference)]
    for it in range(3):
        for opt in opts:
            opt.zero_grad(set_to_none=it % 2 == 0)
        x, y = global_batch(it)
        xl, yl = local_slice(x, dp_rank, dp_size), local_slice(y, dp_rank, dp_size)
        F.mse_loss(ours(xl), yl).backward()
        F.mse_loss(reference(x), y).backward()
        got = {n: p.grad.full_tensor() for n, p in ours.named_parameters()}
        assert_close(got, grads(reference), f"iter {it} dtensor grads vs single")
        grads_are_bucket_views(ours)
        for opt in opts:
            opt.step()
        got = {n: p.full_tensor() for n, p in ours.named_parameters()}
        assert_close(got, params(reference), f"iter {it} dtensor params vs single")
    assert ours.buckets_rebuilt


def deliberate_failure(rank: int, world: int) -> None:
    """Proves that the harness reports failures (checked by test_worker_failures_reach_pytest)."""
    raise AssertionError(f"deliberate failure 1234 on rank {rank}")


def rebuild_takes_first_rank_order(rank: int, world: int) -> None:
    """Ranks see different gradient orders; all must adopt rank 0's and stay correct."""
    torch.manual_seed(0)
    ours = BucketedDDP(TwoBranches(), bucket_cap_mb=TINY_MB, first_bucket_cap_mb=TINY_MB)
    reference = copy.deepcopy(ours.module)
    initial = ours.bucket_parameter_names()
    for it in range(3):
        for m in (ours, reference):
            m.zero_grad()
        x, y = global_batch(it, d_out=4)
        F.mse_loss(
            ours(local_slice(x, rank, world), a_first=rank != 0), local_slice(y, rank, world)
        ).backward()
        F.mse_loss(reference(x, a_first=True), y).backward()
        assert_close(grads(ours), grads(reference), f"iter {it} after rebuild")
    rebuilt = ours.bucket_parameter_names()
    assert ours.buckets_rebuilt and rebuilt != initial, (initial, rebuilt)
    # Backward reaches the branch computed last first: on rank 0 that is a, while the
    # initial (reverse registration) order starts with b and the other ranks see b first.
    flat = [n for bucket in rebuilt for n in bucket]
    assert flat.index("a.weight") < flat.index("b.weight"), flat
    order = torch.tensor([["a.weight", "a.bias", "b.weight", "b.bias"].index(n) for n in flat])
    assert same_on_all_ranks(order), "ranks rebuilt different bucket orders"


def unused_parameters_with_no_sync(rank: int, world: int) -> None:
    """``branch`` gets gradients only in a no_sync micro-step, on rank 0 only."""
    torch.manual_seed(0)
    ours = BucketedDDP(
        Branchy(), bucket_cap_mb=TINY_MB, first_bucket_cap_mb=TINY_MB, find_unused_parameters=True
    )
    reference = copy.deepcopy(ours.module)
    theirs_module = copy.deepcopy(ours.module)
    theirs = torch_ddp(theirs_module, bucket_cap_mb=TINY_MB, find_unused_parameters=True)
    for cycle in range(2):
        for m in (ours, reference, theirs_module):
            m.zero_grad()
        for micro, branch_on_rank0 in enumerate([True, False]):
            x, y = global_batch(10 * cycle + micro)
            xl, yl = local_slice(x, rank, world), local_slice(y, rank, world)
            use = branch_on_rank0 and rank == 0
            sync = micro == 1
            for model in (ours, theirs):
                context = contextlib.nullcontext() if sync else model.no_sync()
                with context:
                    F.mse_loss(model(xl, use_branch=use), yl).backward()
            total = sum(
                F.mse_loss(
                    reference(local_slice(x, r, world), use_branch=branch_on_rank0 and r == 0),
                    local_slice(y, r, world),
                )
                for r in range(world)
            )
            (total / world).backward()
        got = grads(ours)
        assert got["never.weight"] is None
        assert_close(got, grads(reference), f"cycle {cycle} vs single")
        assert_close(got, grads(theirs_module), f"cycle {cycle} vs torch")
