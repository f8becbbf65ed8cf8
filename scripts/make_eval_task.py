"""Turn a Hugging Face multiple-choice dataset into a titanlite task file (docs/evaluation.md).

    python scripts/make_eval_task.py FORMAT SOURCE OUT.jsonl [--split S] [--name CONFIG]
                                     [--limit N]

FORMAT is how SOURCE lays out its questions:

  hellaswag  ctx (or ctx_a and ctx_b), endings, label           (Rowan/hellaswag)
  arc        question, choices {text, label}, answerKey          (allenai/ai2_arc)
  piqa       goal, sol1, sol2, label                             (ybisk/piqa)
  mmlu       question, choices, answer                           (cais/mmlu)

SOURCE is a local file or folder of .jsonl/.json/.parquet files (a downloaded copy), or a Hub
dataset id (with --name for its config, e.g. ARC-Challenge or all; needs the network). The
prompts follow the usual zero-shot layouts: HellaSwag's context continued by each ending;
ARC and PIQA as "Question: ...\\nAnswer:" with each answer text as a choice; MMLU with the
lettered options in the question and " A" .. " D" as the choices.

Exit status: 0 written; 2 bad input (a missing source, a row without a field its format
needs, an unknown format), reported in one line; OUT is written whole or not at all.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from titanlite.errors import EXIT_USER_ERROR, UserError
from titanlite.files import atomic_write


def _hellaswag(row: dict[str, Any]) -> dict[str, Any]:
    context = row["ctx"] if row.get("ctx") else f"{row['ctx_a']} {row['ctx_b'].capitalize()}"
    endings = [" " + " ".join(e.split()) for e in row["endings"]]
    return {"context": " ".join(context.split()), "choices": endings, "label": int(row["label"])}


def _arc(row: dict[str, Any]) -> dict[str, Any]:
    texts, keys = row["choices"]["text"], list(row["choices"]["label"])
    return {
        "context": f"Question: {row['question']}\nAnswer:",
        "choices": [" " + t for t in texts],
        "label": keys.index(row["answerKey"]),
    }


def _piqa(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "context": f"Question: {row['goal']}\nAnswer:",
        "choices": [" " + row["sol1"], " " + row["sol2"]],
        "label": int(row["label"]),
    }


def _mmlu(row: dict[str, Any]) -> dict[str, Any]:
    letters = "ABCDEFGHIJ"[: len(row["choices"])]
    options = "".join(f"\n{k}. {c}" for k, c in zip(letters, row["choices"], strict=True))
    return {
        "context": f"{row['question'].strip()}{options}\nAnswer:",
        "choices": [" " + k for k in letters],
        "label": int(row["answer"]),
    }


FORMATS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "hellaswag": _hellaswag,
    "arc": _arc,
    "piqa": _piqa,
    "mmlu": _mmlu,
}


def read_rows(source: str, split: str, name: str | None) -> Iterable[dict[str, Any]]:
    """The rows of a local copy (files or a folder of them) or of a Hub dataset."""
    path = Path(source).expanduser()
    if path.exists():
        files = sorted(p for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file())
        files = [f for f in files if f.suffix in (".jsonl", ".json", ".parquet")]
        if not files:
            raise UserError(f"{source}: no .jsonl, .json or .parquet files")
        return (row for f in files for row in _read_file(f))
    if "/" not in source:
        raise UserError(f"{source!r} is neither a local file or folder nor a Hub dataset id")
    import datasets

    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(source, name, split=split)
    except Exception as e:  # noqa: BLE001 (the Hub's many failure types: one line)
        raise UserError(
            f"{source}: could not load split {split!r} from the Hub "
            f"({' '.join(str(e).split())[:200]})"
        ) from None


def _read_file(path: Path) -> Iterable[dict[str, Any]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet

        yield from pyarrow.parquet.read_table(path).to_pylist()
        return
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        yield from json.loads(text)
        return
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{number}: not JSON ({e.msg})") from None


def convert(fmt: str, rows: Iterable[dict[str, Any]], limit: int = 0) -> list[dict[str, Any]]:
    """The task lines of ``rows`` read as ``fmt``; UserError naming the row and field."""
    if fmt not in FORMATS:
        raise UserError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    lines = []
    for i, row in enumerate(rows):
        if limit and i >= limit:
            break
        try:
            line = FORMATS[fmt](row)
        except KeyError as e:
            raise UserError(
                f"row {i + 1}: no field {e.args[0]!r}, which the {fmt} format needs"
            ) from None
        except (ValueError, TypeError) as e:
            raise UserError(f"row {i + 1}: not a {fmt} row ({e})") from None
        if not 0 <= line["label"] < len(line["choices"]):
            raise UserError(f"row {i + 1}: label {line['label']} is not an index of its choices")
        lines.append(line)
    if not lines:
        raise UserError("the source holds no rows")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("format", choices=list(FORMATS))
    parser.add_argument("source", help="a local file or folder, or a Hub dataset id")
    parser.add_argument("out", type=Path, help="the task file to write (.jsonl)")
    parser.add_argument("--split", default="validation", help="Hub split (default validation)")
    parser.add_argument("--name", default=None, help="Hub config, e.g. ARC-Challenge or all")
    parser.add_argument("--limit", type=int, default=0, help="at most this many questions")
    args = parser.parse_args(argv)
    try:
        lines = convert(args.format, read_rows(args.source, args.split, args.name), args.limit)
        atomic_write(args.out, "".join(json.dumps(line) + "\n" for line in lines))
    except UserError as e:
        print(f"make_eval_task: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"wrote {len(lines)} questions to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
