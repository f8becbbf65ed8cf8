"""A scaling ladder: train a grid of small models, fit a scaling law, predict the next size.

    python scripts/ladder.py run CONFIG --sizes 64x2 128x2 256x4 --tokens 2e5 4e5 8e5 \\
        --lrs 1e-3 3e-3 --out ladder [--set section.key value ...]
    python scripts/ladder.py run CONFIG --sizes 32x2 64x2 128x2 --tokens 0.5x 1x 2x ...
    python scripts/ladder.py fit ladder --budget 1e18 [--at N D] [--plot ladder/fit.png]
    python scripts/ladder.py transfer ladder [--plot ladder/transfer.png]

``run`` trains every size (``WIDTHxDEPTH``: model.dim x model.n_layers; heads = width /
--head-dim) at every token budget (training.steps = tokens / (batch x seq_len)) and every
learning rate, one run after the other (``--slurm`` writes an array job instead, one task per
run), each in OUT/<size>-<budget>-<lr>/. A budget is a number of tokens (``2e5``) or of tokens
per parameter (``20x``: the size's parameters are counted first, from the run's own config,
on the meta device). A run that finished (its ``ladder.json``) is not repeated: a ladder cut
short resumes where it stopped. Its loss is the last validation loss (the last training loss
without validation).

``fit`` takes the best learning rate of each (size, tokens) and fits, by least squares on the
relative residuals, the law L(N, D) = E + A / N^alpha + B / D^beta (N: parameters, D: training
tokens), and the simpler L(N) = E + A / N^alpha over the runs at the most common
tokens-per-parameter ratio (a budget given as ``20x``). It prints the parameters with
bootstrap intervals (runs resampled), the compute-optimal N and D for --budget FLOPs
(C = 6 N D) with the loss predicted there (and at any --at N D), and plots the fit with the
points (and the optimum).
``transfer`` reads a ladder run with several learning rates (with or without ``--set
mup.enable true``) and prints, per size and token budget, the loss at each learning rate and
which is best: with μP the best stays put as the width grows.

Exit 2: bad input (no finished runs, fewer runs than parameters, a malformed size or budget,
a config the runs cannot build).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
EXIT_BAD_INPUT = 2


# --------------------------------------------------------------------------- the law
@dataclass(frozen=True)
class Law:
    """L(N, D) = E + A / N^alpha + B / D^beta (B = 0: the law of N alone)."""

    E: float
    A: float
    alpha: float
    B: float = 0.0
    beta: float = 0.0

    def loss(self, n: float, d: float = math.inf) -> float:
        data = self.B / d**self.beta if self.B and math.isfinite(d) else 0.0
        return self.E + self.A / n**self.alpha + data

    def optimal(self, flops: float) -> tuple[float, float]:
        """The N and D of least loss with 6 N D = ``flops`` (needs the data term)."""
        a, b = self.alpha, self.beta
        g = (a * self.A / (b * self.B)) ** (1 / (a + b))
        n = g * (flops / 6) ** (b / (a + b))
        return n, flops / (6 * n)


def fit(points: Sequence[tuple[float, float, float]], *, with_data: bool = True) -> Law:
    """The law of ``points`` (N, D, loss), by variable projection: for given exponents the law
    is linear in E, A and B, which least squares on the relative residuals (loss - fit) / loss
    gives at once, for a whole grid of exponents (torch, float64, batched); the grid is then
    refined around its best point, three times. Coefficients must come out >= 0."""
    import torch

    n = torch.tensor([p[0] for p in points], dtype=torch.float64)
    d = torch.tensor([p[1] for p in points], dtype=torch.float64)
    y = torch.tensor([p[2] for p in points], dtype=torch.float64)

    def solve(alpha: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Coefficients [G, 3] and the sum of squared relative residuals [G] per exponent pair."""
        cols = [torch.ones_like(alpha)[:, None].expand(-1, n.numel()), n[None] ** -alpha[:, None]]
        if with_data:
            cols.append(d[None] ** -beta[:, None])
        x = torch.stack(cols, dim=-1) / y[None, :, None]  # rows weighted by 1 / loss
        gram = x.transpose(1, 2) @ x  # the normal equations: [G, k, k], tiny
        coef = torch.linalg.solve(gram, x.sum(1))
        error = ((x @ coef[..., None])[..., 0] - 1).pow(2).sum(-1)
        error[(coef < 0).any(-1) | ~torch.isfinite(error)] = math.inf
        return coef, error

    lo, hi, size = torch.tensor([0.02, 0.02]), torch.tensor([2.0, 2.0]), 120
    best = None
    for _ in range(4):
        a_axis = torch.linspace(float(lo[0]), float(hi[0]), size, dtype=torch.float64)
        b_axis = torch.linspace(
            float(lo[1]), float(hi[1]), size if with_data else 1, dtype=torch.float64
        )
        alpha, beta = (g.reshape(-1) for g in torch.meshgrid(a_axis, b_axis, indexing="ij"))
        coef, error = solve(alpha, beta)
        i = int(error.argmin())
        if not math.isfinite(float(error[i])):
            break
        best = (float(alpha[i]), float(beta[i]), coef[i].tolist())
        step = (hi - lo) / (size - 1) * 4
        centre = torch.tensor([best[0], best[1]])
        lo, hi = (centre - step).clamp(min=1e-3), centre + step
    if best is None:
        raise ValueError("no law with non-negative coefficients fits the points")
    alpha_, beta_, c = best
    if with_data:
        return Law(c[0], c[1], alpha_, c[2], beta_)
    return Law(c[0], c[1], alpha_)


