"""scripts/multinode_trainer.slurm without a cluster: what it asks SLURM to run.

`srun`, `scontrol` and `getent` are stand-ins on PATH (small bash scripts, below) and the
script runs as sbatch would run it, with the job's variables (SLURM_JOB_ID, ...) set. The
stand-in srun records every call (its arguments and environment) and plays the job step it
was asked for: the lighthouse prints its "listening on" line and runs until SIGTERM; a replica
group's step follows a plan the test writes (exit with a status, wait for a file, or wait for
SIGUSR1 and exit 75 as the trainers do after saving). Nothing trains: tests/test_cluster.py runs
the script on a real two-node cluster, tests/test_ft.py runs real replica groups.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, subprocess_env

SCRIPT = REPO / "scripts" / "multinode_trainer.slurm"
CONFIG = str(REPO / "train_configs" / "debug_model.toml")
LIGHTHOUSE = str(Path(sys.executable).parent / "torchft_lighthouse")
WAIT_S = 60  # any single wait (a busy machine); every wait ends as soon as it can

FAKE_SRUN = r"""#!/usr/bin/env bash
# srun's stand-in: records the call, then plays the step.
dir="$FAKE_SLURM"
name="$(date +%s%N).$$"
env -0 >"$dir/calls/$name.env"
printf '%s\0' "$@" >"$dir/calls/$name.tmp"
mv "$dir/calls/$name.tmp" "$dir/calls/$name.argv"
value_of() {  # value_of FLAG ARGS...: the word after FLAG
  local flag="$1"; shift
  while [ $# -gt 1 ]; do [ "$1" = "$flag" ] && { echo "$2"; return; }; shift; done
}
if [[ " $* " == *"/torchft_lighthouse "* ]]; then
  bind="$(value_of --bind "$@")"
  echo "Lighthouse listening on: http://fakehost:${bind##*:}"
  trap 'kill "$sleeper" 2>/dev/null; : >"$dir/lighthouse.stopped"; exit 143' TERM
  sleep 300 & sleeper=$!
  wait "$sleeper"
  exit 97  # never stopped
fi
replica="$(value_of --fault_tolerance.replica_id "$@")"
replica="${replica:-single}"
attempt=$(( $(cat "$dir/attempts.$replica" 2>/dev/null || echo 0) + 1 ))
echo "$attempt" >"$dir/attempts.$replica"
: >"$dir/started.$replica.$attempt"
plan="$(cat "$dir/plan.$replica.$attempt" 2>/dev/null || echo "exit 0")"
echo "fake step of replica $replica, attempt $attempt: $plan"
case "$plan" in
  exit*) exit "${plan#exit }" ;;
  wait*)  # until the file exists (another group's restart started), then done
    for _ in $(seq 1200); do
      [ -e "$dir/${plan#wait }" ] && exit 0
      sleep 0.05
    done
    exit 99 ;;
  usr1)  # until SIGUSR1, then "saved and stopped"
    trap 'kill "$sleeper" 2>/dev/null; : >"$dir/usr1.$replica"; exit 75' USR1
    sleep 300 & sleeper=$!
    : >"$dir/ready.$replica"
    wait "$sleeper"
    exit 98 ;;
esac
"""
FAKE_SCONTROL = r"""#!/usr/bin/env bash
case "$1 $2" in
  "show hostnames") tr ',' '\n' <<<"$3" ;;
  "show node") echo "NodeName=$3 Arch=x86_64 NodeAddr=addr-$3 NodeHostName=$3" ;;
  "requeue "*) echo "$2" >>"$FAKE_SLURM/requeued" ;;
  *) exit 1 ;;
