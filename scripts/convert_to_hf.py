"""Export a titanlite checkpoint as a Hugging Face folder (LlamaForCausalLM, Qwen3ForCausalLM).

    python scripts/convert_to_hf.py outputs/debug/checkpoint/step-100 hf/debug [--dtype bfloat16]
    python scripts/convert_to_hf.py ... --ema    # the average of the weights (training.ema_decay)
    python scripts/convert_to_hf.py ... --merge-lora  # a LoRA run: adapters merged into the base
    python scripts/convert_to_hf.py STEP peft/adapter --peft-adapter  # its adapters alone, for PEFT

Writes config.json, model.safetensors (or model-0000X-of-0000Y.safetensors + an index when
larger than --max-shard-size) and the tokenizer (sentencepiece or tokenizer.json), loadable with
``transformers.AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``. The
folder is written atomically and only replaces an empty folder or an earlier export. Writing
into a run's folder, the script holds that folder's run.lock meanwhile, and refuses with one
line while a run holds it.

With --peft-adapter, OUT becomes a PEFT adapter folder instead (adapter_config.json and
adapter_model.safetensors, for ``peft.PeftModel.from_pretrained`` on the HF model of the base
the run trained on; titanlite.interop.peft_export).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from titanlite.dtypes import DTYPES
from titanlite.errors import EXIT_USER_ERROR, UserError
from titanlite.interop.export import export_checkpoint
from titanlite.interop.hf import parse_size
from titanlite.interop.peft_export import export_peft_adapter
from titanlite.runtime import run_lock


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="titanlite checkpoint folder (step-N)")
    parser.add_argument("out", type=Path, help="HF folder to write (new, empty or an export)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--max-shard-size", default="5GB", help="largest safetensors file (5GB; 500MB, 2GiB)"
    )
    parser.add_argument(
        "--ema",
        action="store_true",
        help="export the checkpoint's average of the weights (training.ema_decay)",
    )
    parser.add_argument(
        "--merge-lora",
        action="store_true",
        help="a LoRA run's checkpoint: merge its adapters into the base model it trained on",
    )
    parser.add_argument(
        "--peft-adapter",
        action="store_true",
        help="a LoRA run's checkpoint: write its adapters as a PEFT adapter folder (for the "
        "HF model of its base)",
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        help="sentencepiece model or tokenizer.json (default: the checkpoint's)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # Library warnings (e.g. a tied model saved untied) go to stderr; stdout is the result.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.peft_adapter:
        return _peft_adapter(args)
    try:
        with run_lock.hold(args.out, "scripts/convert_to_hf.py"):
            exported = export_checkpoint(
                args.checkpoint,
                args.out,
                dtype=DTYPES[args.dtype],
                max_shard_bytes=parse_size(args.max_shard_size),
                ema=args.ema,
                tokenizer=args.tokenizer,
                merge_lora=args.merge_lora,
            )
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    files = ", ".join(exported.files)
    print(f"wrote {args.out} ({args.dtype}, step {exported.step}): {files}")
    return 0


def _peft_adapter(args: argparse.Namespace) -> int:
    """--peft-adapter: the adapters alone, as a PEFT adapter folder."""
    given = [f for f, on in (("--merge-lora", args.merge_lora), ("--ema", args.ema)) if on]
    if args.tokenizer is not None:
        given.append("--tokenizer")
    try:
        if given:
            raise UserError(f"--peft-adapter writes the adapters alone: drop {', '.join(given)}")
        with run_lock.hold(args.out, "scripts/convert_to_hf.py"):
            exported = export_peft_adapter(args.checkpoint, args.out, dtype=DTYPES[args.dtype])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    base = exported.base
    if not exported.hf_base:
        base = f"the titanlite checkpoint {base}: load the adapters onto its HF export"
    print(
        f"wrote {args.out} (PEFT LoRA adapter, {args.dtype}, step {exported.step}, rank "
        f"{exported.rank}, {exported.modules} linears; base {base}): {', '.join(exported.files)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