def bootstrap(
    points: Sequence[tuple[float, float, float]], *, with_data: bool, samples: int, seed: int = 0
) -> list[Law]:
    """Laws fitted to ``samples`` resamplings (with replacement) of the points."""
    import random

    rng = random.Random(seed)
    laws = []
    for _ in range(samples):
        drawn = [points[rng.randrange(len(points))] for _ in points]
        if len({(p[0], p[1]) for p in drawn}) < (5 if with_data else 3):
            continue  # too few distinct runs to pin the law down
        try:
            laws.append(fit(drawn, with_data=with_data))
        except ValueError:
            continue
    return laws


def interval(values: Sequence[float]) -> tuple[float, float]:
    """The 5th and 95th percentiles."""
    ordered = sorted(v for v in values if math.isfinite(v))
    if not ordered:
        return math.nan, math.nan
    pick = lambda q: ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]  # noqa: E731
    return pick(0.05), pick(0.95)


# --------------------------------------------------------------------------- running
def parse_size(text: str) -> tuple[int, int]:
    try:
        width, depth = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"size {text!r}: expected WIDTHxDEPTH, e.g. 128x4") from None
    if width < 1 or depth < 1:
        raise ValueError(f"size {text!r}: width and depth must be positive")
    return width, depth


def parse_budget(text: str) -> tuple[float, bool]:
    """A token budget: (tokens, False) for "2e5", (tokens per parameter, True) for "20x"."""
    per_param = text.lower().endswith("x")
    try:
        value = float(text[:-1] if per_param else text)
    except ValueError:
        value = math.nan
    if not value > 0 or not math.isfinite(value):
        raise ValueError(
            f"token budget {text!r}: expected a positive number of tokens (2e5) or of tokens "
            "per parameter (20x)"
        )
    return value, per_param


def run_name(size: str, tokens: float | str, lr: float) -> str:
    """The run's folder: the budget as given ("20x") or its tokens."""
    return f"{size}-{tokens if isinstance(tokens, str) else format(tokens, 'g')}-{lr:g}"


def steps_of(tokens: float, args: argparse.Namespace) -> int:
    return max(1, round(tokens / (args.batch * args.seq_len)))


