"""titanlite's own data-parallel engine (the PyTorch DDP paper's algorithm): the module a user
holds (``engine.BucketedDDP``), the reducer that fills buckets and launches their all-reduces
during backward (``reducer``), the per-bucket communication hooks (``comm_hooks``) and the
engine's stateless building blocks (``support``). docs/ddp.md walks through it.

May import: torch and torch.distributed only; nothing else of titanlite.
"""
