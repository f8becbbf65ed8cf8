"""Cluster health ([health], docs/reliability.md): its settings and their checks, and the
straggler detector naming a rank made 1.5x slower under every layout family while clean runs
raise no flag. The hang watchdog and the replica fingerprints have their own files
(test_health_hang.py, test_health_sdc.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from titanlite.config import ConfigError, load_config
from titanlite.health.stragglers import StragglerDetector

SMALL = [
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
    "--training.local_batch_size",
    "2",
    "--validation.enable",
    "false",
    "--checkpoint.enable",
    "false",
]


def test_health_is_on_by_default_and_its_values_are_checked() -> None:
    cfg = load_config([])
    assert cfg.health.enable and cfg.health.hang_timeout_s > 0 and cfg.health.sdc_check_interval
    bad = [
        "--health.straggler_ratio",
        "1.0",
        "--health.straggler_steps",
        "0",
        "--health.hang_timeout_s",
        "-1",
        "--health.sdc_check_interval",
        "-2",
    ]
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    lines = str(e.value).splitlines()
    for key in ("straggler_ratio", "straggler_steps", "hang_timeout_s", "sdc_check_interval"):
        assert any(line.startswith(f"health.{key}: must be") for line in lines), key


def test_the_watchdog_leaves_a_shorter_collective_timeout_to_name_the_lost_rank() -> None:
    from titanlite.health.settings import hang_timeout

    cfg = load_config(["--health.hang_timeout_s", "300", "--comm.timeout_seconds", "600"])
    assert hang_timeout(cfg.health, cfg.comm.timeout_seconds) == 300
    for argv in (["--comm.timeout_seconds", "4"], ["--health.enable", "false"]):
        cfg = load_config(argv)
        assert hang_timeout(cfg.health, cfg.comm.timeout_seconds) == 0


def detector_after(own_times: list[list[float]], ratio: float = 1.3, steps: int = 3) -> list:
    """One process standing in for every rank: the windows a report would gather."""
    import torch

    detector = StragglerDetector(
        rank=0, world_size=len(own_times[0]), ratio=ratio, steps=steps, device=torch.device("cpu")
    )
    reports = []
    for window in own_times:
        rows = [[1.0, t, t, 0.0, 0.0, t, 0.0] for t in window]
        detector._gather = lambda row, rows=rows: rows  # the rows an all-gather would bring
        reports.append(detector.report(len(reports) + 1))
    return reports


def test_the_rule_names_a_rank_slow_for_n_logged_steps_in_a_row_once(caplog) -> None:
    slow = [[0.1, 0.1, 0.16, 0.1]] * 4
    with caplog.at_level("WARNING", logger="titanlite.health.stragglers"):
        # (the first window, start-up's, never counts)
        reports = detector_after([[0.1, 0.1, 0.5, 0.1], [0.1] * 4, *slow])
    assert [r["straggler_rank"] for r in reports] == [-1, -1, -1, -1, 2, 2]
    assert reports[-1]["straggler_ratio"] == pytest.approx(1.6)
    named = [r.getMessage() for r in caplog.records]
    assert len(named) == 1 and "rank 2 " in named[0] and "1.60x the median" in named[0]
    # A rank slow on and off never is: the count is of logged steps in a row.
    flicker = detector_after([[0.1] * 2, [0.1, 0.16], [0.1, 0.1], [0.1, 0.16], [0.1, 0.16]])
    assert all(r["straggler_rank"] == -1 for r in flicker)


LAYOUTS = {
    "ddp": (4, ["--parallelism.data_parallel_replicate_degree", "4"]),
    "fsdp": (4, ["--parallelism.data_parallel_shard_degree", "4"]),
    "tp": (4, ["--parallelism.tensor_parallel_degree", "2"]),
    "pp": (4, ["--parallelism.pipeline_parallel_degree", "2"]),
    "fsdp8": (8, ["--parallelism.data_parallel_shard_degree", "8"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_rank_made_slower_is_named(layout: str, tmp_path: Path) -> None:
    import health_scenarios
    from pool import get_pool

    world, parallelism = LAYOUTS[layout]
    slow_rank = world - 1
    argv = [
        *SMALL,
        *parallelism,
        "--training.steps",
        "16",
        "--metrics.log_freq",
        "2",
        "--job.dump_folder",
        str(tmp_path / "run"),
    ]
    pool = get_pool(world)
    run = pool.run(health_scenarios.train_with_a_slow_rank, argv=argv, slow_rank=slow_rank)[0]
    flagged = [r["straggler_rank"] for r in run["records"] if "straggler_rank" in r]
    print(f"{layout}: straggler_rank per logged step {flagged}")
    # Named by the third slow window (step 6) on a quiet machine; 16 steps leave room for a
    # window that load pushed under the ratio (the count of windows in a row starts again).
    assert flagged[-1] == slow_rank, flagged
    assert set(flagged) <= {-1.0, float(slow_rank)}
    lines = [line for logs in pool.last_logs for line in logs if "straggler at step" in line]
    assert any(f"rank {slow_rank} " in line for line in lines), lines


@pytest.mark.slow
def test_fifty_clean_steps_raise_no_flag(tmp_path: Path) -> None:
    import health_scenarios
    from pool import get_pool

    argv = [
        *SMALL,
        *LAYOUTS["ddp"][1],
        "--training.steps",
        "50",
        "--metrics.log_freq",
        "5",
        "--job.dump_folder",
        str(tmp_path / "run"),
    ]
    run = get_pool(4).run(health_scenarios.train_with_a_slow_rank, argv=argv)[0]
    records = [r for r in run["records"] if "straggler_rank" in r]
    worst = max(r["straggler_ratio"] for r in records)
    print(f"clean run: largest own-time ratio to the median {worst:.3f}")
    assert len(records) >= 10 and all(r["straggler_rank"] == -1 for r in records)
