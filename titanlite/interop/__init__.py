"""Interoperation with other formats: Hugging Face folders (``hf``) and single-process use of
titanlite checkpoints (``checkpoint_model``), each through the model family's spec.

May import: ``checkpoint``, ``data`` (tokenizers), ``models``, ``errors``, ``files``.
"""
