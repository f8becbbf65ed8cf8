"""What each parallelism needs of the model and the other settings, checked before a run
starts (rules of ``titanlite.config.planned``). Plain Python: the launcher's preflight runs
them without torch; the parallelisms themselves assume them.
"""

from __future__ import annotations

from titanlite.config.layout import pipeline_plan
from titanlite.config.planned import PlannedRun
from titanlite.errors import Problems


def tensor(run: PlannedRun) -> list[str]:
    """Tensor parallelism splits heads, hidden sizes and (sequence parallelism) the sequence."""
    d = run.degrees
    if d is None:
        return []
    lines = []
    if run.args is not None:
        for key, value in run.spec.tp_divisible(run.args).items():
            if value % d.tp:
                lines.append(
                    f"parallelism.tensor_parallel_degree {d.tp} does not divide model.{key} {value}"
                )
    seq_len = run.cfg.training.seq_len
    if d.cp == 1 and seq_len % d.tp:  # with cp, ``context`` checks the finer split
        lines.append(
            f"parallelism.tensor_parallel_degree {d.tp} does not divide training.seq_len "
            f"{seq_len} (sequence parallelism splits the sequence)"
        )
    return lines


def pipeline(run: PlannedRun) -> list[str]:
    """The pipeline split and schedule, and FSDP settings that give wrong results with it."""
    d = run.degrees
    if d is None or d.pp == 1 or run.args is None:
        return []
    problems = Problems()
    p = run.cfg.parallelism
    with problems.check():
        pipeline_plan(p, d, run.args.n_layers, run.cfg.training.local_batch_size)
    if "ZeroBubble" in p.pipeline_parallel_schedule and p.fsdp_reshard_after_forward == "always":
        problems.add(
            f"parallelism.fsdp_reshard_after_forward always gives wrong gradients with the "
            f"{p.pipeline_parallel_schedule} schedule (torch 2.13); use default or never"
        )
    return problems.lines


def context(run: PlannedRun) -> list[str]:
    """What context parallelism needs: sequences that split into 2 chunks per cp rank, each
    rank's share split again by sequence parallelism; no pipeline stages (not built yet)."""
    d = run.degrees
    if d is None or d.cp == 1:
        return []
    lines = []
    cp, tp, seq = d.cp, d.tp, run.cfg.training.seq_len
    if seq % (2 * cp * tp):
        lines.append(
            f"training.seq_len {seq} is not divisible by 2 x context_parallel_degree x "
            f"tensor_parallel_degree = 2 x {cp} x {tp} = {2 * cp * tp}"
        )
    if d.pp > 1:
        lines.append(
            "parallelism: context parallelism does not combine with pipeline parallelism yet; "
            "set context_parallel_degree or pipeline_parallel_degree to 1"
        )
    return lines


def experts(run: PlannedRun) -> list[str]:
    """Expert parallelism needs experts, as many as a multiple of its degree."""
    d = run.degrees
    if d is None or run.args is None:
        return []
    if run.spec.experts:
        if d.ep > 1 and run.args.num_experts % d.ep:
            return [
                f"parallelism.expert_parallel_degree {d.ep} does not divide model.num_experts "
                f"{run.args.num_experts}"
            ]
    elif d.ep > 1:
        return [
            f"parallelism.expert_parallel_degree {d.ep}: {run.cfg.model.name} has no experts "
            "(a mixture-of-experts model such as qwen3_moe has); set it to 1"
        ]
    return []


RULES = (tensor, pipeline, context, experts)
"""Every parallelism's rules, in the order their problems are listed."""
