"""Downstream evaluation: multiple-choice tasks scored during training (``[eval]``).

``tasks`` reads and checks task files, ``builtin`` makes the built-in task from the corpus
(both plain Python), ``evaluator`` scores them with the parallel model on every rank;
``harness`` is lm-evaluation-harness's side (scripts/eval_harness.py), outside training.

May import: ``config``, ``data``, ``metrics``, ``parallel``, ``runtime``, ``errors``,
``paths``.
"""
