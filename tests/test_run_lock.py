"""One run per dump folder (titanlite.runtime.run_lock, issue 37): who may take a folder, with real
holder processes (no torch in them: a second each). The launches through ./run_train.sh
(a second run refused by the launcher, a killed run's lock taken over) are in
test_interrupts.py."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, subprocess_env

from titanlite.errors import EXIT_USER_ERROR
from titanlite.files import atomic_write
from titanlite.runtime import run_lock

HOLDER = """
import logging, sys, time
from titanlite.runtime import run_lock
logging.basicConfig(level=logging.INFO, format="%(message)s")
run_lock.REFRESH_S = float(sys.argv[2])
lock = run_lock.acquire(sys.argv[1], "training")
print("held", flush=True)
sys.stdin.readline()  # until the test says so (or ends: EOF)
releasing = time.time()
lock.release()
print("released", releasing, flush=True)
"""


class Holder:
    """A process holding ``folder`` until it is told to release it (``finish``)."""

    def __init__(self, folder: Path, refresh_s: float = 10.0, **env: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(folder), str(refresh_s)],
            cwd=REPO,
            env=subprocess_env(folder.parent, **env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert self.proc.stdout.readline().strip() == "held", self.proc.communicate()[0]

    def finish(self) -> str:
        """Release (if it still runs) and its remaining output."""
        return self.proc.communicate("\n", timeout=60)[0]


@pytest.fixture
def no_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)


def write_lock(folder: Path, **fields: object) -> None:
    holder = run_lock.this_process("training")
    folder.mkdir(parents=True, exist_ok=True)
    content = {**holder.__dict__, **fields}
    # Atomically, as a run writes its own: a holder polling every 0.1 s never reads it half
    # written (it would take the empty file for an unreadable lock of host "?").
    atomic_write(folder / run_lock.LOCK_FILE, json.dumps(content))


def test_a_live_run_holds_its_folder_and_a_killed_one_is_taken_over(tmp_path, caplog, no_slurm):
    folder = tmp_path / "run"
    holder = Holder(folder)
    naming = f"is in use by another run (training: pid {holder.proc.pid} on host "
    with pytest.raises(run_lock.RunFolderBusy, match=naming.replace("(", r"\(")):
        run_lock.check_free(folder)  # the launcher's preflight
    with pytest.raises(run_lock.RunFolderBusy, match="let it finish or stop it"):
        run_lock.acquire(folder, "training")
    holder.proc.send_signal(signal.SIGKILL)
    holder.finish()
    run_lock.check_free(folder)  # a dead holder stops nobody
    with caplog.at_level(logging.WARNING, logger="titanlite.runtime.run_lock"):
        lock = run_lock.acquire(folder, "training")
    assert f"process {holder.proc.pid} no longer exists" in caplog.text
    assert run_lock.read(folder / run_lock.LOCK_FILE).pid == os.getpid()
    lock.release()
    assert not (folder / run_lock.LOCK_FILE).exists()


def test_a_lock_from_another_host_is_judged_by_its_heartbeat(tmp_path, caplog, no_slurm):
    """Its pid means nothing here: alive while the heartbeat is younger than STALE_AFTER_S."""
    folder = tmp_path / "run"
    now = time.time()
    write_lock(folder, host="node-elsewhere", pid=1, heartbeat=now - 30)
    with pytest.raises(run_lock.RunFolderBusy, match="on host node-elsewhere"):
        run_lock.acquire(folder, "training")
    write_lock(folder, host="node-elsewhere", pid=1, heartbeat=now - run_lock.STALE_AFTER_S - 5)
    with caplog.at_level(logging.WARNING, logger="titanlite.runtime.run_lock"):
        run_lock.acquire(folder, "training").release()
    # 65 s, or a little more where the test was held up between writing the lock and reading it
    assert re.search(r"no heartbeat for 6[5-9] s \(more than 60 s\)", caplog.text), caplog.text


def test_a_reused_pid_or_an_unreadable_lock_holds_nothing(tmp_path, no_slurm):
    """A live pid that is another process now (its start time differs) is not the holder; an
    unreadable lock file counts by its age, like another host's."""
    folder = tmp_path / "run"
    write_lock(folder, pid=os.getppid(), pid_start="1")
    run_lock.acquire(folder, "training").release()
    (folder / run_lock.LOCK_FILE).write_text("{not json")
    with pytest.raises(run_lock.RunFolderBusy, match="an unreadable lock file"):
        run_lock.acquire(folder, "training")
    old = time.time() - run_lock.STALE_AFTER_S - 1
    os.utime(folder / run_lock.LOCK_FILE, (old, old))
    run_lock.acquire(folder, "training").release()


