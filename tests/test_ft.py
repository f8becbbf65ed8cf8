"""Replica groups through torchft (titanlite/ft/), in real processes on gloo with a lighthouse on
this machine: bad input, and a group killed, restarted, killed again in the middle of its heal,
restarted again, healed and rejoined while the other groups train on without a restart, started
by scripts/ft_local.sh (the one-machine recipe) and restarted with the line it prints; Ctrl-C.
More recoveries in tests/test_ft_recovery.py."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from itertools import groupby
from pathlib import Path

import pytest
from conftest import REPO, read_metrics, run_train, subprocess_env
from ft_scenarios import (
    committed,
    ft_hooks,
    last_step,
    markers,
    set_pace,
    trace,
    wait_for,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchft") is None,
    reason="needs torchft (pip install 'titanlite[ft]')",
)

CONFIG = "train_configs/debug_model.toml"
SMALL = tuple(
    "--model.dim 64 --model.n_layers 2 --model.n_heads 4 --model.n_kv_heads 4 "
    "--model.multiple_of 32 --training.seq_len 64 --training.local_batch_size 2 "
    "--health.enable false --checkpoint.enable false --validation.enable false".split()
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("titanlite: error:")]


# ---------------------------------------------------------------------------- bad input
LIGHTHOUSE = "--fault_tolerance.lighthouse http://127.0.0.1:1"  # never reached: refused first
DILOCO = "--fault_tolerance.semi_sync_method diloco --fault_tolerance.sync_steps 4"


@pytest.mark.parametrize(
    "args, key",
    [
        ("--fault_tolerance.group_size 2", "fault_tolerance.lighthouse"),
        (
            f"--fault_tolerance.group_size 3 --fault_tolerance.replica_id 3 {LIGHTHOUSE}",
            "fault_tolerance.replica_id",
        ),
        (
            f"--fault_tolerance.group_size 2 --fault_tolerance.replica_id -1 {LIGHTHOUSE}",
            "fault_tolerance.replica_id",
        ),
        (
            f"--fault_tolerance.group_size 2 {LIGHTHOUSE} {DILOCO} "
            "--fault_tolerance.num_fragments 3",
            "fault_tolerance.num_fragments",
        ),
        (
            f"--fault_tolerance.group_size 2 {LIGHTHOUSE} {DILOCO} "
            "--fault_tolerance.num_fragments 2 --fault_tolerance.fragment_sync_delay 2",
            "fault_tolerance.fragment_sync_delay",
        ),
        (
            f"--fault_tolerance.group_size 2 {LIGHTHOUSE} {DILOCO} "
            "--fault_tolerance.num_fragments 2 --fault_tolerance.fragment_sync_delay 1 "
            "--checkpoint.enable true --training.steps 3",
            "fault_tolerance: training.steps = 3 ends while a fragment is in flight",
        ),
    ],
    ids=[
        "no-lighthouse",
        "replica_id=group_size",
        "negative-replica_id",
        "fragments-not-dividing",
        "delay-not-below-period",
        "ends-in-flight",
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_anything_starts(tmp_path, args, key):
    out = str(tmp_path / "out")
    ft = ["--fault_tolerance.enable", "true", *args.split()]
    result = run_train(tmp_path, CONFIG, *SMALL, "--job.dump_folder", out, *ft, timeout=120)
    assert result.returncode == 2, result.stderr
    assert len(errors(result.stderr)) == 1, result.stderr
    assert errors(result.stderr)[0].startswith(f"titanlite: error: {key}"), result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()  # preflight refused it: no process started


def test_the_local_launcher_refuses_bad_input_before_starting_a_lighthouse(tmp_path):
    env = subprocess_env(tmp_path)
    script = str(REPO / "scripts" / "ft_local.sh")
    usage = subprocess.run(
        [script, "two", CONFIG], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert usage.returncode == 2 and usage.stderr.startswith("usage: "), usage.stderr
    out = tmp_path / "out"
    bad = subprocess.run(
        [script, "2", CONFIG, *SMALL, "--job.dump_folder", str(out)]
        + ["--fault_tolerance.min_replica_size", "3"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.splitlines() == errors(bad.stderr), bad.stderr
    assert errors(bad.stderr)[0].startswith("titanlite: error: fault_tolerance.min_replica_size")
    assert not out.exists()  # no lighthouse started, no log written


@pytest.mark.slow
def test_an_unreachable_lighthouse_is_one_line_and_exit_2_within_the_timeout(tmp_path):
    """Nothing listens at the address (connections refused): the trainer gives up after
    quorum_timeout_s, with one line, instead of a traceback or a wait of torchft's 60 s."""
    timeout_s = 2.0
    cmd = [str(REPO / "run_train.sh"), CONFIG, *SMALL, "--job.dump_folder", str(tmp_path / "o")]
    cmd += ["--fault_tolerance.enable", "true", "--fault_tolerance.group_size", "2"]
    cmd += ["--fault_tolerance.lighthouse", f"http://127.0.0.1:{free_port()}"]
    cmd += ["--fault_tolerance.quorum_timeout_s", str(timeout_s)]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=subprocess_env(tmp_path, NGPU="1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lines: list[tuple[float, str]] = []  # (when it arrived, line)
    reader = threading.Thread(
        target=lambda: lines.extend((time.monotonic(), line) for line in proc.stderr)
    )
    reader.start()
    try:
        status = proc.wait(timeout=180)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        reader.join(timeout=10)
    ended = time.monotonic()
    stderr = "".join(line for _, line in lines)
    assert status == 2, stderr
    assert len(errors(stderr)) == 1, stderr
    assert errors(stderr)[0].startswith("titanlite: error: fault_tolerance.lighthouse: no "), stderr
    assert "Traceback" not in stderr
    # The last thing the trainer says before it joins the groups is the model line: from
    # there the timeout, plus generous room for a busy machine.
    built = next(t for t, line in lines if "titanlite.train: model " in line)
    assert ended - built < timeout_s + 20, stderr


# ------------------------------------------------------------------ the proof: kill, heal
PACE = 0.3  # seconds every step sleeps until the group killed is back (the test's clock)
STEPS = 100  # enough for two restarts at PACE on a busy machine; the rest runs at full speed
KILL_AT = 4  # group 2 is killed once it committed this step


def as_from_a_terminal() -> None:
    """In the launcher's child before exec: SIGINT at its default and not blocked, as a
    terminal's shell starts a command (an ignored or blocked SIGINT is inherited through exec,
    and bash cannot trap a signal ignored when it started; the Ctrl-C test's launcher twice
    never ran its trap in loaded full-suite runs)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def signal_masks(pid: int) -> str:
    """A process's blocked, ignored and caught signal masks (for a failure's message)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "(gone)"
    return " ".join(
        line for line in status.splitlines() if line.startswith(("SigBlk", "SigIgn", "SigCgt"))
    )


