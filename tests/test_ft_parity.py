"""Replica groups without failures are data parallelism (docs/fault_tolerance.md): two groups
averaging their gradients through torchft train the model one job of the same data-parallel
degree trains, step for step. Each group is a real titanlite run (its own processes, its own
torch.distributed world), joined through a lighthouse running in this test process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, subprocess_env

pytest.importorskip("torchft")

SMALL = [
    "--job.config_file",
    str(REPO / "train_configs" / "debug_model.toml"),
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
    "--training.local_batch_size",
    "2",
    "--training.steps",
    "8",
    "--metrics.log_freq",
    "1",
    "--validation.enable",
    "false",
    "--checkpoint.enable",
    "false",
]
RTOL = 1e-6
MUON = ["--optimizer.name", "Muon", "--optimizer.lr", "0.02"]


def records(folder: Path) -> list[dict]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def run_groups(tmp_path: Path, groups: int, ngpu: int, argv: list[str]) -> list[list[dict]]:
    """``groups`` titanlite runs of ``ngpu`` processes each, joined as replica groups."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=groups, join_timeout_ms=60000, heartbeat_timeout_ms=5000
    )
    folder = tmp_path / "groups"
    try:
        procs = []
        for g in range(groups):
            ft = [
                "--fault_tolerance.enable",
                "true",
                "--fault_tolerance.group_size",
                str(groups),
                "--fault_tolerance.replica_id",
                str(g),
                "--fault_tolerance.lighthouse",
                lighthouse.address(),
                "--job.dump_folder",
                str(folder),
            ]
            if ngpu == 1:
                cmd = [sys.executable, "-m", "titanlite.train", *argv, *ft]
            else:
                cmd = [str(REPO / "run_train.sh"), *argv, *ft]
            env = subprocess_env(tmp_path, NGPU=str(ngpu))
            procs.append(
                subprocess.Popen(
                    cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
                )
            )
        outputs = [p.communicate(timeout=600)[0].decode() for p in procs]
        for g, (p, out) in enumerate(zip(procs, outputs, strict=True)):
            assert p.returncode == 0, f"group {g} exited {p.returncode}:\n{out[-3000:]}"
    finally:
        lighthouse.shutdown()
    return [records(folder / f"replica-{g}") for g in range(groups)]


def one_job(tmp_path: Path, world: int, argv: list[str]) -> list[dict]:
    import train_scenarios
    from pool import get_pool

    run = get_pool(world).run(
        train_scenarios.train, argv=[*argv[2:], "--job.dump_folder", str(tmp_path / "job")]
    )[0]
    return [r for r in run["records"] if "loss" in r]


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ngpu", "inside", "job"),
    [
        (1, [], ["--parallelism.data_parallel_replicate_degree", "2"]),
        (
            2,
            ["--parallelism.data_parallel_shard_degree", "2", *MUON],
            ["--parallelism.data_parallel_shard_degree", "4", *MUON],
        ),
        (
            2,
            ["--parallelism.data_parallel_replicate_degree", "2"],
            ["--parallelism.data_parallel_replicate_degree", "4"],
        ),
        (
            2,
            ["--parallelism.tensor_parallel_degree", "2"],
            [
                "--parallelism.data_parallel_replicate_degree",
                "2",
                "--parallelism.tensor_parallel_degree",
                "2",
            ],
        ),
        (
            2,
            ["--parallelism.pipeline_parallel_degree", "2"],
            [
                "--parallelism.data_parallel_replicate_degree",
                "2",
                "--parallelism.pipeline_parallel_degree",
                "2",
            ],
        ),
    ],
    ids=[
        "2 groups x 1 = ddp 2",
        "2 groups x dp_shard 2 = dp_shard 4, muon",
        "2 groups x ddp 2 = ddp 4",
        "2 groups x tp 2",
        "2 groups x pp 2",
    ],
)
def test_two_groups_train_as_one_job_of_the_same_degree(
    ngpu: int, inside: list[str], job: list[str], tmp_path: Path
) -> None:
    groups = run_groups(tmp_path, 2, ngpu, [*SMALL, *inside])
    base = one_job(tmp_path, 2 * ngpu, [*SMALL, *job])
    assert [len(g) for g in groups] == [len(base)] * 2 == [8, 8]
    worst = {"loss": 0.0, "grad_norm": 0.0}
    for a, b, ref in zip(*groups, base, strict=True):
        assert a["replicas"] == b["replicas"] == 2
        # Each group logs the mean over its own share, the job over both (equal token counts).
        worst["loss"] = max(worst["loss"], relative((a["loss"] + b["loss"]) / 2, ref["loss"]))
        for g in (a, b):  # the gradient after the average is the job's
            worst["grad_norm"] = max(worst["grad_norm"], relative(g["grad_norm"], ref["grad_norm"]))
    print(f"replica groups vs one job over 8 steps: max relative differences {worst}")
    assert all(v <= RTOL for v in worst.values()), worst