def test_a_requeued_job_waits_for_its_previous_attempt_and_never_runs_beside_it(
    tmp_path, monkeypatch
):
    """The previous attempt (same SLURM job, restart 0) still holds the folder: the requeued
    attempt (restart 1) passes the launcher's check, waits, and takes the folder only once it
    is released (1 s into the wait); within a shorter wait it gives up (no deadlock); another
    job is refused at once, not after its 30 s wait."""
    import threading

    folder = tmp_path / "run"
    job = {"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "0"}
    previous = Holder(folder, **job)
    monkeypatch.setenv("SLURM_JOB_ID", "4343")
    started = time.monotonic()
    with pytest.raises(run_lock.RunFolderBusy, match="SLURM job 4242"):
        run_lock.acquire(folder, "training", wait_s=30)
    assert time.monotonic() - started < 15
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    run_lock.check_free(folder)
    with pytest.raises(run_lock.RunFolderBusy, match="SLURM job 4242"):
        run_lock.acquire(folder, "training", wait_s=0.3)
    output: list[str] = []
    release = threading.Timer(1.0, lambda: output.append(previous.finish()))
    release.start()
    lock = run_lock.acquire(folder, "training", wait_s=30)
    got = time.time()
    release.join()
    released = float(output[0].split("released")[1])
    assert got >= released
    assert run_lock.read(lock.path).attempt == "1"
    lock.release()


LOSE_IT = """
import logging, sys, time
from titanlite.runtime import run_lock
logging.basicConfig(level=logging.INFO, format="%(message)s")
run_lock.REFRESH_S = 0.1
lock = run_lock.acquire(sys.argv[1], "training")
first = run_lock.read(lock.path).heartbeat
deadline = time.monotonic() + 10
while run_lock.read(lock.path).heartbeat <= first:
    assert time.monotonic() < deadline, "not refreshed"
    time.sleep(0.05)
print("refreshed", flush=True)
time.sleep(30)
"""


def test_the_heartbeat_refreshes_and_a_holder_that_lost_its_lock_stops(tmp_path, no_slurm):
    """A holder whose lock another run took over (it was judged gone: frozen for a minute)
    exits without writing on, naming the new holder. The taker's lock is written again every
    0.2 s, as the taking run's own heartbeat does: a refresh of the holder that read its own
    lock just before the takeover writes over it once (the machine was loaded when one did),
    and the next one meets the taker's."""
    folder = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", LOSE_IT, str(folder)],
        cwd=REPO,
        env=subprocess_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout.readline().strip() == "refreshed", proc.communicate()[0]
    deadline = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < deadline:
        write_lock(folder, host="node-elsewhere", pid=1)
        time.sleep(0.2)
    output = proc.communicate(timeout=5)[0]
    assert proc.returncode == EXIT_USER_ERROR, output
    assert "lost job.dump_folder" in output and "on host node-elsewhere" in output


@pytest.mark.slow
def test_a_trainer_started_past_the_launchers_check_is_refused_too(tmp_path, no_slurm):
    """Two launches at the same moment both pass the launcher's check: the trainer's own lock
    refuses the second (exit 2, the line naming the holder), before it writes anything."""
    import train_scenarios
    from pool import get_pool

    folder = tmp_path / "run"
    holder = Holder(folder)
    argv = [
        "--job.config_file",
        str(REPO / "train_configs" / "debug_model.toml"),
        "--job.dump_folder",
        str(folder),
        "--training.steps",
        "1",
        "--model.n_layers",
        "1",
        "--validation.enable",
        "false",
        "--training.seq_len",
        "64",
    ]
    pool = get_pool(2)
    try:
        statuses = pool.run(train_scenarios.main, argv=argv, timeout=300)
    finally:
        holder.proc.kill()
        holder.finish()
    assert statuses == [EXIT_USER_ERROR] * 2, pool.last_output[0][-3000:]
    assert f"is in use by another run (training: pid {holder.proc.pid}" in pool.last_output[1]
    assert sorted(p.name for p in folder.iterdir()) == [run_lock.LOCK_FILE]


def test_converting_into_a_held_run_folder_is_refused_with_one_line(tmp_path, capsys, no_slurm):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import convert_from_hf
    finally:
        sys.path.pop(0)
    folder = tmp_path / "run"
    holder = Holder(folder)
    try:
        target = folder / "checkpoint" / "step-0"
        status = convert_from_hf.main([str(tmp_path / "hf"), str(target)])
    finally:
        holder.proc.kill()
        holder.finish()
    err = capsys.readouterr().err.strip().splitlines()
    assert status == EXIT_USER_ERROR and len(err) == 1, err
    assert f"is in use by another run (training: pid {holder.proc.pid}" in err[0]
    assert not target.exists()
    assert socket.gethostname() in err[0]
