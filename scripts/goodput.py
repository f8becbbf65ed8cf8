"""Goodput at scale, by simulation: full restart from checkpoints against replica groups.

Goodput: the fraction of a run's GPU-hours that trained. Failures strike running GPUs as a
Poisson process at the Llama 3 report's rate (Llama Team, "The Llama 3 Herd of Models", 2024,
section 3.3.4: 419 unexpected interruptions in 54 days on 16,384 GPUs) per GPU, x --gpus (2,048:
one every 24.7 h) x --failure-scale. Checkpoints every --save-interval-min block all GPUs
--save-s. (a) Full restart: a failure stops every GPU for detection + the scheduler's
requeue + start-up, then the steps since the last checkpoint are done again. (b) Replica groups
(torchft, github.com/pytorch/torchft) of --group-gpus: a failure takes its group out for
detection + a node's replacement + start-up + a heal from a live peer; the others pause
--pause-s, then train on at a smaller world (no steps lost, throughput per GPU unchanged);
--full-fraction of the failures (lighthouse, network, storage) still stop the job as in (a).

Analytic (renewal): a job down R s per failure cannot fail, so at rate lf it fails
lf D / (1 + lf R) times in D; each loses the age of the last checkpoint, E[X mod P] for
X ~ Exp(lf), P = interval + save: 1/lf - P/(exp(lf P) - 1), the uniform model's P/2 when lf P
is small; a group out d s at rate lg fails lg D / (1 + lg d) times. Monte-Carlo: seeded runs of
the timeline (failures drawn at the full rate, dropped where they land on hardware that is down;
checkpoints every P of up time from each start; a full restart ends every group's outage).
They agree within the Monte-Carlo's error while outages are short against the time between
failures (the analytic is first order in their product; past that, trust the Monte-Carlo).
Not modelled: correlated failures, survivors slowed by a heal, the smaller batch's effect,
planned stops. Exit 2: bad input.

Measured inputs (BENCHMARKS.md): --startup-s 16.9, titanlite's first step after the command
(a 1B model, bf16, compiled, on an H100); --pause-s 1.8, a SIGKILLed group to the survivors'
next committed step (tests/test_ft.py: 1.64-1.80 s, with the lighthouse's 2 s heartbeat timeout;
a cluster's timeout is the knob); --heal-s 8, an 8B model's fp32 weights and AdamW state per
rank of an 8-GPU group (11.2 GiB) at torchft's measured HTTP rate (1.5 GiB/s over loopback),
plus the measured quorum (0.34 s).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from titanlite.files import atomic_path, atomic_write

EXIT_OK, EXIT_BAD_INPUT = 0, 2
LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 419, 54, 16_384
RESTART = ("detect", "restart_overhead", "startup")  # what a full restart costs every GPU
OUTAGE = ("detect", "replace", "startup", "heal")  # what a group's loss costs its GPUs
CAUSES = (*RESTART, "lost_steps", "saves", "pause", "replace", "heal")
STRATEGIES = ("full_restart", "replica_groups")
GROUP_SWEEP = (8, 16, 32, 64, 128, 256, 512, 1024)
RATE_SWEEP = (0.5, 1.0, 2.0, 4.0)
SWEEPS = {"group_gpus": "GPUs per replica group", "failure_scale": "failure rate (x Llama 3's)"}


def _in(default: float, doc: str) -> Any:
    return field(default=default, metadata={"help": doc})


@dataclass(frozen=True)
class Inputs:
    """The model's inputs, in seconds unless named otherwise; the CLI's flags take dashes."""

    gpus: int = _in(2048, "GPUs in the job")
    days: float = _in(30.0, "wall-clock length of the run")
    group_gpus: int = _in(8, "GPUs per replica group (8: one node)")
    failure_scale: float = _in(1.0, "multiplies the Llama 3 per-GPU failure rate")
    detect_s: float = _in(60.0, "from a fault to the launcher acting on it")
    restart_overhead_s: float = _in(300.0, "the scheduler's requeue of the whole job")
    startup_s: float = _in(
        16.9, "titanlite's start-up to its first step (measured: a 1B model on an H100)"
    )
    save_interval_min: float = _in(30.0, "training between two checkpoints")
    save_s: float = _in(1.0, "how long a save blocks training (async: the copy to host)")
    pause_s: float = _in(
        1.8, "a group's loss to the others' next step (measured: 2 s heartbeat timeout)"
    )
    replace_s: float = _in(900.0, "a spare node running the failed group's command again")
    heal_s: float = _in(
        8.0, "the returning group's heal from a live peer (from measured rates: 8B model)"
    )
    full_fraction: float = _in(0.0, "replica groups: failures that still stop every group")

    @property
    def failures_per_s(self) -> float:
        per_gpu_s = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * 86_400 * LLAMA3_GPUS)
        return per_gpu_s * self.gpus * self.failure_scale

    def phases(self, causes: Sequence[str]) -> dict[str, float]:
        return {cause: getattr(self, cause + "_s") for cause in causes}


def _shape(p: Inputs, strategy: str) -> dict[str, float]:
    """The derived times both methods share (seconds); ``full``: failures that stop the job."""
    return {
        "rate": p.failures_per_s,
        "horizon": p.days * 86_400,
        "period": p.save_interval_min * 60 + p.save_s,
        "groups": p.gpus // p.group_gpus,
        "full": 1.0 if strategy == "full_restart" else p.full_fraction,
    }


def analytic(p: Inputs, strategy: str) -> dict:
    """Expected failures, GPU-hours lost per cause and goodput."""
    s = _shape(p, strategy)
    rate_full, rate_group = s["full"] * s["rate"], (1 - s["full"]) * s["rate"] / s["groups"]
    restart, outage = p.phases(RESTART), p.phases(OUTAGE)
    up = s["horizon"] / (1 + rate_full * sum(restart.values()))
    n_full = rate_full * up
    n_group = s["groups"] * rate_group * up / (1 + rate_group * sum(outage.values()))
    x = rate_full * s["period"]
    lost = s["period"] / 2 if x < 1e-9 else 1 / rate_full - s["period"] / math.expm1(x)
    gpu_s = dict.fromkeys(CAUSES, 0.0)
    for gpus, phases in ((n_full * p.gpus, restart), (n_group * p.group_gpus, outage)):
        for cause, seconds in phases.items():
            gpu_s[cause] += gpus * seconds
    gpu_s["lost_steps"] = n_full * p.gpus * lost
    gpu_s["saves"] = p.gpus * (up - n_full * lost) * p.save_s / s["period"]
    gpu_s["pause"] = n_group * (p.gpus - p.group_gpus) * p.pause_s
    return _result(p, n_full + n_group, gpu_s)


def _result(p: Inputs, failures: float, gpu_s: dict[str, float], se: float = 0.0) -> dict:
    lost = sum(gpu_s.values())
    return {
        "failures": failures,
        "gpu_hours_lost": {c: gpu_s[c] / 3600 for c in CAUSES},
        "goodput_pct": 100 * (1 - lost / (p.gpus * p.days * 86_400)),
        "goodput_se_pct": se,
    }


def _charge(gpu_s: dict[str, float], gpus: int, span: float, phases: dict[str, float]) -> float:
    """Charge ``gpus`` idle through ``phases`` in order, cut at ``span``; return their length."""
    for cause, seconds in phases.items():
        used = min(seconds, max(span, 0.0))
        gpu_s[cause] += gpus * used
        span -= used
    return sum(phases.values())


def _segment(gpu_s: dict[str, float], p: Inputs, s: dict[str, float], up: float, *, failed: bool):
    """A stretch of ``up`` seconds from a start: saves every period, then a failure or the end."""
    saves, age = divmod(max(up, 0.0), s["period"])
    saving = 0.0 if failed else max(age - s["period"] + p.save_s, 0.0)  # a save cut by the end
    gpu_s["saves"] += p.gpus * (saves * p.save_s + saving)
    gpu_s["lost_steps"] += p.gpus * age if failed else 0.0


def _one_run(p: Inputs, s: dict[str, float], rng: np.random.Generator) -> tuple[int, dict]:
    """One run's timeline: its failures and the GPU-seconds lost per cause."""
    gpu_s, failures = dict.fromkeys(CAUSES, 0.0), 0
    back_at = np.zeros(s["groups"])  # when each group's outage ends
    outages: list[list[float]] = []  # [start, end] of each group's outage
    t = job_up_at = 0.0
    while s["rate"] > 0 and (t := t + rng.exponential(1 / s["rate"])) < s["horizon"]:
        group = rng.integers(s["groups"])
        if t < job_up_at or back_at[group] > t:
            continue  # it lands on hardware that is down: nothing runs there, so nothing fails
        failures += 1
        if rng.random() < s["full"]:
            _segment(gpu_s, p, s, t - job_up_at, failed=True)
            for outage in outages:
                outage[1] = min(outage[1], t)  # the restart brings every group back
            back_at[:] = 0.0
            job_up_at = t + _charge(gpu_s, p.gpus, s["horizon"] - t, p.phases(RESTART))
            continue
        survivors = np.count_nonzero(back_at <= t) - 1
        gpu_s["pause"] += survivors * p.group_gpus * min(p.pause_s, s["horizon"] - t)
        back_at[group] = t + sum(p.phases(OUTAGE).values())
        outages.append([t, back_at[group]])
    _segment(gpu_s, p, s, s["horizon"] - job_up_at, failed=False)
    for start, end in outages:
        _charge(gpu_s, p.group_gpus, min(end, s["horizon"]) - start, p.phases(OUTAGE))
    return failures, gpu_s


