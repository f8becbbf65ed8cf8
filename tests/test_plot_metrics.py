"""scripts/plot_metrics.py: resumed runs parsed right, a PNG written, bad input refused cleanly."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

SCRIPT = REPO / "scripts" / "plot_metrics.py"
sys.path.insert(0, str(REPO / "scripts"))
import plot_metrics  # noqa: E402


def train(step: int, loss: float) -> dict:
    """A training record as titanlite logs it."""
    return {
        "step": step,
        "loss": loss,
        "grad_norm": 0.5,
        "lr": 1e-3 * min(1.0, step / 5),
        "tps": 1000.0 + 10 * step,
        "mfu_pct": 12.5 + step / 100,
        "mem_peak_gib": 1.5,
        "model_state_gib": 0.2,
        "tokens_seen": 4096 * step,
        "data_wait_pct": 0.3,
        "time": 1.7e9 + step,
    }


def write_run(folder: Path, records: list[dict | str]) -> Path:
    """A run folder whose metrics.jsonl holds these records (a str is written as-is)."""
    folder.mkdir(parents=True)
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    (folder / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    return folder


def plot(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=120
    )


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    # The 12x8 inch figure at 100 dpi, with four panels of curves in it, not an empty canvas.
    assert struct.unpack(">II", data[16:24]) == (1200, 800)
    assert len(data) > 20_000


def test_two_runs_written_as_one_png(tmp_path: Path) -> None:
    val = {"step": 20, "kind": "validation", "val_loss": 6.1, "val_tokens": 8192}
    a = write_run(tmp_path / "a", [train(s, 9 - s / 10) for s in range(1, 31)] + [val])
    b = write_run(tmp_path / "b", [train(s, 9 - s / 20) for s in range(1, 21)])
    out = tmp_path / "curves.png"
    # The metrics.jsonl path works as well as the folder.
    result = plot(a, b / "metrics.jsonl", "-o", out, "--title", "a vs b", "--smooth", "3")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.splitlines() == [f"wrote {out} (2 runs, 30 steps max)"]
    assert_png(out)
    assert [p.name for p in tmp_path.iterdir() if p.is_file()] == ["curves.png"]  # no temp left


@pytest.mark.parametrize("marker", [True, False], ids=["resume-marker", "no-marker"])
def test_resumed_run_keeps_the_last_record_of_each_step(tmp_path: Path, marker: bool) -> None:
    records: list[dict | str] = [train(s, 10.0 - s / 10) for s in range(1, 11)]
    records.append({"step": 8, "kind": "validation", "val_loss": 9.5, "val_tokens": 100})
    if marker:
        records.append({"step": 5, "kind": "resume", "time": 1.8e9})
    records += [train(s, 5.0 - s / 10) for s in range(6, 13)]
    records.append({"step": 8, "kind": "validation", "val_loss": 4.5, "val_tokens": 100})
    records.append({"step": 12, "kind": "startup", "note": "an unknown kind is ignored"})
    run = plot_metrics.load_run(write_run(tmp_path / "resumed", records))
    assert run.series["step"] == list(range(1, 13))
    assert run.series["loss"][:5] == [10.0 - s / 10 for s in range(1, 6)]
    assert run.series["loss"][5] == 5.0 - 0.6  # step 6 from after the resume
    assert run.series["loss"][-1] == 5.0 - 1.2
    assert run.series["tps"][0] == 1010.0
    assert run.series["val_step"] == [8] and run.series["val_loss"] == [4.5]
    assert run.label == "resumed" and run.skipped == []


def test_steps_a_resume_abandoned_are_dropped(tmp_path: Path) -> None:
    # Steps 9-10 ran, crashed, and the run went back to step 5: only 1-8 are one history.
    records: list[dict | str] = [train(s, 10.0) for s in range(1, 11)]
    records.append({"step": 10, "kind": "validation", "val_loss": 9.5, "val_tokens": 100})
    records.append({"step": 5, "kind": "resume", "time": 1.8e9})
    records += [train(s, 4.0) for s in range(6, 9)]
    run = plot_metrics.load_run(write_run(tmp_path / "resumed", records))
    assert run.series["step"] == list(range(1, 9))
    assert run.series["loss"] == [10.0] * 5 + [4.0] * 3
    assert run.series["val_step"] == []


def test_truncated_last_line_is_skipped_with_a_warning(tmp_path: Path) -> None:
    cut = json.dumps(train(11, 1.0))[:40]
    run = write_run(tmp_path / "crashed", [train(s, 9 - s / 10) for s in range(1, 11)] + [cut])
    out = tmp_path / "curves.png"
    result = plot(run, "-o", out)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        f"plot_metrics: warning: {run / 'metrics.jsonl'}: skipped 1 malformed line (11)"
    ]
    assert result.stdout.splitlines() == [f"wrote {out} (1 run, 10 steps max)"]
    assert_png(out)


@pytest.mark.parametrize(
    ("name", "records", "problem"),
    [
        ("missing", None, "no such file or directory"),
        ("empty", [], "no metrics.jsonl"),
        ("validation-only", [{"step": 5, "kind": "validation", "val_loss": 3.0}], "no training"),
    ],
)
def test_bad_run_exits_2_and_leaves_the_output_alone(
    tmp_path: Path, name: str, records: list[dict] | None, problem: str
) -> None:
    good = write_run(tmp_path / "good", [train(s, 5.0) for s in range(1, 4)])
    bad = tmp_path / name
    if records == []:
        bad.mkdir()
    elif records is not None:
        write_run(bad, records)
    out = tmp_path / "curves.png"
    out.write_bytes(b"an earlier plot")
    result = plot(good, bad, "-o", out)
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and problem in lines[0], result.stderr
    assert result.stdout == ""
    assert out.read_bytes() == b"an earlier plot"
    assert not list(tmp_path.glob(".curves.png*"))  # no temporary file left behind


def test_without_matplotlib_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_run(tmp_path / "run", [train(s, 5.0) for s in range(1, 4)])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    assert plot_metrics.main([str(run), "-o", str(tmp_path / "curves.png")]) == 2
    captured = capsys.readouterr()
    assert captured.err == (
        "plot_metrics: matplotlib is not installed; pip install 'titanlite[plot]'\n"
    )
    assert captured.out == ""
    assert not (tmp_path / "curves.png").exists()
