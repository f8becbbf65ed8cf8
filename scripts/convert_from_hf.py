"""Import a Hugging Face folder as a titanlite checkpoint (model weights only).

    python scripts/convert_from_hf.py hf/llama-folder outputs/init/step-0

The result is a complete titanlite checkpoint folder (DCP "model" + titanlite.json with
model_only=true), usable as ``checkpoint.initial_load_path`` or by scripts/generate.py.
Reads config.json and model.safetensors (or a sharded index); the folder's tokenizer
(tokenizer.json with its tokenizer_config.json, else tokenizer.model), if any, is copied in.
Weights are stored in float32, as titanlite trains; quantized published checkpoints are
dequantized first: FP8 weights with per-block scales (DeepSeek-V3 and Kimi K2: config.json's
quantization_config, ``*.weight_scale_inv``) and MXFP4 experts (gpt-oss: ``*_blocks`` and
``*_scales``).
Writing into a run's folder (e.g. outputs/debug/checkpoint/step-0), the script holds that
folder's run.lock meanwhile, and refuses with one line while a run holds it.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from titanlite.data.tokenizer import HF_TOKENIZER_FILE, SENTENCEPIECE_FILE, load_tokenizer
from titanlite.errors import EXIT_USER_ERROR, UserError
from titanlite.interop.checkpoint_model import save_model_checkpoint
from titanlite.interop.hf import load_hf
from titanlite.runtime import run_lock

TOKENIZER_FILES = (HF_TOKENIZER_FILE, SENTENCEPIECE_FILE)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hf_dir", type=Path, help="folder with config.json and *.safetensors")
    parser.add_argument("out", type=Path, help="checkpoint folder to write (new or empty)")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        help="sentencepiece model or tokenizer.json (default: the one in HF_DIR, if any)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # Library warnings (e.g. a tied model saved untied) go to stderr; stdout is the result.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        with run_lock.hold(args.out, "scripts/convert_from_hf.py"):
            state, spec, model_args = load_hf(args.hf_dir)
            tokenizer = None
            has_tokenizer = any((args.hf_dir / name).is_file() for name in TOKENIZER_FILES)
            if args.tokenizer is not None or has_tokenizer:
                tokenizer = load_tokenizer(args.tokenizer or args.hf_dir)
            if tokenizer is not None and tokenizer.vocab_size > model_args.vocab_size:
                raise UserError(f"tokenizer {str(tokenizer.path)!r} has more tokens than the model")
            state = {name: tensor.float() for name, tensor in state.items()}
            save_model_checkpoint(
                state,
                spec,
                model_args,
                args.out,
                tokenizer=tokenizer,
                source=str(args.hf_dir.resolve()),
            )
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    note = "" if tokenizer else " (no tokenizer: pass --tokenizer to generate.py)"
    print(f"wrote {args.out}: {spec.name} {model_args}{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
