"""The pieces of a training step that are not the model: the loss (``loss``: cross-entropy
summed over target tokens, z-loss, multi-token prediction), spike skipping (``stability``),
the weight average (``ema``) and held-out validation (``validate``).

May import: the root's cross-cutting modules, config, data, models, runtime, metrics, and
parallel (validation runs the ParallelModel). The trainer composes them; nothing below it
imports this package.
"""
