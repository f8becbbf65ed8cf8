"""The processes of a run and their life: the process group and devices (``distributed``), one
run per dump folder (``run_lock``), who is alive (``heartbeat``), signals and the agreed stop
(``stop_signals``, ``stop_vote``), the trainers' pids for the launcher (``pids``).

May import: ``errors``, ``files``, ``paths`` (and torch). Nothing of the model, data,
optimizers or config.
"""
