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

With --exchange, no kill: two groups train --steps steps three times, averaging gradients at
every step, with DiLoCo (H = --sync-steps) and with Streaming DiLoCo (--fragments fragments),
and the bytes each rank sent across groups (metrics.jsonl's replica_sent_mib, step by step)
are printed: the mean per step and the most in one step, against every-step averaging.

    python scripts/bench_ft.py --groups 3 --steps 40 --kill-at 15
    python scripts/bench_ft.py --exchange --steps 16 --sync-steps 8 --fragments 4
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


def start_group(g: int, groups: int, steps: int, folder: str, address: str, extra: list[str]):
    cmd = [
        sys.executable,
        "-m",
        "titanlite.train",
        "--job.config_file",
        str(REPO / "train_configs" / "debug_model.toml"),
        *MODEL,
        "--training.steps",
        str(steps),
        "--metrics.log_freq",
        "1",
        "--validation.enable",
        "false",
        "--checkpoint.enable",
        "false",
        "--job.dump_folder",
        folder,
        "--fault_tolerance.enable",
        "true",
        "--fault_tolerance.group_size",
        str(groups),
        "--fault_tolerance.replica_id",
        str(g),
        "--fault_tolerance.lighthouse",
        address,
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = open(Path(folder) / f"group-{g}.log", "w")  # noqa: SIM115 - closed with the run
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=log)


def exchange(args: argparse.Namespace) -> None:
    """Bytes sent across groups per step: every step, DiLoCo, Streaming DiLoCo."""
    from torchft.coordination import LighthouseServer

    h, f = args.sync_steps, args.fragments
    diloco = ["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps"]
    runs = {
        "every step": [],
        f"DiLoCo H={h}": [*diloco, str(h)],
        f"Streaming DiLoCo H={h} F={f}": [
            *diloco,
            str(h),
            "--fault_tolerance.num_fragments",
            str(f),
        ],
    }
    results = {}
    for name, extra in runs.items():
        lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=2000)
        with tempfile.TemporaryDirectory() as tmp:
            procs = [
                start_group(g, 2, args.steps, tmp, lighthouse.address(), extra) for g in (0, 1)
            ]
            codes = [p.wait(timeout=1200) for p in procs]
            lighthouse.shutdown()
            if any(codes):
                sys.exit(f"{name}: a group exited {codes}; see its group-N.log")
            sent = [r["replica_sent_mib"] for r in records(Path(tmp) / "replica-0")]
        steps = [b - a for a, b in zip([0.0, *sent], sent, strict=False)]
        results[name] = (sum(steps) / len(steps), max(steps))
    base_mean, base_peak = results["every step"]
    print(f"2 groups of 1 process, the debug model at dim 256, 4 layers, {args.steps} steps")
    print("| exchange | MiB/step, mean | x every step | MiB in one step, peak | x every step |")
    print("|---|---|---|---|---|")
    for name, (mean, peak) in results.items():
        ratios = f"{mean / base_mean:.3f} | {peak:.3f} | {peak / base_peak:.3f}"
        print(f"| {name} | {mean:.3f} | {ratios} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-at", type=int, default=15)
    parser.add_argument("--exchange", action="store_true", help="bytes: every step vs DiLoCo")
    parser.add_argument("--sync-steps", type=int, default=8)
    parser.add_argument("--fragments", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse logs every quorum at INFO
    if args.exchange:
        exchange(args)
        return
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=2000
    )
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            start_group(g, args.groups, args.steps, tmp, lighthouse.address(), [])
            for g in range(args.groups)
        ]
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
