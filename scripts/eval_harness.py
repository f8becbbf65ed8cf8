"""Score a titanlite checkpoint with EleutherAI's lm-evaluation-harness.

    python scripts/eval_harness.py outputs/debug/checkpoint/step-100 --tasks hellaswag,arc_easy
    python scripts/eval_harness.py CHECKPOINT --tasks my_tasks/tiny.yaml --limit 100 --output r.json
    python scripts/eval_harness.py CHECKPOINT --tasks my_tasks/ --ema --keep-hf hf/debug

The checkpoint is exported as a Hugging Face folder (what scripts/convert_to_hf.py writes) into
a temporary folder, removed afterwards whatever happens (``--keep-hf DIR`` writes and keeps it
there instead), and lm-eval scores it with its own "hf" model: the numbers are the harness's,
comparable with published ones. ``--tasks`` takes lm-eval's task names (and glob patterns),
task YAML files and folders of them. Needs lm-eval: pip install 'lm-eval[hf]' (or the
repository's harness extra). Bad input is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from titanlite.checkpoint.folders import read_sidecar
from titanlite.downstream import harness
from titanlite.dtypes import DTYPES
from titanlite.errors import EXIT_USER_ERROR, UserError
from titanlite.files import atomic_write
from titanlite.interop.export import export_checkpoint
from titanlite.runtime import run_lock


def positive_int(text: str, least: int = 1) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{text} is less than {least}")
    return value


def count(text: str) -> int:
    return positive_int(text, least=0)


def batch_size(text: str) -> int | str:
    return text if text == "auto" or text.startswith("auto:") else positive_int(text)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="titanlite checkpoint folder (step-N)")
    parser.add_argument(
        "--tasks",
        required=True,
        help="comma-separated lm-eval task names or glob patterns, task YAML files, "
        "folders of them",
    )
    parser.add_argument(
        "--include-path",
        type=Path,
        action="append",
        default=[],
        help="a folder of task YAML files whose task and group names --tasks may use (repeatable)",
    )
    parser.add_argument("--limit", type=positive_int, help="at most this many examples per task")
    parser.add_argument("--num-fewshot", type=count, help="examples in each prompt (task default)")
    parser.add_argument(
        "--batch-size", type=batch_size, default=8, help="sequences per forward, or auto (8)"
    )
    parser.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--ema", action="store_true", help="score the average of the weights (training.ema_decay)"
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        help="sentencepiece model or tokenizer.json (default: the checkpoint's)",
    )
    parser.add_argument("--output", type=Path, help="write lm-eval's results here (JSON)")
    parser.add_argument(
        "--log-samples", action="store_true", help="with --output: every scored example too"
    )
    parser.add_argument(
        "--keep-hf",
        type=Path,
        metavar="DIR",
        help="export into DIR and keep it (new, empty or an export)",
    )
    args = parser.parse_args(argv)
    if args.log_samples and args.output is None:
        parser.error("--log-samples writes the samples into --output FILE: give one")
    return args


def check_output(path: Path | None) -> None:
    if path is not None and (path.is_dir() or not path.parent.is_dir()):
        why = "is a folder" if path.is_dir() else "is in no existing folder"
        raise UserError(f"--output {str(path)!r} {why}")


def check_device(name: str | None) -> str:
    """The torch device to score on: ``name``, else cuda when there is one, else cpu."""
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(name).type
    except RuntimeError:
        raise UserError(
            f"--device {name!r} is not a torch device (cpu, cuda, cuda:1, ...)"
        ) from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name}: no CUDA device is available")
    return name


def run(args: argparse.Namespace) -> dict:
    """Check everything, export, score; lm-eval's results with a titanlite section. The
    checks that need no lm-eval come first (quick), then lm-eval's (task names, datasets),
    then the export, which can take long for a large model."""
    check_output(args.output)
    device = check_device(args.device)
    read_sidecar(args.checkpoint)
    items = [t.strip() for t in args.tasks.split(",") if t.strip()]
    selection = harness.select_tasks(items, args.include_path)
    if not selection.specs:
        raise UserError("--tasks names no task")
    harness.import_lm_eval()
    manager = harness.task_manager(selection)
    tasks = harness.load_tasks(manager, selection)
    with tempfile.TemporaryDirectory(prefix="titanlite-harness-") as tmp:
        folder = args.keep_hf or Path(tmp) / "hf"
        with run_lock.hold(folder, "scripts/eval_harness.py"):
            exported = export_checkpoint(
                args.checkpoint,
                folder,
                dtype=DTYPES[args.dtype],
                ema=args.ema,
                tokenizer=args.tokenizer,
            )
        results = harness.evaluate(
            folder,
            tasks,
            manager,
            device=device,
            dtype=args.dtype,
            batch_size=args.batch_size,
            limit=args.limit,
            num_fewshot=args.num_fewshot,
            log_samples=args.log_samples,
        )
    results["titanlite"] = {
        "checkpoint": str(args.checkpoint.resolve()),
        "step": exported.step,
        "weights": "ema" if args.ema else "model",
        "dtype": args.dtype,
        "device": device,
    }
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # lm-eval and transformers report progress and warnings on stderr; stdout is the result.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        results = run(args)
    except UserError as e:
        print(f"eval_harness: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    if args.output is not None:
        atomic_write(args.output, json.dumps(results, indent=2, default=harness.json_value) + "\n")
    results.pop("samples", None)
    info = results["titanlite"]
    print(
        f"{args.checkpoint} (step {info['step']}, {info['weights']} weights, "
        f"{args.dtype} on {info['device']})"
    )
    print(harness.results_tables(results))
    if args.output is not None:
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
