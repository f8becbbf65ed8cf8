"""Coordinate check for μP: train a few steps at several widths and record, per step, the RMS
of each layer's activations (the embeddings' output, every block's output, the logits).

With μP ([mup]) the lines are flat across widths: every layer's activations keep their size
as the model widens. Without it (standard parametrization, the same learning rate), the
updates grow with width and so do the activations after a few steps. The numbers go to a
JSON file, and one PNG panel per layer plots RMS at the last step against width.

    python scripts/coord_check.py --widths 64 128 256 512 1024 --steps 5 --out coord
    python scripts/coord_check.py --no-mup ...        # the same, standard parametrization

Each width keeps the head size (``--head-dim``: heads = width / head_dim) and the debug
config's depth; ``--set section.key value`` passes any other override. Exit 2: bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "train_configs" / "debug_model.toml"


def width_args(width: int, head_dim: int) -> list[str]:
    heads = str(width // head_dim)
    return ["--model.dim", str(width), "--model.n_heads", heads, "--model.n_kv_heads", heads]


def run_width(argv: list[str], steps: int) -> dict[str, list[float]]:
    """RMS of each recorded activation at every step of a short run (one process)."""
    import torch

    from titanlite.config import load_config
    from titanlite.trainer import Trainer

    cfg = load_config(["--job.config_file", str(CONFIG), *argv])
    trainer = Trainer(cfg)
    rms: dict[str, list[float]] = {}
    current: dict[str, float] = {}

    def record(name: str) -> Any:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            out = output[0] if isinstance(output, tuple) else output
            current[name] = float(out.detach().float().pow(2).mean().sqrt())

        return hook

    model = trainer.model.parts[0]
    handles = [model.tok_embeddings.register_forward_hook(record("embeddings"))]
    for i, block in enumerate(
        model.layers.values() if hasattr(model.layers, "values") else model.layers
    ):
        handles.append(block.register_forward_hook(record(f"block {i}")))
    handles.append(model.output.register_forward_hook(record("logits")))
    try:
        it = iter(trainer.data.loader)
        for step in range(1, steps + 1):
            trainer.state.step = step
            current.clear()
            trainer.train_step(trainer.ramp.take(step, it, trainer.data.loader), log=False)
            for name, value in current.items():
                rms.setdefault(name, []).append(value)
            if not all(math.isfinite(v) for v in current.values()):
                break
    finally:
        for handle in handles:
            handle.remove()
        trainer.close()
        del trainer
        torch.set_grad_enabled(True)
    return rms


def coord_check(
    widths: list[int],
    *,
    steps: int,
    mup: bool,
    base_dim: int,
    head_dim: int,
    lr: float,
    extra: list[str] | None = None,
) -> dict[str, Any]:
    """{"widths", "mup", "rms": {width: {layer: [rms per step]}}}."""
    results: dict[str, Any] = {"widths": widths, "mup": mup, "base_dim": base_dim, "rms": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for width in widths:
            argv = [
                *width_args(width, head_dim),
                "--training.steps",
                str(steps),
                "--optimizer.lr",
                str(lr),
                "--lr_scheduler.warmup_steps",
                "0",
                "--metrics.log_freq",
                "1000",
                "--validation.enable",
                "false",
                "--checkpoint.enable",
                "false",
                "--mup.enable",
                "true" if mup else "false",
                "--mup.base_dim",
                str(base_dim),
                # The logits' RMS is read at the output projection: the unfused loss runs it.
                "--training.fused_loss",
                "false",
                "--job.dump_folder",
                str(Path(tmp) / f"w{width}"),
                *(extra or []),
            ]
            results["rms"][str(width)] = run_width(argv, steps)
            print(
                f"width {width}: "
                + ", ".join(f"{k} {v[-1]:.3g}" for k, v in results["rms"][str(width)].items()),
                flush=True,
            )
    return results


def spread(results: dict[str, Any], step: int) -> dict[str, float]:
    """Per layer: the largest RMS at ``step`` (1-based) over widths divided by the smallest."""
    per_layer: dict[str, list[float]] = {}
    for rms in results["rms"].values():
        for layer, values in rms.items():
            per_layer.setdefault(layer, []).append(values[step - 1])
    return {layer: max(v) / min(v) for layer, v in per_layer.items()}


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(next(iter(results[0]["rms"].values())))
    fig, axes = plt.subplots(
        1, len(results), figsize=(6 * len(results), 4), squeeze=False, sharey=True
    )
    for ax, res in zip(axes[0], results, strict=True):
        widths = [int(w) for w in res["rms"]]
        for layer in layers:
            ax.plot(
                widths, [res["rms"][str(w)][layer][-1] for w in widths], marker="o", label=layer
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("width (model.dim)")
        ax.set_ylabel("activation RMS at the last step")
        ax.set_title("muP" if res["mup"] else "standard parametrization")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--base-dim", type=int, default=64)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--no-mup", action="store_true", help="only the standard run")
    parser.add_argument("--both", action="store_true", help="μP and standard, side by side")
    parser.add_argument("--out", default="coord_check", help="OUT.json and OUT.png")
    parser.add_argument("--set", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"))
    args = parser.parse_args(argv)
    bad = [w for w in args.widths if w < args.head_dim or w % args.head_dim]
    if bad or args.steps < 1:
        print(
            f"coord_check.py: widths must be multiples of --head-dim {args.head_dim} and "
            f"steps >= 1 (got widths {bad or args.widths}, steps {args.steps})",
            file=sys.stderr,
        )
        return 2
    extra = [x for key, value in args.set for x in (f"--{key}", value)]
    modes = [True, False] if args.both else [not args.no_mup]
    results = [
        coord_check(
            args.widths,
            steps=args.steps,
            mup=m,
            base_dim=args.base_dim,
            head_dim=args.head_dim,
            lr=args.lr,
            extra=extra,
        )
        for m in modes
    ]
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    plot(results, out.with_suffix(".png"))
    for res in results:
        worst = max(spread(res, args.steps).values())
        name = "muP" if res["mup"] else "standard"
        print(
            f"{name}: at step {args.steps}, the largest per-layer RMS ratio over widths "
            f"{worst:.2f}x"
        )
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