class Run:
    """scripts/ft_local.sh GROUPS ... under the hooks, NGPU=``ngpu`` processes per group, and
    every process it and the test start (all killed at the end, whatever happened)."""

    def __init__(
        self,
        tmp_path: Path,
        groups: int = 3,
        steps: int = STEPS,
        *,
        ngpu: int = 1,
        args: tuple[str, ...] = (),
        pace: float = PACE,
        env: dict[str, str] | None = None,
    ) -> None:
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.tmp_path = tmp_path
        self.control = tmp_path / "control"
        self.out = tmp_path / "run"
        self.env = subprocess_env(tmp_path, NGPU=str(ngpu), LOG_GROUP="none")
        self.env.update(ft_hooks(tmp_path, self.control), **(env or {}))
        set_pace(self.control, pace)
        self.cmd = [str(REPO / "scripts" / "ft_local.sh"), str(groups), CONFIG, *SMALL]
        self.cmd += ["--training.steps", str(steps), "--metrics.log_freq", "1"]
        self.cmd += ["--job.dump_folder", str(self.out), *args]
        self.launches: list[tuple[subprocess.Popen, Path]] = []
        self.restarts: list[subprocess.Popen] = []
        self.launch()

    def launch(self) -> None:
        """ft_local.sh with this run's command: its first launch, or the same command again
        after every group stopped."""
        n = len(self.launches)
        log_path = self.tmp_path / ("ft_local.out" if n == 0 else f"ft_local-{n}.out")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                self.cmd,
                cwd=REPO,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=as_from_a_terminal,
            )
        self.launches.append((proc, log_path))

    @property
    def launcher(self) -> subprocess.Popen:
        return self.launches[-1][0]

    @property
    def launcher_log(self) -> Path:
        return self.launches[-1][1]

    def output(self) -> str:
        return self.launcher_log.read_text()

    def launcher_running(self) -> None:
        if self.launcher.poll() is not None:
            raise AssertionError(f"ft_local.sh ended early:\n{self.output()[-4000:]}")

    def restart_line(self, group: int) -> str:
        match = re.search(rf"^ft_local: replica {group}: (.*)$", self.output(), re.MULTILINE)
        assert match, self.output()
        return match.group(1)

    def restart(self, group: int, **env: str) -> subprocess.Popen:
        """The line ft_local.sh printed for ``group``, run as a user would."""
        with open(self.tmp_path / f"restart-{len(self.restarts)}.out", "w") as log:
            proc = subprocess.Popen(
                ["bash", "-c", self.restart_line(group)],
                env={**self.env, **env},
                stdout=log,
                stderr=subprocess.STDOUT,  # bash's own word when its trainer is killed
                start_new_session=True,
            )
        self.restarts.append(proc)
        return proc

    def restart_output(self, index: int) -> str:
        """The end of a restarted group's output and of its trace (for a failure's message)."""
        out = (self.tmp_path / f"restart-{index}.out").read_text()[-4000:]
        traces = "".join(
            f"\n--- {p.name}: " + " ".join(p.read_text().splitlines()[-3:])[-1500:]
            for p in sorted(self.control.glob("trace-*"))
        )
        return f"restart {index} output:\n{out}{traces}"

    def new_pids(self, group: int, known: set[int], count: int = 1) -> set[int] | None:
        """The ``count`` processes of ``group`` not in ``known``, once all are built."""
        pids = set(markers(self.control, "ready").get(group, [])) - known
        return pids if len(pids) >= count else None

    def new_pid(self, group: int, known: set[int]) -> int | None:
        pids = self.new_pids(group, known)
        return pids.pop() if pids else None

    def kill_everything(self) -> None:
        launchers = [proc for proc, _ in self.launches]
        logs = [log for _, log in self.launches]
        stop_everything(self.control, logs, [*launchers, *self.restarts])


