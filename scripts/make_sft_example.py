"""Write the shipped SFT example's conversations (titanlite/assets/sft_arithmetic.jsonl):
small arithmetic questions and their answers, some with a system turn, some as
prompt/completion pairs, all made here from a fixed seed (nothing downloaded).

    python scripts/make_sft_example.py [--out PATH] [--count N]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "titanlite" / "assets" / "sft_arithmetic.jsonl"
OPS = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b, "times": lambda a, b: a * b}


def conversation(rng: random.Random) -> dict:
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    word = rng.choice(sorted(OPS))
    question = f"What is {a} {word} {b}?"
    answer = f"{a} {word} {b} is {OPS[word](a, b)}."
    if rng.random() < 0.25:
        return {"prompt": question, "completion": answer}
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": "Answer in one short sentence."})
    if rng.random() < 0.3:
        c = rng.randint(1, 9)
        messages += [
            {"role": "user", "content": f"And plus {c}?"},
            {"role": "assistant", "content": f"That makes {OPS[word](a, b) + c}."},
        ]
    return {"messages": messages}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--count", type=int, default=400)
    args = parser.parse_args(argv)
    if args.count < 1:
        print("error: --count must be at least 1", file=sys.stderr)
        return 2
    rng = random.Random(0)
    lines = [json.dumps(conversation(rng)) for _ in range(args.count)]
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}: {args.count} conversations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