def monte_carlo(p: Inputs, strategy: str, *, trials: int, seed: int) -> dict:
    """The mean of ``trials`` seeded runs; the goodput's standard error; MC minus analytic."""
    s = _shape(p, strategy)
    rng = np.random.default_rng(seed)
    runs = [_one_run(p, s, rng) for _ in range(trials)]
    lost = np.array([[gpu_s[c] for c in CAUSES] for _, gpu_s in runs])
    goodput = 100 * (1 - lost.sum(axis=1) / (p.gpus * s["horizon"]))
    se = float(goodput.std(ddof=1) / math.sqrt(trials))
    mean = dict(zip(CAUSES, lost.mean(axis=0).tolist(), strict=True))
    result = _result(p, float(np.mean([n for n, _ in runs])), mean, se)
    result["minus_analytic_pct"] = result["goodput_pct"] - analytic(p, strategy)["goodput_pct"]
    return result


def compare(p: Inputs, *, trials: int, seed: int) -> dict:
    """Both strategies, both methods: {strategy: {"analytic": ..., "monte_carlo": ...}}."""
    mc = {k: monte_carlo(p, k, trials=trials, seed=seed) for k in STRATEGIES}
    return {k: {"analytic": analytic(p, k), "monte_carlo": mc[k]} for k in STRATEGIES}