def ours(pid: int, control: Path) -> bool:
    """Whether ``pid`` is still one of this test's processes (they all have ``control`` in their
    environment): a pid that ended may be another program's by now."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"TITANLITE_FT_TEST_DIR={control}".encode() in environ


def left_running(control: Path) -> list[int]:
    """Every process still running with ``control`` in its environment: the trainers, and with
    NGPU > 1 each group's torchrun and run_train.sh, which no marker names."""
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    return [pid for pid in pids if pid != os.getpid() and ours(pid, control)]


def stop_everything(
    control: Path, launcher_logs: list[Path], procs: list[subprocess.Popen]
) -> None:
    """Whatever is left of a run, whatever happened: the launchers get SIGTERM (ft_local.sh
    stops its groups and its lighthouse), then every trainer, launcher and lighthouse SIGKILL."""
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = [p for group in markers(control, "ready").values() for p in group]
    for log in launcher_logs:
        lighthouse = re.search(r"lighthouse \S+ \(pid (\d+)", log.read_text())
        pids += [int(lighthouse.group(1))] if lighthouse else []
    for pid in [*pids, *left_running(control)]:
        if ours(pid, control):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for proc in procs:
        if proc.poll() is None:  # not yet reaped: its process group is still its own
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def first_commit_after(control: Path, groups: list[int], when: float) -> float:
    """Seconds from ``when`` until every one of ``groups`` committed a step that ended after it."""
    ends = [min(r["t1"] for r in committed(control, g) if r["t1"] > when) for g in groups]
    return max(ends) - when


