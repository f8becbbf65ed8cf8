"""What a run reports: loggers (console, metrics.jsonl, wandb, TensorBoard) and device facts
(``loggers``), reading metrics.jsonl back (``jsonl``), run.json and the step line
(``run_info``), profiling traces (``profiling``), mixture-of-experts routing statistics
(``moe_tracker``), and how two runs' numbers are compared (``compare``).

May import: ``config``, ``models``, ``optim`` (resolved groups, for run.json), ``files``,
``errors`` and ``titanlite`` itself (when the process began importing it). Never parallel/,
training/ or the trainer.
"""