def sweeps(p: Inputs, *, trials: int, seed: int) -> dict:
    """Goodput % (analytic, Monte-Carlo) against the group size and against the failure rate."""

    def goodputs(q: Inputs, strategies: Sequence[str]) -> dict:
        mc = {k: monte_carlo(q, k, trials=trials, seed=seed) for k in strategies}
        return {k: [analytic(q, k)["goodput_pct"], mc[k]["goodput_pct"]] for k in strategies}

    sizes = [g for g in GROUP_SWEEP if p.gpus % g == 0 and g < p.gpus]
    restart = goodputs(p, STRATEGIES[:1])  # the same for every group size
    by_size = {g: restart | goodputs(replace(p, group_gpus=g), STRATEGIES[1:]) for g in sizes}
    scales = [p.failure_scale * x for x in RATE_SWEEP]
    by_rate = {x: goodputs(replace(p, failure_scale=x), STRATEGIES) for x in scales}
    return {"group_gpus": by_size, "failure_scale": by_rate}


def markdown(head: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = [head, ["---"] + ["---:"] * (len(head) - 1), *rows]
    return "\n".join("| " + " | ".join(map(str, row)) + " |" for row in lines)


def report(results: dict, sweep: dict) -> str:
    """The table of both strategies, then the two sweeps, as markdown."""
    rows = []
    for strategy, methods in results.items():
        for method, r in methods.items():
            se = f" ± {r['goodput_se_pct']:.4f}" if method == "monte_carlo" else ""
            lost = [*r["gpu_hours_lost"].values(), sum(r["gpu_hours_lost"].values())]
            cells = [f"{r['failures']:.2f}", *(f"{h:,.1f}" for h in lost)]
            rows.append([strategy, method, *cells, f"{r['goodput_pct']:.3f}{se}"])
    out = [markdown(["strategy", "method", "failures", *CAUSES, "lost GPU-h", "goodput %"], rows)]
    head = [f"{k} % (analytic / MC)" for k in STRATEGIES]
    pair = "{0:.3f} / {1:.3f}".format
    for key, label in SWEEPS.items():
        rows = [[x, *(pair(*v) for v in r.values())] for x, r in sweep[key].items()]
        out.append(markdown([label, *head], rows))
    return "\n\n".join(out)


def plot(sweep: dict, p: Inputs, path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: a PNG is drawn by Agg, no display needed

    fig = Figure(figsize=(11, 4.2), layout="tight")
    for ax, (key, label) in zip(fig.subplots(1, 2), SWEEPS.items(), strict=True):
        xs = list(sweep[key])
        for color, k in zip(("C0", "C1"), STRATEGIES, strict=True):
            ys = np.array([sweep[key][x][k] for x in xs])
            ax.plot(xs, ys[:, 0], "-", color=color, label=f"{k} (analytic)")
            ax.plot(xs, ys[:, 1], "o", color=color, label=f"{k} (Monte-Carlo)")
        ax.set_xscale("log", base=2)  # no minor ticks
        ax.set(xlabel=label, ylabel="goodput %", xticks=xs, xticklabels=xs)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Goodput, {p.gpus:,} GPUs over {p.days:g} days")
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    for f in fields(Inputs):
        text = f"{f.metadata['help']} (default {f.default})"
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), help=text)
    parser.add_argument("--trials", type=int, default=1000, help="Monte-Carlo runs per case")
    parser.add_argument("--seed", type=int, default=0, help="the Monte-Carlo RNG's seed")
    parser.add_argument("--json", type=Path, help="also write every number here")
    parser.add_argument("--plot", type=Path, help="a PNG of the two sweeps")
    return parser.parse_args(argv)


