"""[fault_tolerance]: replica groups through torchft, with TorchTitan's key names. Plain
Python: torchft is only looked for, not imported."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass
from typing import Any, Literal

from titanlite.config.catalog import Section
from titanlite.config.planned import PlannedRun

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


@dataclass
class FaultTolerance:
    """[fault_tolerance]: train as one of several replica groups that fail, heal and rejoin
    without stopping the others (docs/fault_tolerance.md; needs torchft:
    pip install 'titanlite[ft]')."""

    enable: bool = False
    """Join the replica groups through torchft's lighthouse."""
    replica_id: int = 0
    """This group's id, 0 .. group_size - 1 (each group reads its own share of the data)."""
    group_size: int = 0
    """How many replica groups the run has (TorchTitan's name): the data is split into that
    many shares, one per group."""
    min_replica_size: int = 1
    """Groups that must take part in a step for it to count (fewer: the step is not taken)."""
    lighthouse: str = ""
    """The lighthouse's address, e.g. http://host:29510 ("" = the TORCHFT_LIGHTHOUSE
    environment variable)."""
    process_group: Literal["gloo", "nccl"] = "gloo"
    """The backend of the process group across groups."""
    process_group_timeout_ms: int = 10000
    """How long a collective across groups may take before the group it waits for is
    counted out of the step."""
    quorum_timeout_s: float = 60.0
    """How long a step waits for the quorum (the lighthouse's answer) before the run stops
    with exit status 4."""
    semi_sync_method: Literal["", "diloco", "local_sgd"] = ""
    """"" = gradients averaged across groups at every step; "diloco" = each group takes
    sync_steps steps of its own, then the groups average how far they moved and an outer
    optimizer (SGD, Nesterov momentum) applies it (Streaming DiLoCo with num_fragments > 1);
    "local_sgd" = the groups average their weights every sync_steps steps (DiLoCo with
    outer_lr 1 and no momentum). docs/fault_tolerance.md says which to choose."""
    sync_steps: int = 5
    """(semi_sync_method) inner steps between two synchronizations of the whole model."""
    num_fragments: int = 1
    """(semi_sync_method = diloco) fragments of consecutive blocks, synchronized one at a
    time every sync_steps / num_fragments steps (Streaming DiLoCo); must divide sync_steps."""
    fragment_sync_delay: int = 0
    """(semi_sync_method = diloco) steps a fragment's exchange overlaps: it is sent this many
    steps before it is applied (less than sync_steps / num_fragments)."""
    fragment_update_alpha: float = 0.0
    """(semi_sync_method = diloco) weight of a group's own parameters when a fragment is
    merged after a synchronization (0 = take the global ones)."""
    should_quantize: bool = False
    """(semi_sync_method = diloco) exchange the pseudo-gradients in 8 bits (torchft; needs a
    GPU with triton, ignored on the CPU)."""
    outer_lr: float = 0.7
    """(semi_sync_method = diloco) the outer optimizer's learning rate."""
    outer_momentum: float = 0.9
    """(semi_sync_method = diloco) the outer optimizer's Nesterov momentum (0 = none)."""


def semi_sync(settings: FaultTolerance) -> FaultTolerance | None:
    """The settings DiLoCo runs with (local_sgd is DiLoCo with outer_lr 1 and no momentum),
    or None when gradients are averaged at every step."""
    if not settings.enable or not settings.semi_sync_method:
        return None
    if settings.semi_sync_method == "local_sgd":
        return dataclasses.replace(settings, outer_lr=1.0, outer_momentum=0.0, num_fragments=1)
    return settings


def sync_period(settings: FaultTolerance) -> int:
    """Inner steps between two fragment synchronizations."""
    return settings.sync_steps // max(settings.num_fragments, 1)


def group_folder(settings: FaultTolerance, dump_folder: str) -> str:
    """Each replica group's own folder under job.dump_folder (its run lock, metrics and
    checkpoints): replica-<id>; the folder itself without fault tolerance."""
    if not settings.enable:
        return dump_folder
    return os.path.join(dump_folder, f"replica-{settings.replica_id}")


def data_share(settings: FaultTolerance, batch_rank: int, batch_size: int) -> dict[str, int]:
    """This rank's share of the data: across replica groups as data parallelism is within
    one (group g's ranks read shares g x batch_size ... g x batch_size + batch_size - 1)."""
    if not settings.enable:
        return {"dp_rank": batch_rank, "dp_world_size": batch_size}
    return {
        "dp_rank": settings.replica_id * batch_size + batch_rank,
        "dp_world_size": settings.group_size * batch_size,
    }


