"""scripts/loss_compare.py as a user runs it: tables, verdicts, exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

SCRIPT = REPO / "scripts" / "loss_compare.py"
sys.path.insert(0, str(REPO / "scripts"))
import plot_metrics  # noqa: E402

LOSSES = [8.8, 8.5, 8.1, 7.6, 7.2]
GRAD_NORMS = [0.9, 0.8, 0.7, 0.75, 0.6]


def write_run(folder: Path, losses: list[float] = LOSSES, steps: list[int] | None = None) -> Path:
    """A run folder whose metrics.jsonl has training records plus one validation record."""
    folder.mkdir(parents=True)
    steps = steps or list(range(1, len(losses) + 1))
    lines = [
        json.dumps({"step": s, "loss": loss, "grad_norm": g, "lr": 1e-3, "tps": 1000.0 + s})
        for s, loss, g in zip(steps, losses, GRAD_NORMS, strict=False)
    ]
    lines.append(json.dumps({"step": steps[-1], "kind": "validation", "val_loss": 9.9}))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def compare(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=60
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], *expected: str) -> str:
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for text in expected:
        assert text in lines[0]
    return lines[0]


def test_identical_runs_pass_and_validation_records_are_ignored(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a")
    b = write_run(tmp_path / "b")
    # The metrics.jsonl path works as well as the folder.
    result = compare(a, b / "metrics.jsonl")
    assert result.returncode == 0, result.stderr
    table = [line.split() for line in result.stdout.splitlines()]
    rows = [row for row in table if row and row[0].isdigit()]
    assert [int(row[0]) for row in rows] == [1, 2, 3, 4, 5]  # not the validation record
    assert "max rel diff loss: 0.000e+00" in result.stdout
    assert "max rel diff grad_norm: 0.000e+00" in result.stdout
    assert result.stderr == ""


def test_difference_above_rtol_fails_and_the_table_shows_where(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a")
    b = write_run(tmp_path / "b", [8.8, 8.5, 8.1 * (1 + 1e-3), 7.6, 7.2])
    result = compare(a, b)
    assert result.returncode == 1, result.stderr
    step3 = next(line for line in result.stdout.splitlines() if line.split()[:1] == ["3"])
    assert "8.1081" in step3 and "9.990e-04" in step3
    assert "max rel diff loss: 9.990e-04 at step 3" in result.stdout
    assert "EXCEEDS" in result.stdout
    # A looser tolerance accepts the same pair.
    assert compare(a, b, "--rtol", "1e-2").returncode == 0


def test_only_the_chosen_metrics_are_compared(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a")
    b = write_run(tmp_path / "b", [9.0, 8.5, 8.1, 7.6, 7.2])
    result = compare(a, b, "--metrics", "grad_norm", "lr")
    assert result.returncode == 0, result.stdout
    assert "loss A" not in result.stdout and "lr rel" in result.stdout
    missing = compare(a, b, "--metrics", "val_loss")
    assert_one_line_error(missing, "step 1", "'val_loss'")


def test_missing_run_is_one_line_and_status_2(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a")
    result = compare(a, tmp_path / "nope")
    assert_one_line_error(result, str(tmp_path / "nope"))


def test_malformed_line_is_named_with_its_number(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a")
    b = write_run(tmp_path / "b")
    path = b / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[2] = lines[2][:-5]  # a line cut short, as by a crash mid-write
    path.write_text("\n".join(lines) + "\n")
    assert_one_line_error(compare(a, b), f"{path}:3")


def test_no_common_steps_is_an_error_and_partial_overlap_is_named(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", steps=[1, 2, 3, 4, 5])
    b = write_run(tmp_path / "b", steps=[10, 20, 30, 40, 50])
    assert_one_line_error(compare(a, b), "no steps in common")

    c = write_run(tmp_path / "c", LOSSES[:3], steps=[1, 2, 3])
    result = compare(a, c)
    assert result.returncode == 0, result.stderr
    assert "steps missing from" in result.stderr and "4, 5" in result.stderr
    rows = [line for line in result.stdout.splitlines() if line.split()[:1] in (["1"], ["3"])]
    assert len(rows) == 2


def test_plot_without_matplotlib_names_the_extra(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a")
    # A None entry in sys.modules makes `import matplotlib` fail as if it were not installed.
    hide = (
        "import runpy, sys; sys.modules['matplotlib'] = None; "
        f"sys.argv = {[str(SCRIPT), str(a), str(a), '--plot', str(tmp_path / 'x.png')]!r}; "
        f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')"
    )
    result = subprocess.run(
        [sys.executable, "-c", hide], capture_output=True, text=True, timeout=60
    )
    assert_one_line_error(result, "matplotlib", "titanlite[plot]")
    assert not (tmp_path / "x.png").exists()


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (pip install matplotlib)")
    a = write_run(tmp_path / "a")
    b = write_run(tmp_path / "b", [8.8, 8.4, 8.0, 7.7, 7.1])
    out = tmp_path / "curves.png"
    result = compare(a, b, "--rtol", "0.1", "--plot", out)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes().startswith(b"\x89PNG") and out.stat().st_size > 1000


def test_resumed_run_is_read_as_plot_metrics_reads_it(tmp_path: Path) -> None:
    # Steps 1-10 ran and crashed; the run resumed from its step-5 checkpoint (a "resume"
    # record at step 5) and re-did steps 6-8 on another path. What continues is 1-5 as first
    # logged and 6-8 as re-done; 9 and 10 were undone. The resume record is not a step.
    def train(step: int, loss: float) -> str:
        return json.dumps({"step": step, "loss": loss, "grad_norm": 0.5, "lr": 1e-3})

    def write(folder: Path, lines: list[str]) -> Path:
        folder.mkdir()
        (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        return folder

    lines = [train(s, 10 - s / 10) for s in range(1, 11)]
    lines.append(json.dumps({"step": 5, "kind": "resume", "time": 1.8e9}))
    lines += [train(s, 5 - s / 10) for s in range(6, 9)]
    resumed = write(tmp_path / "resumed", lines)
    expected = {s: 10 - s / 10 for s in range(1, 6)} | {s: 5 - s / 10 for s in range(6, 9)}
    baseline = write(tmp_path / "baseline", [train(s, loss) for s, loss in expected.items()])

    result = compare(baseline, resumed)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # no "steps missing" for the undone steps 9 and 10
    rows = [line.split() for line in result.stdout.splitlines()]
    table = {int(r[0]): float(r[2]) for r in rows if r and r[0].isdigit()}  # step -> B's loss
    assert table == expected
    plotted = plot_metrics.load_run(resumed).series
    assert dict(zip(map(int, plotted["step"]), plotted["loss"], strict=True)) == table
