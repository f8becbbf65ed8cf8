"""Faults injected into real trainer processes (gloo): what the survivors do and what is lost.

Each case here is a row of docs/reliability.md's table; the checkpoint cases (SIGKILL during a
save, damaged shards, preemption) are in test_checkpoint.py and test_cluster.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import REPO, subprocess_env
from test_checkpoint import trainer_cmd

from titanlite.errors import EXIT_COMM_FAILURE

pytestmark = pytest.mark.slow

TIMEOUT_S = 4.0  # comm.timeout_seconds in these runs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def logged_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["step"] for r in records if "loss" in r]


def start_ranks(out: Path, world: int, *args: str) -> tuple[list[subprocess.Popen], list[Path]]:
    """``world`` trainer processes started directly (MASTER_ADDR/PORT, no torchrun: nothing
    else stops the survivors), each writing its output to a file."""
    port = str(free_port())
    procs, logs = [], []
    for rank in range(world):
        logs.append(out.parent / f"rank{rank}.log")
        env = subprocess_env(
            out.parent, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank),
            WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        )  # fmt: skip
        with open(logs[-1], "w") as log:
            procs.append(subprocess.Popen(
                trainer_cmd(out, *args), cwd=REPO, env=env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            ))  # fmt: skip
    return procs, logs


@pytest.mark.parametrize("fault", ["SIGSTOP", "SIGKILL"])
def test_a_lost_rank_is_named_and_the_others_stop_within_the_timeout(tmp_path, fault):
    """Rank 1 of 2 frozen (SIGSTOP: its connections stay open, like a node gone from the
    network) or killed, mid-training: rank 0 stops within comm.timeout_seconds plus a few
    heartbeats, exit 4, with one line naming rank 1; the checkpoint it had is untouched."""
    out = tmp_path / "run"
    procs, logs = start_ranks(
        out, 2, "--training.steps", "100000", "--comm.timeout_seconds", str(TIMEOUT_S),
        "--training.local_batch_size", "2",
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not (len(logged_steps(out)) >= 6 and (out / "checkpoint" / "step-4").is_dir()):
            assert all(p.poll() is None for p in procs), logs[0].read_text()[-3000:]
            assert time.monotonic() < deadline, "no steps logged"
            time.sleep(0.05)
        before = sorted(p.name for p in (out / "checkpoint" / "step-4").iterdir())
        os.kill(procs[1].pid, getattr(signal, fault))
        lost_at = time.monotonic()
        status = procs[0].wait(timeout=120)
        waited = time.monotonic() - lost_at
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    output = logs[0].read_text()
    errors = [line for line in output.splitlines() if line.startswith("titanlite: error:")]
    assert status == EXIT_COMM_FAILURE and len(errors) == 1, output[-3000:]
    assert "a collective failed at step" in errors[0] and "lost rank 1 (" in errors[0]
    assert "RuntimeError" not in errors[0] and ".cc:" not in errors[0]
    # A fifth of the timeout per heartbeat, three missed ones to call a rank lost.
    bound = TIMEOUT_S + 4 * TIMEOUT_S / 5 + 2
    assert waited < bound, f"rank 0 took {waited:.1f} s to stop (bound {bound:.1f} s)"
    print(f"{fault}: rank 0 exited {status} {waited:.1f} s after the fault: {errors[0]}")
    assert sorted(p.name for p in (out / "checkpoint" / "step-4").iterdir()) == before
