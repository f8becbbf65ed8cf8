"""Metrics: duration formatting, metrics.jsonl, the peak-FLOP/s cache and the wandb mode."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from titanlite.metrics import loggers as metrics
from titanlite.metrics.loggers import (
    MetricsLogger,
    format_duration,
    measure_matmul_flops,
    peak_flops,
    wandb_mode,
)
from titanlite.metrics.run_info import StepLogger, Throughput


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0m00s"),
        (9.9, "0m09s"),
        (59, "0m59s"),
        (60, "1m00s"),
        (61, "1m01s"),
        (3599, "59m59s"),
        (3600, "1h00m"),
        (3661, "1h01m"),
        (36000 + 59 * 60 + 59, "10h59m"),
        (100 * 3600, "100h00m"),
        (-5, "0m00s"),
    ],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


# --- MetricsLogger ----------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_logger_writes_one_json_line_per_call(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "run" / "nested"  # created on demand
    logger = MetricsLogger(folder, enabled=True)
    records = [
        {"step": 1, "loss": 8.25, "lr": 1e-4, "tokens": 4096},
        {"step": 10, "loss": 6.5, "lr": 8e-4, "mfu_pct": 12.5, "note": "é"},
        {"step": 11, "val_loss": 6.75},
    ]
    logger.log(records[0], console="step 1 | loss 8.25")
    # Line-buffered: each record is on disk as soon as it is logged, before close().
    assert read_jsonl(folder / "metrics.jsonl") == records[:1]
    logger.log(records[1])
    logger.log(records[2], console="validation")
    logger.close()
    assert read_jsonl(folder / "metrics.jsonl") == records
    assert capsys.readouterr().out == "step 1 | loss 8.25\nvalidation\n"
    logger.close()  # idempotent


def test_logger_appends_on_resume(tmp_path: Path) -> None:
    first = MetricsLogger(tmp_path, enabled=True)
    first.log({"step": 1, "loss": 2.0})
    first.close()
    second = MetricsLogger(tmp_path, enabled=True)
    second.log({"step": 2, "loss": 1.5})
    second.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]


def test_disabled_logger_writes_nothing(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "run"
    logger = MetricsLogger(folder, enabled=False, wandb_settings={"project": "x"})
    logger.log({"step": 1, "loss": 1.0}, console="should not appear")
    logger.close()
    assert not folder.exists()
    assert capsys.readouterr().out == ""


# --- peak FLOP/s ------------------------------------------------------------------------------


def test_measure_matmul_flops_is_plausible() -> None:
    flops = measure_matmul_flops(torch.device("cpu"), torch.float32, max_size=256)
    assert math.isfinite(flops)
    assert 1e7 < flops < 1e15  # between a very slow core and far beyond any CPU


def use_xdg_cache(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """The cache under $XDG_CACHE_HOME, where it goes without TITANLITE_CACHE_DIR (which the
    suite sets for every test: tests/conftest.py)."""
    monkeypatch.delenv("TITANLITE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(folder))


def test_peak_flops_is_measured_once_then_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_xdg_cache(monkeypatch, tmp_path)
    calls = []

    def small_measure(device: torch.device, dtype: torch.dtype) -> float:
        calls.append((device, dtype))
        return measure_matmul_flops(device, dtype, max_size=256)

    monkeypatch.setattr(metrics, "measure_matmul_flops", small_measure)
    cpu = torch.device("cpu")
    first, how_first = peak_flops(cpu, torch.float32)
    assert how_first.startswith("measured ") and "cached" not in how_first
    assert "float32" in how_first and f"{torch.get_num_threads()} threads" in how_first
    cache = tmp_path / "titanlite" / "peak_flops.json"
    assert cache.is_file()
    assert list(json.loads(cache.read_text()).values()) == [first]

    second, how_second = peak_flops(cpu, torch.float32)
    assert second == first
    assert how_second.startswith("measured (cached) ")
    assert len(calls) == 1  # the second call did not measure

    # Another dtype is another entry; the first survives.
    peak_flops(cpu, torch.bfloat16)
    assert len(calls) == 2
    assert len(json.loads(cache.read_text())) == 2
    assert not list(cache.parent.glob("*.tmp"))  # written atomically, no leftovers


def test_forgotten_peak_is_measured_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the trainer does when MFU comes out above 100% (a peak measured on a busy machine)."""
    monkeypatch.setenv("TITANLITE_CACHE_DIR", str(tmp_path / "cache"))
    measured = iter([1.0e9, 2.0e9, 4.0e9])
    monkeypatch.setattr(metrics, "measure_matmul_flops", lambda device, dtype: next(measured))
    cpu = torch.device("cpu")
    assert peak_flops(cpu, torch.float32)[0] == 1.0e9
    peak_flops(cpu, torch.bfloat16)  # another entry, which must survive
    metrics.forget_peak_flops(cpu, torch.float32)
    flops, how = peak_flops(cpu, torch.float32)
    assert flops == 4.0e9 and "cached" not in how
    cache = json.loads((tmp_path / "cache" / "peak_flops.json").read_text())
    assert sorted(cache.values()) == [2.0e9, 4.0e9]  # bf16 kept, fp32 re-measured


