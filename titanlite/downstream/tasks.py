"""Downstream tasks: multiple-choice questions a model answers by likelihood, and completions.

A task is a JSONL file, one question per line::

    {"context": "The capital of France is", "choices": [" Paris", " Rome"], "label": 0}

``context`` (a string), ``choices`` (two or more strings, each the text that follows the
context, leading space included where the words need one) and ``label`` (the index of the right
choice) are required; other fields are ignored. HellaSwag, ARC, PIQA and MMLU are laid out like
this (``scripts/make_eval_task.py`` converts them). The model's answer is the choice whose
tokens have the largest summed log-likelihood after the context (``acc``), or the largest per
character of the choice (``acc_norm``, which does not favour short choices).

A completion task's lines have ``context`` and ``target`` instead::

    {"context": "2 + 2 =", "target": " 4"}

scored by exact match (greedy decoding from the context produces exactly the target's tokens:
at every target position the target token is the most likely one) and by the target's
log-likelihood. A file holds one kind of line.

Everything here is plain Python: tasks are read and checked before training starts, so a bad
file is a one-line error naming the file and line, never a failure mid-run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from titanlite.errors import UserError

if TYPE_CHECKING:
    from titanlite.data.tokenizer import Tokenizer


@dataclass(frozen=True)
class Question:
    context: str
    choices: tuple[str, ...]  # a completion task's one target
    label: int
    completion: bool = False


@dataclass(frozen=True)
class Task:
    name: str
    questions: tuple[Question, ...]

    @property
    def completion(self) -> bool:
        return self.questions[0].completion


def encode_pair(
    tokenizer: Tokenizer, context: str, continuation: str
) -> tuple[list[int], list[int]]:
    """The tokens of ``context`` (BOS first) and of ``continuation`` after it, as running text
    encodes them: the whole text is encoded once and split after the context's own tokens,
    whitespace ending the context moving to the continuation (lm-evaluation-harness's rule, so
    ``scripts/eval_harness.py`` scores the same tokens). Encoded alone, a continuation would
    not be running text: a sentencepiece tokenizer starts " Paris" with a lone word-start
    token that "... is Paris" never has."""
    head = tokenizer.encode(context.rstrip(), bos=True, eos=False)
    whole = tokenizer.encode(context + continuation, bos=True, eos=False)
    return head, whole[len(head) :]


def read_task(path: Path) -> Task:
    """The questions of a task file; UserError naming the file and line of any problem."""
    if not path.is_file():
        raise UserError(f"eval.tasks: {str(path)!r} is not a file (nor a built-in task)")
    questions = []
    with path.open(encoding="utf-8") as f:
        try:
            for number, line in enumerate(f, 1):
                if line.strip():
                    questions.append(_question(line, f"{path}:{number}"))
        except UnicodeDecodeError:
            raise UserError(f"eval.tasks: {path} is not UTF-8 text") from None
    if not questions:
        raise UserError(f"eval.tasks: {path} holds no questions")
    if len({q.completion for q in questions}) > 1:
        raise UserError(
            f"eval.tasks: {path} mixes multiple-choice and completion lines; use one kind per file"
        )
    return Task(path.stem, tuple(questions))


def _question(line: str, where: str) -> Question:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not a JSON object ({e.msg})") from None
    if not isinstance(row, dict):
        raise UserError(f"{where}: not a JSON object")
    if not isinstance(row.get("context"), str):
        raise UserError(
            f"{where}: context must be a string"
            if "context" in row
            else f"{where}: missing context"
        )
    if "target" in row and "choices" not in row:  # a completion
        if not isinstance(row["target"], str) or not row["target"]:
            raise UserError(f"{where}: target must be a non-empty string")
        return Question(row["context"], (row["target"],), 0, completion=True)
    missing = [k for k in ("choices", "label") if k not in row]
    if missing:
        raise UserError(
            f"{where}: missing {', '.join(missing)} "
            "(a question needs context, choices and label; a completion context and target)"
        )
    context, choices, label = row["context"], row["choices"], row["label"]
    if (
        not isinstance(choices, list)
        or len(choices) < 2
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise UserError(f"{where}: choices must be a list of two or more non-empty strings")
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(choices):
        raise UserError(f"{where}: label {label!r} is not an index of the {len(choices)} choices")
    return Question(context, tuple(choices), label)
