"""Ctrl-C and kills through ./run_train.sh, as a user at a terminal meets them (issue 37).

SIGINT goes to the launcher's whole process group, as a terminal sends it, with SIGINT's
default disposition restored first (a test runner may start children with it ignored, which
is what hid the orphaned trainer). Every case checks that no process of the run is left 10 s
after the launcher exits. Rows of docs/reliability.md's table.

Cost: each launch is a real process start (the torchrun ones three `import torch`); the
baselines and resumes run in the reused worker pool instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import train_scenarios
from conftest import REPO, slow_steps, subprocess_env
from pool import get_pool

from titanlite.checkpoint import integrity
from titanlite.checkpoint.folders import read_sidecar
from titanlite.errors import EXIT_INTERRUPTED, EXIT_USER_ERROR
from titanlite.metrics.jsonl import read_metrics
from titanlite.runtime import pids, run_lock

pytestmark = pytest.mark.slow

CONFIG = str(REPO / "train_configs" / "debug_model.toml")
STEPS = 16  # a Ctrl-C after step 3 lands mid-run (with slow_steps, however late it comes)
SMALL = [
    "--checkpoint.interval",
    "4",
    "--metrics.log_freq",
    "1",
    "--validation.enable",
    "false",
    "--training.local_batch_size",
    "2",
    "--training.seq_len",
    "64",
    "--model.n_layers",
    "2",
]
# SIGINT's default action back, then the launcher (a terminal's shell starts commands so).
AS_A_TERMINAL = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)
# Every save but TEST_FAST_SAVE's takes 30 s per shard file (the sleep before each is opened).
SLOW_SAVES = """
import io, os, time
_open = io.open
def _slow_open(file, mode="r", *args, **kwargs):
    if "w" in mode and ".distcp" in str(file) and os.environ["TEST_FAST_SAVE"] not in str(file):
        time.sleep(30)
    return _open(file, mode, *args, **kwargs)
io.open = _slow_open
"""


class Launch:
    """./run_train.sh in a process group of its own, its output in a file."""

    def __init__(self, out: Path, ngpu: int, *args: str, steps: int = STEPS, **env: str):
        out.parent.mkdir(parents=True, exist_ok=True)
        self.log = out.parent / f"{out.name}-{time.monotonic_ns()}.log"
        cmd = [
            sys.executable,
            "-c",
            AS_A_TERMINAL,
            str(REPO / "run_train.sh"),
            CONFIG,
            *SMALL,
            "--training.steps",
            str(steps),
            "--job.dump_folder",
            str(out),
            *args,
        ]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=REPO,
                env=subprocess_env(out.parent, NGPU=str(ngpu), **env),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.out = out

    def ctrl_c(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)

    def wait_until(self, what: str, condition, timeout: float = 300) -> None:  # noqa: ANN001
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None, f"exited before {what}:\n{self.output()}"
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"timed out waiting for {what}:\n{self.output()}")
            time.sleep(0.01)

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"did not exit within {timeout} s:\n{self.output()}")

    def kill(self) -> None:
        for pid in processes_of(self.out):
            with contextlib.suppress(ProcessLookupError):  # a child that died with its parent
                os.kill(pid, signal.SIGKILL)

    def output(self) -> str:
        return self.log.read_text()[-5000:]


def processes_of(out: Path, naming: bytes = b"") -> list[int]:
    """Every live process whose command line names the run's folder (launcher, preflight,
    torchrun, trainers) and `naming`; zombies have none. Read in one pass: a short-lived
    process may be gone between the listing and the read."""
    needle, found = str(out).encode(), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes()
                if needle in cmdline and naming in cmdline:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def assert_nothing_left(launch: Launch) -> float:
    """No process of the run 10 s after the launcher exited; how long the last one took."""
    start = time.monotonic()
    while processes_of(launch.out) and time.monotonic() - start < 10:
        time.sleep(0.05)
    left = processes_of(launch.out)
    launch.kill()
    assert not left, f"processes left behind: {left}\n{launch.output()}"
    return time.monotonic() - start


def logged_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    lines = path.read_text().splitlines(keepends=True)
    return [json.loads(line)["step"] for line in lines if line.endswith("\n") and '"loss"' in line]


def steps_since_resume(out: Path) -> list[int]:
    """The steps logged since the last resume record (all of them when there is none)."""
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True) if path.is_file() else []
    records = [json.loads(line) for line in lines if line.endswith("\n")]
    starts = [i for i, r in enumerate(records) if r.get("kind") == "resume"]
    return [r["step"] for r in records[starts[-1] + 1 if starts else 0 :] if "loss" in r]


def losses(out: Path) -> dict[int, float]:
    return {
        s: r["loss"] for s, r in read_metrics(out / "metrics.jsonl").train.items() if "loss" in r
    }


def pool_run(world: int, out: Path, *args: str, steps: int = STEPS) -> str:
    """`python -m titanlite.train` with the launch's arguments on ``world`` pool ranks: rank
    0's output (it must exit 0)."""
    argv = [
        "--job.config_file",
        CONFIG,
        *SMALL,
        "--training.steps",
        str(steps),
        "--job.dump_folder",
        str(out),
        *args,
    ]
    pool = get_pool(world)
    statuses = pool.run(train_scenarios.main, argv=argv, timeout=300)
    assert statuses == [0] * world, pool.last_output[0][-3000:]
    return pool.last_output[0]


