"""Layouts meet checkpoints: every layout starts from bit-identical weights, a checkpoint
saved under one layout resumes under another (both families), RNG state is per rank, and a
resume skips initializing the weights it is about to overwrite.

All runs use titanlite's Trainer on a reused worker pool (tests/pool.py); the launcher paths
(signals, kills, exit statuses) are covered by test_checkpoint.py through real processes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import train_scenarios
from pool import get_pool

from titanlite.checkpoint.safe_reader import SafeFileSystemReader

pytestmark = pytest.mark.slow

STEPS = 12
SMALL = [
    "--training.steps", str(STEPS), "--checkpoint.interval", "4", "--metrics.log_freq", "1",
    "--validation.enable", "false", "--training.seq_len", "64", "--model.n_layers", "2",
]  # fmt: skip
QWEN3 = ["--model.name", "qwen3", "--model.flavor", "debugmodel"]
# Global batch 4 sequences in every layout.
LAYOUTS = {
    "1proc": (1, ["--training.local_batch_size", "4"]),
    "dp_shard2": (2, ["--training.local_batch_size", "2"]),
    "dp_shard2_tp2": (
        4, ["--training.local_batch_size", "2", "--parallelism.tensor_parallel_degree", "2"]
    ),
    "dp_replicate4": (
        4,
        ["--training.local_batch_size", "1", "--parallelism.data_parallel_replicate_degree", "4",
         "--parallelism.data_parallel_shard_degree", "1"],
    ),
    "dp_replicate2_tp2": (
        4,
        ["--training.local_batch_size", "2", "--parallelism.data_parallel_replicate_degree", "2",
         "--parallelism.data_parallel_shard_degree", "1",
         "--parallelism.tensor_parallel_degree", "2"],
    ),
    # Context parallelism: each sequence split over 2 ranks (alone: DDP over them; with
    # dp_shard: FSDP over dp_shard x cp).
    "cp2": (2, ["--training.local_batch_size", "4", "--parallelism.context_parallel_degree", "2"]),
    "cp2_dp_shard2": (
        4, ["--training.local_batch_size", "2", "--parallelism.context_parallel_degree", "2"]
    ),
}  # fmt: skip
RTOL = 1e-5


def train(out: Path, layout: str, *args: str) -> tuple[dict[int, float], list[str], list[dict]]:
    """(loss of the last record of each step, rank 0's log lines, every record)."""
    world, layout_args = LAYOUTS[layout]
    pool = get_pool(world)
    run = pool.run(
        train_scenarios.train, argv=[*SMALL, "--job.dump_folder", str(out), *layout_args, *args]
    )[0]
    losses = {r["step"]: r["loss"] for r in run["records"] if "loss" in r}
    return losses, pool.last_logs[0], run["records"]


def steps_after_resume(records: list[dict]) -> list[int]:
    starts = [i for i, r in enumerate(records) if r.get("kind") == "resume"]
    return [r["step"] for r in records[starts[-1] + 1 :] if "loss" in r]


def assert_close(got: dict[int, float], want: dict[int, float], steps: range) -> None:
    for step in steps:
        a, b = want[step], got[step]
        assert abs(a - b) <= RTOL * abs(a), f"step {step}: {a!r} vs {b!r} (rtol {RTOL})"


@pytest.fixture(scope="module")
def baselines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    """Per family: 12 uninterrupted steps in one process, checkpoints every 4."""
    result = {}
    for family, extra in (("llama3", []), ("qwen3", QWEN3)):
        out = tmp_path_factory.mktemp(f"baseline_{family}") / "run"
        losses, _, _ = train(out, "1proc", *extra)
        assert sorted(losses) == list(range(1, STEPS + 1))
        result[family] = (out, losses)
    return result


@pytest.fixture(scope="module")
def one_process_weights() -> dict[str, dict[str, torch.Tensor]]:
    """Per family, the initial weights of one process (gathered once, on first use)."""
    return {}


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
@pytest.mark.parametrize(
    "layout", ["dp_shard2", "dp_shard2_tp2", "dp_replicate2_tp2", "cp2_dp_shard2"]
)
def test_every_layout_starts_from_the_same_weights(
    family: str, layout: str, one_process_weights: dict[str, dict[str, torch.Tensor]]
) -> None:
    extra = QWEN3 if family == "qwen3" else []
    world, layout_args = LAYOUTS[layout]
    if family not in one_process_weights:
        one_process_weights[family] = get_pool(1).run(
            train_scenarios.initial_weights, argv=[*SMALL, *extra]
        )[0]
    one = one_process_weights[family]
    many = get_pool(world).run(
        train_scenarios.initial_weights, argv=[*SMALL, *extra, *layout_args]
    )[0]
    assert one.keys() == many.keys()
    for name, value in one.items():
        assert torch.equal(value, many[name]), f"{family} {layout}: {name} differs"


@pytest.mark.parametrize(
    ("family", "layout"),
    [
        ("llama3", "dp_shard2_tp2"), ("llama3", "dp_replicate4"), ("qwen3", "dp_shard2_tp2"),
        ("llama3", "cp2_dp_shard2"),
    ],
)  # fmt: skip
def test_one_process_checkpoint_resumes_on_4_ranks(
    tmp_path: Path, baselines: dict, family: str, layout: str
) -> None:
    base_run, base = baselines[family]
    out = tmp_path / "run"
    shutil.copytree(base_run / "checkpoint" / "step-8", out / "checkpoint" / "step-8")
    extra = QWEN3 if family == "qwen3" else []
    losses, logs, records = train(out, layout, *extra)
    assert any("resumed from" in line and "step 8" in line for line in logs), logs
    # The weights come from the checkpoint: initializing them first would be wasted work.
    assert any("weights left to the checkpoint" in line for line in logs), logs
    assert steps_after_resume(records) == list(range(9, STEPS + 1))
    assert_close(losses, base, range(9, STEPS + 1))


@pytest.mark.parametrize(
    ("family", "layout"), [("llama3", "dp_shard2"), ("qwen3", "dp_shard2"), ("qwen3", "cp2")]
)
def test_two_rank_checkpoint_resumes_in_one_process(
    tmp_path: Path, baselines: dict, family: str, layout: str
) -> None:
    _, base = baselines[family]
    extra = QWEN3 if family == "qwen3" else []
    two = tmp_path / "two"
    losses_two, _, _ = train(two, layout, *extra)
    assert_close(losses_two, base, range(1, STEPS + 1))
    # Each rank saved its own RNG state under its own key.
    saved = SafeFileSystemReader(str(two / "checkpoint" / "step-8")).read_metadata()
    rng_keys = sorted(k for k in saved.state_dict_metadata if k.startswith("rng."))
    assert rng_keys == ["rng.rank0.cpu", "rng.rank1.cpu"]
    out = tmp_path / "one"
    shutil.copytree(two / "checkpoint" / "step-8", out / "checkpoint" / "step-8")
    losses, _, records = train(out, "1proc", *extra)
    assert steps_after_resume(records) == list(range(9, STEPS + 1))
    assert_close(losses, losses_two, range(9, STEPS + 1))
    assert_close(losses, base, range(9, STEPS + 1))


def test_resume_restores_each_ranks_rng_state(tmp_path: Path) -> None:
    """Each rank gets its own generator state back: after a resume, every rank draws what it
    would have drawn next in the run that saved."""
    argv = [*SMALL, "--job.dump_folder", str(tmp_path / "run"), *LAYOUTS["dp_shard2"][1]]
    pool = get_pool(2)
    expected = pool.run(
        train_scenarios.train_with_rank_seeds, argv=[*argv, "--training.steps", "4"]
    )
    assert expected[0] != expected[1]
    resumed = pool.run(train_scenarios.rng_after_resume, argv=[*argv, "--training.steps", "4"])
    assert resumed == expected
