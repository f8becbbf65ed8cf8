"""Tests of the multi-rank worker pool (tests/pool.py) that the process-group tests run on.

The scenarios are in this module (workers import it by name). All tests share the session's
pool of two ranks; the tests that hang or crash a rank check that the next call gets fresh
workers, which with the forkserver start takes well under a second.
"""

from __future__ import annotations

import logging
import os
import signal

import pytest
import torch
import torch.distributed as dist
from conftest import TEST_CACHE
from pool import ScenarioError, WorkerPool, get_pool
from torch.distributed import distributed_c10d

pytestmark = pytest.mark.slow

# ----- scenarios ----------------------------------------------------------------------------


def sum_of_ranks(rank: int, world: int, scale: float = 1.0) -> dict:
    t = torch.tensor([float(rank) * scale])
    dist.all_reduce(t)
    env = os.environ
    return {
        "rank": rank,
        "world": world,
        "sum": t.item(),
        "pid": os.getpid(),
        "env": [env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")],
        "offline": [
            env.get(k)
            for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "WANDB_MODE")
        ],
        "caches": [env.get("TITANLITE_CACHE_DIR"), env.get("HF_HOME")],
        "threads": torch.get_num_threads(),
        "group": (dist.get_rank(), dist.get_world_size(), dist.get_backend()),
    }


def fail_on(rank: int, world: int, bad: int) -> int:
    if rank == bad:
        raise AssertionError(f"deliberate failure 1234 on rank {rank}")
    return rank


def unpicklable(rank: int, world: int) -> object:
    return (lambda: None) if rank == 1 else rank


def wait_in_collective(rank: int, world: int) -> None:
    """Rank 0 waits in an all_reduce that the other ranks never join."""
    if rank == 0:
        dist.all_reduce(torch.zeros(1))


def fail_while_others_wait(rank: int, world: int) -> None:
    if rank == 1:
        raise RuntimeError("rank 1 gives up before the barrier")
    dist.barrier()


def crash(rank: int, world: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.barrier()


def destroy_default_group(rank: int, world: int) -> int:
    dist.destroy_process_group()
    return rank


def chatty(rank: int, world: int) -> None:
    """Logs through several loggers and reconfigures logging and signals like train.py might."""
    logging.getLogger("titanlite.somewhere").info("info from rank %d", rank)
    logging.getLogger("titanlite.somewhere").debug("debug is not captured")
    quiet = logging.getLogger("pool_test.no_propagation")
    quiet.propagate = False
    quiet.warning("warning that does not propagate")
    logging.basicConfig(level=logging.WARNING, force=True)  # drops root handlers, raises level
    logging.getLogger("after").error("error after basicConfig on rank %d", rank)
    print(f"printed by rank {rank}")
    signal.signal(signal.SIGTERM, lambda *_: None)
    os.chdir("/")
    os.environ["POOL_TEST_LEFTOVER"] = "1"
    torch.manual_seed(1234)
    torch.set_num_threads(2)


def process_state(rank: int, world: int) -> dict:
    return {
        "cwd": os.getcwd(),
        "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "seed": torch.initial_seed(),
        "threads": torch.get_num_threads(),
        "leftover": os.environ.get("POOL_TEST_LEFTOVER"),
        "root": (logging.getLogger().level, len(logging.getLogger().handlers)),
    }


def make_groups(rank: int, world: int) -> int:
    for _ in range(3):
        group = dist.new_group(list(range(world)))
        dist.all_reduce(torch.ones(1), group=group)
    return len(distributed_c10d._world.pg_map)


def open_resources(rank: int, world: int) -> tuple[int, int, int]:
    """(process groups, file descriptors, threads) of this worker."""
    groups = len(distributed_c10d._world.pg_map)
    return groups, len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def pid(rank: int, world: int) -> int:
    return os.getpid()


# ----- tests --------------------------------------------------------------------------------


def test_results_come_back_per_rank_and_all_reduce_works() -> None:
    pool = get_pool(2)
    results = pool.run(sum_of_ranks, scale=2.0)
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["sum"] for r in results] == [2.0, 2.0]
    assert [r["env"] for r in results] == [["0", "2", "0", "2"], ["1", "2", "1", "2"]]
    # Whatever the caller's environment says (conftest pins these for every test).
    assert all(r["offline"] == ["1", "1", "1", "offline"] for r in results)
    caches = [str(TEST_CACHE), str(TEST_CACHE / "huggingface")]
    assert all(r["caches"] == caches and r["threads"] == 1 for r in results)
    assert [r["group"] for r in results] == [(0, 2, "gloo"), (1, 2, "gloo")]
    assert pool.run("test_pool:sum_of_ranks")[1]["sum"] == 1.0  # "module:function" works too


def test_same_workers_are_reused() -> None:
    pool = get_pool(2)
    first = pool.run(pid)
    starts = pool.starts
    assert pool.run(pid) == first == pool.pids
    assert pool.run(sum_of_ranks)[0]["pid"] == first[0]
    assert pool.starts == starts


