"""Context parallelism: each sequence split across the cp ranks. ``attention`` cuts the
sequence into load-balanced chunks and gathers keys and values; ``window`` plans and runs
the exchange of only the keys a sliding window reaches, for windowed layers; ``recurrent``
passes the linear-attention layers' state between chunks instead.

May import: torch, ``models.interfaces`` (the attention cores it points at the cp group)
and titanlite.parallel's own modules (``parallel.expert``: the all-to-all).
"""
