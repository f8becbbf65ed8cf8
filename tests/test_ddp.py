"""Tests of titanlite's bucketed data-parallel engine (titanlite/parallel/ddp/engine.py).

Single-process tests check bucket assignment and gradient views in a world of one. The slow
tests run scenarios (tests/ddp_scenarios.py) on the session's pools of 2 and 4 gloo ranks
(tests/pool.py), which later test modules reuse; a failing scenario shows every failing rank's
traceback.
"""

from __future__ import annotations

import ddp_models
import pytest
import torch
import torch.distributed as dist
from pool import ScenarioError, get_pool
from torch import nn

from titanlite.parallel.ddp import BucketedDDP
from titanlite.parallel.ddp.buckets import assign_buckets

KIB = 1024

# ----- bucket assignment (pure) -----------------------------------------------------------------


def test_assign_buckets_reverse_order_and_small_first_bucket() -> None:
    sizes = [400] * 6
    keys = ["f32"] * 6
    buckets = assign_buckets(sizes, keys, order=[5, 4, 3, 2, 1, 0], first_cap=400, cap=1000)
    assert buckets == [[5], [4, 3, 2], [1, 0]]


def test_assign_buckets_groups_by_dtype_and_device() -> None:
    sizes = [100, 100, 100, 100]
    keys = ["f32", "bf16", "f32", "bf16"]
    buckets = assign_buckets(sizes, keys, order=[3, 2, 1, 0], first_cap=10_000, cap=10_000)
    assert sorted(buckets) == [[2, 0], [3, 1]]
    assert buckets[0] == [3, 1]  # ordered by the first tensor each bucket expects ready


def test_assign_buckets_big_tensor_gets_its_own_bucket() -> None:
    sizes = [10, 10, 5000, 10, 10]
    buckets = assign_buckets(sizes, ["k"] * 5, order=[4, 3, 2, 1, 0], first_cap=15, cap=100)
    assert buckets == [[4, 3], [2], [1, 0]]


# ----- the engine in a world of one -------------------------------------------------------------


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory: pytest.TempPathFactory):
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    store = dist.FileStore(str(tmp_path_factory.mktemp("ddp") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)  # 1088 bytes of fp32
        self.b = nn.Linear(16, 16).double()
        self.big = nn.Linear(64, 64)  # 16.6 KB: larger than the cap below
        self.c = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x[:, :16])
        h = h + self.b(x[:, :16].double()).float()
        return self.c(self.big(torch.cat([h, h, h, h], dim=1)))


def test_buckets_follow_reverse_order_dtype_and_caps(world_of_one: None) -> None:
    torch.manual_seed(0)
    model = BucketedDDP(
        Mixed(), bucket_cap_mb=8 * KIB / 2**20, first_bucket_cap_mb=0.5 * KIB / 2**20
    )
    names = model.bucket_parameter_names()
    # Reverse order; per dtype a 512-byte first bucket, then 8 KiB ones; big.weight alone.
    assert names == [
        ["c.bias"],
        ["c.weight", "big.bias"],
        ["big.weight"],
        ["b.bias"],
        ["b.weight"],
        ["a.bias", "a.weight"],
    ]
    dtypes = [b.dtype for b in model.bucket_buffers()]
    assert dtypes == [torch.float32] * 3 + [torch.float64] * 2 + [torch.float32]


def test_grads_are_views_and_survive_set_to_none(world_of_one: None) -> None:
    torch.manual_seed(0)
    plain = Mixed()
    model = BucketedDDP(
        Mixed(), bucket_cap_mb=8 * KIB / 2**20, first_bucket_cap_mb=0.5 * KIB / 2**20
    )
    plain.load_state_dict(model.state_dict())
    x = torch.randn(4, 16)
    for set_to_none in (True, False, True):
        model.zero_grad(set_to_none=set_to_none)
        plain.zero_grad(set_to_none=set_to_none)
        model(x).square().sum().backward()
        plain(x).square().sum().backward()
        ddp_models.assert_close(ddp_models.grads(model), ddp_models.grads(plain), "world 1")
        ddp_models.grads_are_bucket_views(model)
    # The views are the buffers: writing a grad writes the bucket (no hidden copies).
    model.module.c.bias.grad.fill_(3.0)
    bucket = model.bucket_buffers()[model.bucket_parameter_names().index(["c.bias"])]
    assert torch.equal(bucket, torch.full_like(bucket, 3.0))


def test_state_dict_and_parameter_names_have_no_prefix(world_of_one: None) -> None:
    inner = Mixed()
    model = BucketedDDP(inner)
    assert list(model.state_dict()) == list(inner.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in inner.named_parameters()]
    assert model.big is inner.big  # attributes resolve on the wrapped module
    fresh = Mixed()
    model.load_state_dict(fresh.state_dict())
    assert torch.equal(inner.big.weight, fresh.big.weight)


def test_stats_and_missing_gradient_error_in_world_of_one(world_of_one: None) -> None:
    model = BucketedDDP(
        nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)),
        bucket_cap_mb=1e-5,
        first_bucket_cap_mb=1e-5,
    )
    model(torch.randn(2, 4)).sum().backward()
    stats = model.last_iteration_stats()
    assert stats is not None and len(stats.bucket_launch_s) == 4
    with torch.no_grad():
        model(torch.randn(2, 4))  # no backward expected: no error at the next forward
    model(torch.randn(2, 4))  # a synchronised forward whose output is dropped, then
    model.module[1](torch.randn(2, 4)).sum().backward()  # a backward that misses layer 0
    with pytest.raises(RuntimeError, match=r"0\.weight, 0\.bias"):
        model(torch.randn(2, 4))


# ----- real process groups ------------------------------------------------------------------------

WORLD2 = [
    "parity_tiny_buckets_sgd",
    "parity_default_buckets_adamw",
    "parity_no_bucket_view",
    "no_sync_accumulation",
    "tied_weights",
    "unused_parameters",
    "unused_parameters_with_no_sync",
    "unused_without_flag_is_an_error",
    "parameter_used_twice",
    "activation_checkpointing",
    "shape_mismatch_is_an_error",
    "buffers_are_broadcast",
    "overlap_is_real",
    "comm_hooks",
    "compiled_blocks",
    "rebuild_takes_first_rank_order",
]
WORLD4 = [
    "parity_tiny_buckets_sgd",
    "no_sync_accumulation",
    "unused_parameters",
    "shape_mismatch_is_an_error",
    "rebuild_takes_first_rank_order",
    "dtensor_tensor_parallel",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", WORLD2)
def test_two_ranks(name: str) -> None:
    get_pool(2).run(f"ddp_scenarios:{name}")


@pytest.mark.slow
@pytest.mark.parametrize("name", WORLD4)
def test_four_ranks(name: str) -> None:
    get_pool(4).run(f"ddp_scenarios:{name}")


@pytest.mark.slow
def test_worker_failures_reach_pytest() -> None:
    """The harness itself: a scenario failing on every rank comes back with each rank's
    message, and the pool stays up for the next test (tests/test_pool.py covers one-rank
    failures, hangs and crashes)."""
    pool = get_pool(2)
    with pytest.raises(ScenarioError) as failure:
        pool.run("ddp_scenarios:deliberate_failure")
    assert sorted(failure.value.tracebacks) == [0, 1]
    for rank, tb in failure.value.tracebacks.items():
        assert f"deliberate failure 1234 on rank {rank}" in tb and "Traceback" in tb
        assert f"deliberate failure 1234 on rank {rank}" in str(failure.value)
    assert pool.alive
