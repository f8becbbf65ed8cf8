"""Compare two titanlite runs step by step: do they train the same?

    python scripts/loss_compare.py RUN_A RUN_B [--rtol R] [--metrics loss grad_norm]
                                   [--plot out.png]

RUN_A and RUN_B are run dump folders (``--job.dump_folder``) or their ``metrics.jsonl``
files. The training records (validation records are ignored) are matched by step; for every
step both runs logged, the table shows each metric in A and B and their relative difference
``|A - B| / max(|A|, |B|)``, followed by the largest relative difference per metric. Of a
resumed run, each step counts as the run that continued logged it (the last record of the step;
steps a resume went back over and did not redo are left out).

Typical use: a 1-process run against the same run on N processes with the same global batch,
with ``--metrics.log_freq 1`` so that every step is logged (see docs/parity.md).

Exit status: 0 every metric within --rtol (default 1e-4) at every common step; 1 some
difference exceeds it; 2 bad input (a missing folder or file, a malformed line, no common
steps, a missing metric, matplotlib absent with --plot), reported in one line on stderr.
``--plot`` needs matplotlib: ``pip install titanlite[plot]``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from titanlite.metrics.compare import relative_difference
from titanlite.metrics.jsonl import MetricsFileError, find_metrics_file, read_metrics

EXIT_OK, EXIT_DIFFERENT, EXIT_BAD_INPUT = 0, 1, 2
DEFAULT_RTOL = 1e-4
DEFAULT_METRICS = ("loss", "grad_norm")


class InputError(Exception):
    """Bad input a user can fix; the message is the one line the script prints."""


@dataclass(frozen=True)
class Run:
    """The training records of one run, by step."""

    path: Path
    records: dict[int, dict]


@dataclass(frozen=True)
class Comparison:
    """Both runs' values of each metric on their common steps, and the relative differences."""

    steps: list[int]
    values: dict[str, list[tuple[float, float]]]
    rel_diffs: dict[str, list[float]]

    def max_rel_diff(self, metric: str) -> float:
        return max(self.rel_diffs[metric])


def load_run(run: str | Path) -> Run:
    """Training records (not validation ones) of a run, keyed by step: of a step logged twice
    (a run resumed from an earlier checkpoint) the last record, and none of the steps a
    resume abandoned (titanlite.metrics.jsonl). A malformed line is an error: a comparison
    must not quietly skip a step."""
    try:
        found = read_metrics(find_metrics_file(run))
    except MetricsFileError as e:
        raise InputError(str(e)) from None
    if found.malformed:
        bad = found.malformed[0]
        raise InputError(f"{found.path}:{bad.line}: {bad.reason}")
    if not found.train:
        raise InputError(f"{found.path}: no training records")
    return Run(found.path, found.train)


def common_steps(a: Run, b: Run) -> tuple[list[int], list[str]]:
    """(steps both runs logged, warnings naming the steps only one of them logged)."""
    steps = sorted(a.records.keys() & b.records.keys())
    if not steps:
        raise InputError(
            f"no steps in common: {a.path} logged {describe_steps(a.records)}, "
            f"{b.path} logged {describe_steps(b.records)}"
        )
    warnings = []
    for run, other in ((a, b), (b, a)):
        missing = sorted(other.records.keys() - run.records.keys())
        if missing:
            warnings.append(f"steps missing from {run.path}: {format_steps(missing)}")
    return steps, warnings


def describe_steps(records: dict[int, dict]) -> str:
    return f"{len(records)} steps ({format_steps(sorted(records))})"


def format_steps(steps: list[int], limit: int = 10) -> str:
    shown = ", ".join(map(str, steps[:limit]))
    return shown + (f", ... ({len(steps) - limit} more)" if len(steps) > limit else "")


def compare(a: Run, b: Run, steps: list[int], metrics: Sequence[str]) -> Comparison:
    values: dict[str, list[tuple[float, float]]] = {}
    for metric in metrics:
        values[metric] = [(metric_value(a, s, metric), metric_value(b, s, metric)) for s in steps]
    rel = {m: [relative_difference(x, y) for x, y in pairs] for m, pairs in values.items()}
    return Comparison(steps, values, rel)