def problem(p: Inputs, trials: int) -> str | None:
    """What is wrong with the inputs, in one line; None when nothing is."""
    if min(asdict(p).values()) < 0 or p.gpus < 1 or p.days <= 0 or trials < 2:
        return "times, counts and rates must be >= 0; --gpus, --days > 0, --trials > 1"
    if p.group_gpus < 1 or p.gpus % p.group_gpus or p.group_gpus == p.gpus:
        return f"--group-gpus {p.group_gpus} must divide --gpus {p.gpus} in >= 2 groups"
    if p.full_fraction > 1 or p.save_interval_min <= 0:
        return "--full-fraction must be in [0, 1] and --save-interval-min > 0"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    p = Inputs(**{k: v for k in asdict(Inputs()) if (v := getattr(args, k)) is not None})
    if error := problem(p, args.trials):
        print(f"goodput.py: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    results = compare(p, trials=args.trials, seed=args.seed)
    sweep = sweeps(p, trials=args.trials, seed=args.seed)
    hours = 1 / (p.failures_per_s * 3600) if p.failures_per_s else math.inf
    print("inputs: " + ", ".join(f"{k}={v:g}" for k, v in asdict(p).items()))
    print("  (startup_s, pause_s, heal_s: from titanlite's measurements, see --help)")
    print(f"one failure every {hours:.1f} h; Monte-Carlo: {args.trials} runs, seed {args.seed}")
    tables = report(results, sweep).split("\n\n")
    print(f"\nGPU-hours lost per cause, of {p.gpus * p.days * 24:,.0f}:\n\n{tables[0]}\n")
    for k, r in results.items():
        diff, se = r["monte_carlo"]["minus_analytic_pct"], r["monte_carlo"]["goodput_se_pct"]
        print(f"{k}: Monte-Carlo - analytic = {diff:+.4f} points (standard error {se:.4f})")
    print("\n" + "\n\n".join(tables[1:]))
    if args.json:
        body = {"inputs": asdict(p), "trials": args.trials, "seed": args.seed}
        body |= {"failures_per_hour": p.failures_per_s * 3600, "results": results, "sweeps": sweep}
        atomic_write(args.json, json.dumps(body, indent=1) + "\n")
    if args.plot:
        plot(sweep, p, args.plot)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