def run_argv(
    config: str, size: str, tokens: float, lr: float, args: argparse.Namespace, *, label: str = ""
) -> list[str]:
    """The trainer's arguments for one run (``label``: its budget as written, for its folder)."""
    width, depth = parse_size(size)
    steps = steps_of(tokens, args)
    heads = max(1, width // args.head_dim)
    extra = [x for key, value in args.set for x in (f"--{key}", value)]
    return [
        "--job.config_file", config,
        "--model.dim", str(width), "--model.n_layers", str(depth),
        "--model.n_heads", str(heads), "--model.n_kv_heads", str(heads),
        "--training.local_batch_size", str(args.batch), "--training.seq_len", str(args.seq_len),
        "--training.steps", str(steps), "--optimizer.lr", str(lr),
        "--checkpoint.enable", "false",
        "--job.dump_folder", str(Path(args.out) / run_name(size, label or tokens, lr)),
        *extra,
    ]  # fmt: skip


def final_loss(folder: Path) -> float | None:
    """The run's last validation loss, else its last training loss (None: no records)."""
    path = folder / "metrics.jsonl"
    if not path.exists():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    val = [r["val_loss"] for r in records if r.get("kind") == "validation" and "val_loss" in r]
    train = [r["loss"] for r in records if "loss" in r]
    return (val or train or [None])[-1]


def count_parameters(config: str, size: str, args: argparse.Namespace) -> int:
    """The parameters a run of this size trains: its model as the trainer builds it, from the
    run's own config, on the meta device (ValueError: the config's problem, in one line)."""
    import torch

    from titanlite.assembly import build_model_args
    from titanlite.checks import check
    from titanlite.config import load_config
    from titanlite.errors import UserError
    from titanlite.models.layers import count_params

    try:
        cfg = load_config(run_argv(config, size, 1, 1.0, args))
        tokenizer = check(cfg, 1)
        spec, model_args = build_model_args(cfg, tokenizer.vocab_size if tokenizer else 0)
    except UserError as e:
        problems = [line for line in str(e).split("\n") if line]
        raise ValueError(f"size {size}: " + "; ".join(problems)) from None
    with torch.device("meta"):
        return count_params(spec.build(model_args))


def plan_ladder(args: argparse.Namespace) -> list[tuple[str, str, float, float | None, float]]:
    """Every run: (size, its folder's budget label, tokens, tokens per parameter, lr)."""
    budgets = [parse_budget(t) for t in args.tokens]
    params = {}
    for size in args.sizes:
        parse_size(size)
        if any(per_param for _, per_param in budgets):
            params[size] = count_parameters(args.config, size, args)
    cells = []
    for size, (value, per_param), lr in itertools.product(args.sizes, budgets, args.lrs):
        tokens = value * params[size] if per_param else value
        tokens = float(steps_of(tokens, args) * args.batch * args.seq_len)  # as trained
        label = f"{value:g}x" if per_param else f"{value:g}"
        cells.append((size, label, tokens, value if per_param else None, lr))
    return cells


def run_ladder(args: argparse.Namespace) -> int:
    try:
        grid = plan_ladder(args)
    except ValueError as e:
        print(f"ladder.py: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.slurm:
        lines = [
            " ".join(run_argv(args.config, size, tokens, lr, args, label=label))
            for size, label, tokens, _, lr in grid
        ]
        (out / "runs.txt").write_text("\n".join(lines) + "\n")
        (out / "ladder.slurm").write_text(
            "#!/bin/bash\n#SBATCH --job-name=ladder\n"
            f"#SBATCH --array=0-{len(grid) - 1}\n#SBATCH --output={out}/slurm-%A_%a.out\n"
            f'cd {REPO}\nargs="$(sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" {out}/runs.txt)"\n'
            "./run_train.sh $args\n"
        )
        print(f"wrote {out / 'ladder.slurm'} ({len(grid)} runs): sbatch it, then ladder.py fit")
        return 0
    for i, (size, label, tokens, per_param, lr) in enumerate(grid, 1):
        folder = out / run_name(size, label, lr)
        done = folder / "ladder.json"
        if done.exists():
            print(f"[{i}/{len(grid)}] {folder.name}: done before", flush=True)
            continue
        cmd = [
            sys.executable,
            "-m",
            "titanlite.train",
            *run_argv(args.config, size, tokens, lr, args, label=label),
        ]
        print(f"[{i}/{len(grid)}] {folder.name}: training", flush=True)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "ladder.log", "w") as log:
            status = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
        loss = final_loss(folder)
        if status != 0 or loss is None:
            print(f"  failed (exit {status}); see {folder / 'ladder.log'}", file=sys.stderr)
            continue
        info = json.loads((folder / "run.json").read_text())
        width, depth = parse_size(size)
        record = {
            "size": size, "width": width, "depth": depth, "tokens": tokens, "lr": lr,
            "params": info["num_params"], "loss": loss,
        }  # fmt: skip
        if per_param is not None:
            record["tokens_per_param"] = per_param
        done.write_text(json.dumps(record))
        print(f"  loss {loss:.4f} ({info['num_params']:,} parameters)", flush=True)
    return 0


# --------------------------------------------------------------------------- fitting
def collect(out: Path) -> list[dict[str, Any]]:
    """The best learning rate's run of each (size, tokens)."""
    runs = [json.loads(p.read_text()) for p in sorted(out.glob("*/ladder.json"))]
    best: dict[tuple[str, float], dict[str, Any]] = {}
    for r in runs:
        key = (r["size"], r["tokens"])
        if key not in best or r["loss"] < best[key]["loss"]:
            best[key] = r
    return list(best.values())


def ratio_of(run: dict[str, Any]) -> float:
    """Its tokens per parameter: as the budget gave it ("20x"), else as trained (rounded)."""
    return run.get("tokens_per_param") or round(run["tokens"] / run["params"], 3)


def fit_ladder(args: argparse.Namespace) -> int:
    runs = collect(Path(args.out))
    points = [(float(r["params"]), float(r["tokens"]), float(r["loss"])) for r in runs]
    if len(points) < 5:
        print(
            f"ladder.py: {len(points)} finished (size, tokens) cells in {args.out}; the law of N "
            "and D has 5 parameters: run more of the ladder",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    law = fit(points)
    laws = bootstrap(points, with_data=True, samples=args.bootstrap)
    print(f"{len(points)} runs (best learning rate of each size and token budget)")
    print("L(N, D) = E + A / N^alpha + B / D^beta, with 90% bootstrap intervals:")
    for key in ("E", "A", "alpha", "B", "beta"):
        lo, hi = interval([getattr(x, key) for x in laws])
        print(f"  {key:5s} = {getattr(law, key):.4g}   [{lo:.4g}, {hi:.4g}]")
    residual = max(abs(math.log(law.loss(n, d) / y)) for n, d, y in points)
    print(f"  largest |log(fit / loss)| over the runs: {residual:.4f}")
    ratios = [ratio_of(r) for r in runs]
    common = max(set(ratios), key=lambda q: (ratios.count(q), q))  # ties: the largest
    fixed = [p for p, q in zip(points, ratios, strict=True) if q == common]
    if len(fixed) >= 3:
        simple = fit(fixed, with_data=False)
        print(
            f"L(N) at {common:g} tokens per parameter ({len(fixed)} runs): E = {simple.E:.4g}, "
            f"A = {simple.A:.4g}, alpha = {simple.alpha:.4g}"
        )
    optimum = None
    if args.budget:
        n_opt, d_opt = law.optimal(args.budget)
        optimum = (n_opt, law.loss(n_opt, d_opt))
        spread = [x.optimal(args.budget) for x in laws]
        (n_lo, n_hi), (d_lo, d_hi) = (
            interval([s[0] for s in spread]),
            interval([s[1] for s in spread]),
        )
        loss_lo, loss_hi = interval([x.loss(*x.optimal(args.budget)) for x in laws])
        print(f"compute-optimal at {args.budget:.3g} FLOPs (C = 6 N D):")
        print(f"  N = {n_opt:.4g} parameters   [{n_lo:.4g}, {n_hi:.4g}]")
        print(f"  D = {d_opt:.4g} tokens       [{d_lo:.4g}, {d_hi:.4g}]")
        print(f"  predicted loss {law.loss(n_opt, d_opt):.4f}   [{loss_lo:.4f}, {loss_hi:.4f}]")
    for n, d in args.at:  # a size and budget of the user's: e.g. one held out of the ladder
        lo, hi = interval([x.loss(n, d) for x in laws])
        predicted = law.loss(n, d)
        print(f"at N = {n:.4g}, D = {d:.4g}: predicted loss {predicted:.4f}   [{lo:.4f}, {hi:.4f}]")
    plot_path = Path(args.plot) if args.plot else Path(args.out) / "fit.png"
    per_param = all("tokens_per_param" in r for r in runs)
    plot(law, points, plot_path, ratios=ratios if per_param else None, optimum=optimum)
    (Path(args.out) / "fit.json").write_text(
        json.dumps({"law": law.__dict__, "runs": runs}, indent=1)
    )
    print(f"wrote {plot_path} and {Path(args.out) / 'fit.json'}")
    return 0


def transfer(args: argparse.Namespace) -> int:
    """The loss at each learning rate, per size and token budget; the best one marked."""
    runs = [json.loads(p.read_text()) for p in sorted(Path(args.out).glob("*/ladder.json"))]
    if not runs:
        print(f"ladder.py: no finished runs in {args.out}", file=sys.stderr)
        return EXIT_BAD_INPUT
    lrs = sorted({r["lr"] for r in runs})
    cells: dict[tuple[int, int, float], dict[float, float]] = {}
    for r in runs:
        cells.setdefault((r["width"], r["depth"], r["tokens"]), {})[r["lr"]] = r["loss"]
    print("| width x depth | tokens | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | best |")
    print("|---|---|" + "---|" * len(lrs) + "---|")
    best_of = {}
    for key in sorted(cells):
        losses = cells[key]
        best = min(losses, key=losses.get)
        best_of[key] = best
        row = [
            f"**{losses[lr]:.4f}**" if lr == best else f"{losses.get(lr, math.nan):.4f}"
            for lr in lrs
        ]
        print(f"| {key[0]}x{key[1]} | {key[2]:g} | " + " | ".join(row) + f" | {best:g} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for key in sorted(cells):
        xs = sorted(cells[key])
        ax.plot(xs, [cells[key][x] for x in xs], marker="o", label=f"width {key[0]}")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("final loss")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(args.plot) if args.plot else Path(args.out) / "transfer.png"
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")
    return 0


def plot(
    law: Law,
    points: Sequence[tuple[float, float, float]],
    path: Path,
    *,
    ratios: Sequence[float] | None = None,
    optimum: tuple[float, float] | None = None,
) -> None:
    """The fitted law through the runs: one line per token budget, or per tokens-per-parameter
    ratio (``ratios``, one per point: D = ratio x N along the line); ``optimum`` (N, loss)
    starred."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    keys = list(ratios) if ratios is not None else [p[1] for p in points]
    n_lo, n_hi = min(p[0] for p in points), max(p[0] for p in points) * 4
    if optimum is not None:
        n_lo, n_hi = min(n_lo, optimum[0]), max(n_hi, optimum[0] * 2)
    grid = [n_lo * (n_hi / n_lo) ** (i / 60) for i in range(61)]
    for key in sorted(set(keys)):
        if ratios is not None:
            curve, label = [law.loss(n, key * n) for n in grid], f"D = {key:g} N"
        else:
            curve, label = [law.loss(n, key) for n in grid], f"D = {key:.3g} tokens"
        line = ax.plot(grid, curve, label=label)[0]
        pts = [p for p, k in zip(points, keys, strict=True) if k == key]
        ax.scatter([p[0] for p in pts], [p[2] for p in pts], color=line.get_color())
    if optimum is not None:
        ax.scatter([optimum[0]], [optimum[1]], marker="*", s=150, color="black", zorder=3)
        ax.annotate(
            "compute-optimal", optimum, textcoords="offset points", xytext=(6, 6), fontsize=7
        )
    ax.set_xscale("log")
    ticker = matplotlib.ticker  # 1, 2 and 5 of each decade, written 2e+05
    ax.xaxis.set_major_locator(ticker.LogLocator(subs=(1, 2, 5)))
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:.0e}"))
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_xlabel("parameters N")
    ax.set_ylabel("final loss")
    ax.set_title(
        f"L = {law.E:.3g} + {law.A:.3g}/N^{law.alpha:.3g} + {law.B:.3g}/D^{law.beta:.3g}",
        fontsize=9,
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train the ladder (resumes)")
    run.add_argument("config")
    run.add_argument("--sizes", nargs="+", required=True, help="WIDTHxDEPTH ...")
    run.add_argument(
        "--tokens", nargs="+", required=True, help="budgets: tokens (2e5) or per parameter (20x)"
    )
    run.add_argument("--lrs", nargs="+", type=float, default=[1e-3])
    run.add_argument("--batch", type=int, default=4)
    run.add_argument("--seq-len", type=int, default=128)
    run.add_argument("--head-dim", type=int, default=16)
    run.add_argument("--out", default="ladder")
    run.add_argument("--slurm", action="store_true", help="write an array job instead")
    run.add_argument("--set", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"))
    fitting = sub.add_parser("fit", help="fit the law to a ladder's runs")
    fitting.add_argument("out")
    fitting.add_argument("--budget", type=float, default=0.0, help="FLOPs to plan for")
    fitting.add_argument(
        "--at", nargs=2, type=float, action="append", default=[], metavar=("N", "D"),
        help="also predict the loss of N parameters trained on D tokens",
    )  # fmt: skip
    fitting.add_argument("--bootstrap", type=int, default=50)
    fitting.add_argument("--plot", default="")
    moved = sub.add_parser("transfer", help="the best learning rate of each size")
    moved.add_argument("out")
    moved.add_argument("--plot", default="")
    args = parser.parse_args(argv)
    if args.command == "run":
        return run_ladder(args)
    if args.command == "transfer":
        return transfer(args)
    import torch

    # The fit's tensors are tiny: on a busy machine a second intra-op thread made it 10x slower.
    torch.set_num_threads(1)
    return fit_ladder(args)


if __name__ == "__main__":
    sys.exit(main())