esac
"""
FAKE_GETENT = "#!/usr/bin/env bash\nexit 2  # no node name resolves: SLURM's NodeAddr is used\n"


class Job:
    """The batch script under fake SLURM, in tmp_path: NODES nodes n1..nNODES, job 4242."""

    def __init__(self, tmp_path: Path, nodes: int, *args: str, **env: str):
        self.dir = tmp_path / "slurm"
        (self.dir / "calls").mkdir(parents=True)
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
            (bin_dir / name).write_text(text)
        (bin_dir / "getent").write_text(FAKE_GETENT)
        for path in bin_dir.iterdir():
            path.chmod(0o755)
        self.out = tmp_path / "run"
        self.nodes = [f"n{i}" for i in range(1, nodes + 1)]
        base = subprocess_env(tmp_path)
        for key in list(base):  # nothing from the caller's SLURM or launcher settings
            if key.startswith(("SLURM_", "FT_", "TITANLITE_RESIGNAL")) or key in (
                "REPLICA_GROUPS",
                "GROUP_RESTARTS",
                "LOG_GROUP",
                "TORCHFT_LIGHTHOUSE",
                "RDZV_PORT",
                "TITANLITE_REQUEUE",
            ):
                del base[key]
        self.env = {
            **base,
            "PATH": f"{bin_dir}{os.pathsep}{base['PATH']}",
            "FAKE_SLURM": str(self.dir),
            "TITANLITE_REPO": str(REPO),
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NUM_NODES": str(nodes),
            "SLURM_JOB_NODELIST": ",".join(self.nodes),
            "SLURM_JOB_CPUS_PER_NODE": f"2(x{nodes})",
            **env,
        }
        self.args = [CONFIG, "--job.dump_folder", str(self.out), *args]

    def plan(self, replica: int | str, attempt: int, what: str) -> None:
        (self.dir / f"plan.{replica}.{attempt}").write_text(what)

    def start(self) -> subprocess.Popen:
        # Output into files, not pipes: the script's "first step" watcher may outlive it by a
        # second (it polls), and a pipe would stay open until then.
        with open(self.dir / "out", "w") as out, open(self.dir / "err", "w") as err:
            return subprocess.Popen(
                ["bash", str(SCRIPT), *self.args], env=self.env, stdout=out, stderr=err
            )

    def output(self) -> tuple[str, str]:
        return (self.dir / "out").read_text(), (self.dir / "err").read_text()

    def run(self) -> tuple[int, str, str]:
        proc = self.start()
        try:
            code = proc.wait(timeout=WAIT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
        return code, *self.output()

    def calls(self) -> list[tuple[list[str], dict[str, str]]]:
        """Every srun call in order: (arguments, environment)."""
        result = []
        for argv in sorted(self.dir.glob("calls/*.argv"), key=lambda p: int(p.name.split(".")[0])):
            env = argv.with_suffix(".env").read_text().split("\0")
            result.append(
                (
                    argv.read_text().split("\0")[:-1],
                    dict(e.split("=", 1) for e in env if "=" in e),
                )
            )
        return result

    def attempts(self, replica: int | str) -> int:
        path = self.dir / f"attempts.{replica}"
        return int(path.read_text()) if path.exists() else 0


def group_calls(job: Job) -> list[tuple[list[str], dict[str, str]]]:
    return [(a, e) for a, e in job.calls() if not any(w.endswith("/torchft_lighthouse") for w in a)]


def wait_for_files(job: Job, proc: subprocess.Popen, *paths: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not all(p.exists() for p in paths):
        if proc.poll() is not None:
            raise AssertionError(f"the script ended ({proc.returncode}):\n{job.output()}")
        assert time.monotonic() < deadline, f"timed out waiting for {paths}"
        time.sleep(0.02)


def test_groups_get_the_lighthouse_on_the_first_node_and_a_node_set_each(tmp_path):
    """REPLICA_GROUPS=4 on 8 nodes: the lighthouse on n1 (before any group), then one step per
    pair of nodes, each with its own rendezvous and the lighthouse's address; group 1 fails
    once and is started again alone, while the others run on (they wait, in their steps, for
    its second start: had the script stopped or restarted them, they would not end with 0)."""
    job = Job(tmp_path, 8, "--training.steps", "7", REPLICA_GROUPS="4", FT_MIN_REPLICAS="2")
    job.plan(1, 1, "exit 1")
    for g in (0, 2, 3):  # started.1.2: the stand-in writes it as group 1's second step starts
        job.plan(g, 1, "wait started.1.2")

    code, out, err = job.run()
    assert code == 0, f"{out}\n{err}"
    assert "training finished" in out

    calls = job.calls()
    lighthouse_argv, lighthouse_env = calls[0]
    assert lighthouse_argv[:5] == [
        "--nodes=1",
        "--ntasks=1",
        "--nodelist=n1",
        "--overlap",
        "--kill-on-bad-exit=0",
    ]
    at = lighthouse_argv.index(LIGHTHOUSE)
    assert lighthouse_argv[at + 1 :] == [
        "--bind",
        "0.0.0.0:29510",
        "--min_replicas",
        "2",
        "--join_timeout_ms",
        "5000",
        "--heartbeat_timeout_ms",
        "5000",
        "--quorum_tick_ms",
        "100",
    ]
    assert lighthouse_env["RUST_LOG"] == "info"
    assert (job.dir / "lighthouse.stopped").exists()  # SIGTERM at the end
    assert sum(LIGHTHOUSE in a for a, _ in calls) == 1

    lighthouse = "http://addr-n1:29510"
    steps = group_calls(job)
    assert len(steps) == 5
    for g in range(4):
        argv, env = next(
            (a, e) for a, e in steps if a[a.index("--fault_tolerance.replica_id") + 1] == str(g)
        )
        first, second = f"n{2 * g + 1}", f"n{2 * g + 2}"
        assert argv[:5] == [
            "--nodes=2",
            "--ntasks=2",
            "--ntasks-per-node=1",
            "--cpus-per-task=2",
            f"--nodelist={first},{second}",
        ]
        at = argv.index(str(REPO / "run_train.sh"))
        assert argv[at + 1 :] == [
            CONFIG,
            "--job.dump_folder",
            str(job.out),
            "--training.steps",
            "7",
            "--fault_tolerance.enable",
            "true",
            "--fault_tolerance.group_size",
            "4",
            "--fault_tolerance.replica_id",
            str(g),
            "--fault_tolerance.lighthouse",
            lighthouse,
        ]
        assert env["NNODES"] == "2"
        assert env["RDZV_ENDPOINT"] == f"addr-{first}:{29500 + g}"
        assert env["RDZV_ID"] == f"4242-replica-{g}"
        assert env["TORCHFT_LIGHTHOUSE"] == lighthouse
        assert env["TITANLITE_TORCHRUN"] == "1"  # MASTER_ADDR: a store the others can reach
    assert [job.attempts(g) for g in range(4)] == [1, 2, 1, 1]
    assert out.count("starting it again alone") == 1, out
    assert "replica 1 ended with status 1: starting it again alone (restart 1 of 3" in out
    for g in range(4):
        assert f"replica {g} ended with status 0" in out
    # Each group's output in its own log; group 0's (LOG_GROUP's default) in the job log too.
    logs = job.out / "logs"
    assert "fake step of replica 2, attempt 1" in (logs / "replica-2.log").read_text()
    assert "fake step of replica 0, attempt 1" in out
    assert "fake step of replica 2" not in out
    assert "listening on" in (logs / "lighthouse.log").read_text()


@pytest.mark.parametrize("how", ["REPLICA_GROUPS", "group_size"])
def test_a_node_count_the_groups_do_not_divide_is_refused(tmp_path, how):
    """6 nodes, 4 groups (asked for either way): one line on stderr, exit 2, nothing run."""
    if how == "REPLICA_GROUPS":
        job = Job(tmp_path, 6, REPLICA_GROUPS="4")
    else:
        args = ("--fault_tolerance.enable", "true", "--fault_tolerance.group_size", "4")
        job = Job(tmp_path, 6, *args)
    code, out, err = job.run()
    assert code == 2, f"{out}\n{err}"
    assert len(err.splitlines()) == 1, err
    assert "6 nodes do not split into 4 replica groups" in err
    assert not job.calls()


def test_a_group_that_keeps_failing_gives_up_and_the_worst_status_is_the_jobs(tmp_path):
    """GROUP_RESTARTS=1: group 0 fails twice and is not started a third time; group 1 diverges
    (3: final, never restarted); group 2 finishes. The job ends with the worst status, 3."""
    job = Job(tmp_path, 3, REPLICA_GROUPS="3", GROUP_RESTARTS="1")
    for attempt in (1, 2):
        job.plan(0, attempt, "exit 1")
    job.plan(1, 1, "exit 3")
    code, out, err = job.run()
    assert code == 3, f"{out}\n{err}"
    assert [job.attempts(g) for g in range(3)] == [2, 1, 1]
    assert out.count("starting it again alone") == 1, out
    assert "replica 0 ended with status 1: starting it again alone (restart 1 of 1" in out
    assert "replica 0 ended with status 1; not started again (GROUP_RESTARTS=1 spent)" in out
    assert "replica 1 ended with status 3" in out
    assert "training failed with status 3" in out
    assert (job.dir / "lighthouse.stopped").exists()


def test_a_preemption_signal_reaches_every_group_and_requeues_the_job(tmp_path):
    """SIGUSR1 to the batch script (--signal=B:USR1@120): every group's step gets it, each
    saves and exits 75 (here: the stand-in), none is started again, the job requeues itself;
    the lighthouse ignores the signals meant for the trainers."""
    job = Job(tmp_path, 4, REPLICA_GROUPS="2")
    job.plan(0, 1, "usr1")
    job.plan(1, 1, "usr1")
    proc = job.start()
    try:
        wait_for_files(job, proc, job.dir / "ready.0", job.dir / "ready.1")
        proc.send_signal(signal.SIGUSR1)
        code = proc.wait(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    out, err = job.output()
    assert code == 0, f"{out}\n{err}"
    assert (job.dir / "usr1.0").exists() and (job.dir / "usr1.1").exists()
    assert [job.attempts(g) for g in range(2)] == [1, 1]
    assert "got SIGUSR1: asking every replica group to save a checkpoint and stop" in out
    assert "requeueing job 4242" in out
    assert (job.dir / "requeued").read_text() == "4242\n"
    assert (job.dir / "lighthouse.stopped").exists()

    # SLURM sends SIGINT and SIGUSR1 (scancel --signal) to every step, the lighthouse's too: the
    # command the script gave srun keeps both from the lighthouse, which ends on SIGTERM. Run
    # here with a stand-in for torchft_lighthouse that, as torchft does for SIGINT, sets both to
    # their default action (death). Were either not blocked, it would die of that one: the
    # lowest pending signal comes first.
    stand_in = tmp_path / "bin" / "lighthouse"
    stand_in.write_text("#!/usr/bin/env bash\ntrap - INT USR1\necho listening on\nexec sleep 300\n")
    stand_in.chmod(0o755)
    argv = next(a for a, _ in job.calls() if LIGHTHOUSE in a)
    command = argv[argv.index("--kill-on-bad-exit=0") + 1 :]
    command[command.index(LIGHTHOUSE)] = str(stand_in)
    log = tmp_path / "lighthouse.log"
    with open(log, "w") as f:
        lighthouse = subprocess.Popen(command, env=job.env, stdout=f)
    try:
        deadline = time.monotonic() + WAIT_S
        while "listening on" not in log.read_text():
            assert lighthouse.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the stand-in did not start"
            time.sleep(0.02)
        for sig in (signal.SIGINT, signal.SIGUSR1, signal.SIGTERM):
            lighthouse.send_signal(sig)
        assert lighthouse.wait(timeout=WAIT_S) == -signal.SIGTERM
    finally:
        if lighthouse.poll() is None:
            lighthouse.kill()


@pytest.mark.parametrize("groups", [None, "1"])
def test_without_replica_groups_the_job_is_one_step_as_before(tmp_path, groups):
    """REPLICA_GROUPS unset or 1: one step on every node, one rendezvous, no lighthouse."""
    env = {"REPLICA_GROUPS": groups} if groups else {}
    job = Job(tmp_path, 2, "--training.steps", "7", **env)
    code, out, err = job.run()
    assert code == 0, f"{out}\n{err}"
    ((argv, env),) = job.calls()
    assert argv == [
        "--nodes=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=2",
        "--kill-on-bad-exit=0",
        "--wait=120",
        "bash",
        "-c",
        'trap "" USR1; exec "$@"',
        "titanlite-node",
        str(REPO / "run_train.sh"),
        CONFIG,
        "--job.dump_folder",
        str(job.out),
        "--training.steps",
        "7",
    ]
    assert (env["NNODES"], env["RDZV_ENDPOINT"], env["RDZV_ID"]) == ("2", "addr-n1:29500", "4242")
    assert "TORCHFT_LIGHTHOUSE" not in env
    assert "2 nodes (n1,n2), auto processes per node, rendezvous addr-n1:29500" in out
    assert "training finished" in out