def lighthouse_address(settings: FaultTolerance) -> str:
    return settings.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")


def check(cfg: Any, problems: Any) -> None:
    """The values of [fault_tolerance], when it is on."""
    f = cfg.fault_tolerance
    if not f.enable:
        return
    if f.group_size < 1:
        problems.add(
            f"fault_tolerance.group_size: must be at least 1 (the number of replica groups), "
            f"got {f.group_size!r}"
        )
    elif not 0 <= f.replica_id < f.group_size:
        problems.add(
            f"fault_tolerance.replica_id: must be in [0, group_size = {f.group_size}), got "
            f"{f.replica_id!r}"
        )
    if f.group_size >= 1 and not 1 <= f.min_replica_size <= f.group_size:
        problems.add(
            f"fault_tolerance.min_replica_size: must be in [1, group_size = {f.group_size}], "
            f"got {f.min_replica_size!r}"
        )
    if f.process_group_timeout_ms < 1:
        problems.add("fault_tolerance.process_group_timeout_ms: must be at least 1")
    if not f.quorum_timeout_s > 0:
        problems.add("fault_tolerance.quorum_timeout_s: must be > 0")
    if f.semi_sync_method:
        _check_semi_sync(f, problems)
    if not lighthouse_address(f):
        problems.add(
            "fault_tolerance.lighthouse: no lighthouse address (set it, or "
            f"{LIGHTHOUSE_ENV}; scripts/ft_local.sh starts one and the groups)"
        )
    if importlib.util.find_spec("torchft") is None:
        problems.add(
            "fault_tolerance.enable needs torchft, which is not installed: "
            "pip install 'titanlite[ft]'"
        )


def _check_semi_sync(f: FaultTolerance, problems: Any) -> None:
    if f.sync_steps < 1:
        problems.add(f"fault_tolerance.sync_steps: must be at least 1, got {f.sync_steps!r}")
        return
    if f.num_fragments < 1 or f.sync_steps % f.num_fragments:
        problems.add(
            f"fault_tolerance.num_fragments: must divide sync_steps = {f.sync_steps}, got "
            f"{f.num_fragments!r}"
        )
        return
    if f.semi_sync_method == "local_sgd" and f.num_fragments != 1:
        problems.add("fault_tolerance.num_fragments: local_sgd synchronizes the whole model; use 1")
    if not 0 <= f.fragment_sync_delay < sync_period(f):
        problems.add(
            "fault_tolerance.fragment_sync_delay: must be in [0, sync_steps / num_fragments = "
            f"{sync_period(f)}), got {f.fragment_sync_delay!r}"
        )
    if not 0 <= f.fragment_update_alpha <= 1:
        problems.add("fault_tolerance.fragment_update_alpha: must be in [0, 1]")
    if not f.outer_lr > 0:
        problems.add("fault_tolerance.outer_lr: must be > 0")
    if not 0 <= f.outer_momentum < 1:
        problems.add("fault_tolerance.outer_momentum: must be in [0, 1)")


def rules(run: PlannedRun) -> list[str]:
    """What replica groups cannot take yet: each is a decision every group must make alike,
    which today each group would make from its own batch alone."""
    f, lines = run.cfg.fault_tolerance, []
    if not f.enable:
        return lines
    if run.cfg.training.skip_spikes:
        lines.append(
            "fault_tolerance: training.skip_spikes would decide from each group's own loss "
            "(the groups would part ways); leave it empty with replica groups"
        )
    semi = semi_sync(f)
    if semi is not None and semi.fragment_sync_delay > 0 and run.cfg.checkpoint.enable:
        period, delay, steps = sync_period(semi), semi.fragment_sync_delay, run.cfg.training.steps
        if steps % period >= period - delay:
            lines.append(
                f"fault_tolerance: training.steps = {steps} ends while a fragment is in flight "
                f"(the last {delay} of every {period} steps: fragment_sync_delay), where no "
                "checkpoint can be taken; end the run at another step"
            )
    if getattr(run.args, "bias_update_rate", 0) > 0:
        lines.append(
            "fault_tolerance: the routing bias moves with each group's own expert loads (the "
            "groups would part ways); set model.bias_update_rate = 0 with replica groups"
        )
    return lines


SECTION = Section("fault_tolerance", FaultTolerance, after="comm", check=check)
