"""Average the model weights of several checkpoints of one run into a model-only checkpoint.

    python scripts/average_checkpoints.py outputs/run/checkpoint/step-{8000,9000,10000} \\
        --out outputs/run/averaged

Every tensor of the model state is the mean of its values in the checkpoints (summed in
float64 on the CPU of one process, stored in float32). The result is a complete titanlite
checkpoint folder (DCP "model" + titanlite.json with model_only=true, the last checkpoint's
tokenizer) that scripts/convert_to_hf.py, scripts/generate.py and checkpoint.initial_load_path
take.

The checkpoints must be of one run: in one checkpoint folder, of the same model (family and
shape); anything else is a one-line error (exit 2). Averaging the last checkpoints of a run
with a constant learning rate approximates the decay phase of a WSD schedule; the average of
the weights that training.ema_decay keeps is the running alternative (docs/stability.md).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from titanlite.errors import EXIT_USER_ERROR, UserError
from titanlite.interop.checkpoint_model import (
    CheckpointModel,
    checkpoint_tokenizer,
    load_checkpoint_model,
    save_model_checkpoint,
)
from titanlite.runtime import run_lock


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", type=Path, nargs="+", help="step-N folders of one run")
    parser.add_argument("--out", type=Path, required=True, help="folder to write (new or empty)")
    return parser.parse_args(argv)


def average(paths: Sequence[Path]) -> tuple[dict[str, torch.Tensor], CheckpointModel]:
    """(the mean model state, the last checkpoint's CheckpointModel); UserError when the
    folders are not checkpoints of one run."""
    if len({p.resolve() for p in paths}) < 2:
        raise UserError("give at least two different checkpoint folders to average")
    folders = {p.resolve().parent for p in paths}
    if len(folders) > 1:
        raise UserError(
            "the checkpoints are not of one run: they are in "
            + ", ".join(repr(str(f)) for f in sorted(folders))
        )
    total: dict[str, torch.Tensor] = {}
    first = None
    for path in paths:
        loaded = load_checkpoint_model(path)
        identity = (loaded.spec.name, loaded.args)
        if first is None:
            first = (path, identity)
        elif identity != first[1]:
            raise UserError(
                f"checkpoint folder {str(path)!r} holds another model than {str(first[0])!r} "
                f"({identity[0]} {identity[1]} vs {first[1][0]} {first[1][1]})"
            )
        for name, tensor in loaded.model.state_dict().items():
            value = tensor.detach().double()
            total[name] = total[name] + value if name in total else value.clone()
    state = {name: (value / len(paths)).float() for name, value in total.items()}
    return state, loaded


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        with run_lock.hold(args.out, "scripts/average_checkpoints.py"):
            state, last = average(args.checkpoints)
            tokenizer = checkpoint_tokenizer(
                last.meta, None, last.args.vocab_size, args.checkpoints[-1]
            )
            source = "average of " + ", ".join(str(p.resolve()) for p in args.checkpoints)
            save_model_checkpoint(
                state, last.spec, last.args, args.out, tokenizer=tokenizer, source=source
            )
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"wrote {args.out}: the average of {len(args.checkpoints)} checkpoints")
    return 0


if __name__ == "__main__":
    sys.exit(main())
