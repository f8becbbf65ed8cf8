"""Sample text from a titanlite checkpoint.

    python scripts/generate.py --checkpoint outputs/debug/checkpoint/step-100 \
        --prompt "Mr. Speaker," --max-new-tokens 100 --temperature 0.8 --top-k 50 --seed 0

Prints the prompt followed by its continuation. --temperature 0 (the default) is greedy
decoding; generation stops at the tokenizer's end-of-sequence token.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from titanlite.errors import EXIT_USER_ERROR, UserError
from titanlite.interop.checkpoint_model import checkpoint_tokenizer, load_checkpoint_model
from titanlite.models.generate import generate


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="checkpoint folder")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--top-k", type=int, help="sample among the K most likely tokens")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (0)")
    parser.add_argument("--tokenizer", type=Path, help="sentencepiece model (default: ckpt's)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 0:
        raise UserError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise UserError(f"--top-k must be >= 1, got {args.top_k}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # Library warnings (e.g. a tied model saved untied) go to stderr; stdout is the result.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        check_args(args)
        loaded = load_checkpoint_model(args.checkpoint)
        model, model_args = loaded.model, loaded.args
        tokenizer = checkpoint_tokenizer(
            loaded.meta, args.tokenizer, model_args.vocab_size, args.checkpoint
        )
        prompt_ids = tokenizer.encode(args.prompt, bos=True, eos=False)
        if not prompt_ids:
            raise UserError("the prompt is empty and the tokenizer has no BOS token")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    model.to(args.device)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    new_ids = generate(
        model,
        prompt_ids,
        max_new_tokens=args.max_new_tokens,
        max_seq_len=model_args.max_seq_len,
        temperature=args.temperature,
        top_k=args.top_k,
        eos_id=tokenizer.eos_id if tokenizer.eos_id >= 0 else None,
        generator=generator,
    )
    # Decode prompt and continuation together (a piece's leading space depends on what
    # precedes it), then print the prompt exactly as given followed by the new text.
    prompt_text = tokenizer.decode(prompt_ids)
    full_text = tokenizer.decode(prompt_ids + new_ids)
    continuation = full_text.removeprefix(prompt_text)
    if not full_text.startswith(prompt_text):  # byte pieces merged across the boundary
        continuation = tokenizer.decode(new_ids)
    print(args.prompt + continuation)
    return 0


if __name__ == "__main__":
    sys.exit(main())
