"""Checkpoints: a dict of Stateful objects saved with torch.distributed.checkpoint.

``keys`` and ``folders`` are plain Python (the launcher and config checks use them without
torch); ``states`` holds the Stateful wrappers and ``checkpointer`` the saving and loading;
``formats`` is where a format of weights from above (interop's Hugging Face folders) is
registered, for initial_load_path and last_save_in_hf.

May import: ``config``, ``runtime`` (naming a lost rank), ``errors``, ``files``,
``dtypes``.
"""
