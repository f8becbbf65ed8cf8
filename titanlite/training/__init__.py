"""The pieces of a training step that are not the model: the loss (``loss``: cross-entropy
summed over target tokens, z-loss, multi-token prediction), spike skipping (``stability``),
the weight average (``ema``) and held-out validation (``validate``).

May import: ``config``, ``data``, ``models``, ``runtime``, ``metrics``, ``parallel``
(validation runs the ParallelModel), ``errors``. Only the root's entry modules import this
package.
"""
