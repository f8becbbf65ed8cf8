"""Replica groups recovering (titanlite/ft/), continued from tests/test_ft.py (its launcher
and helpers; a file of its own so that the two run side by side): groups of two processes
(FSDP) with one killed inside a checkpoint save, which resumes from its last complete
checkpoint and heals; a live group late to a quorum is waited for; every group stopped at
once resumes as if never stopped; a killed save's partial folder goes with the next save."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

import pytest
from conftest import read_metrics
from ft_scenarios import (
    committed,
    in_step,
    last_step,
    markers,
    set_pace,
    trace,
    wait_for,
)
from test_ft import Run, first_commit_after, ours

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchft") is None,
    reason="needs torchft (pip install 'titanlite[ft]')",
)


# ------------------------------------- groups of two ranks (FSDP), a kill inside a save
FSDP_STEPS = 45  # the survivors' steps: the returning group rejoins well before the end
SAVE_EVERY = 5
SAVE_KILL_AT = 2 * SAVE_EVERY  # group 2 is killed inside its save of this step (its second)
AWAY_PACE = 0.5  # seconds every step sleeps while group 2 is coming back (from its restart)
JOIN_TIMEOUT_MS = 10000  # the lighthouse's (ft_local.sh's FT_JOIN_TIMEOUT_MS); below


def hold_back(run: Run, survivors: list[int], steps: int, restarted: subprocess.Popen) -> None:
    """Called while waiting for a group to come back: ``run`` and the ``restarted`` group must
    still be running, and the survivors, if they come within 10 steps of the end, slow to 3 s
    a step (a machine so busy that the restart takes long must not let them finish without
    it)."""
    run.launcher_running()
    if restarted.poll() is not None:
        log = run.out / "logs" / "replica-2.log"
        raise AssertionError(f"the restarted group ended early:\n{log.read_text()[-3000:]}")
    if min(last_step(run.control, g) for g in survivors) >= steps - 10:
        set_pace(run.control, 3.0)


@pytest.mark.slow
def test_a_group_of_two_ranks_killed_inside_a_save_resumes_its_last_checkpoint_and_heals(
    tmp_path,
):
    """3 groups of 2 processes each (FSDP inside: each rank holds half of every parameter),
    checkpoints every SAVE_EVERY steps. Both processes of group 2 are SIGKILLed inside its save
    of step SAVE_KILL_AT: every shard and the metadata are in step-N.partial, the sidecar that
    marks it complete is not (rank 0 was paused before writing it) and training was going on.
    Restarted 3 steps later with the line ft_local.sh printed, the group resumes from its own
    last complete checkpoint (step SAVE_EVERY, never the partial one), then heals from a live
    group: each rank receives the shards of the same rank of a live group. Groups 0 and 1
    never restart: the same two processes each, every step committed once and logged with the
    groups that took part (3, 2 while group 2 is away, 3); every rank of every group holds the
    same shards as the same rank of the others at every step they share, and at the end."""
    args = ("--checkpoint.enable", "true", "--checkpoint.interval", str(SAVE_EVERY))
    args += ("--parallelism.data_parallel_shard_degree", "2")
    # A join timeout above any step's time: with ft_local.sh's 1 s, the first quorum of the
    # returning group (its request waits at the lighthouse, the join timer starts with it)
    # can leave out a survivor that asks a second after the other, which is then healed and
    # never commits that step (test_a_group_late_to_a_quorum_is_waited_for_not_left_out).
    env = {"FT_JOIN_TIMEOUT_MS": str(JOIN_TIMEOUT_MS)}
    run = Run(tmp_path, steps=FSDP_STEPS, ngpu=2, args=args, pace=0, env=env)
    control, survivors, ranks = run.control, [0, 1], [0, 1]
    (control / "pause-save-2").write_text(f"{SAVE_KILL_AT} 600")  # until it is killed
    checkpoints = run.out / "replica-2" / "checkpoint"
    try:
        wait_for(
            "the three groups of two processes to start",
            lambda: {g: len(p) for g, p in markers(control, "ready").items()} == {0: 2, 1: 2, 2: 2},
            300,
            run.launcher_running,
        )
        (control / "go").touch()

        # 1. Both processes of group 2 killed inside its save of SAVE_KILL_AT.
        wait_for(
            f"group 2 inside its save of step {SAVE_KILL_AT}",
            lambda: markers(control, "saving").get(2),
            300,
            run.launcher_running,
        )
        victims = set(markers(control, "ready")[2])
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        killed = time.time()
        (control / "pause-save-2").unlink()  # the restarted group saves as usual
        wait_for(  # (a write in flight at the kill ends first)
            "group 2's processes to end",
            lambda: not any(ours(pid, control) for pid in victims),
            60,
        )
        # What the kill left: the save of step SAVE_KILL_AT complete but for its mark.
        partial = checkpoints / f"step-{SAVE_KILL_AT}.partial"
        found = sorted(p.name for p in checkpoints.iterdir())
        assert found == [partial.name, f"step-{SAVE_EVERY}"], found
        assert (partial / ".metadata").is_file()
        assert not (partial / "titanlite.json").exists()
        killed_at = {r: last_step(control, 2, r) for r in ranks}
        at_kill = max(last_step(control, g) for g in survivors)

        # 2. Restarted about 3 steps later: it resumes from its checkpoint, heals and rejoins.
        wait_for(
            "the survivors 3 steps on",
            lambda: min(last_step(control, g) for g in survivors) >= at_kill + 3,
            120,
            run.launcher_running,
        )
        set_pace(control, AWAY_PACE)
        restarted = time.time()
        final = run.restart(2)
        pids = wait_for(
            "group 2's two new processes",
            lambda: run.new_pids(2, victims, 2),
            240,
            lambda: hold_back(run, survivors, FSDP_STEPS, final),
        )
        wait_for(
            "both ranks of group 2 to rejoin",
            lambda: all(
                any(r["pid"] in pids for r in committed(control, 2, rank=rank)) for rank in ranks
            ),
            240,
            lambda: hold_back(run, survivors, FSDP_STEPS, final),
        )
        # Its complete checkpoints up to the kill's step, now that it rejoined: the partial
        # one was neither loaded (the resume record, below) nor completed.
        resumed_from = [
            p.name
            for p in sorted(checkpoints.iterdir())
            if re.fullmatch(r"step-\d+", p.name) and int(p.name[5:]) <= SAVE_KILL_AT
        ]
        set_pace(control, 0)  # the rest at full speed
        status = run.launcher.wait(timeout=300)
        assert final.wait(timeout=120) == 0
    finally:
        run.kill_everything()

    # Group 2's processes, rank by rank: the killed one, and the one that rejoined.
    first = {r: committed(control, 2, trace(control, 2, r)[0]["pid"], r) for r in ranks}
    last = {r: [x for x in committed(control, 2, rank=r) if x["pid"] in pids] for r in ranks}
    healed_at = last[0][0]["step"]
    timings = {
        "kill -> the survivors' next committed step": first_commit_after(
            control, survivors, killed
        ),
        "restart -> the rejoined group's first committed step": max(last[r][0]["t1"] for r in ranks)
        - restarted,
        "  its first quorum, the heal included": max(last[r][0]["quorum_s"] for r in ranks),
    }
    print(f"\nreplica groups (3 x 2 processes, FSDP; killed in the save of step {SAVE_KILL_AT}):")
    for what, seconds in timings.items():
        print(f"  {what}: {seconds:.2f} s")

    output = run.output()
    for group, code in [(0, 0), (1, 0), (2, 1)]:  # 1: torchrun's, for its killed processes
        assert f"ft_local: replica {group} ended with status {code} " in output, output
    assert status == 1

    # The survivors never restarted: one process per rank, every step once, in order, each
    # logged (by rank 0) with the groups that took part.
    for g in survivors:
        for rank in ranks:
            records = trace(control, g, rank)
            assert {r["pid"] for r in records} == {records[0]["pid"]}, (g, rank)
            steps = [r["step"] for r in committed(control, g, rank=rank)]
            assert steps == list(range(1, FSDP_STEPS + 1)), (g, rank)
            assert not any(r["healed"] for r in records)
        train, _ = read_metrics(run.out / f"replica-{g}")
        assert [r["step"] for r in train] == list(range(1, FSDP_STEPS + 1))
        assert all(r.get("kind") is None for r in train)  # no resume, no restart record
        by_step = {r["step"]: r["replicas"] for r in committed(control, g)}
        assert all(r["replicas"] == by_step[r["step"]] for r in train)
        assert [k for k, _ in groupby(r["replicas"] for r in train)] == [3, 2, 3], train

    # Group 2: both ranks killed after the save's step (its save in flight); both rejoined
    # at the same step, healed there (and only there), and trained to the end.
    # (a rank may have recorded the step both committed when the other was killed)
    assert min(killed_at.values()) >= SAVE_KILL_AT and abs(killed_at[0] - killed_at[1]) <= 1
    for rank in ranks:
        assert [r["step"] for r in first[rank]] == list(range(1, killed_at[rank] + 1))
        assert [r["step"] for r in last[rank]] == list(range(healed_at, FSDP_STEPS + 1))
        assert [r["healed"] for r in last[rank]] == [True] + [False] * (len(last[rank]) - 1)
    assert healed_at > at_kill + 3
    # It resumed from its own last complete checkpoint, never the partial one, before the heal.
    records, _ = read_metrics(run.out / "replica-2")
    resumes = [r["step"] for r in records if r.get("kind") == "resume"]
    assert resumes == [SAVE_EVERY], records
    assert resumed_from == [f"step-{SAVE_EVERY}"], resumed_from
    train = [r for r in records if r.get("kind") is None]
    logged = [r["step"] for r in first[0] + last[0]]
    assert [r["step"] for r in train] in [logged, [s for s in logged if s != killed_at[0]]]
    assert all(r["replicas"] == 3 for r in train)

    # Bitwise, rank by rank: the same shards as the same rank of every other group at every
    # step they share, the returning group's from the start of its first step (the heal,
    # before its forward), and at the end.
    for rank in ranks:
        survivor = {g: {r["step"]: r for r in committed(control, g, rank=rank)} for g in survivors}
        for r in first[rank] + last[rank]:
            for g in survivors:
                assert survivor[g][r["step"]]["before"] == r["before"], (g, rank, r["step"])
                assert survivor[g][r["step"]]["after"] == r["after"], (g, rank, r["step"])
        assert survivor[0][healed_at]["before"] == last[rank][0]["before"]  # right after the heal
        ends = {survivor[g][FSDP_STEPS]["after"] for g in survivors} | {last[rank][-1]["after"]}
        assert len(ends) == 1, (rank, ends)
    # (each rank holds its own half: hashing per rank compares shards, not whole models)
    assert trace(control, 0, 0)[0]["before"] != trace(control, 0, 1)[0]["before"]


# ---------------------- a full stop, then a resume; beside it, a live group late to a quorum
# Two runs of 2 groups of one process, side by side (their start-ups overlap: most of the time
# here), shared by the two tests below: one stopped at once by SIGTERM and launched again with
# the same command, and the uninterrupted run it must equal, in which group 1 asks for one
# quorum late (which changes no number, if it is waited for).
STOP_STEPS = 12
STOP_AT = 4  # the step every group is in when ft_local.sh gets SIGTERM
STOP_WINDOW = 60.0  # seconds that step may sleep before its forward: the signal lands inside
# (and ends the sleep: tests/ft_scenarios.py)
LATE_AT = 4  # the step whose quorum group 1 of the uninterrupted run asks for late
LATE_BY = 3.0  # seconds: a group asks this late for one quorum (ft_local.sh waits 10 s)
GROUPS = [0, 1]


@dataclass
class FullStop:
    run: Run  # stopped by SIGTERM in step STOP_AT, then launched again
    reference: Run  # uninterrupted; group 1 late to step LATE_AT's quorum
    statuses: dict[str, int]  # ft_local.sh's exit statuses


def asleep_in(control: Path, groups: list[int], step: int) -> bool:
    """Whether every one of ``groups`` is asleep in ``step`` (paced STOP_WINDOW)."""
    return all(in_step(control, g) == (step, STOP_WINDOW) for g in groups)


@pytest.fixture(scope="module")
def full_stop(tmp_path_factory: pytest.TempPathFactory) -> FullStop:
    tmp_path = tmp_path_factory.mktemp("full-stop")
    args = ("--checkpoint.enable", "true", "--checkpoint.interval", "1000")
    # The uninterrupted run: the lighthouse as ft_local.sh ships it. The stopped run: a join
    # timeout of JOIN_TIMEOUT_MS whatever that default becomes (a group a second late to a
    # quorum, on this busy machine, must not be left out of a step).
    reference = Run(tmp_path / "reference", groups=2, steps=STOP_STEPS, args=args, pace=0)
    env = {"FT_JOIN_TIMEOUT_MS": str(JOIN_TIMEOUT_MS)}
    run = Run(tmp_path / "stopped", groups=2, steps=STOP_STEPS, args=args, pace=0, env=env)
    (reference.control / "late-1").write_text(f"{LATE_AT} {LATE_BY}")
    control = run.control
    set_pace(control, STOP_WINDOW, from_step=STOP_AT)
    statuses = {}
    try:
        for each in (reference, run):  # every group started, then all step together
            wait_for(
                "the two groups to start",
                lambda each=each: set(markers(each.control, "ready")) == set(GROUPS),
                240,
                each.launcher_running,
            )
            (each.control / "go").touch()
        wait_for(
            f"both groups asleep in step {STOP_AT}",
            lambda: asleep_in(control, GROUPS, STOP_AT),
            240,
            run.launcher_running,
        )
        os.kill(run.launcher.pid, signal.SIGTERM)
        statuses["stopped"] = run.launcher.wait(timeout=120)
        first_pids = {g: markers(control, "ready")[g] for g in GROUPS}

        # The same command again, every group started together (as at the first launch).
        (control / "go").unlink()
        set_pace(control, 0)
        run.launch()
        wait_for(
            "the two groups to start again",
            lambda: all(run.new_pids(g, set(first_pids[g])) for g in GROUPS),
            240,
            run.launcher_running,
        )
        (control / "go").touch()
        statuses["resumed"] = run.launcher.wait(timeout=300)
        statuses["reference"] = reference.launcher.wait(timeout=300)
    finally:
        run.kill_everything()
        reference.kill_everything()
    return FullStop(run, reference, statuses)


@pytest.mark.slow
def test_a_group_late_to_a_quorum_is_waited_for_not_left_out(full_stop: FullStop) -> None:
    """2 groups of one process, started by ft_local.sh as a user does (the uninterrupted run of
    ``full_stop``). Group 1 asks for step LATE_AT's quorum LATE_BY seconds after the other,
    heartbeating all along (a save or a validation slower on its node, a pause of the
    machine): it is alive, so it takes part in every step. Every group commits every step
    once, with both groups, and none is healed (a heal would mean it was left out of a step and
    lost it). (Left out, it is healed at the next step, or, once the other has ended, trains
    the rest alone: it ends with other parameters than the other group's.)"""
    reference = full_stop.reference
    assert full_stop.statuses["reference"] == 0, reference.output()
    control = reference.control
    for g in GROUPS:
        records = trace(control, g)
        assert [r["step"] for r in committed(control, g)] == list(range(1, STOP_STEPS + 1)), g
        assert [r["replicas"] for r in committed(control, g)] == [2] * STOP_STEPS, g
        assert not any(r["healed"] for r in records), g
    # It was late: group 0 waited in that quorum (about LATE_BY; the others take milliseconds).
    waited = next(r["quorum_s"] for r in committed(control, 0) if r["step"] == LATE_AT)
    assert waited > LATE_BY / 6, waited


@pytest.mark.slow
def test_every_group_stopped_at_once_resumes_from_its_checkpoint_as_if_never_stopped(
    full_stop: FullStop,
) -> None:
    """2 groups of one process. SIGTERM to ft_local.sh while both are in step STOP_AT: each
    group finishes it, saves it and exits 75. The same command again: each group resumes from
    its own checkpoint (no heal: they are at the same step) and the run ends as an
    uninterrupted run of the same groups does (``full_stop``'s), bitwise: the parameters at
    every step, the losses logged."""
    run, reference = full_stop.run, full_stop.reference
    control = run.control
    first_output = run.launches[0][1].read_text()
    assert full_stop.statuses["stopped"] == 75, first_output
    assert full_stop.statuses["resumed"] == 0, run.output()
    assert full_stop.statuses["reference"] == 0, reference.output()
    for g in GROUPS:
        assert f"ft_local: replica {g} ended with status 75 " in first_output, first_output
        assert f"ft_local: replica {g} ended with status 0 " in run.output(), run.output()
    for g in GROUPS:
        # Two processes: the first to the step it was stopped in, the second from the next.
        records = committed(control, g)
        pids = [r["pid"] for r in records]
        assert len(set(pids)) == 2, g
        steps = [r["step"] for r in records]
        assert steps == list(range(1, STOP_STEPS + 1)), (g, steps)
        # (the signal came while both were in STOP_AT: each stopped at its end)
        assert pids.index(pids[-1]) == STOP_AT, (g, "stopped at", steps[pids.index(pids[-1]) - 1])
        assert not any(r["healed"] for r in trace(control, g))  # it resumed, no heal
        assert all(r["replicas"] == 2 for r in records)
        # Its own checkpoint of the stopped step, then the resume from it.
        train, _ = read_metrics(run.out / f"replica-{g}")
        resumes = [r["step"] for r in train if r.get("kind") == "resume"]
        assert resumes == [STOP_AT], train
        # As if never stopped: every step's parameters and every logged loss.
        expected = {r["step"]: r for r in committed(reference.control, g)}
        assert [r["after"] for r in records] == [expected[s]["after"] for s in steps], g
        ref_train, _ = read_metrics(reference.out / f"replica-{g}")
        losses = [r["loss"] for r in train if r.get("kind") is None]
        assert losses == [r["loss"] for r in ref_train], g
    ends = {committed(control, g)[-1]["after"] for g in GROUPS}
    assert ends == {committed(reference.control, 0)[-1]["after"]}


class _Weights:
    """The smallest Stateful: one tensor."""

    def __init__(self) -> None:
        import torch

        self.w = torch.arange(4.0)

    def state_dict(self) -> dict:
        return {"w": self.w}

    def load_state_dict(self, state: dict) -> None:
        self.w = state["w"]


def test_a_partial_save_the_group_healed_past_is_removed_by_its_next_save(tmp_path):
    """What the kill inside a save leaves (test_a_group_of_two_ranks_killed_inside_a_save...):
    step-10.partial, every shard and the metadata but no sidecar, beside step-5. The restarted
    group resumes from step 5, heals to the others' step and saves step 15 next: it never saves
    step 10 again, and the partial folder (a whole checkpoint's bytes, never loaded) must not
    stay in its checkpoint folder for the rest of the run (in-process world of one)."""
    import shutil

    import torch.distributed as dist

    from titanlite.checkpoint.checkpointer import Checkpointer, ModelIdentity
    from titanlite.config.job_config import Checkpoint as CheckpointConfig

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    folder = tmp_path / "checkpoint"
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )

    def checkpointer() -> Checkpointer:
        return Checkpointer(
            {"model": _Weights()},
            CheckpointConfig(),
            folder,
            ModelIdentity("llama3", {}),
            sidecar_fields={},
            is_main=True,
        )

    try:
        first = checkpointer()
        first.save(5, force_sync=True)
        first.close()
        shutil.copytree(folder / "step-5", folder / "step-10.partial")  # the killed save
        (folder / "step-10.partial" / "titanlite.json").unlink()
        restarted = checkpointer()  # the restart (then the heal to step 14)
        assert restarted.load()
        restarted.save(15)
        restarted.close()
        names = sorted(p.name for p in folder.iterdir())
        assert names == ["step-15", "step-5"], names
    finally:
        dist.destroy_process_group()
