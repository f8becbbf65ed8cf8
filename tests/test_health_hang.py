"""The collective record and the hang watchdog ([health], titanlite.health.record, .watchdog):
what the record sees of each layout's collectives on real gloo ranks, the diagnosis over dump
files, and a rank frozen inside a collective of a real run (docs/reliability.md)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, slow_steps, subprocess_env

from titanlite.errors import EXIT_COMM_FAILURE
from titanlite.health.hang_report import diagnose, read_dumps

HANG_TIMEOUT_S = 5.0
GRACE_S = 10.0  # the watchdog's default wait for the other ranks' dumps
TORCHRUN_STOP_S = 30.0  # torchrun's wait for a rank to take its SIGTERM, before SIGKILL


@pytest.mark.slow
def test_the_record_sees_every_layouts_collectives_and_the_time_blocked_in_them() -> None:
    """2 ranks: a sync and an async all_reduce that rank 1 enters 1 s late (rank 0's
    blocked time grows by about that, rank 1's does not), FSDP2's all-gather and
    reduce-scatter, a DTensor redistribution and a tensor-parallel layer, the pipeline's P2P
    (each direction counted on both ends), titanlite's DDP engine; then uninstall puts every
    entry point back and nothing more is recorded."""
    from pool import get_pool

    delay = 1.0
    seen = get_pool(2).run("hang_scenarios:record_paths", delay_s=delay)
    for s in seen:
        assert s["active"] and all(s["wrapped"]) and all(s["restored"]) and s["inactive"], s
        assert s["after_uninstall"] == 0
        assert s["sync"][0] == "all_reduce" and s["sync"][2] == "done"
        assert s["async"][0] == "all_reduce" and "all_reduce" in s["async_in_flight"]
        ops = {key: {op for op, _, _ in s[key]} for key in ("fsdp", "tp", "pipeline", "ddp")}
        assert {"all_gather_single", "reduce_scatter_single"} <= ops["fsdp"], s["fsdp"]
        assert {"funcol.all_gather_single", "funcol.all_reduce"} <= ops["tp"], s["tp"]
        assert {"isend", "irecv"} <= ops["pipeline"], s["pipeline"]
        assert "ProcessGroup.allreduce" in ops["ddp"], s["ddp"]
        for key in ("fsdp", "tp", "ddp", "pipeline"):
            assert all(state == "done" for _, _, state in s[key]), s[key]
        assert not s["in_flight_at_end"], s["in_flight_at_end"]
        channels = {channel for _, channel, _ in s["pipeline"]}
        assert {c.rpartition(":")[2] for c in channels} == {"0->1", "1->0"}, channels
        assert s["dtensor_sum"] == sum(range(16))
        entries = [line for line in s["lines"] if line.startswith("  state=")]
        assert len(entries) >= 10 and all(" seq=" in e and " start=" in e for e in entries)
    # Rank 0 waited for rank 1 both times; rank 1, which came late, hardly waited.
    assert seen[0]["sync_blocked"] > 0.5 * delay, seen[0]["sync_blocked"]
    assert seen[0]["async_blocked"] > 0.5 * delay, seen[0]["async_blocked"]
    assert seen[1]["sync_blocked"] < seen[0]["sync_blocked"]


@pytest.mark.slow
def test_a_rank_that_never_enters_a_collective_is_named_by_the_watchdog(tmp_path: Path) -> None:
    """2 ranks: rank 1 stays in Python while rank 0 waits in an all_reduce. Both watchdogs
    fire (2 s without progress) and dump; rank 0, the lowest, names rank 1, the collective
    and where rank 1 is; rank 1's dump shows its stack."""
    from pool import get_pool

    results = get_pool(2).run(
        "hang_scenarios:never_entered",
        dump_folder=str(tmp_path),
        timeout_s=2.0,
        grace_s=60.0,  # an upper bound: the wait ends as soon as both dumps are there
    )
    line = results[0]["line"]
    assert results[1]["line"] is None  # one line, from the lowest rank
    assert line.startswith("hang at step 3: rank 1 (host "), line
    assert "never entered all_reduce #4 of ranks [0, 1], in which rank 0 waits" in line, line
    assert "rank 1 is at " in line and "in _stay_busy_until" in line, line
    assert f"(dumps in {tmp_path / 'health' / 'hang-3'}/)" in line, line
    rank1 = Path(results[1]["dump"]).read_text()
    assert "== python stacks ==" in rank1 and "_stay_busy_until" in rank1
    assert "state=done op=all_reduce seq=3 channel=0 ranks=0,1" in rank1
    rank0 = Path(results[0]["dump"]).read_text()
    assert re.search(r"state=waiting op=all_reduce seq=4 channel=0 ranks=0,1 ", rank0), rank0
    assert (tmp_path / "health" / "hang-3" / "summary.txt").read_text() == line + "\n"


# A watchdog (2 s) that is armed, then waits for the test's word on stdin (no beats meanwhile).
ARMED = """
import sys
from titanlite.health.watchdog import Watchdog
fired = []
dog = Watchdog(timeout_s=2, rank=0, world_size=1, dump_folder=sys.argv[1], on_hang=fired.append)
dog.start()
dog.beat(1)
dog.beat(2)
print("ready", flush=True)
sys.stdin.readline()
dog.stop()
print("hang" if fired else "no hang", flush=True)
"""


@pytest.mark.slow
def test_a_process_stopped_and_continued_is_no_hang(tmp_path: Path) -> None:
    """A suspended job (SLURM's suspend, Ctrl-Z) stops every process of a rank, the watchdog's
    thread too: continued 3 s later (past the 2 s timeout), it counts afresh instead of taking
    the pause for a hang."""
    proc = subprocess.Popen(
        [sys.executable, "-c", ARMED, str(tmp_path)],
        cwd=REPO,
        env=subprocess_env(tmp_path),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(3)
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.5)  # the watchdog's thread polls meanwhile
        out, _ = proc.communicate("go\n", timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert out == "no hang\n" and not (tmp_path / "health").exists(), out


# -- diagnose over dump files written here -------------------------------------------------------


def write_dump(
    folder: Path, rank: int, *, world: int, entries: list[str], entered: dict[str, int], **header
) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    fields = {
        "rank": rank,
        "world_size": world,
        "host": f"node{rank // 2}",
        "pid": 100 + rank,
        "step": 12,
        "written": time.time(),
        "timeout_s": 5,
        "attempt": "run/0/host:1",
        "where": "titanlite/trainer.py:230 in train_step",
        **header,
    }
    lines = ["titanlite hang dump", *(f"{k}={v}" for k, v in fields.items()), "== collectives =="]
    lines += [f"  {e}" for e in entries]
    lines += [f"  channel={c} ranks=0,1,2,3 entered={n}" for c, n in entered.items()]
    lines += ["== python stacks ==", "thread MainThread (ident 1, main):"]
    (folder / f"rank-{rank}.txt").write_text("\n".join(lines) + "\n")


def entry(op: str, seq: int, state: str, channel: str = "0", ranks: str = "0,1,2,3") -> str:
    return (
        f"state={state} op={op} seq={seq} channel={channel} ranks={ranks} data=float32[8] "
        "start=100.0 end=- took=5.0 async=no thread=MainThread"
    )


def test_diagnose_names_the_rank_that_never_entered_the_collective_the_others_wait_in(tmp_path):
    hang = tmp_path / "health" / "hang-12"
    for rank in (0, 2, 3):
        waits = [entry("all_reduce", 56, "done"), entry("all_reduce", 57, "waiting")]
        write_dump(hang, rank, world=4, entries=waits, entered={"0": 57})
    busy = [entry("all_reduce", 56, "done")]
    write_dump(hang, 1, world=4, entries=busy, entered={"0": 56}, where="data.py:9 in next")
    line = diagnose(hang)
    assert line == (
        "hang at step 12: rank 1 (host node0) never entered all_reduce #57 of ranks "
        "[0, 1, 2, 3], in which ranks 0, 2, 3 wait; rank 1 is at data.py:9 in next "
        f"(dumps in {hang}/)"
    )


def test_diagnose_names_a_rank_without_a_dump_and_one_waiting_elsewhere(tmp_path):
    """Rank 3 is stopped (no dump); rank 1 waits in another group's collective for it (since a
    step earlier: its dump is in hang-11); ranks 0 and 2 wait in the all-rank all_reduce that
    rank 1 never reached. A stale dump of an earlier attempt is ignored."""
    hang = tmp_path / "health" / "hang-12"
    for rank in (0, 2):
        write_dump(
            hang, rank, world=4, entries=[entry("all_reduce", 9, "waiting")], entered={"0": 9}
        )
    tp = entry("funcol.all_reduce", 4, "waiting", channel="5")
    earlier = tmp_path / "health" / "hang-11"  # rank 1 hung a step before the others
    write_dump(earlier, 1, world=4, step=11, entries=[tp], entered={"0": 8, "5": 4})
    stale = {"attempt": "run/0/host:2", "written": time.time() - 3600}
    write_dump(hang, 3, world=4, entries=[], entered={}, **stale)
    line = diagnose(hang)
    assert line.startswith(
        "hang at step 12: rank 1 (host node0) never entered all_reduce #9 of ranks [0, 1, 2, 3],"
        " in which ranks 0, 2 wait; rank 1 waits in funcol.all_reduce #4 of ranks [0, 1, 2, 3]; "
        "rank 3 wrote no dump (stopped or gone)"
    ), line
    assert sorted(read_dumps(hang)) == [0, 1, 2]


def test_diagnose_of_a_stopped_rank_and_of_a_p2p_wait(tmp_path):
    hang = tmp_path / "health" / "hang-4"
    waits = [entry("all_reduce", 3, "waiting", ranks="0,1")]
    write_dump(hang, 0, world=2, step=4, entries=waits, entered={"0": 3})
    assert diagnose(hang) == (
        "hang at step 4: rank 1 wrote no dump (stopped or gone) and rank 0 waits in "
        f"all_reduce #3 of ranks [0, 1] (dumps in {hang}/)"
    )
    p2p = tmp_path / "p2p" / "health" / "hang-4"
    recv = entry("irecv", 2, "waiting", channel="3:2->1")
    write_dump(p2p, 1, world=4, step=4, entries=[recv], entered={"3:2->1": 2})
    for rank in (0, 2, 3):
        write_dump(p2p, rank, world=4, step=4, entries=[], entered={"3:2->1": 1})
    line = diagnose(p2p)
    assert line.startswith(
        "hang at step 4: rank 2 (host node1) never sent message #2 to rank 1, which waits in irecv;"
    ), line


# -- a rank frozen in a real run -----------------------------------------------------------------


def alive(pid: int) -> bool:
    """Running (or stopped), not gone or a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_a_rank_frozen_in_a_collective_is_named_the_run_exits_4_and_the_same_command_resumes(
    tmp_path: Path,
) -> None:
    """./run_train.sh with NGPU=2: rank 1 is frozen (SIGSTOP) mid-run, so rank 0 waits in a
    collective that cannot finish. Rank 0's watchdog dumps its stacks and record after
    health.hang_timeout_s (5 s), waits GRACE_S for rank 1's dump, names rank 1 and the
    collective in one line, and exits 4; torchrun then kills the frozen rank (it cannot take
    SIGTERM) TORCHRUN_STOP_S later and the launcher exits 4 with that line. The same command
    then resumes from step-4 and its losses equal an uninterrupted run's."""
    from test_cluster import trainer_pid
    from test_interrupts import CONFIG, SMALL, logged_steps, losses, pool_run

    out, steps = tmp_path / "run", 16
    hang = ["--health.hang_timeout_s", f"{HANG_TIMEOUT_S:g}", "--comm.timeout_seconds", "60"]
    cmd = [str(REPO / "run_train.sh"), CONFIG, *SMALL, "--training.steps", str(steps)]
    cmd += ["--job.dump_folder", str(out), *hang]
    log = tmp_path / "launch.log"
    env = subprocess_env(tmp_path, NGPU="2", **slow_steps(tmp_path))
    with open(log, "w") as f:
        launch = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
    victim = None
    try:
        deadline = time.monotonic() + 300
        while not ((out / "checkpoint" / "step-4").is_dir() and len(logged_steps(out)) >= 5):
            assert launch.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no step 5 within 300 s"
            time.sleep(0.05)
        survivor, victim = trainer_pid(out, 0), trainer_pid(out, 1)
        os.kill(victim, signal.SIGSTOP)
        frozen = time.monotonic()
        while alive(survivor) and time.monotonic() - frozen < 120:
            time.sleep(0.05)
        survivor_s = time.monotonic() - frozen
        status = launch.wait(timeout=180)
        total_s = time.monotonic() - frozen
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launch.pid, signal.SIGKILL)
        if victim is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        launch.wait()
    output = log.read_text()
    errors = [line for line in output.splitlines() if line.startswith("titanlite: error:")]
    assert status == EXIT_COMM_FAILURE and len(errors) == 1, output[-5000:]
    named = re.fullmatch(
        r"titanlite: error: hang at step (\d+): rank 1 wrote no dump \(stopped or gone\) and "
        r"rank 0 waits in (\S+) #(\d+) of ranks \[0, 1\] \(dumps in (.+)/\); the "
        r"checkpoints on disk are intact: run the same command to resume",
        errors[0],
    )
    assert named, errors[0]
    folder = Path(named[4])
    assert folder == out / "health" / f"hang-{named[1]}"
    dump = (folder / "rank-0.txt").read_text()
    assert f"state=waiting op={named[2]} seq={named[3]} " in dump, dump[:3000]
    assert "== python stacks ==" in dump and not (folder / "rank-1.txt").exists()
    # The survivor: the timeout, the grace for rank 1's dump, polls of 0.25 s; slack for a
    # loaded machine. The launcher: torchrun's stop of the frozen rank besides.
    bound = HANG_TIMEOUT_S + GRACE_S + 20
    assert survivor_s < bound, f"rank 0 exited {survivor_s:.1f} s after the freeze ({bound} s)"
    assert total_s < bound + TORCHRUN_STOP_S + 20, f"the launch ended after {total_s:.1f} s"
    print(f"rank 0 exited {survivor_s:.1f} s, the launch {total_s:.1f} s later: {errors[0]}")

    resumed = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert "resumed from checkpoint at step" in resumed.stdout + resumed.stderr
    baseline = tmp_path / "baseline"
    pool_run(2, baseline, steps=steps)
    assert losses(out) == losses(baseline)
