"""Benchmark replica groups ([fault_tolerance]): the survivors' step time while a group is
missing, against their step time with every group there, and the bytes each rank sends
across groups per step.

A lighthouse runs in this process; GROUPS groups of one process each train the debug model
(`python -m titanlite.train`); once every group has logged --kill-at steps, the last group is
SIGKILLed and the others train on to --steps. Step times come from the survivors'
metrics.jsonl (the wall-clock time of consecutive logged steps): the median with every group
there (from step 3 on), the median once the killed group is out (the steps after the
survivors' first step without it), and their ratio. On one machine the groups share its
cores, so the survivors speed up when a group dies; on a cluster each group has its own.
The bytes: every local gradient once per step (float32), whatever the number of groups.

    python scripts/bench_ft.py --groups 3 --steps 40 --kill-at 15
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL = ["--model.dim", "256", "--model.n_layers", "4", "--training.seq_len", "128"]


def records(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-at", type=int, default=15)
    args = parser.parse_args()
    os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse logs every quorum at INFO
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=2000
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for g in range(args.groups):
            cmd = [
                sys.executable,
                "-m",
                "titanlite.train",
                "--job.config_file",
                str(REPO / "train_configs" / "debug_model.toml"),
                *MODEL,
                "--training.steps",
                str(args.steps),
                "--metrics.log_freq",
                "1",
                "--validation.enable",
                "false",
                "--checkpoint.enable",
                "false",
                "--job.dump_folder",
                tmp,
                "--fault_tolerance.enable",
                "true",
                "--fault_tolerance.group_size",
                str(args.groups),
                "--fault_tolerance.replica_id",
                str(g),
                "--fault_tolerance.lighthouse",
                lighthouse.address(),
            ]
            log = open(Path(tmp) / f"group-{g}.log", "w")  # noqa: SIM115 - closed with the run
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=log))
        victim = Path(tmp) / f"replica-{args.groups - 1}"
        while len(records(victim)) < args.kill_at and procs[-1].poll() is None:
            time.sleep(0.1)
        killed_at = time.time()
        os.kill(procs[-1].pid, signal.SIGKILL)
        for p in procs[:-1]:
            p.wait(timeout=1200)
        lighthouse.shutdown()
        survivor = records(Path(tmp) / "replica-0")
    times = [(r["step"], r["time"], r.get("replicas", 0)) for r in survivor]
    durations = [(s, t - t0, n) for (_, t0, _), (s, t, n) in zip(times, times[1:], strict=False)]
    before = [d for s, d, n in durations if s >= 3 and n == args.groups]
    gone = next(s for s, t, n in times if n == args.groups - 1 and t > killed_at)
    after_steps = [(s, d) for s, d, n in durations if n == args.groups - 1 and s > gone]
    after = [d for _, d in after_steps]
    first = next((t for _, t, n in times if n == args.groups - 1 and t > killed_at), None)
    params = survivor[0].get("model_state_gib", 0.0)
    print(f"{args.groups} groups of 1 process, the debug model at dim 256, 4 layers, seq 128")
    print(f"survivors' step time, all {args.groups} groups: {statistics.median(before):.3f} s")
    print(
        f"survivors' step time, {args.groups - 1} groups: {statistics.median(after):.3f} s "
        f"({statistics.median(after) / statistics.median(before):.2f}x)"
    )
    if first is not None:
        print(f"kill -> the survivors' first step without it logged: {first - killed_at:.2f} s")
    print(
        f"model state per rank {params:.3f} GiB; bytes sent across groups per step: every "
        "local gradient once (4 bytes a parameter), the same for any number of groups"
    )


if __name__ == "__main__":
    main()