@pytest.fixture(scope="module")
def baselines(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[int, float]]:
    """Uninterrupted losses of each layout, by world size."""
    found = {}
    for world in (1, 2):
        out = tmp_path_factory.mktemp(f"baseline{world}") / "run"
        pool_run(world, out)
        found[world] = losses(out)
        assert sorted(found[world]) == list(range(1, STEPS + 1))
    return found


def assert_stopped_and_saved(launch: Launch, status: int) -> int:
    """Exit 130, one line saying so and how to resume, the stop step saved; that step."""
    assert status == EXIT_INTERRUPTED, launch.output()
    last = launch.output().strip().splitlines()[-1]
    assert last.startswith("titanlite: interrupted (Ctrl-C) at step "), launch.output()
    assert last.endswith("; checkpoint saved; run the same command to resume"), last
    stopped = max(steps_since_resume(launch.out))
    assert stopped < STEPS and f"at step {stopped};" in last, last
    assert read_sidecar(launch.out / "checkpoint" / f"step-{stopped}")["step"] == stopped
    assert not (launch.out / "run.lock").exists()  # released after the save
    return stopped


def test_ctrl_c_mid_run_one_process_saves_exits_130_and_resumes_exactly(tmp_path, baselines):
    """The direct path (one process, exec'd). While it trains, the same command into the same
    folder exits 2 at once, naming the run; the first run's metrics.jsonl stays its own."""
    out = tmp_path / "run"
    job = Launch(out, 1, **slow_steps(tmp_path))
    job.wait_until("step 3", lambda: len(logged_steps(out)) >= 3)
    # Held still meanwhile (alive, holding its lock), so the second launch meets it running
    # however slowly this machine starts a process: unheld, the first run once finished its
    # last 13 steps before the second got to its check.
    os.kill(job.proc.pid, signal.SIGSTOP)
    started = time.monotonic()
    second = Launch(out, 1)
    assert second.wait() == EXIT_USER_ERROR, second.output()
    refused_s = time.monotonic() - started
    os.kill(job.proc.pid, signal.SIGCONT)
    line = f"is in use by another run (training: pid {job.proc.pid} on host "
    assert line in second.output() and len(second.output().strip().splitlines()) == 1
    assert job.proc.poll() is None  # the first goes on

    job.ctrl_c()
    started = time.monotonic()
    stopped = assert_stopped_and_saved(job, job.wait())
    stop_s = time.monotonic() - started
    assert_nothing_left(job)
    assert logged_steps(out) == list(range(1, stopped + 1))  # each step once: nobody else wrote
    output = pool_run(1, out)
    assert f"resumed from checkpoint at step {stopped}" in output
    assert losses(out) == baselines[1]
    print(
        f"second launch refused in {refused_s:.1f} s; stopped at step {stopped}, exit 130 "
        f"{stop_s:.1f} s after Ctrl-C"
    )