def test_an_mfu_above_100_measures_the_peak_again_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A cached peak measured on a busy machine makes MFU exceed 100%: the step logger
    measures again on the spot, logs both figures, and the run and the cache use the new one."""
    monkeypatch.setenv("TITANLITE_CACHE_DIR", str(tmp_path / "cache"))
    measured = iter([1.0e6, 4.0e9])  # a busy machine first, then the real peak
    monkeypatch.setattr(metrics, "measure_matmul_flops", lambda device, dtype: next(measured))
    cpu = torch.device("cpu")
    peak_flops(cpu, torch.float32)
    flops, how = peak_flops(cpu, torch.float32)  # the stale figure, from the cache
    assert flops == 1.0e6 and "cached" in how
    trainer = Throughput(1000.0, cpu, torch.float32, flops, how)
    step_logger = StepLogger(trainer, MetricsLogger(tmp_path, enabled=False), total_steps=10)
    assert step_logger._checked_mfu(100.0) == pytest.approx(10.0)  # 1e5 of 1e6: nothing to do
    with caplog.at_level(logging.WARNING):
        mfu = step_logger._checked_mfu(2000.0)  # 2e6 FLOP/s against 1e6: 200%
    assert mfu == pytest.approx(100 * 2.0e6 / 4.0e9)
    assert trainer.peak_flops == 4.0e9 and "cached" not in trainer.peak_source
    assert "MFU 200% is above 100%" in caplog.text and "MFU 0%" in caplog.text
    cache = json.loads((tmp_path / "cache" / "peak_flops.json").read_text())
    assert list(cache.values()) == [4.0e9]
    # Once per run: a later step above 100% is reported as it is, not measured again (a
    # third measurement would fail: the iterator is spent).
    trainer.peak_flops = 1.0
    assert step_logger._checked_mfu(2000.0) > 100


def test_peak_flops_survives_a_corrupt_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_xdg_cache(monkeypatch, tmp_path)
    monkeypatch.setattr(metrics, "measure_matmul_flops", lambda device, dtype: 1.5e9)
    cache = tmp_path / "titanlite" / "peak_flops.json"
    cache.parent.mkdir(parents=True)
    cache.write_text("{not json")
    assert peak_flops(torch.device("cpu"), torch.float32)[0] == 1.5e9
    assert list(json.loads(cache.read_text()).values()) == [1.5e9]


def test_peak_flops_unwritable_cache_still_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the cache folder would go
    use_xdg_cache(monkeypatch, blocker)
    monkeypatch.setattr(metrics, "measure_matmul_flops", lambda device, dtype: 2.5e9)
    flops, how = peak_flops(torch.device("cpu"), torch.float32)
    assert flops == 2.5e9 and how.startswith("measured ")


# --- wandb mode -------------------------------------------------------------------------------


@pytest.fixture
def no_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    return tmp_path


def test_wandb_offline_without_credentials(no_credentials: Path) -> None:
    assert wandb_mode() == "offline"


def test_wandb_mode_env_wins(no_credentials: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_mode() == "offline"


def test_wandb_online_with_api_key(no_credentials: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode() == "online"


def test_wandb_netrc(no_credentials: Path) -> None:
    netrc = no_credentials / ".netrc"
    netrc.write_text("machine example.com\n  login a\n  password b\n")
    assert wandb_mode() == "offline"  # a netrc for another host is not a wandb login
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "x" * 40 + "\n")
    assert wandb_mode() == "online"
