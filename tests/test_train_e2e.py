"""End to end through ./run_train.sh, as a user runs it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, read_metrics, run_train

from titanlite.config.parse import tomllib

pytestmark = pytest.mark.slow

REQUIRED_FIELDS = {
    "step",
    "loss",
    "grad_norm",
    "lr",
    "tps",
    "mfu_pct",
    "mem_peak_gib",
    "tokens_seen",
}
STEPS = 20  # of the default config's 100
# Two processes through the launcher against one process: test_cluster's plain-torchrun test
# (and test_interrupts' torchrun runs, bit-identical to the same layout on the pool).


def test_default_run_learns_and_writes_its_outputs(tmp_path: Path) -> None:
    """The quick-start command (the default config, through ./run_train.sh) for 20 of its 100
    steps, validating twice as it does: the debug model trains on sotu and the loss falls by
    more than a fifth (8.81 -> 6.62 at step 20, the schedule being the run's; val_loss 7.32 ->
    6.86 from step 10). The other steps would run the same code for another minute of the
    suite; the full run is measured in BENCHMARKS.md."""
    out = tmp_path / "run"
    result = run_train(
        tmp_path,
        "--job.dump_folder",
        str(out),
        "--metrics.enable_wandb",
        "--training.steps",
        str(STEPS),
        "--validation.freq",
        str(STEPS // 2),
        WANDB_MODE="offline",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    train, val = read_metrics(out)
    assert [r["step"] for r in train][:2] == [1, 10]
    assert train[-1]["step"] == STEPS
    for record in train:
        assert REQUIRED_FIELDS <= record.keys()
        assert math.isfinite(record["loss"]) and record["tps"] > 0 and record["mfu_pct"] > 0
    assert train[-1]["loss"] < 0.8 * train[0]["loss"], [r["loss"] for r in train]
    assert [r["step"] for r in val] == [STEPS // 2, STEPS]
    assert val[-1]["val_loss"] < val[0]["val_loss"]
    tokens_per_step = 8 * 256
    assert train[-1]["tokens_seen"] == STEPS * tokens_per_step

    # The console shows the same steps, one line each, with an ETA.
    console = [line for line in result.stdout.splitlines() if "| loss " in line]
    assert len(console) == len(train) and all("eta" in line for line in console)

    resolved = tomllib.loads((out / "config.toml").read_text())
    assert resolved["training"]["steps"] == STEPS and resolved["model"]["flavor"] == "debugmodel"
    run = json.loads((out / "run.json").read_text())
    assert run["num_params"] > 1_000_000 and run["flops_per_token"] > 6 * run["num_params"] // 2
    assert run["world_size"] == 1 and run["peak_flops_source"].startswith("measured")
    assert run["parallel_degrees"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1}

    # wandb (offline) wrote a run with data in it.
    runs = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert runs and runs[0].stat().st_size > 0

    # The checkpoint carries its tokenizer: it converts from any folder.
    last = out / "checkpoint" / f"step-{STEPS}"
    assert json.loads((last / "titanlite.json").read_text())["tokenizer"] == "tokenizer.model"
    shipped = REPO / "titanlite" / "assets" / "tokenizer.model"
    assert (last / "tokenizer.model").read_bytes() == shipped.read_bytes()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    convert = [sys.executable, str(REPO / "scripts" / "convert_to_hf.py"), str(last), "hf"]
    converted = subprocess.run(convert, cwd=elsewhere, capture_output=True, text=True, timeout=300)
    assert converted.returncode == 0, converted.stderr
    assert (elsewhere / "hf" / "tokenizer.model").is_file()


def _losses(folder: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(folder)[0]]


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr
    return lines[-1]


def test_bad_config_is_one_line_and_status_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nstpes = 3\n")
    result = run_train(tmp_path, str(bad))
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert "stpes" in result.stderr and "did you mean 'steps'" in result.stderr

    missing = run_train(tmp_path, str(tmp_path / "nope.toml"))
    assert missing.returncode == 2 and "nope.toml" in _one_error_line(missing.stderr)

    layout = run_train(tmp_path, "--parallelism.data_parallel_replicate_degree", "3", ngpu=2)
    assert layout.returncode == 2 and "parallelism" in _one_error_line(layout.stderr)


def test_error_found_inside_the_ranks_still_exits_2(tmp_path: Path) -> None:
    """An empty data folder passes the launcher's checks but not the loader's: both ranks
    report it, and the launcher repeats it once, last, after torchrun's report."""
    empty = tmp_path / "empty"
    empty.mkdir()
    args = ("--training.dataset_path", str(empty), "--training.steps", "2")
    result = run_train(tmp_path, *args, ngpu=2)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("titanlite: error:") and str(empty) in last
    # Both ranks wrote it to the launcher's error file; rank 0's own output says it too.
    assert result.stderr.splitlines().count(last) == 1, result.stderr[-3000:]


def test_divergence_stops_with_a_message_and_status_3(tmp_path: Path) -> None:
    result = run_train(
        tmp_path,
        "--optimizer.lr",
        "1e30",
        "--lr_scheduler.warmup_steps",
        "0",
        "--training.max_norm",
        "0",
        "--training.steps",
        "20",
        "--metrics.log_freq",
        "1",
        "--job.dump_folder",
        str(tmp_path / "run"),
        # The debug model at two blocks on short sequences: it diverges as the full one does.
        "--model.n_layers",
        "2",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
    )
    assert result.returncode == 3, result.stderr[-2000:]
    assert "non-finite" in result.stderr.strip().splitlines()[-1]


def test_help_lists_every_section(tmp_path: Path) -> None:
    result = run_train(tmp_path, "--help")
    assert result.returncode == 0
    for section in (
        "[job]",
        "[model]",
        "[optimizer]",
        "[lr_scheduler]",
        "[training]",
        "[parallelism]",
        "[metrics]",
        "[validation]",
    ):
        assert section in result.stdout


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))
