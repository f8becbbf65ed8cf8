"""Batch-size warmup (training.batch_size_schedule, docs/stability.md): the global batch of
each step, the settings' errors, the same global batches under 1 and 4 ranks, the token
accounting, and an exact resume in the middle of the ramp."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from train_scenarios import by_step, on_pool

from titanlite.config import ConfigError, load_config, resolve_degrees
from titanlite.config.batch_ramp import BatchRamp

SCHEDULE = "512:4,1536:8"  # 4 sequences of 64 tokens until 512 tokens, 8 until 1,536, then 16
SEQUENCES = [4, 4, 8, 8, 16, 16]


def ramp(world: int, local_batch: int, schedule: str = SCHEDULE) -> BatchRamp:
    cfg = load_config(
        [
            "--training.seq_len",
            "64",
            "--training.global_batch_size",
            "16",
            "--training.local_batch_size",
            str(local_batch),
            "--training.batch_size_schedule",
            schedule,
        ]
    )
    return BatchRamp.of(cfg, resolve_degrees(cfg, world))


def test_each_step_takes_the_stage_of_the_tokens_trained_before_it() -> None:
    one, four = ramp(1, 4), ramp(4, 1)
    assert [one.sequences(s) for s in range(1, 7)] == SEQUENCES
    assert [four.sequences(s) for s in range(1, 7)] == SEQUENCES  # the layout does not matter
    assert [one.micro_batches(s) for s in range(1, 7)] == [1, 1, 2, 2, 4, 4]
    assert ramp(1, 4, "").sequences(1) == 16  # no schedule: the global batch from the start
    # A stage shorter than one of its steps still gets that step: 100 tokens < 4 x 64.
    assert [ramp(1, 4, "100:4").sequences(s) for s in (1, 2)] == [4, 16]


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        ("512", "'512' is not TOKENS:SEQUENCES"),
        ("512:4,256:8", "tokens must grow"),
        ("512:0", "sequences be at least 1"),
        ("inf:8", "'inf:8' is not TOKENS:SEQUENCES"),  # was an OverflowError traceback
    ],
)
def test_bad_schedules_are_one_line_config_errors(schedule: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        ramp(1, 4, schedule)
    assert len(str(error.value).splitlines()) == 1


def test_a_stage_the_micro_batches_cannot_make_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="6 sequences is not a multiple of .* = 4"):
        ramp(1, 4, "512:6")
    # a multiple, but above the global batch: said so (it read "not a multiple of 4")
    with pytest.raises(ConfigError, match="32 sequences is above the global batch 16"):
        ramp(1, 4, "512:32")


# --- training (worker pool) ----------------------------------------------------------------------

ARGS = (
    "--model.dim",
    "64",
    "--model.n_layers",
    "2",
    "--model.n_heads",
    "4",
    "--model.n_kv_heads",
    "4",
    "--model.multiple_of",
    "32",
    "--training.seq_len",
    "64",
    "--training.steps",
    "6",
    "--metrics.log_freq",
    "1",
    "--validation.enable",
    "false",
    "--training.global_batch_size",
    "16",
    "--training.batch_size_schedule",
    SCHEDULE,
    "--checkpoint.interval",
    "3",
    "--checkpoint.keep_latest_k",
    "0",
)


def train(world: int, out: Path, *args: str) -> list[dict]:
    return on_pool(world, [*ARGS, *args, "--job.dump_folder", str(out)])["records"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict]]:
    out = tmp_path_factory.mktemp("ramp") / "one"
    return out, by_step(train(1, out, "--training.local_batch_size", "4"))


@pytest.mark.slow
def test_the_ramp_trains_the_same_global_batches_on_1_and_4_ranks(one_process, tmp_path) -> None:
    from titanlite.metrics.compare import relative_difference

    _, one = one_process
    tokens = [r["tokens_seen"] for r in one.values()]
    grown = [64 * sum(SEQUENCES[:i]) for i in range(1, 7)]  # every position is a target
    assert tokens == grown, tokens
    four = by_step(train(4, tmp_path / "four", "--training.local_batch_size", "1"))
    assert [r["tokens_seen"] for r in four.values()] == grown
    worst = {
        m: max(relative_difference(one[s][m], four[s][m]) for s in one)
        for m in ("loss", "grad_norm")
    }
    print(f"batch ramp, 4 ranks vs 1: max relative differences {worst}")
    assert all(d <= 1e-6 for d in worst.values()), worst


@pytest.mark.slow
def test_resume_in_the_middle_of_the_ramp_is_exact(one_process, tmp_path) -> None:
    """Saved at step 3 (the second stage, 8 sequences), resumed: steps 4 to 6 as before."""
    out, one = one_process
    again = tmp_path / "run"
    shutil.copytree(out, again, ignore=shutil.ignore_patterns("step-6"))
    records = train(1, again, "--training.local_batch_size", "4")
    after = records[max(i for i, r in enumerate(records) if r.get("kind") == "resume") + 1 :]
    resumed = by_step(after)
    assert sorted(resumed) == [4, 5, 6]
    for step, record in resumed.items():
        for key in ("loss", "grad_norm", "lr", "tokens_seen"):
            assert repr(record[key]) == repr(one[step][key]), (step, key)