def metric_value(run: Run, step: int, metric: str) -> float:
    value = run.records[step].get(metric)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InputError(f"{run.path}: step {step} has no numeric '{metric}'")
    return float(value)


def format_table(comparison: Comparison) -> str:
    """One row per step: step, then A, B and the relative difference of each metric."""
    metrics = list(comparison.values)
    header = ["step"]
    for m in metrics:
        header += [f"{m} A", f"{m} B", f"{m} rel"]
    rows = [header]
    for i, step in enumerate(comparison.steps):
        row = [str(step)]
        for m in metrics:
            a, b = comparison.values[m][i]
            row += [f"{a:.8g}", f"{b:.8g}", f"{comparison.rel_diffs[m][i]:.3e}"]
        rows.append(row)
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows)


def format_summary(comparison: Comparison, rtol: float) -> tuple[str, bool]:
    """Lines with the largest relative difference per metric; and whether all are within."""
    lines, ok = [], True
    for metric in comparison.values:
        worst = comparison.max_rel_diff(metric)
        within = worst <= rtol
        ok &= within
        i = comparison.rel_diffs[metric].index(worst)
        verdict = "ok" if within else "EXCEEDS"
        lines.append(
            f"max rel diff {metric}: {worst:.3e} at step {comparison.steps[i]} "
            f"(rtol {rtol:g}) {verdict}"
        )
    return "\n".join(lines), ok


def plot(a: Run, b: Run, comparison: Comparison, out: Path) -> None:
    """One panel per metric with both runs' curves over all their logged steps."""
    try:
        import matplotlib
    except ImportError:
        raise InputError(
            "--plot needs matplotlib: pip install 'titanlite[plot]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = list(comparison.values)
    fig, axes = plt.subplots(len(metrics), 1, figsize=(8, 3 * len(metrics)), squeeze=False)
    for ax, metric in zip(axes[:, 0], metrics, strict=True):
        for run, name, style in ((a, "A", "-"), (b, "B", "--")):
            steps = [s for s in sorted(run.records) if metric in run.records[s]]
            label = f"{name}: {run.path}"
            ax.plot(steps, [run.records[s][metric] for s in steps], style, label=label)
        ax.set_ylabel(metric)
        ax.legend(fontsize="small")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    try:
        fig.savefig(out)
    except OSError as e:
        raise InputError(f"cannot write plot {out}: {e.strerror}") from None
    finally:
        plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="loss_compare.py",
        description="Compare two titanlite runs' metrics step by step.",
    )
    parser.add_argument("run_a", help="run dump folder or its metrics.jsonl")
    parser.add_argument("run_b", help="run dump folder or its metrics.jsonl")
    parser.add_argument(
        "--rtol",
        type=float,
        default=DEFAULT_RTOL,
        help=f"largest allowed relative difference (default {DEFAULT_RTOL:g})",
    )
    parser.add_argument(
        "--metrics",
        nargs="+",
        default=list(DEFAULT_METRICS),
        help=f"record fields to compare (default: {' '.join(DEFAULT_METRICS)})",
    )
    parser.add_argument("--plot", type=Path, help="write a PNG of both runs' curves here")
    args = parser.parse_args(argv)
    if not args.rtol >= 0:
        parser.error(f"--rtol must be >= 0, got {args.rtol}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        a, b = load_run(args.run_a), load_run(args.run_b)
        steps, warnings = common_steps(a, b)
        comparison = compare(a, b, steps, args.metrics)
        if args.plot is not None:
            plot(a, b, comparison, args.plot)
    except InputError as e:
        sys.stderr.write(f"loss_compare: error: {e}\n")
        return EXIT_BAD_INPUT
    for warning in warnings:
        sys.stderr.write(f"loss_compare: warning: {warning}\n")
    summary, ok = format_summary(comparison, args.rtol)
    print(f"A: {a.path}\nB: {b.path}\n")
    print(format_table(comparison))
    print()
    print(summary)
    if args.plot is not None:
        print(f"plot written to {args.plot}")
    return EXIT_OK if ok else EXIT_DIFFERENT


if __name__ == "__main__":
    sys.exit(main())