def test_ctrl_c_mid_run_through_torchrun_stops_every_rank_at_one_step(tmp_path, baselines):
    """NGPU=2 (torchrun; the launcher relays Ctrl-C to the trainers, which run in sessions of
    their own): both ranks stop at one step, save it, exit 130; resumed losses are exact.
    Each rank's output is kept in the run's folder, and the launch leaves nothing in TMPDIR;
    it removed the scratch files a SIGKILLed launcher left on this node, not a live one's."""
    out = tmp_path / "run"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    gone = subprocess.Popen(["true"])  # a launcher pid that no longer runs
    gone.wait()
    node, logs = os.uname().nodename, out / "logs"
    logs.mkdir(parents=True)
    left = [logs / f"launcher.{node}.{gone.pid}.errors", logs / f"launcher.{node}.{gone.pid}.pids"]
    live = [logs / f"launcher.{node}.{os.getpid()}.pids", logs / f"launcher.other.{gone.pid}.pids"]
    for path in left + live:
        path.write_text("")
    job = Launch(out, 2, TMPDIR=str(scratch), **slow_steps(tmp_path))
    job.wait_until("step 3", lambda: len(logged_steps(out)) >= 3)
    job.ctrl_c()
    started = time.monotonic()
    stopped = assert_stopped_and_saved(job, job.wait())
    stop_s = time.monotonic() - started
    left_s = assert_nothing_left(job)
    assert sorted(p for p in logs.iterdir() if p.is_file()) == sorted(live)
    (launch_logs,) = (p for p in logs.iterdir() if p.is_dir())  # torchrun's, one per launch
    ranks = launch_logs / "attempt_0"
    assert sorted(p.name for p in ranks.iterdir()) == ["0", "1"]
    assert f"interrupted (Ctrl-C) at step {stopped}" in (ranks / "0" / "stderr.log").read_text()
    litter = [p.name for p in scratch.iterdir() if p.name.startswith(("torchelastic", "titanlite"))]
    assert not litter, litter
    output = pool_run(2, out)
    assert f"resumed from checkpoint at step {stopped}" in output
    assert losses(out) == baselines[2]
    print(
        f"stopped at step {stopped}, exit 130 {stop_s:.1f} s after Ctrl-C; last process gone "
        f"{left_s:.1f} s after the launcher"
    )


def test_sigkill_of_the_whole_job_leaves_no_trainer_and_the_same_command_resumes(
    tmp_path, baselines
):
    """SIGKILL of the launcher's process group (run_train.sh and torchrun; the trainers are in
    sessions of their own) once step-4 is saved: the trainers die with torchrun, and the same
    command takes over the dead run's lock with a warning and resumes exactly from step-4.
    The launcher's two scratch files, which it had no chance to remove, are in the run's logs
    folder, not in TMPDIR. Saves after step-4 are slowed (30 s per shard file): none completes
    before the kill, however late it comes."""
    out = tmp_path / "run"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_SAVES)
    job = Launch(out, 2, TMPDIR=str(scratch), PYTHONPATH=str(hook), TEST_FAST_SAVE="step-4.partial")
    job.wait_until("step-4 is saved", (out / "checkpoint" / "step-4").is_dir)
    os.killpg(job.proc.pid, signal.SIGKILL)
    job.wait()
    left_s = assert_nothing_left(job)
    assert not [p.name for p in scratch.iterdir() if p.name.startswith("titanlite")]
    assert sorted(p.suffix for p in (out / "logs").glob("launcher.*")) == [".errors", ".pids"]
    holder = run_lock.read(out / "run.lock")
    assert holder is not None  # nobody released it
    # A killed trainer's command line reads empty while the kernel still tears it down (a
    # busy machine takes seconds to free its memory); until its pid is gone the lock is live.
    deadline = time.monotonic() + 20
    while pids.alive(holder.pid, holder.pid_start) and time.monotonic() < deadline:
        time.sleep(0.05)
    output = pool_run(2, out)
    assert "taking over job.dump_folder" in output and "no longer exists" in output
    assert "resumed from checkpoint at step 4" in output
    assert losses(out) == baselines[2]
    print(f"trainers gone {left_s:.1f} s after the SIGKILL")