@pytest.mark.slow
def test_a_killed_group_heals_from_a_live_one_and_rejoins_while_the_others_train_on(tmp_path):
    """3 groups of one process. Group 2 is SIGKILLed after step KILL_AT and restarted 3 steps
    later; that process is SIGKILLed in the middle of its heal and the group restarted again.
    Groups 0 and 1 never restart: one process each, every step from 1 to STEPS committed once,
    logged with the groups that took part (3, then 2 while group 2 is away, then 3). The group
    that comes back holds, before its first forward, exactly the parameters of the others at
    that step, and every group ends with the same parameters."""
    run = Run(tmp_path)
    control, survivors = run.control, [0, 1]
    try:
        # Every group built (heartbeating), then all ask for the first quorum together.
        wait_for(
            "the three groups to start",
            lambda: set(markers(control, "ready")) == {0, 1, 2},
            240,
            run.launcher_running,
        )
        (control / "go").touch()

        # 1. Group 2 killed between two steps.
        wait_for(f"group 2 at step {KILL_AT}", lambda: last_step(control, 2) >= KILL_AT, 120)
        victim = committed(control, 2)[-1]["pid"]
        os.kill(victim, signal.SIGKILL)
        killed = time.time()
        at_kill = max(last_step(control, g) for g in survivors)

        # 2. Restarted about 3 steps later; this process is killed in the middle of its heal.
        wait_for(
            "the survivors 3 steps on",
            lambda: min(last_step(control, g) for g in survivors) >= at_kill + 3,
            120,
            run.launcher_running,
        )
        run.restart(2, TITANLITE_FT_TEST_HEAL_PAUSE="5")
        healing = wait_for(
            "group 2 to heal",
            lambda: markers(control, "healing").get(2),
            180,
            run.launcher_running,
        )
        os.kill(healing[0], signal.SIGKILL)
        killed_healing = time.time()
        at_heal_kill = max(last_step(control, g) for g in survivors)
        assert not committed(control, 2, healing[0])  # it never got to train

        # 3. Restarted again: it heals and rejoins.
        wait_for(
            "the survivors 2 steps on",
            lambda: min(last_step(control, g) for g in survivors) >= at_heal_kill + 2,
            120,
            run.launcher_running,
        )
        known = {victim, healing[0]}
        restarted = time.time()
        final = run.restart(2)
        pid = wait_for("group 2's new process", lambda: run.new_pid(2, known), 180)
        wait_for(
            "group 2 to rejoin",
            lambda: committed(control, 2, pid),
            180,
            run.launcher_running,
        )
        set_pace(control, 0)  # the rest at full speed
        assert run.launcher.wait(timeout=300) == 137  # the worst group status: group 2's kill
        status = final.wait(timeout=120)
        assert status == 0, run.restart_output(len(run.restarts) - 1)
    finally:
        run.kill_everything()

    # Group 2: its first process until the kill, its last one from the heal on.
    first, last = committed(control, 2, victim), committed(control, 2, pid)
    timings = {
        "kill -> the survivors' next committed step": first_commit_after(
            control, survivors, killed
        ),
        "kill during a heal -> the survivors' next committed step": first_commit_after(
            control, survivors, killed_healing
        ),
        "restart -> the rejoined group's first committed step": last[0]["t1"] - restarted,
        "  its start-up, until its first quorum": last[0]["t0"] - last[0]["quorum_s"] - restarted,
        "  its first quorum, the heal included": last[0]["quorum_s"],
    }
    print(f"\nreplica groups (3 x 1 process, steps paced at {PACE} s until the rejoin):")
    for what, seconds in timings.items():
        print(f"  {what}: {seconds:.2f} s")
    (control / "timings.json").write_text(json.dumps(timings))

    output = run.output()
    for group, status in [(0, 0), (1, 0), (2, 137)]:
        assert f"ft_local: replica {group} ended with status {status} " in output, output

    # The survivors never restarted: one process, every step once, in order, each logged.
    for g in survivors:
        records = trace(control, g)
        assert {r["pid"] for r in records} == {records[0]["pid"]}
        assert [r["step"] for r in committed(control, g)] == list(range(1, STEPS + 1))
        train, _ = read_metrics(run.out / f"replica-{g}")
        assert [r["step"] for r in train] == list(range(1, STEPS + 1))
        assert all(r.get("kind") is None for r in train)  # no resume, no restart record
        by_step = {r["step"]: r["replicas"] for r in committed(control, g)}
        assert all(r["replicas"] == by_step[r["step"]] for r in train)
        # 3 groups, then 2 while group 2 is away (its heal that was cut short never
        # committed), then 3 again.
        assert [k for k, _ in groupby(r["replicas"] for r in train)] == [3, 2, 3], train

    # Group 2: every step of both processes logged, all with the three groups.
    assert [r["step"] for r in first] == list(range(1, len(first) + 1))
    healed_at = last[0]["step"]
    assert [r["step"] for r in last] == list(range(healed_at, STEPS + 1))
    records, _ = read_metrics(run.out / "replica-2")
    train = [r for r in records if "loss" in r]
    # (the kill may fall between a step's trace record and its metrics line)
    logged = [[r["step"] for r in first + last], [r["step"] for r in first[:-1] + last]]
    assert [r["step"] for r in train] in logged
    assert all(r["replicas"] == 3 for r in train)
    # The heal that went through is in the metrics: when, how long, how much state.
    heals = [r for r in records if r.get("kind") == "heal"]
    assert [r["step"] for r in heals] == [healed_at - 1], heals
    assert heals[0]["heal_s"] > 0 and heals[0]["heal_mib"] > 0 and heals[0]["replicas"] == 3

    # Bitwise: every group holds the same parameters at every step it took part in, the
    # returning group from the start of its first step (the heal, before its forward).
    records = {g: {r["step"]: r for r in committed(control, g)} for g in (0, 1)}
    for r in first + last:
        for g in survivors:
            assert records[g][r["step"]]["before"] == r["before"], (g, r["step"])
            # (equal before but not after the step: the returning group's update differs,
            # its optimizer state or learning rate not those of the others)
            assert records[g][r["step"]]["after"] == r["after"], (g, r["step"], healed_at)
    assert records[0][healed_at]["before"] == last[0]["before"]  # right after the heal
    assert records[0][STEPS]["after"] == records[1][STEPS]["after"] == last[-1]["after"]


