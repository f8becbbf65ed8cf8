"""Parallelism: how a model's work is split over ranks, applied in one fixed order by
``parallelize`` (parallelize.py, which documents the order) into the ``ParallelModel`` that
training and validation run (parallel_model.py). Owns the device mesh (dims.py), tensor,
context (context/), expert and pipeline parallelism, FSDP, titanlite's own data-parallel
engine (ddp/), activation checkpointing and compile per block, the materialization of each
rank's shards, and the rules each parallelism sets a run before it starts (rules.py).

May import: ``config``, ``models.spec``, ``models.interfaces``, ``models.init`` (the model
only through its spec and interfaces, never a family's classes), ``data.batches`` (the
ignored label), ``dtypes``, ``errors``. The loss comes in as a value (``LossSum``).
"""
