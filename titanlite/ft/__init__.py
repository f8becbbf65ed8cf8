"""Fault tolerance across replica groups (torchft): the data-parallel world split into groups,
each an ordinary titanlite job (any layout inside), averaging gradients across the groups
through torchft's Manager; a group that fails leaves the quorum and the others train on, and
when it comes back it heals from a live peer and rejoins (docs/fault_tolerance.md).

``settings`` is the [fault_tolerance] section (TorchTitan's key names) and its checks;
``replicas`` is the trainer's handle: the Manager of this rank, the step protocol (quorum,
the gradient average across groups, commit) and the state a healing group receives.

May import: ``config``, ``runtime``, ``parallel.ddp``, ``errors``. torchft only when
fault tolerance is on (the ``ft`` extra).
"""
