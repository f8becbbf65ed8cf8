"""What a training step asks of the host and the network (issue 13, per-step stalls).

A step that is not logged must make no device-to-host synchronization and no blocking CPU
collective of titanlite's own beyond the global target-token count: the loss is reduced and
read only at log steps, the token count stays on the device, and the preemption vote is an
asynchronous all-reduce read one step later. With the spike guard on (docs/stability.md) each
step also reduces its loss and reads it and the gradient norm once.
tests/train_scenarios.step_work records, during each whole step asked for (data, the step, the
checks after it), every read of a tensor's value into Python and every torch.distributed call
with its caller.
"""

from __future__ import annotations

import pytest
import train_scenarios
from pool import get_pool

pytestmark = pytest.mark.slow

ARGS = [
    "--training.steps",
    "6",
    "--metrics.log_freq",
    "5",
    "--validation.enable",
    "false",
    "--checkpoint.enable",
    "false",
    "--training.seq_len",
    "64",
    "--model.n_layers",
    "2",
    "--training.local_batch_size",
    "2",
]
LAYOUTS = {
    "dp_shard=2": (2, []),
    "dp_shard=2xtp=2": (4, ["--parallelism.tensor_parallel_degree", "2"]),
    "dp_replicate=2xdp_shard=2": (4, ["--parallelism.data_parallel_replicate_degree", "2"]),
}
# With the spike guard on (docs/stability.md) every step reduces its loss and reads it and the
# gradient norm once, before the optimizer step; a logged step reuses that reduction.
GUARDED = {
    "dp_shard=2, skip_spikes": (
        2,
        ["--training.skip_spikes", "loss,grad_norm", "--training.max_skipped", "1"],
    )
}
# The documented list (docs/performance.md, "What a step waits for"): titanlite's own calls
# in a step that is not logged.
TOKEN_COUNT = ("all_reduce", False, "titanlite.runtime.distributed.all_reduce")
VOTE = ("all_reduce", True, "titanlite.runtime.stop_vote.start")
VOTE_READ = ("__int__", "titanlite.runtime.stop_vote.settle")  # a CPU tensor: no device sync
LOSS_SUM = TOKEN_COUNT  # the same call: the loss terms' sums, all-reduced over the loss group
GUARD_READ = ("tolist", "titanlite.training.stability.accept")  # the step's loss and gradient norm
# Under tensor parallelism the fused loss (the default) reduces each block of tokens' scores
# over the vocabulary shards: two all-reduces (the maxima, then the sums); one block here.
FUSED_TP = [("all_reduce", False, "titanlite.training.fused_loss._in_forward")] * 2
# [health] (docs/reliability.md): a logged step also gathers every rank's step timings.
STRAGGLERS = ("all_gather", False, "titanlite.health.stragglers._gather")


QUIET_STEP, LOGGED_STEP = 3, 5  # log_freq 5


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """work(layout): what steps 3 (not logged) and 5 (logged) of one 6-step run in ``layout``
    asked for, by step; each layout's run is made once, for every test that reads it."""
    runs: dict[str, dict[int, dict[str, list]]] = {}

    def recorded(layout: str) -> dict[int, dict[str, list]]:
        if layout not in runs:
            world, extra = {**LAYOUTS, **GUARDED}[layout]
            out = tmp_path_factory.mktemp("work") / "run"
            argv = [*ARGS, *extra, "--job.dump_folder", str(out)]
            steps = [QUIET_STEP, LOGGED_STEP]
            runs[layout] = get_pool(world).run(train_scenarios.step_work, argv=argv, steps=steps)[0]
        return runs[layout]

    return recorded


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_step_that_is_not_logged_waits_only_for_the_token_count(work, layout):
    got = work(layout)[QUIET_STEP]
    assert got["reads"] == [VOTE_READ]
    own = [c for c in got["calls"] if c[2].startswith("titanlite.")]
    assert own == [TOKEN_COUNT, *(FUSED_TP if "tp=2" in layout else []), VOTE]
    # The rest is the data-parallel engine's own (HSDP: FSDP all-reduces across replicas).
    assert all(c[2].startswith("torch.distributed.fsdp") for c in got["calls"] if c not in own)


def test_a_logged_step_also_reduces_and_reads_the_loss(work):
    got = work("dp_shard=2")[LOGGED_STEP]  # the same run as the first layout's test above
    own = [c for c in got["calls"] if c[2].startswith("titanlite.")]
    # the stragglers' timings as the step ends, then the loss sum for the log
    assert own == [TOKEN_COUNT, STRAGGLERS, LOSS_SUM, VOTE]
    assert len(got["reads"]) > 1 and VOTE_READ in got["reads"]


def test_with_the_spike_guard_every_step_reduces_and_reads_its_loss_once(work):
    runs = work(next(iter(GUARDED)))
    quiet, logged = runs[QUIET_STEP], runs[LOGGED_STEP]
    assert quiet["reads"] == [GUARD_READ, VOTE_READ]
    for got, health in ((quiet, []), (logged, [STRAGGLERS])):
        # the logged step reads more values, but reduces nothing more than the stragglers' timings
        own = [c for c in got["calls"] if c[2].startswith("titanlite.")]
        assert own == [TOKEN_COUNT, LOSS_SUM, *health, VOTE]
    assert logged["reads"].count(GUARD_READ) == 1


@pytest.mark.parametrize("world", [1, 2])
def test_interval_minutes_saves_on_every_rank_at_the_same_step(tmp_path, world):
    """A time-based save (interval_minutes so small that every step is due): one process
    saves at once, several ranks one step after the vote; the step interval is far away."""
    out = tmp_path / "run"
    argv = [
        *ARGS,
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "1000",
        "--checkpoint.interval_minutes",
        "1e-9",
        "--checkpoint.keep_latest_k",
        "0",
        "--job.dump_folder",
        str(out),
        "--parallelism.data_parallel_shard_degree",
        str(world),
    ]
    pool = get_pool(world)
    pool.run(train_scenarios.train, argv=argv)
    saved = sorted(int(p.name.split("-")[1]) for p in (out / "checkpoint").glob("step-*"))
    first = 1 if world == 1 else 2
    assert saved == list(range(first, 7))  # 6 is also the last step
    logs = pool.last_logs[0]
    assert any("saving at step 3: checkpoint.interval_minutes passed" in line for line in logs)