def caught(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (/proc/PID/status SigCgt)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(
        next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt")), 16
    )
    return bool(mask >> (sig - 1) & 1)


def ctrl_c_in_a_held_import(
    tmp_path: Path, process: str, module: str, **env: str
) -> tuple[Launch, Path]:
    """A one-process launch in which PROCESS (what its command line contains, e.g. the module
    run with -m) holds its import or look-up of MODULE for 3 s, Ctrl-C once the hold began (a
    Ctrl-C before it would land in the interpreter's own start-up), and exit 130. The launch
    and the file that got a line for each hold."""
    hook, holding = tmp_path / "hook", tmp_path / "holding"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(f"""
import sys, time
class _Slow:
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            with open({str(holding)!r}, "a") as held:
                held.write("held\\n")
            time.sleep(3)
        return None
if {process.encode()!r} in open("/proc/self/cmdline", "rb").read():
    sys.meta_path.insert(0, _Slow())
""")
    job = Launch(tmp_path / "run", 1, PYTHONPATH=str(hook), **env)
    # the line, not the file: open() creates it, and a Ctrl-C between that and the write (at
    # close, one write) would leave it empty
    job.wait_until(
        f"{process}'s held import of {module}",
        lambda: holding.exists() and holding.read_text().endswith("\n"),
    )
    job.ctrl_c()
    assert job.wait() == EXIT_INTERRUPTED, job.output()
    return job, holding


def test_ctrl_c_before_the_trainer_can_handle_it_is_the_start_up_line(tmp_path):
    """One process, Ctrl-C while the trainer still imports what it needs to install its
    handlers (an import held 3 s): the start-up line (without a step: a resumed run's is not
    known yet) and exit 130, no traceback."""
    job, _ = ctrl_c_in_a_held_import(tmp_path, "titanlite.train", "titanlite.runtime.run_lock")
    assert "Traceback" not in job.output() and "KeyboardInterrupt" not in job.output()
    assert job.output().strip().splitlines()[-1] == (
        "titanlite: interrupted (Ctrl-C) during start-up; nothing new to save; run the same "
        "command to resume"
    )
    assert_nothing_left(job)


def test_ctrl_c_during_the_checks_before_launch_is_one_line(tmp_path):
    """Ctrl-C while the launcher's checks still import (an import held 3 s): exit 130 and the
    one line (it printed a KeyboardInterrupt traceback and exited 1), nothing launched,
    nothing left."""
    job, _ = ctrl_c_in_a_held_import(tmp_path, "titanlite.preflight", "titanlite.checks")
    assert "Traceback" not in job.output() and "KeyboardInterrupt" not in job.output()
    last = job.output().strip().splitlines()[-1]
    assert last == "titanlite: interrupted (Ctrl-C) before the run started; nothing ran", last
    assert_nothing_left(job)
    assert not job.out.exists()


def test_ctrl_c_while_the_launcher_checks_its_python_stops_there(tmp_path):
    """Ctrl-C while scripts/setup_env.sh asks a Python whether titanlite's modules import (the
    look-up held): the one line and exit 130 (it exited 130 silently), and nothing after it
    (a check cut short must not read as "modules missing" and go on to install them)."""
    # "sentencepiece": in the check's command line (the modules it looks up)
    job, holding = ctrl_c_in_a_held_import(tmp_path, "sentencepiece", "torch", TITANLITE_PYTHON="")
    assert job.output().strip().splitlines() == [
        "titanlite: interrupted (Ctrl-C) before the run started; nothing ran"
    ]
    assert holding.read_text() == "held\n"  # one check, then nothing
    assert_nothing_left(job)
    assert not job.out.exists()


@pytest.mark.parametrize("ngpu", [1, 2])
def test_ctrl_c_during_start_up_exits_130_without_a_save(tmp_path, ngpu):
    """One process: Ctrl-C once the trainer handles signals, while it still imports torch.
    torchrun: Ctrl-C as soon as torchrun runs, before any trainer exists (the launcher hands
    it on when they start). Exit 130 before step 1, nothing saved, nothing left."""
    out = tmp_path / "run"
    job = Launch(out, ngpu)
    if ngpu == 1:  # run_train.sh execs the trainer: this pid
        job.wait_until("the trainer's handlers", lambda: caught(job.proc.pid, signal.SIGUSR1))
    else:
        job.wait_until("torchrun", lambda: processes_of(out, b"torch.distributed.run"))
    job.ctrl_c()
    started = time.monotonic()
    assert job.wait() == EXIT_INTERRUPTED, job.output()
    print(f"start-up Ctrl-C: exit 130 {time.monotonic() - started:.1f} s later")
    last = job.output().strip().splitlines()[-1]
    assert last == (
        "titanlite: interrupted (Ctrl-C) during start-up, before step 1; nothing "
        "new to save; run the same command to resume"
    ), job.output()
    assert "KeyboardInterrupt" not in job.output()
    assert_nothing_left(job)
    assert not logged_steps(out) and not list((out / "checkpoint").glob("step-*"))
    assert not (out / "run.lock").exists()


@pytest.mark.parametrize("ngpu", [1, 2])
def test_a_second_ctrl_c_during_the_save_stops_at_once(tmp_path, ngpu):
    """Every save after step-4 is slowed (30 s per shard file); a second Ctrl-C during the
    first one's save ends the run within seconds, without that save; step-4 is untouched
    (files, checksums), and the same command resumes from it like after any kill (the test
    above). Whether the first Ctrl-C comes before step 8 or during its periodic save (it may
    start as soon as step-4 is complete), no save after step-4 completes."""
    out = tmp_path / "run"
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_SAVES)
    job = Launch(out, ngpu, PYTHONPATH=str(hook), TEST_FAST_SAVE="step-4.partial")
    step4 = out / "checkpoint" / "step-4"
    job.wait_until("step-4 is saved", step4.is_dir)
    before = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in step4.iterdir()}
    job.ctrl_c()
    job.wait_until("a save after step 4", lambda: any((out / "checkpoint").glob("*.partial")))
    # The first Ctrl-C handled (two in a row could arrive as one): one process has re-armed
    # SIGINT's default; run_train.sh has said it relays it.
    if ngpu == 1:
        job.wait_until("SIGINT's default", lambda: not caught(job.proc.pid, signal.SIGINT))
    else:
        job.wait_until(
            "the launcher's relay", lambda: "run_train: Ctrl-C: stopping" in job.output()
        )
    job.ctrl_c()
    started = time.monotonic()
    status = job.wait()
    exit_s = time.monotonic() - started
    # One process dies of the signal itself (its shell reports 130); torchrun's launcher says 130.
    assert status == (-signal.SIGINT if ngpu == 1 else EXIT_INTERRUPTED), job.output()
    assert exit_s < 15, f"took {exit_s:.1f} s to stop"  # a save would take 30 s or more
    if ngpu == 2:
        assert (
            job.output()
            .strip()
            .splitlines()[-1]
            .startswith("titanlite: stopped at once on the second Ctrl-C, nothing saved")
        )
    assert_nothing_left(job)
    after = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in step4.iterdir()}
    assert after == before
    assert integrity.problems(step4, read_sidecar(step4)["checksum_ranks"]) == []
    complete = sorted(p.name for p in (out / "checkpoint").iterdir() if "." not in p.name)
    assert complete == ["step-4"], complete
    print(f"second Ctrl-C: exited in {exit_s:.2f} s")
