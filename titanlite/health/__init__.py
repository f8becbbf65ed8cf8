"""Cluster health: naming the slow rank, the hung rank and the rank whose numbers went wrong.

``settings`` is the [health] section. ``record`` keeps each rank's ring of the collectives it
entered and left (like NCCL's flight recorder, for every backend) and the time it spent
blocked in them (``record_hooks``: the entry points of torch.distributed it wraps);
``stragglers`` compares the ranks' step timings at every logged step and names a rank that
stays slower than the median; ``watchdog`` dumps every rank's stacks and collective record
when a step hangs, and ``hang_report`` reads the dumps and names the rank(s) the others wait
for;
``fingerprints`` compares what data-parallel and tensor-parallel replicas must hold
bit-identically (parameters, optimizer state) and names the rank that differs. ``monitor``
is the trainer's one handle on all of them. docs/reliability.md has the fault table.

May import: ``config``, ``errors``, ``files``. torch.distributed is its whole view of the
ranks; it never reaches into a layout.
"""
