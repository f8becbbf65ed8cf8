"""The built-in tasks, made from the held-out speeches of the built-in corpus (the documents
``validation.holdout_fraction`` keeps out of training, so no run trained on them). Each
question is three consecutive sentences of a speech and four candidates for the fourth:

- ``sotu_word_order``: the true sentence and three copies of it with the words shuffled. A
  model that learned any English word order tells them apart: the debug config's run gets
  most of them right within its 100 steps, so this is the one its examples show.
- ``sotu_next_sentence``: the true sentence and three drawn from other held-out speeches. This
  needs the context: the debug run stays at chance (25%) on it; larger, longer runs do not.

The questions depend only on the corpus and the holdout fraction (fixed seeds), so every run
and every layout sees the same.
"""

from __future__ import annotations

import random
import re

from titanlite.data.sources import in_validation, sotu_files
from titanlite.downstream.tasks import Question, Task
from titanlite.errors import UserError

NAMES = ("sotu_word_order", "sotu_next_sentence")
CONTEXT_SENTENCES = 3
CHOICES = 4
SEED = 0
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def sentences(text: str) -> list[str]:
    """The sentences of a speech (split after . ! or ?; short fragments dropped)."""
    parts = [" ".join(s.split()) for s in _SENTENCE_END.split(text)]
    return [s for s in parts if 40 <= len(s) <= 300]


def build(name: str, holdout_fraction: float, limit: int) -> Task:
    """Up to ``limit`` questions of the built-in task ``name`` (0: one per four sentences of
    every held-out speech)."""
    speeches = [p.read_text(encoding="utf-8") for p in sotu_files()]
    held_out = [sentences(t) for t in speeches if in_validation(t, holdout_fraction)]
    held_out = [s for s in held_out if len(s) > CONTEXT_SENTENCES]
    if len(held_out) < 2:
        raise UserError(
            f"eval.tasks: {name} needs held-out speeches; validation.holdout_fraction "
            f"{holdout_fraction} keeps fewer than 2 of the corpus out of training"
        )
    rng = random.Random(SEED)
    questions = []
    for i, speech in enumerate(held_out):
        others = [s for j, other in enumerate(held_out) if j != i for s in other]
        for start in range(0, len(speech) - CONTEXT_SENTENCES, CONTEXT_SENTENCES + 1):
            context = " ".join(speech[start : start + CONTEXT_SENTENCES])
            true = speech[start + CONTEXT_SENTENCES]
            if name == "sotu_word_order":
                choices = [true, *(_shuffled(true, rng) for _ in range(CHOICES - 1))]
            else:
                choices = [true, *rng.sample(others, CHOICES - 1)]
            rng.shuffle(choices)
            questions.append(
                Question(context, tuple(" " + c for c in choices), choices.index(true))
            )
    rng.shuffle(questions)
    return Task(name, tuple(questions[:limit] if limit else questions))


def _shuffled(sentence: str, rng: random.Random) -> str:
    """The sentence's words in another order (sentences here have at least 40 characters)."""
    words = sentence.split()
    for _ in range(10):
        order = rng.sample(words, len(words))
        if order != words:
            return " ".join(order)
    return " ".join(reversed(words))
