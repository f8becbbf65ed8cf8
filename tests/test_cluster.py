"""Multi-node training on a real two-node cluster made on this machine.

scripts/local_cluster.sh builds it: two network namespaces joined by a veth pair (node1
10.200.0.1, node2 10.200.0.2), each with its own hostname, and SLURM (munged, slurmctld, one
slurmd per node). Jobs go through scripts/multinode_trainer.slurm exactly as on a cluster; the
plain-torchrun tests start ./run_train.sh once per node. Everything is real processes talking
gloo over the veth pair; no traffic leaves the machine.

Needs root (namespaces, daemons): skipped, with the reason, only when not root or when this
machine cannot create namespaces. On a fresh machine the cluster fixture installs slurm-wlm and
munge itself (apt-get, through local_cluster.sh). Measured times (sbatch to first step) go to
cluster_timings.json in pytest's base temporary folder.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO, read_metrics, slow_steps, subprocess_env

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

LOCAL_CLUSTER = REPO / "scripts" / "local_cluster.sh"
SLURM_SCRIPT = REPO / "scripts" / "multinode_trainer.slurm"
CONFIG = str(REPO / "train_configs" / "debug_model.toml")
STEPS = 16  # a checkpoint every 4: the kill and preemption tests need a few after one
RTOL = 1e-4  # a parallel layout against one process: float32 round-off only
# The tiny debug model of test_parity (heads divisible by tp), a checkpoint every 4 steps.
TINY = (
    "--model.dim",
    "64",
    "--model.n_layers",
    "2",
    "--model.n_heads",
    "4",
    "--model.n_kv_heads",
    "4",
    "--model.multiple_of",
    "32",
    "--training.seq_len",
    "64",
    "--training.steps",
    str(STEPS),
    "--metrics.log_freq",
    "1",
    "--validation.enable",
    "false",
    "--checkpoint.interval",
    "4",
)
# Global batch 2 everywhere: one process with 2 sequences, or dp=2 ranks with 1 each.
SLURM_LAYOUT = (
    "--parallelism.data_parallel_shard_degree",
    "2",
    "--parallelism.tensor_parallel_degree",
    "2",
    "--training.local_batch_size",
    "1",
)
PLAIN_LAYOUT = ("--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "1")
WAIT_S = 300  # any single wait; the machine may be shared and slow
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}  # a job's states once it is over

TIMINGS: dict[str, float] = {}


# --------------------------------------------------------------------------- helpers
def losses(folder: Path) -> dict[int, float]:
    """The last logged loss of every step (metrics.jsonl is append-only: a step logged before
    an interruption and again after the resume counts once, as the resumed run logged it)."""
    records, _ = read_metrics(folder)
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def step_records(folder: Path) -> list[dict]:
    """Training and resume records so far (a line being written is skipped)."""
    path = folder / "metrics.jsonl"
    records = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("kind") != "validation":
            records.append(record)
    return records


def first_step_time(folder: Path) -> float:
    return next(r["time"] for r in step_records(folder) if "loss" in r)


def assert_close(name: str, base: dict[int, float], other: dict[int, float], rtol: float) -> None:
    assert sorted(other) == list(range(1, STEPS + 1)), f"{name}: steps {sorted(other)}"
    worst = max(abs(base[s] - other[s]) / abs(base[s]) for s in base)
    table = "\n".join(f"  step {s:2d}  {base[s]:.8g} vs {other[s]:.8g}" for s in sorted(base))
    assert worst <= rtol, f"{name}: max relative loss difference {worst:.3g} > {rtol}\n{table}"


def wait_for(what: str, condition, timeout: float = WAIT_S, every: float = 0.1):  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


class Cluster:
    def __init__(self, folder: Path, env: dict[str, str]):
        self.folder = folder
        self.env = env

    def command(self, node: str, *cmd: str) -> list[str]:
        return [str(LOCAL_CLUSTER), "exec", node, "--dir", str(self.folder), "--", *cmd]

    def run(self, node: str, *cmd: str, timeout: float = 60, **env: str) -> str:
        """CMD on NODE; its stdout (fails the test on a non-zero exit)."""
        result = subprocess.run(
            self.command(node, *cmd),
            cwd=REPO,
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert result.returncode == 0, f"{cmd}: exit {result.returncode}\n{result.stderr}"
        return result.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, Reason, ...)."""
        text = self.run("node1", "scontrol", "show", "job", "-o", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def submit(self, folder: Path, *args: str, **env: str) -> str:
        """sbatch multinode_trainer.slurm with the debug config, TINY and ARGS from node1, its
        output in FOLDER/slurm-JOBID.out; the job id."""
        return (
            self.run(
                "node1",
                "sbatch",
                "--parsable",
                f"--output={folder}/slurm-%j.out",
                str(SLURM_SCRIPT),
                CONFIG,
                *TINY,
                *args,
                **env,
            )
            .strip()
            .split(";")[0]
        )

    def finished(self, job_id: str) -> dict[str, str] | None:
        """The job's state once it has ended, else None."""
        state = self.job(job_id)
        return state if state["JobState"] in ENDED else None


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The two-node cluster, up for this module (skipped only without root or namespaces)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: network namespaces and SLURM daemons")
    folder = tmp_path_factory.mktemp("cluster")
    env = subprocess_env(folder, OMP_NUM_THREADS="1")
    up = subprocess.run(
        [str(LOCAL_CLUSTER), "up", "--dir", str(folder)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if up.returncode == 2:  # local_cluster.sh refuses: not root, or no namespaces here
        pytest.skip(up.stderr.strip().splitlines()[-1])
    assert up.returncode == 0, f"local_cluster.sh up failed:\n{up.stdout}\n{up.stderr}"
    try:
        yield Cluster(folder, env)
    finally:
        subprocess.run(
            [str(LOCAL_CLUSTER), "down", "--dir", str(folder)],
            env=env,
            capture_output=True,
            timeout=120,
        )
        if TIMINGS:
            path = tmp_path_factory.getbasetemp() / "cluster_timings.json"
            path.write_text(json.dumps(TIMINGS, indent=2) + "\n")


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """One process, global batch 2 (test_parity shows every layout matches one process).
    The trainer on a rank of the reused worker pool (tests/pool.py; one intra-op thread):
    the cheapest correct baseline, with no process to start."""
    import train_scenarios
    from pool import get_pool

    out = tmp_path_factory.mktemp("baseline") / "run"
    argv = [
        *TINY,
        "--training.local_batch_size",
        "2",
        "--checkpoint.enable",
        "false",
        "--job.dump_folder",
        str(out),
    ]
    get_pool(1).run(train_scenarios.train, argv=argv, timeout=WAIT_S)
    curve = losses(out)
    assert len(set(curve.values())) == STEPS  # the model trains: every loss differs
    return curve


@pytest.fixture(scope="module")
def slurm_run(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """An uninterrupted 2-node x 2-process sbatch job: (dump folder, job log)."""
    folder = tmp_path_factory.mktemp("slurm")
    out = folder / "run"
    start = time.time()
    job = cluster.submit(folder, *SLURM_LAYOUT, "--job.dump_folder", str(out), NGPU="2")
    # Polled here rather than with `sbatch --wait`, whose own polling backs off: it returned
    # about 25 s after this job had ended.
    state = wait_for("the job to finish", lambda: cluster.finished(job), every=0.5)
    TIMINGS["sbatch_to_first_step_s"] = round(first_step_time(out) - start, 2)
    TIMINGS["sbatch_to_end_s"] = round(time.time() - start, 2)
    (log,) = folder.glob("slurm-*.out")
    assert state["JobState"] == "COMPLETED", f"{state}\n{log.read_text()[-4000:]}"
    return out, log.read_text()


@pytest.fixture(scope="module")
def killed_rank_run(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """./run_train.sh on node1 and node2 (plain torchrun, c10d rendezvous on node1, 1 process
    per node, MAX_RESTARTS=1); rank 1 is SIGKILLed once a checkpoint exists and steps after it
    were logged."""
    folder = tmp_path_factory.mktemp("plain")
    out = folder / "run"
    env = {
        **cluster.env,
        "NNODES": "2",
        "NGPU": "1",
        "RDZV_ENDPOINT": "node1:29400",
        "RDZV_ID": "plain",
        "MAX_RESTARTS": "1",
        **slow_steps(folder),  # the kill lands before step-8 is saved, however late
    }
    args = (CONFIG, *TINY, *PLAIN_LAYOUT, "--job.dump_folder", str(out))
    procs, logs = {}, {}
    try:
        for node in ("node1", "node2"):
            logs[node] = folder / f"{node}.log"
            with open(logs[node], "w") as log:
                procs[node] = subprocess.Popen(
                    cluster.command(node, str(REPO / "run_train.sh"), *args),
                    cwd=REPO,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )

        def ready() -> bool:
            logged = [r["step"] for r in step_records(out) if "loss" in r]
            return (out / "checkpoint" / "step-4" / "titanlite.json").is_file() and bool(
                logged and logged[-1] >= 6
            )

        wait_for("a checkpoint and two more steps", ready, every=0.05)
        victim = trainer_pid(out, rank=1)
        os.kill(victim, signal.SIGKILL)
        killed_after = [r["step"] for r in step_records(out) if "loss" in r][-1]
        codes = wait_all(procs)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    return {
        "out": out,
        "codes": codes,
        "killed_after": killed_after,
        "logs": {node: path.read_text() for node, path in logs.items()},
    }


def wait_all(procs: dict[str, subprocess.Popen], grace: float = 90) -> dict[str, int | None]:
    """Exit statuses; a node still running `grace` s after another failed is reported as None
    (it would only wait for a rendezvous that cannot complete)."""
    deadline = time.monotonic() + WAIT_S
    failed_at = None
    while time.monotonic() < deadline:
        codes = {node: p.poll() for node, p in procs.items()}
        if all(c is not None for c in codes.values()):
            return codes
        if failed_at is None and any(c not in (None, 0) for c in codes.values()):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() > failed_at + grace:
            return codes
        time.sleep(0.5)
    return {node: p.poll() for node, p in procs.items()}


def trainer_pid(dump_folder: Path, rank: int) -> int:
    """The trainer process of RANK writing to dump_folder (not its torchrun)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            b"titanlite.train" in argv
            and b"torch.distributed.run" not in argv
            and str(dump_folder).encode() in argv
            and f"RANK={rank}".encode() in environ
        ):
            return int(proc.name)
    raise AssertionError(f"no trainer of rank {rank} for {dump_folder}")


# --------------------------------------------------------------------------- tests
def test_sbatch_two_nodes_matches_one_process(
    slurm_run: tuple[Path, str], baseline: dict[int, float]
) -> None:
    """sbatch multinode_trainer.slurm: 2 nodes x 2 processes, dp_shard=2 x tp=2, trains like
    one process on the same global batch."""
    out, log = slurm_run
    info = json.loads((out / "run.json").read_text())
    assert info["world_size"] == 4
    assert info["parallel_degrees"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2}
    assert "2 nodes (node[1-2]), 2 processes per node, rendezvous node1:" in log, log[-3000:]
    assert "world size 4 (2 per node)" in log
    assert re.search(r"first step 1 logged [\d.]+ s after the job started", log), log[-3000:]
    assert "training finished" in log
    assert_close("2 nodes x 2 processes", baseline, losses(out), RTOL)


def test_preempted_job_requeues_and_resumes_exactly(
    cluster: Cluster, killed_rank_run: dict, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """SIGUSR1 to the batch script mid-run (as --signal=B:USR1@120 sends it): the trainers
    save and stop, the job requeues itself, and the requeued run resumes from that checkpoint
    and ends with the same losses, bit for bit, as the plain-torchrun run of the same layout
    (2 nodes x 1 process, dp_shard=2; that run replays its lost steps exactly, and
    test_plain_torchrun_two_namespaces_matches_one_process holds it to one process). One
    process per node rather than the sbatch test's two: each start of the job costs half the
    processes, and the 2 x 2 launch is proven by that test."""
    folder = tmp_path_factory.mktemp("preempt")
    out = folder / "run"
    # The first attempt's steps after step 3 slowed: the signal arrives mid-run, however long
    # its way through slurmctld, slurmd and the batch script takes.
    job = cluster.submit(
        folder, *PLAIN_LAYOUT, "--job.dump_folder", str(out), NGPU="1", **slow_steps(folder)
    )

    def logged(step: int) -> bool:
        return any(r.get("step", 0) >= step and "loss" in r for r in step_records(out))

    wait_for("step 2 of the first run", lambda: logged(2), every=0.05)
    cluster.run("node1", "scancel", "--signal=USR1", "--batch", job)

    # SLURM holds a requeued job for about two minutes (Reason=BeginTime) before it may
    # start again; release it sooner rather than wait. Not at once: until the old run's
    # processes are gone its job credential is revoked, and a start then fails the job
    # ("Killing non-startable batch job: Job credential revoked"): 10 s after the requeue and
    # once no process of the first attempt (the batch script, srun, launchers, trainers) runs.
    from test_interrupts import processes_of

    requeued_at: list[float] = []

    def finished() -> dict[str, str] | None:
        state = cluster.job(job)
        if state["Restarts"] == "1" and state["Reason"] == "BeginTime":
            if not requeued_at:
                requeued_at.append(time.monotonic())
            if time.monotonic() - requeued_at[0] > 10 and not processes_of(out):
                cluster.run("node1", "scontrol", "update", f"JobId={job}", "StartTime=now")
        return state if state["JobState"] in ENDED else None

    state = wait_for("the job to requeue itself and finish", finished, every=0.5)
    log = "\n".join(p.read_text() for p in folder.glob("slurm-*.out"))
    assert state["JobState"] == "COMPLETED", f"{state}\n{log[-4000:]}"

    records = step_records(out)
    resumes = [r["step"] for r in records if r.get("kind") == "resume"]
    assert len(resumes) == 1, f"resume records {resumes}: was the signal too late?\n{log[-3000:]}"
    stopped = resumes[0]
    assert 2 <= stopped < STEPS
    # The first run stopped right after logging the step it saved: no step runs twice.
    cut = [r.get("kind") for r in records].index("resume")
    assert [r["step"] for r in records[:cut]] == list(range(1, stopped + 1))
    assert "requeueing job" in log and "(restart 1)" in log, log[-3000:]
    assert f"resumed from checkpoint at step {stopped}" in log
    assert losses(out) == losses(killed_rank_run["out"])  # same layout: bit for bit
    TIMINGS["preempted_at_step"] = stopped


def test_killed_rank_restarts_from_checkpoint(killed_rank_run: dict) -> None:
    """Plain torchrun across two namespaces with MAX_RESTARTS=1: SIGKILL of one trainer makes
    torchrun restart both nodes, which resume from the latest complete checkpoint and replay
    the lost steps exactly."""
    run = killed_rank_run
    assert run["codes"] == {"node1": 0, "node2": 0}, "\n".join(
        f"--- {node} (exit {run['codes'][node]}):\n{log[-2500:]}"
        for node, log in run["logs"].items()
    )
    records = step_records(run["out"])
    kinds = [r.get("kind") for r in records]
    assert kinds.count("resume") == 1, kinds
    cut = kinds.index("resume")
    before, after = records[:cut], records[cut + 1 :]
    resumed_at = records[cut]["step"]
    assert resumed_at % 4 == 0 and 4 <= resumed_at <= run["killed_after"]
    assert [r["step"] for r in before] == list(range(1, len(before) + 1))
    assert [r["step"] for r in after] == list(range(resumed_at + 1, STEPS + 1))
    # Steps logged before the kill and again after the restart: the same numbers.
    replayed = {r["step"]: r["loss"] for r in before if r["step"] > resumed_at}
    assert replayed, "the kill came before any step after the checkpoint"
    assert {s: loss for s, loss in losses_of(after).items() if s in replayed} == replayed


def test_plain_torchrun_two_namespaces_matches_one_process(
    killed_rank_run: dict, baseline: dict[int, float]
) -> None:
    """./run_train.sh with NNODES=2 and RDZV_ENDPOINT, one per namespace (no SLURM): a 2-rank
    job across the veth pair trains like one process (the same run as the kill test)."""
    run = killed_rank_run
    assert run["codes"] == {"node1": 0, "node2": 0}
    info = json.loads((run["out"] / "run.json").read_text())
    assert info["world_size"] == 2 and info["parallel_degrees"]["dp_shard"] == 2
    assert any("world size 2 (1 per node)" in log for log in run["logs"].values())
    assert_close("plain torchrun, 2 nodes", baseline, losses(run["out"]), RTOL)


def losses_of(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if "loss" in r}
