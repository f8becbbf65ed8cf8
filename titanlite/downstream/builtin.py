"""The built-in task, ``sotu_next_sentence``: which sentence comes next?

Made from the held-out speeches of the built-in corpus (the documents
``validation.holdout_fraction`` keeps out of training, so the model never trained on them):
each question is three consecutive sentences of a speech and four candidates for the fourth,
the true one and three drawn from other held-out speeches. Chance is 25%; a model that learned
some English and some of the speeches' style does better. The questions depend only on the
corpus and the holdout fraction (a fixed seed), so every run and every layout sees the same.
"""

from __future__ import annotations

import random
import re

from titanlite.data.sources import in_validation, sotu_files
from titanlite.downstream.tasks import Question, Task

NAME = "sotu_next_sentence"
CONTEXT_SENTENCES = 3
CHOICES = 4
SEED = 0
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def sentences(text: str) -> list[str]:
    """The sentences of a speech (split after . ! or ?; short fragments dropped)."""
    parts = [" ".join(s.split()) for s in _SENTENCE_END.split(text)]
    return [s for s in parts if 40 <= len(s) <= 300]


def build(holdout_fraction: float, limit: int) -> Task:
    """Up to ``limit`` questions (0: one per four sentences of every held-out speech)."""
    speeches = [p.read_text(encoding="utf-8") for p in sotu_files()]
    held_out = [sentences(t) for t in speeches if in_validation(t, holdout_fraction)]
    held_out = [s for s in held_out if len(s) > CONTEXT_SENTENCES]
    if len(held_out) < 2:
        from titanlite.errors import UserError

        raise UserError(
            f"eval.tasks: {NAME} needs held-out speeches; validation.holdout_fraction "
            f"{holdout_fraction} keeps fewer than 2 of the corpus out of training"
        )
    rng = random.Random(SEED)
    questions = []
    for i, speech in enumerate(held_out):
        others = [s for j, other in enumerate(held_out) if j != i for s in other]
        for start in range(0, len(speech) - CONTEXT_SENTENCES, CONTEXT_SENTENCES + 1):
            context = " ".join(speech[start : start + CONTEXT_SENTENCES])
            true = speech[start + CONTEXT_SENTENCES]
            choices = [true, *rng.sample(others, CHOICES - 1)]
            rng.shuffle(choices)
            questions.append(Question(context, tuple(" " + c for c in choices), choices.index(true)))  # fmt: skip
    rng.shuffle(questions)
    return Task(NAME, tuple(questions[:limit] if limit else questions))
