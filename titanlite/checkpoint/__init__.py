"""Checkpoints: a dict of Stateful objects saved with torch.distributed.checkpoint.

``keys`` and ``folders`` are plain Python (the launcher and config checks use them without
torch); ``states`` holds the Stateful wrappers and ``checkpointer`` the saving and loading.

May import: ``config``, ``runtime`` (naming a lost rank), ``errors``, ``files``,
``dtypes``.
"""
