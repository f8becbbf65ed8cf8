"""Plot the training curves of one or more titanlite runs into one PNG.

    python scripts/plot_metrics.py RUN [RUN ...] -o curves.png [--title TEXT] [--smooth N]

RUN is a run dump folder (``--job.dump_folder``) or its ``metrics.jsonl``. The figure has four
panels against the step: training loss (validation loss dashed, with markers, in the run's
color), tokens/s, MFU % and learning rate; one color per run, labelled by its folder's name.
``--smooth N`` draws the loss as a trailing mean of N logged steps (the raw curve stays, faint).

A resumed run appends to the same metrics.jsonl and re-does the steps after its checkpoint:
records a resume abandoned are dropped, and of a step logged twice the last record counts.
Malformed lines (a line cut short by a crash) are skipped with a warning.

Exit status: 0 written; 2 bad input (a missing run, no training steps, matplotlib absent),
reported in one line on stderr, and the output file is left as it was.
Needs matplotlib: ``pip install 'titanlite[plot]'``.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from titanlite.files import atomic_path
from titanlite.metrics.jsonl import MetricsFileError, find_metrics_file, read_metrics

EXIT_OK, EXIT_BAD_INPUT = 0, 2
TRAIN_KEYS = ("loss", "tps", "mfu_pct", "lr")
PANELS = (("loss", "loss"), ("tps", "tokens/s"), ("mfu_pct", "MFU %"), ("lr", "learning rate"))


class InputError(Exception):
    """Bad input a user can fix; the message is the one line the script prints."""


@dataclass(frozen=True)
class Run:
    """One run's curves: series["step"] with TRAIN_KEYS aligned to it; "val_step", "val_loss"."""

    path: Path  # its metrics.jsonl
    label: str
    series: dict[str, list[float]]
    skipped: list[int]  # line numbers of malformed lines


def load_run(run: str | Path) -> Run:
    try:
        found = read_metrics(find_metrics_file(run))
    except MetricsFileError as e:
        raise InputError(str(e)) from None
    if not found.train:
        raise InputError(f"{found.path}: no training steps")
    train, val = found.train, found.validation
    steps = sorted(train)
    series: dict[str, list[float]] = {"step": [float(s) for s in steps]}
    for key in TRAIN_KEYS:
        series[key] = [number_or_nan(train[s].get(key)) for s in steps]
    series["val_step"] = [float(s) for s in sorted(val)]
    series["val_loss"] = [number_or_nan(val[s].get("val_loss")) for s in sorted(val)]
    skipped = [bad.line for bad in found.malformed]
    return Run(found.path, found.path.resolve().parent.name, series, skipped)


def number_or_nan(value: object) -> float:
    # NaN leaves a gap in the curve: an old run lacking a field still plots the others.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return math.nan


def trailing_mean(values: list[float], n: int) -> list[float]:
    """Mean of each value and the n - 1 before it (fewer at the start, so no lag is hidden)."""
    return [sum(values[max(0, i - n + 1) : i + 1]) / min(i + 1, n) for i in range(len(values))]


def plot(runs: list[Run], out: Path, title: str | None, smooth: int) -> None:
    try:
        import matplotlib
    except ImportError:
        raise InputError("matplotlib is not installed; pip install 'titanlite[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [run.label for run in runs]
    if len(set(labels)) < len(labels):  # runs/a/out and runs/b/out: the name alone is ambiguous
        labels = [str(run.path.parent) for run in runs]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    for i, (run, label) in enumerate(zip(runs, labels, strict=True)):
        color, s = f"C{i % 10}", run.series
        for ax, (key, _) in zip(axes.flat, PANELS, strict=True):
            if key == "loss" and smooth > 1:
                ax.plot(s["step"], s["loss"], color=color, alpha=0.25, linewidth=0.8)
                ax.plot(s["step"], trailing_mean(s["loss"], smooth), color=color, label=label)
            else:
                ax.plot(s["step"], s[key], color=color, label=label)
        if s["val_step"]:
            axes[0, 0].plot(
                s["val_step"],
                s["val_loss"],
                "o--",
                color=color,
                markersize=4,
                label=f"{label} (val)",
            )
    axes[0, 0].legend(fontsize="small")
    for ax, (_, ylabel) in zip(axes.flat, PANELS, strict=True):
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    # Written beside the target and renamed over it: a failed save never leaves half a PNG.
    try:
        with atomic_path(out) as tmp:
            fig.savefig(tmp, format="png")
    except OSError as e:
        raise InputError(f"{out}: cannot write ({e.strerror})") from None
    finally:
        plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="plot_metrics.py", description="Plot titanlite runs' training curves into one PNG."
    )
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run dump folder or metrics.jsonl")
    parser.add_argument("-o", "--output", type=Path, required=True, help="PNG file to write")
    parser.add_argument("--title", help="title above the panels")
    parser.add_argument(
        "--smooth",
        type=int,
        default=1,
        metavar="N",
        help="trailing mean of N steps on the loss (default 1: none)",
    )
    args = parser.parse_args(argv)
    if args.smooth < 1:
        parser.error(f"--smooth must be >= 1, got {args.smooth}")
    try:
        runs = [load_run(r) for r in args.runs]
        for run in runs:
            if run.skipped:
                n = len(run.skipped)
                lines = ", ".join(map(str, run.skipped[:5])) + (", ..." if n > 5 else "")
                sys.stderr.write(
                    f"plot_metrics: warning: {run.path}: skipped {n} malformed "
                    f"line{'s' * (n > 1)} ({lines})\n"
                )
        plot(runs, args.output, args.title, args.smooth)
    except InputError as e:
        sys.stderr.write(f"plot_metrics: {e}\n")
        return EXIT_BAD_INPUT
    last = max(int(run.series["step"][-1]) for run in runs)
    print(f"wrote {args.output} ({len(runs)} run{'s' * (len(runs) > 1)}, {last} steps max)")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