@pytest.mark.slow
def test_ctrl_c_reaches_every_group_through_the_local_launcher(tmp_path):
    """The groups run in process groups of their own (a terminal's Ctrl-C reaches the launcher
    alone): it passes SIGINT on, every group stops at the end of its step (130), and so does
    the launcher, its lighthouse stopped."""
    run = Run(tmp_path, groups=2, steps=1000)
    control = run.control
    (control / "go").touch()  # no need to start together
    try:
        wait_for(
            "both groups at step 2",
            lambda: min(last_step(control, g) for g in (0, 1)) >= 2,
            240,
            run.launcher_running,
        )
        os.kill(run.launcher.pid, signal.SIGINT)
        try:
            status = run.launcher.wait(timeout=120)
        except subprocess.TimeoutExpired:  # (seen once under load: say where each group was)
            logs = {p.name: p.read_text()[-3000:] for p in (run.out / "logs").glob("*.log")}
            masks = signal_masks(run.launcher.pid)
            raise AssertionError(
                f"not stopped in 120 s ({masks}):\n{run.output()}\n{logs}"
            ) from None
        assert status == 130, run.output()
        pids = [p for group in markers(control, "ready").values() for p in group]
        lighthouse = re.search(r"lighthouse \S+ \(pid (\d+)", run.output())
        assert lighthouse, run.output()
        pids.append(int(lighthouse.group(1)))
        assert not [p for p in pids if ours(p, control)]  # nothing left running
    finally:
        run.kill_everything()
    for group in (0, 1):
        assert f"ft_local: replica {group} ended with status 130 " in run.output()
        assert last_step(control, group) < 1000