def test_failure_on_one_rank_shows_its_traceback_and_pool_recovers() -> None:
    pool = get_pool(2)
    before = pool.run(pid)
    with pytest.raises(ScenarioError) as failure:
        pool.run(fail_on, bad=1)
    error = failure.value
    assert error.kind == "error" and sorted(error.tracebacks) == [1]
    message = str(error)
    assert "failed on ranks [1] of 2" in message
    assert "Traceback (most recent call last)" in message and "in fail_on" in message
    assert "AssertionError: deliberate failure 1234 on rank 1" in message
    # A return value that cannot go back to pytest is a failure of that rank, not a crash.
    with pytest.raises(ScenarioError) as failure:
        pool.run(unpicklable)
    assert sorted(failure.value.tracebacks) == [1] and "pickle" in str(failure.value)
    assert pool.run(pid) == before  # same workers, still in a working group
    assert pool.run(sum_of_ranks)[0]["sum"] == 1.0


def test_logs_and_output_are_captured_and_state_is_reset() -> None:
    pool = get_pool(2)
    assert pool.run(chatty) == [None, None]
    for rank in range(2):
        assert pool.last_logs[rank] == [
            f"INFO titanlite.somewhere: info from rank {rank}",
            "WARNING pool_test.no_propagation: warning that does not propagate",
            f"ERROR after: error after basicConfig on rank {rank}",
        ]
        assert f"printed by rank {rank}" in pool.last_output[rank]
        # basicConfig's handler printed the error too (to the worker's stderr).
        assert f"error after basicConfig on rank {rank}" in pool.last_output[rank]
    state = pool.run(process_state)
    assert state[0] == state[1]
    assert state[0] == {
        "cwd": os.getcwd(),
        "sigterm_default": True,
        "seed": 0,
        "threads": 1,
        "leftover": None,
        "root": (logging.INFO, 0),
    }
    assert pool.last_logs == [[], []] and pool.last_output == ["", ""]


def test_groups_a_scenario_creates_are_destroyed_after_it() -> None:
    pool = get_pool(2)
    before = pool.run(open_resources)
    assert all(groups == 1 for groups, _, _ in before)
    assert pool.run(make_groups) == [4, 4]  # the default group and three new ones
    assert pool.run(open_resources) == before  # no sockets or gloo threads left behind


def test_hung_scenario_times_out_and_pool_restarts() -> None:
    pool = get_pool(2)
    before = pool.run(pid)
    starts = pool.starts
    with pytest.raises(ScenarioError) as failure:
        pool.run(wait_in_collective, timeout=5)
    error = failure.value
    assert error.kind == "timeout" and sorted(error.tracebacks) == [0]
    assert "timed out after 5 s on ranks [0]" in str(error)
    # The stuck rank's Python stack, dumped just before the kill, shows where it waits.
    assert "in wait_in_collective" in error.output[0] and "all_reduce" in error.output[0]
    assert not pool.alive
    after = pool.run(pid)
    assert pool.starts == starts + 1 and set(after).isdisjoint(before)
    assert pool.run(sum_of_ranks)[0]["sum"] == 1.0


def test_rank_failing_while_others_wait_in_a_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = get_pool(2)
    before = pool.run(pid)
    monkeypatch.setattr(pool, "grace_s", 0.5)
    with pytest.raises(ScenarioError) as failure:
        pool.run(fail_while_others_wait, timeout=60)
    error = failure.value
    assert error.kind == "stuck" and sorted(error.tracebacks) == [0, 1]
    message = str(error)
    assert "ranks [0] still running 0.5 s after others failed" in message
    assert "RuntimeError: rank 1 gives up before the barrier" in message
    assert message.index("rank 1 gives up") < message.index("----- rank 0 -----")
    assert "in fail_while_others_wait" in error.output[0]
    assert set(pool.run(pid)).isdisjoint(before)


def test_dead_worker_is_reported_and_replaced() -> None:
    pool = get_pool(2)
    before = pool.run(pid)
    with pytest.raises(ScenarioError) as failure:
        pool.run(crash)
    assert failure.value.kind == "died" and "rank 1 died (exit code 3)" in str(failure.value)
    assert set(pool.run(pid)).isdisjoint(before)


def test_scenario_destroying_the_default_group_gets_fresh_workers() -> None:
    pool = get_pool(2)
    before = pool.run(pid)
    assert pool.run(destroy_default_group) == [0, 1]
    assert set(pool.run(pid)).isdisjoint(before)


def test_targets_must_be_module_level_functions() -> None:
    def local(rank: int, world: int) -> None:
        pass

    pool = WorkerPool(2)  # never started: the target is refused first
    with pytest.raises(ValueError, match="module-level"):
        pool.run(local)
    with pytest.raises(ValueError, match="module:function"):
        pool.run("test_pool.sum_of_ranks")
    assert not pool.alive and pool.starts == 0
