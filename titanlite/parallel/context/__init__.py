"""Context parallelism: each sequence split across the cp ranks. ``attention`` cuts the
sequence into load-balanced chunks and gathers keys and values (or, for sliding windows, only
the keys a window reaches); ``recurrent`` passes the linear-attention layers' state between
chunks instead.

May import: torch, titanlite.models.interfaces (the attention cores it points at the cp
group) and titanlite.parallel's own modules.
"""
