"""Interoperation with other formats: Hugging Face folders (``hf``; read straight into a run's
shards by ``hf_reader``, written from them by ``hf_writer``, a run's initial_load_path
described by ``source``; LoRA adapters merged by ``lora_merge`` or written as a PEFT adapter
folder by ``peft_export``) and single-process use of titanlite checkpoints
(``checkpoint_model``), each through the model family's spec.

May import: ``checkpoint``, ``data`` (tokenizers), ``models``, ``errors``, ``files``,
``paths`` (a run's tokenizer, saved with its weights).
"""
